"""Tokenization: Megatron's --append-eod token stream, manifests, workers, bad input."""

import json
from pathlib import Path

import numpy as np
import pytest

from gptflow.data.indexed import IndexedDataset
from gptflow.data.shards import reference_tokens, tokenize_to_shard
from gptflow.errors import GptflowError

TEXTS = ["def f(x):\n    return x + 1\n", "", "import os\nprint(os.getcwd())", "ünïcödé ✓ " * 20]


def test_same_tokens_as_megatron_per_document_encode(tmp_path, tokenizer_json, write_jsonl):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    m = tokenize_to_shard([str(src)], str(tokenizer_json), str(tmp_path / "out"))
    ds = IndexedDataset(tmp_path / "out")
    expected = reference_tokens(TEXTS, str(tokenizer_json), "<|endoftext|>")
    nonempty = [e for e in expected if e]
    assert [ds[i].tolist() for i in range(len(ds))] == nonempty
    assert all(e[-1] == 0 for e in nonempty)  # EOD <|endoftext|> = id 0 ends every document
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3]  # the empty text is an empty document
    assert m["documents"] == 4 and m["sequences"] == 3 and m["empty_documents"] == 1
    assert m["tokens"] == sum(len(e) for e in expected)
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 512
    on_disk = json.loads((tmp_path / "out.json").read_text())
    assert on_disk["bin_sha256"] == m["bin_sha256"]
    assert on_disk["sources"][0]["path"] == str(src)


def test_workers_give_identical_bytes(tmp_path, corpus_jsonl, tokenizer_json):
    inputs = [str(p) for p in corpus_jsonl]
    tokenize_to_shard(inputs, str(tokenizer_json), str(tmp_path / "one"), batch_bytes=50_000)
    tokenize_to_shard(
        inputs, str(tokenizer_json), str(tmp_path / "two"), workers=2, batch_bytes=50_000
    )
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()


def test_without_eod(tmp_path, tokenizer_json, write_jsonl):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc def"}])
    tokenize_to_shard([str(src)], str(tokenizer_json), str(tmp_path / "o"), append_eod=False)
    ids = IndexedDataset(tmp_path / "o")[0].tolist()
    assert ids == reference_tokens(["abc def"], str(tokenizer_json), "<|endoftext|>")[0][:-1]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"content": "x"}', r"in\.jsonl:2: no key 'text' \(found \['content'\]\)"),
        ('{"text": "x"', r"in\.jsonl:2: invalid JSON"),
        ('{"text": 5}', r"in\.jsonl:2: 'text' is int"),
    ],
)
def test_bad_lines_are_named_and_nothing_is_published(
    tmp_path, tokenizer_json, write_jsonl, line, message
):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ok"}, line])
    with pytest.raises(GptflowError, match=message):
        tokenize_to_shard([str(src)], str(tokenizer_json), str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_blank_lines_are_counted(tmp_path, tokenizer_json, write_jsonl):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, "", {"text": "b"}])
    m = tokenize_to_shard([str(src)], str(tokenizer_json), str(tmp_path / "o"))
    assert m["documents"] == 2 and m["dropped"] == {"blank_line": 1}


def test_missing_tokenizer_is_named(tmp_path, write_jsonl):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(GptflowError, match=r"nope\.json: tokenizer file does not exist"):
        tokenize_to_shard([str(src)], str(tmp_path / "nope.json"), str(tmp_path / "o"))


def test_unknown_eod_token_is_named(tmp_path, tokenizer_json, write_jsonl):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(GptflowError, match=r"EOD token '</s>' is not in the vocabulary"):
        tokenize_to_shard([str(src)], str(tokenizer_json), str(tmp_path / "o"), eod_token="</s>")


def test_shard_tokens_read_back_by_megatron(shards, corpus_jsonl, tokenizer_json):
    """Every sequence of both shards, as megatron-core reads it and as we read it, is the
    reference per-document encode (EOD appended), and the document index is one sequence per
    non-empty document (an empty text is an empty document)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    from gptflow.data.readers import iter_texts

    for prefix, source in zip(shards, corpus_jsonl, strict=True):
        texts = list(iter_texts(source))
        expected = reference_tokens(texts, str(tokenizer_json), "<|endoftext|>")
        sequences = [e for e in expected if e]
        boundaries = np.cumsum([0] + [1 if e else 0 for e in expected]).tolist()
        ours, theirs = IndexedDataset(prefix), MegatronIndexed(prefix)
        assert len(ours) == len(theirs) == len(sequences) > 1, prefix
        for i, want in enumerate(sequences):
            assert ours[i].tolist() == want, f"{prefix}: sequence {i} (ours)"
            assert theirs[i].tolist() == want, f"{prefix}: sequence {i} (megatron-core)"
        assert ours.document_indices.tolist() == boundaries, prefix
        assert theirs.document_indices.tolist() == boundaries, prefix
        assert ours.num_documents == len(texts)


def test_trained_bpe_has_special_tokens_first_and_round_trips(tmp_path, corpus_jsonl):
    from gptflow.data.tokenizer import load_tokenizer, sample_texts, tokenizer_info, train_bpe

    path = tmp_path / "t.json"
    summary = train_bpe(
        sample_texts([str(p) for p in corpus_jsonl], "text", 300_000),
        path,
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|padding|>"],
    )
    assert summary["vocab_size"] == 400 and summary["documents"] > 0
    info = tokenizer_info(path)
    assert (info.eod_id, info.vocab_size) == (0, 400)
    tok = load_tokenizer(path)
    assert tok.token_to_id("<|padding|>") == 1
    text = "naïve café — 日本語 🙂\n\tdef x(): pass"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: nothing is unknown
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically


def test_empty_tokenizer_corpus_is_an_error(tmp_path):
    from gptflow.data.tokenizer import train_bpe

    with pytest.raises(GptflowError, match="no documents to train the tokenizer on"):
        train_bpe(iter(()), tmp_path / "t.json", vocab_size=300, special_tokens=["<|endoftext|>"])
    assert not (tmp_path / "t.json").exists()


def test_long_documents_are_encoded_piecewise_with_identical_tokens(tokenizer_json, corpus_jsonl):
    """A document is cut only where the tokenizer provably does not merge across the cut."""
    from gptflow.data.readers import iter_texts
    from gptflow.data.shards import encode_long
    from gptflow.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_json)
    text = "".join(iter_texts(corpus_jsonl[0]))[:200_000]
    assert encode_long(tok, text, piece_chars=3_000).tolist() == tok.encode(text).ids


def test_gpt2_vocab_and_merges_become_an_equivalent_tokenizer(
    tmp_path, tokenizer_json, corpus_jsonl
):
    """Megatron's GPT2BPETokenizer reads vocab.json + merges.txt; ours converts them."""
    import json

    from gptflow.data.readers import iter_texts
    from gptflow.data.tokenizer import gpt2_tokenizer, load_tokenizer

    original = load_tokenizer(tokenizer_json)
    model = json.loads(original.to_str())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    summary = gpt2_tokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt", tmp_path / "t.json")
    converted = load_tokenizer(tmp_path / "t.json")
    assert summary["vocab_size"] == original.get_vocab_size()
    for text in list(iter_texts(corpus_jsonl[1]))[:5]:
        assert converted.encode(text).ids == original.encode(text).ids
    assert converted.token_to_id("<|endoftext|>") == 0


def test_a_long_document_without_newlines_is_still_cut_near_the_target(tokenizer_json):
    """One 12 MB line would take ~1.5 GB in one hf encode; cuts fall back to spaces."""
    from gptflow.data.engines import _safe_cuts
    from gptflow.data.shards import encode_long
    from gptflow.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_json)
    text = " ".join(f"word{i % 977} x={i * 7919 % 1000}," for i in range(12_000))
    assert "\n" not in text
    cuts = list(_safe_cuts(tok, text, 3_000))
    assert len(cuts) >= len(text) // 6_000
    assert all(b - a <= 6_000 for a, b in zip([0, *cuts], cuts, strict=False))
    assert encode_long(tok, text, piece_chars=3_000).tolist() == tok.encode(text).ids


def test_indented_long_documents_find_safe_cuts_without_a_search(tokenizer_json):
    """In indented text (JSON, code) a cut right after a newline splits the indentation run
    that the pre-tokenizer joins to it, so it is never safe; trying those first cost 114 s on a
    7 MB JSON document of the bench corpus. Cuts before a non-space line start come first."""
    from gptflow.data import engines
    from gptflow.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_json)
    text = "{\n" + "".join(f'    "key{i}": {{"value": {i * 31 % 997}}},\n' for i in range(4_000))
    text += "}\n"
    checks = []
    real = engines._cut_is_safe
    try:
        engines._cut_is_safe = lambda *a: checks.append(a[3]) or real(*a)
        cuts = list(engines._safe_cuts(tok, text, 3_000))
    finally:
        engines._cut_is_safe = real
    assert len(cuts) >= len(text) // 6_000
    assert len(checks) <= 3 * len(cuts), f"{len(checks)} cut checks for {len(cuts)} cuts"
    assert engines.encode_long(tok, text, piece_chars=3_000).tolist() == tok.encode(text).ids


@pytest.mark.parametrize(
    ("suffix", "documents", "shows"),
    [
        (".jsonl", (0, None), r"[\d.]+ [kM]B of ([\d.]+ [kM]B) \([\d.]+%\), [\d,]+ documents at"),
        (".jsonl", (5, 25), r"\d+ of 20 documents \([\d.]+%\), [\d.]+ [kM]?B at"),
        (".jsonl.gz", (0, None), r".* \(total unknown: compressed jsonl.gz input: its decoded"),
    ],
)
def test_progress_lines_and_the_closing_totals(
    tmp_path, corpus_jsonl, tokenizer_json, caplog, monkeypatch, suffix, documents, shows
):
    """A line per batch here (every=0), counted against the input bytes of plain JSONL, the
    documents of a range, or nothing (compressed input, and the line says so); then the
    closing line with the documents written."""
    import functools
    import gzip
    import re

    import gptflow.data.shards as shards

    monkeypatch.setattr(shards, "Progress", functools.partial(shards.Progress, every=0))
    src = tmp_path / f"in{suffix}"
    data = corpus_jsonl[0].read_bytes()
    src.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    caplog.set_level("INFO", logger="gptflow")
    m = tokenize_to_shard(
        [str(src)], str(tokenizer_json), str(tmp_path / "o"), documents=documents,
        batch_bytes=20_000,
    )  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("o: ")]
    assert len(lines) >= 3, lines
    for line in lines[:-1]:
        assert re.match(rf"o: {shows}", line), line
    assert re.fullmatch(rf"o: done, [\d.]+ [kM]B, {m['documents']} documents in .*", lines[-1])
    if documents == (0, None) and suffix == ".jsonl":
        total = re.match(rf"o: {shows}", lines[0])[1]
        assert total == f"{len(data) / 1000:.1f} kB" or total == f"{len(data) / 1e6:.1f} MB"
        assert "(100.0%)" in lines[-2]


def test_the_engine_names_have_one_home():
    """tokenize.engine's choices in the schema are gptflow.data.engines.ENGINES (the CLI's
    --engine choices are that tuple itself)."""
    from gptflow.config.schema import load_yaml
    from gptflow.data.engines import ENGINES

    schema = load_yaml(Path(__file__).parents[3] / "config/schema/config.schema.yaml")
    assert tuple(schema["properties"]["tokenize"]["properties"]["engine"]["enum"]) == ENGINES
