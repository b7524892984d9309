"""Tokenization engines: byte identity with Megatron's --append-eod output, the gigatoken
parity guard and memory guard, bad documents, document ranges, and a killed job.

The expected bytes come from an independent path: Hugging Face ``tokenizers`` encoding one
document at a time (what Megatron's ``HuggingFaceTokenizer`` does) and the ``.bin``/``.idx``
layout written here with ``struct`` from the format spec
(``reference/megatron-format-and-tools.md``), not with gptflow's writer.
"""

import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gptflow.data.indexed import IndexedDataset
from gptflow.data.shards import tokenize_to_shard
from gptflow.errors import GptflowError

EDGE_TEXTS = [
    "plain ascii text\n",
    "",  # an empty document: a repeated document-index entry, no sequence
    "windows\r\nline\r\nendings\r\n",
    "emoji 😀🎉👩‍👩‍👧 and CJK 中文字符，日本語のテキスト，한국어",
    "   leading and trailing whitespace \t\t  ",
    "a literal <|endoftext|> inside a document",
    "combining e\u0301 and NUL \x00 and bell \x07",
]


def megatron_bytes(texts: list[str], tokenizer_path, eod_token="<|endoftext|>"):
    """(.bin, .idx) bytes of Megatron preprocess_data.py --append-eod, from the spec."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eod = tok.token_to_id(eod_token)
    sizes, doc_idx, data = [], [0], []
    for text in texts:
        ids = tok.encode(text).ids
        if ids:
            ids = [*ids, eod]
            sizes.append(len(ids))
            data.append(np.asarray(ids, dtype="<u2").tobytes())
        doc_idx.append(len(sizes))
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1] * 2]) if sizes else []
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    idx += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
    idx += np.asarray(sizes, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes()
    idx += np.asarray(doc_idx, "<i8").tobytes()
    return b"".join(data), idx


@pytest.fixture(scope="module")
def edge_corpus(tmp_path_factory, corpus_jsonl):
    """Three JSONL files: the edge cases, real documents with a ~3 MB one, and a CRLF file."""
    from gptflow.data.readers import iter_texts

    out = tmp_path_factory.mktemp("edge")
    real = list(iter_texts(corpus_jsonl[0]))
    big = "".join(real)
    while len(big) < 3_000_000:
        big += big
    files = {
        "a.jsonl": EDGE_TEXTS,
        "b.jsonl": [*real[:40], big[:3000000], *real[40:60]],
        "c.jsonl": ["", "last file", "tail 🙂"],
    }
    paths = []
    for name, texts in files.items():
        newline = "\r\n" if name == "c.jsonl" else "\n"
        with open(out / name, "w", newline="") as f:
            for t in texts:
                f.write(json.dumps({"text": t, "meta": {"n": len(t)}}, ensure_ascii=False))
                f.write(newline)
        paths.append(str(out / name))
    texts = [t for name in files for t in files[name]]
    return paths, texts


@pytest.mark.parametrize(
    ("engine", "workers"), [("hf", 1), ("hf", 2), ("gigatoken", 1), ("auto", 2)]
)
def test_bytes_equal_megatron_append_eod(tmp_path, tokenizer_json, edge_corpus, engine, workers):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    paths, texts = edge_corpus
    want_bin, want_idx = megatron_bytes(texts, tokenizer_json)
    prefix = tmp_path / "out"
    m = tokenize_to_shard(
        paths, str(tokenizer_json), str(prefix), engine=engine, workers=workers, batch_bytes=200_000
    )
    assert (tmp_path / "out.bin").read_bytes() == want_bin
    assert (tmp_path / "out.idx").read_bytes() == want_idx
    assert m["engine"]["name"] == ("hf" if engine == "hf" else "gigatoken")
    assert m["documents"] == len(texts) and m["empty_documents"] == texts.count("")
    theirs = MegatronIndexed(str(prefix))
    assert len(theirs) == m["sequences"]
    assert theirs.document_indices.tolist() == IndexedDataset(prefix).document_indices.tolist()
    assert np.array_equal(theirs[len(theirs) - 1], IndexedDataset(prefix)[len(theirs) - 1])


def test_manifest_records_everything(tmp_path, tokenizer_json, edge_corpus):
    import hashlib

    paths, _texts = edge_corpus
    m = tokenize_to_shard(paths, str(tokenizer_json), str(tmp_path / "out"), workers=2)
    assert m == json.loads((tmp_path / "out.json").read_text())
    assert [s["path"] for s in m["sources"]] == paths
    for s, p in zip(m["sources"], paths, strict=True):
        assert s["sha256"] == hashlib.sha256(Path(p).read_bytes()).hexdigest()  # hashed as read
    tok = m["tokenizer"]
    assert tok["sha256"] == hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    assert (tok["vocab_size"], tok["eod_id"], tok["eod_token"]) == (512, 0, "<|endoftext|>")
    assert m["engine"]["name"] == "gigatoken" and m["engine"]["version"] == "0.10.0"
    assert m["engine"]["parity_documents"] > 0
    assert m["dtype"] == "uint16" and m["dropped"] == {}
    assert m["seconds"] > 0 and m["mb_per_s"] > 0 and m["peak_rss_mb"] > 0


@pytest.fixture(scope="module")
def added_word_tokenizer(tmp_path_factory, tokenizer_json):
    """The test tokenizer plus a non-special added token whose text is already in the
    vocabulary: Hugging Face tokenizers keeps the vocabulary's id, gigatoken 0.10.0 uses the
    added token's."""
    d = json.loads(tokenizer_json.read_text())
    assert "self" in d["model"]["vocab"]
    d["added_tokens"].append(
        {
            "id": 512,
            "content": "self",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": True,
            "special": False,
        }
    )
    path = tmp_path_factory.mktemp("tok") / "added.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("engine", ["auto", "gigatoken"])
def test_a_gigatoken_mismatch_is_an_error_naming_the_document(
    tmp_path, write_jsonl, added_word_tokenizer, engine
):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, {"text": "x = self.y"}])
    with pytest.raises(GptflowError, match=r"in\.jsonl: document 2 is tokenized differently"):
        tokenize_to_shard([str(src)], str(added_word_tokenizer), str(tmp_path / "o"), engine=engine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    # the reference engine is always available, and is what the message points to
    m = tokenize_to_shard([str(src)], str(added_word_tokenizer), str(tmp_path / "o"), engine="hf")
    assert m["documents"] == 2


def test_auto_takes_hf_for_a_tokenizer_gigatoken_does_not_support(
    tmp_path, write_jsonl, tokenizer_json
):
    from tokenizers import Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.normalizer = normalizers.Lowercase()
    tok.save(str(tmp_path / "lower.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "MiXeD Case"}])
    m = tokenize_to_shard([str(src)], str(tmp_path / "lower.json"), str(tmp_path / "o"))
    assert m["engine"]["name"] == "hf"
    assert "Unsupported normalizer type: Lowercase" in m["engine"]["auto"]
    with pytest.raises(GptflowError, match="--engine gigatoken cannot be used: gigatoken cannot"):
        tokenize_to_shard(
            [str(src)], str(tmp_path / "lower.json"), str(tmp_path / "o2"), engine="gigatoken"
        )


def test_a_post_processor_that_adds_tokens_keeps_auto_on_hf(tmp_path, write_jsonl, tokenizer_json):
    """Megatron's HuggingFaceTokenizer keeps a BOS post-processor's token; gigatoken drops it."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.post_processor = processors.TemplateProcessing(
        single="<|padding|> $A", special_tokens=[("<|padding|>", 1)]
    )
    tok.save(str(tmp_path / "bos.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    m = tokenize_to_shard([str(src)], str(tmp_path / "bos.json"), str(tmp_path / "o"))
    assert (
        m["engine"]["name"] == "hf" and "post-processor adds special tokens" in m["engine"]["auto"]
    )
    assert IndexedDataset(tmp_path / "o")[0].tolist()[0] == 1  # the BOS is there


def test_encode_cache_guard_drops_caches_and_keeps_the_bytes(
    tmp_path, corpus_jsonl, tokenizer_json
):
    """gigatoken 0.10.0's encode caches grow without bound; past the RSS limit they are
    rebuilt. A limit below the process's size forces a rebuild after every batch; a limit far
    above it never does (the test session's own process is large: the default limit, 1 GB,
    could be reached by the time this test runs)."""
    inputs = [str(p) for p in corpus_jsonl]
    free = tokenize_to_shard(
        inputs, str(tokenizer_json), str(tmp_path / "a"), batch_bytes=300_000, max_rss_mb=10**6
    )
    tight = tokenize_to_shard(
        inputs, str(tokenizer_json), str(tmp_path / "b"), batch_bytes=300_000, max_rss_mb=1
    )
    assert free["engine"]["cache_resets"] == 0
    assert tight["engine"]["cache_resets"] >= 3
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


BAD_LINES = [
    (b'{"text": "broken', "invalid_json", r"invalid JSON"),
    (b'{"content": "x"}', "missing_key", r"no key 'text' \(found \['content'\]\)"),
    (b'{"text": "caf\xe9"}', "invalid_utf8", r"invalid UTF-8 at byte 13"),
    (b'["text", "x"]', "not_object", r"a JSON list, not an object"),
    (b'{"text": null}', "not_string", r"'text' is NoneType, not a string"),
    (b'{"text": "\\ud800"}', "invalid_unicode", r"'text' holds an unpaired surrogate"),
]


@pytest.mark.parametrize(("line", "reason", "message"), BAD_LINES)
@pytest.mark.parametrize("engine", ["hf", "gigatoken"])
def test_bad_document_is_an_error_naming_file_and_line(
    tmp_path, tokenizer_json, line, reason, message, engine
):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "ok"}\n\n{"text": "fine"}\n' + line + b'\n{"text": "after"}\n')
    with pytest.raises(GptflowError, match=rf"in\.jsonl:4: {message}.*on_bad_document: skip"):
        tokenize_to_shard([str(src)], str(tokenizer_json), str(tmp_path / "o"), engine=engine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_skipped_bad_documents_are_counted_by_reason(tmp_path, tokenizer_json):
    good = [b'{"text": "ok"}', b'{"text": "fine"}', b'{"text": "after"}']
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([good[0], *(b for b, _, _ in BAD_LINES), good[1], b"", good[2]]))
    m = tokenize_to_shard(
        [str(src)], str(tokenizer_json), str(tmp_path / "o"), on_bad_document="skip"
    )
    want = {r: 1 for _, r, _ in BAD_LINES} | {"blank_line": 1}
    assert m["dropped"] == want and m["documents"] == 3
    want_bin, want_idx = megatron_bytes(["ok", "fine", "after"], tokenizer_json)
    assert (tmp_path / "o.bin").read_bytes() == want_bin
    assert (tmp_path / "o.idx").read_bytes() == want_idx


def test_document_ranges_partition_the_input(tmp_path, tokenizer_json, edge_corpus):
    paths, texts = edge_corpus
    cuts = [0, 5, 8, len(texts) - 2, len(texts)]
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        m = tokenize_to_shard(
            paths, str(tokenizer_json), str(tmp_path / f"p{i}"), documents=(a, b), batch_bytes=4096
        )
        assert m["documents"] == b - a and m["document_range"] == [a, b]
        want_bin, _ = megatron_bytes(texts[a:b], tokenizer_json)
        assert (tmp_path / f"p{i}.bin").read_bytes() == want_bin


@pytest.mark.parametrize("on_bad", ["error", "skip"])
def test_counted_ranges_cover_the_input_exactly(tmp_path, tokenizer_json, on_bad):
    """count-documents, then one CLI job per range (as the tokenize_part rule runs them), equals
    one pass: in 'error' mode the lines before a range are skipped unparsed, in 'skip' mode
    they are parsed so that skipped lines do not shift the ranges."""
    from gptflow.data.shards import count_documents

    lines = [json.dumps({"text": f"document {i} " + "word " * (i % 7)}) for i in range(40)]
    if on_bad == "skip":
        lines[3], lines[17], lines[18] = "not json", '{"other": 1}', ""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    counted = count_documents([str(src)], tmp_path / "in.count.json", on_bad_document=on_bad)
    want_docs = 37 if on_bad == "skip" else 40
    assert counted["documents"] == want_docs
    assert counted["sources"][0]["sha256"] == sha256_of(src)
    whole = tokenize_to_shard(
        [str(src)], str(tokenizer_json), str(tmp_path / "whole"), on_bad_document=on_bad
    )
    pieces = []
    for i, start in enumerate(range(0, want_docs, 9)):
        prefix = tmp_path / f"part{i}"
        subprocess.run(
            [
                sys.executable, "-m", "gptflow", "tokenize", "--input", str(src),
                "--tokenizer", str(tokenizer_json), "--output-prefix", str(prefix),
                "--append-eod", "--documents", f"{start}:{start + 9}",
                "--counts", str(tmp_path / "in.count.json"), "--on-bad-document", on_bad,
            ],
            check=True,
            capture_output=True,
        )  # fmt: skip
        m = json.loads(prefix.with_suffix(".json").read_text())
        assert m["documents"] == min(9, want_docs - start)
        assert m["sources"][0]["sha256"] == counted["sources"][0]["sha256"]
        pieces.append((tmp_path / f"part{i}.bin").read_bytes())
    assert b"".join(pieces) == (tmp_path / "whole.bin").read_bytes()
    assert whole["documents"] == want_docs


def test_counting_fails_on_a_bad_line_and_a_changed_input_is_refused(tmp_path, tokenizer_json):
    from gptflow.data.shards import count_documents, read_counts

    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "a"}\n{"text": 1}\n')
    with pytest.raises(GptflowError, match=r"in\.jsonl:2: .*on_bad_document: skip"):
        count_documents([str(src)], tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()
    count_documents([str(src)], tmp_path / "c.json", on_bad_document="skip")
    src.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    with pytest.raises(GptflowError, match=r"c\.json counted .*in\.jsonl.*counted again"):
        read_counts(tmp_path / "c.json", [str(src)])


def sha256_of(path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_killed_job_leaves_no_final_file_and_the_rerun_is_identical(
    tmp_path, tokenizer_json, corpus_jsonl
):
    """SIGKILL mid-run: nothing under the final names. The job is frozen (SIGSTOP) as soon as
    its temporary .bin exists, so the state it is killed in is checked, not guessed."""
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        for _ in range(3):
            for p in corpus_jsonl:
                f.write(p.read_bytes())
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "gptflow", "tokenize", "--input", str(big),
        "--tokenizer", str(tokenizer_json), "--output-prefix", str(out),
        "--append-eod", "--engine", "hf",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not any(tmp_path.glob(".out.bin*")):
            assert proc.poll() is None, "exited before it opened its temporary .bin"
            assert time.monotonic() < deadline, "no temporary .bin within 60 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGSTOP)  # frozen: what is seen now is what the kill hits
        assert proc.poll() is None, "finished before it could be killed"
        assert not list(tmp_path.glob("out.*")), "published before it could be killed"
        assert any(tmp_path.glob(".out.bin*"))
    finally:
        proc.kill()  # SIGKILL; a no-op when the process has already been reaped
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.")]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tokenize_to_shard([str(big)], str(tokenizer_json), str(tmp_path / "ref"), engine="hf")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_merge_keeps_document_boundaries_and_equals_one_pass(tmp_path, tokenizer_json, edge_corpus):
    """Shards tokenized by document range, merged, equal the whole input tokenized at once --
    empty documents included (GPT-NeoX's merge_datasets.py loses the document index)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    from gptflow.data.shards import merge_shards

    paths, texts = edge_corpus
    cuts = [0, 1, 2, len(texts) - 3, len(texts)]
    parts = []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        parts.append(str(tmp_path / f"p{i}"))
        tokenize_to_shard(paths, str(tokenizer_json), parts[-1], documents=(a, b))
    m = merge_shards(parts, str(tmp_path / "merged"))
    whole = tokenize_to_shard(paths, str(tokenizer_json), str(tmp_path / "whole"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()
    assert m["bin_sha256"] == whole["bin_sha256"] and m["documents"] == len(texts)
    assert m["empty_documents"] == texts.count("") == 2
    assert [p["prefix"] for p in m["merged_from"]] == parts
    theirs = MegatronIndexed(str(tmp_path / "merged"))  # kept: its index is an mmap view
    doc_idx = theirs.document_indices.tolist()
    assert len(doc_idx) == len(texts) + 1 and len(set(doc_idx)) < len(doc_idx)


def test_merge_refuses_shards_of_different_tokenizers(tmp_path, tokenizer_json, write_jsonl):
    from tokenizers import Tokenizer

    from gptflow.data.shards import merge_shards

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    other = Tokenizer.from_file(str(tokenizer_json))
    other.add_tokens(["zzz"])
    other.save(str(tmp_path / "other.json"))
    tokenize_to_shard([str(src)], str(tokenizer_json), str(tmp_path / "a"))
    tokenize_to_shard([str(src)], str(tmp_path / "other.json"), str(tmp_path / "b"))
    with pytest.raises(GptflowError, match=r"merge: .*b has a different tokenizer"):
        merge_shards([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))
    assert not list(tmp_path.glob("m.*"))


@pytest.mark.parametrize("doc_tokens", [2, 5_000])  # the mask path, the per-document path
def test_with_eod_equals_insert_then_cast(doc_tokens):
    from gptflow.data.shards import with_eod

    rng = np.random.default_rng(doc_tokens)
    lengths = rng.integers(0, 2 * doc_tokens, 300)
    lengths[[0, 7, -1]] = 0  # empty documents first, inside and last
    flat = rng.integers(0, 60_000, int(lengths.sum())).astype(np.uint32)
    out, out_lengths = with_eod(flat, lengths, 7, np.uint16)
    ends = np.cumsum(lengths)[lengths > 0]
    assert out.dtype == np.uint16
    assert np.array_equal(out, np.insert(flat, ends, 7).astype(np.uint16))
    assert np.array_equal(out_lengths, lengths + (lengths > 0))
