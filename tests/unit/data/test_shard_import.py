"""Existing Megatron shards imported (gptflow.data.shard_import, datasets of type megatron).

Shards made by gptflow and by megatron-core's own tokenizer and writer (the way Megatron-LM's
preprocess_data.py drives them) come in as symlinks with the manifest a tokenized shard has;
damaged files, ids outside the vocabulary, a dtype too narrow for it and shards of another
tokenizer are refused with one line naming the file, what is wrong and the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

from gptflow.cli import main
from gptflow.data.indexed import HEADER_SIZE, IndexedDataset, IndexedDatasetWriter
from gptflow.data.shard_import import import_shard, sample_sequences
from gptflow.data.shards import read_manifest, tokenize_to_shard
from gptflow.data.sources import resolve_dataset
from gptflow.data.tokenizer import load_tokenizer, sample_texts, train_bpe
from gptflow.errors import GptflowError
from gptflow.fsutil import publish_symlink
from gptflow.plan.workflow_config import load_workflow_config
from gptflow.train.run_config import render_run_config
from tests.support.megatron_preprocess import megatron_tokenizer, preprocess, read_texts

REPO = Path(__file__).resolve().parents[3]
FIX_SHARD = (
    "re-create it with Megatron's tools/preprocess_data.py, or remove it from the dataset's "
    "prefixes"
)


def fix_tokenizer(tok) -> str:
    return (
        f"re-create the shard with {tok} (Megatron: tools/preprocess_data.py --tokenizer-type "
        f"HuggingFaceTokenizer --tokenizer-model <its directory> --append-eod), or set the "
        f"config's tokenizer to the one the shard was made with"
    )


def copy_shard(prefix, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(prefix).name
    for ext in (".bin", ".idx"):
        shutil.copy(f"{prefix}{ext}", f"{out}{ext}")
    return out


def write_shard(prefix: Path, docs: list, dtype=np.uint16) -> Path:
    with IndexedDatasetWriter(prefix, dtype) as w:
        w.add_documents([np.asarray(d, dtype=np.int64) for d in docs])
        w.finalize()
    return prefix


def published(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f"{out.name}*")) if out.parent.exists() else []


@pytest.fixture(scope="module")
def line_documents(corpus_jsonl, tokenizer_json) -> list[list[int]]:
    """300 short documents: each non-blank line of the corpus, one encode + EOD (0)."""
    tok = load_tokenizer(tokenizer_json)
    lines = [ln for t in read_texts(corpus_jsonl[0]) for ln in t.splitlines() if ln.strip()]
    return [[*tok.encode(ln).ids, 0] for ln in lines[:300]]


# --------------------------------------------------------------------------- imported as is


def test_gptflow_shards_import_as_themselves(shards, tokenizer_json, tiny_config, tmp_path):
    """The manifest has the tokenized shard's figures and sha256s, the .bin/.idx are links to
    the originals, and a run rendered from the imported shards has the same fingerprint."""
    imported = []
    for prefix in shards:
        out = tmp_path / "tokens" / Path(prefix).name
        m = import_shard(prefix, tokenizer_json, out)
        ours = read_manifest(prefix)
        keys = ("dtype", "tokenizer", "append_eod", "documents", "sequences", "tokens",
                "empty_documents", "bin_sha256", "idx_sha256")  # fmt: skip
        assert {k: m[k] for k in keys} == {k: ours[k] for k in keys}
        assert m == json.loads(Path(f"{out}.json").read_text())
        for ext in (".bin", ".idx"):
            link = Path(f"{out}{ext}")
            assert link.is_symlink() and os.readlink(link) == os.path.abspath(f"{prefix}{ext}")
        assert [s["path"] for s in m["sources"]] == [f"{prefix}.idx", f"{prefix}.bin"]
        assert m["imported"]["round_trip"]["documents"] == m["documents"] > 10
        assert m["imported"]["documents_ending_with_eod"] == m["documents"]
        assert m["imported"]["dtype_note"] is None and m["imported"]["max_token_id"] < 512
        imported.append(str(out))
    cfg = load_workflow_config(
        tiny_config,
        schema_path=REPO / "config/schema/config.schema.yaml",
        models_dir=REPO / "config/models",
        source="test",
    )
    runs = [
        render_run_config(
            cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": p}, run_dir="r"
        )
        for p in (shards, imported)
    ]
    assert runs[0].series == runs[1].series
    assert [s.prefix for s in runs[1].datasets[0].shards] == imported


def test_megatron_core_shards_import_byte_identical_to_ours(
    megatron_shards, shards, tokenizer_json, tmp_path
):
    """preprocess_data.py --append-eod with the same tokenizer (megatron-core's tokenizer and
    writer) makes the very bytes gptflow's tokenization makes; megatron-core reads the
    imported links as the figures say."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    for prefix, own in zip(megatron_shards, shards, strict=True):
        assert prefix.endswith("_text_document")
        out = tmp_path / Path(prefix).name
        m = import_shard(prefix, tokenizer_json, out)
        ours = read_manifest(own)
        assert (m["bin_sha256"], m["idx_sha256"]) == (ours["bin_sha256"], ours["idx_sha256"])
        theirs = MegatronIndexed(str(out))
        assert (len(theirs), len(theirs.document_indices) - 1) == (m["sequences"], m["documents"])
        assert int(theirs.sequence_lengths.sum()) == m["tokens"] and m["append_eod"] is True


@pytest.mark.parametrize("append_eod", [False, True])
def test_sentence_split_shards_with_and_without_eod(
    append_eod, corpus_jsonl, tokenizer_json, tmp_path
):
    """--split-sentences: a document is several sequences (its sentences), an empty one none;
    EOD at the end of every document is reported, not required."""
    texts = [t.split("\n\n") for t in read_texts(corpus_jsonl[1])[:12]] + [[""], []]
    tok = megatron_tokenizer(tokenizer_json, tmp_path / "hf")
    prefix = preprocess(texts, tok, tmp_path / "ss", append_eod=append_eod)
    assert prefix.endswith("_text_sentence")
    m = import_shard(prefix, tokenizer_json, tmp_path / "out" / "ss")
    sentences = sum(1 for t in texts for s in t if tok.text_to_ids(s))
    assert (m["documents"], m["sequences"], m["empty_documents"]) == (14, sentences, 2)
    assert sentences > 40
    assert m["append_eod"] is append_eod
    assert m["imported"]["documents_ending_with_eod"] == (12 if append_eod else 0)
    assert m["imported"]["eod_tokens"] == (12 if append_eod else 0)
    assert m["imported"]["round_trip"]["documents"] == min(sentences, 64)


def test_a_tokenizer_that_adds_a_bos_round_trips(corpus_jsonl, tokenizer_json, tmp_path):
    """A post-processor that puts <|padding|> (1) before every text: the shard's documents
    start with it, and the check strips it before decoding."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.post_processor = processors.TemplateProcessing(
        single="<|padding|> $A", special_tokens=[("<|padding|>", 1)]
    )
    bos_json = tmp_path / "bos-tokenizer.json"
    tok.save(str(bos_json))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in read_texts(corpus_jsonl[0])[:8]))
    tokenize_to_shard([str(src)], str(bos_json), str(tmp_path / "bos"), engine="hf")
    assert IndexedDataset(tmp_path / "bos")[0][0] == 1
    m = import_shard(tmp_path / "bos", bos_json, tmp_path / "out" / "bos")
    assert m["imported"]["round_trip"]["documents"] == 8


def test_a_wider_dtype_is_read_as_is(corpus_jsonl, tokenizer_json, tmp_path):
    """int32 for a 512-id tokenizer (what GPT-NeoX writes when not given the vocabulary)."""
    tok = megatron_tokenizer(tokenizer_json, tmp_path / "hf")
    prefix = preprocess(read_texts(corpus_jsonl[0])[:5], tok, tmp_path / "w", dtype=np.int32)
    m = import_shard(prefix, tokenizer_json, tmp_path / "out" / "w")
    assert m["dtype"] == "int32"
    assert m["imported"]["dtype_note"] == (
        "int32, wider than needed: gptflow writes uint16 for 512 ids (uint16 below 65,500 ids, "
        "else int32: Megatron's rule); it holds every id, read as is"
    )


# --------------------------------------------------------------------------- refused


def refused(prefix, tokenizer_json, out: Path) -> str:
    with pytest.raises(GptflowError) as e:
        import_shard(prefix, tokenizer_json, out)
    assert published(out) == []
    return str(e.value)


def test_a_truncated_bin_is_refused(shards, tokenizer_json, tmp_path):
    prefix = copy_shard(shards[0], tmp_path / "src")
    size = os.path.getsize(f"{prefix}.bin")
    os.truncate(f"{prefix}.bin", size - 2)
    assert refused(prefix, tokenizer_json, tmp_path / "out" / "t") == (
        f"{prefix}.bin: {size - 2} bytes, index implies {size} (truncated or mismatched); "
        f"re-tokenize it (megatron shard {prefix}: {FIX_SHARD})"
    )


def corrupt(idx: Path, n: int, what: str) -> str:
    """Damage the .idx of a shard of `n` one-sequence documents; the error's middle part."""
    data = bytearray(idx.read_bytes())
    pointers = HEADER_SIZE + 4 * n
    docs = HEADER_SIZE + 12 * n
    if what == "magic":
        data[:9] = b"NOTMMIDX\x00"
        expect = None
    elif what == "version":
        data[9:17] = struct.pack("<Q", 2)
        expect = None
    elif what == "pointer":
        (p2,) = struct.unpack_from("<q", data, pointers + 16)
        (p1,) = struct.unpack_from("<q", data, pointers + 8)
        (n1,) = struct.unpack_from("<i", data, HEADER_SIZE + 4)
        struct.pack_into("<q", data, pointers + 16, p2 + 2)
        expect = (
            f"sequence 2 starts at byte {p2 + 2}, but sequence 1 starts at {p1} with {n1} "
            f"tokens of 2 bytes (corrupt index)"
        )
    elif what == "length":
        struct.pack_into("<i", data, HEADER_SIZE + 4, -5)
        expect = "sequence 1 has length -5 (corrupt index)"
    elif what == "document index":
        struct.pack_into("<q", data, docs + 16, 0)
        expect = "the document index goes back from 1 to 0 at document 1 (corrupt index)"
    idx.write_bytes(bytes(data))
    return expect


@pytest.mark.parametrize("what", ["magic", "version", "pointer", "length", "document index"])
def test_a_corrupted_idx_is_refused(what, shards, tokenizer_json, tmp_path):
    prefix = copy_shard(shards[0], tmp_path / "src")
    n = len(IndexedDataset(prefix))
    expect = corrupt(Path(f"{prefix}.idx"), n, what)
    message = refused(prefix, tokenizer_json, tmp_path / "out" / "c")
    if what == "magic":
        assert message == (
            f"{prefix}.idx: not a Megatron MMIDIDX index (bad magic); re-tokenize it "
            f"(megatron shard {prefix}: {FIX_SHARD})"
        )
    elif what == "version":
        assert message == (
            f"{prefix}.idx: index version 2, expected 1 (megatron shard {prefix}: {FIX_SHARD})"
        )
    else:
        assert message == f"{prefix}.idx (megatron shard {prefix}): {expect}; {FIX_SHARD}"


@pytest.mark.parametrize("sequence", [0, 1])
def test_a_token_id_outside_the_vocabulary_is_refused(
    sequence, line_documents, tokenizer_json, tmp_path
):
    """Sequence 0 is in the round-trip sample, sequence 1 only in the scan of the whole .bin:
    the same error either way."""
    assert (0 in sample_sequences(np.full(300, 9))) and (1 not in sample_sequences(np.full(300, 9)))
    docs = [list(d) for d in line_documents]
    docs[sequence][1] = 600
    prefix = write_shard(tmp_path / "v", docs)
    assert refused(prefix, tokenizer_json, tmp_path / "out" / "v") == (
        f"{prefix}.bin (megatron shard {prefix}): token id 600 (token 1 of sequence {sequence}, "
        f"document {sequence}) is not in the vocabulary of tokenizer {tokenizer_json} (ids "
        f"0..511); the shard was made with another tokenizer, or is corrupt: "
        f"{fix_tokenizer(tokenizer_json)}"
    )


def test_a_negative_token_id_is_refused(line_documents, tokenizer_json, tmp_path):
    docs = [list(d) for d in line_documents]
    docs[7][0] = -3
    prefix = write_shard(tmp_path / "neg", docs, dtype=np.int32)
    message = refused(prefix, tokenizer_json, tmp_path / "out" / "neg")
    assert message.startswith(
        f"{prefix}.bin (megatron shard {prefix}): token id -3 (token 0 of sequence 7, document 7)"
    )


def test_a_dtype_too_narrow_for_the_vocabulary_is_refused(tokenizer_json, tmp_path):
    prefix = write_shard(tmp_path / "narrow", [[5, 6, 0]], dtype=np.int8)
    assert refused(prefix, tokenizer_json, tmp_path / "out" / "narrow") == (
        f"{prefix}.idx (megatron shard {prefix}): token dtype int8 holds ids up to 127, but "
        f"tokenizer {tokenizer_json} has 512 ids; gptflow writes uint16 for 512 ids (uint16 "
        f"below 65,500 ids, else int32: Megatron's rule). The shard was made for a smaller "
        f"vocabulary, i.e. with another tokenizer: {fix_tokenizer(tokenizer_json)}"
    )


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A second 512-id ByteLevel BPE, trained on other text (the stdlib's unittest)."""
    import sysconfig

    out = tmp_path_factory.mktemp("other")
    src = out / "unittest.jsonl"
    files = sorted(Path(sysconfig.get_paths()["stdlib"], "unittest").glob("*.py"))
    src.write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in files))
    path = out / "tokenizer.json"
    train_bpe(
        sample_texts([str(src)], "text", 1_000_000),
        path,
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|padding|>"],
    )
    return path


def test_shards_of_another_tokenizer_are_refused(
    other_tokenizer, corpus_jsonl, tokenizer_json, tmp_path
):
    """Same vocabulary size, same dtype, every id in range: only the round trip tells, and
    it fails for every sampled document."""
    tok = megatron_tokenizer(other_tokenizer, tmp_path / "hf")
    prefix = preprocess(read_texts(corpus_jsonl[0]), tok, tmp_path / "other")
    message = refused(prefix, tokenizer_json, tmp_path / "out" / "other")
    documents = len(IndexedDataset(prefix))
    found = re.fullmatch(
        rf"{re.escape(prefix)}\.bin \(megatron shard {re.escape(prefix)}\) was not made with "
        rf"tokenizer {re.escape(str(tokenizer_json))}: (\d+) of (\d+) sampled documents do not "
        rf"encode back to their ids \(sequence 0, from token (\d+): ids \[[\d, ]+\] decode to "
        rf"'.*'\.\.\., which encodes to \[[\d, ]+\]\); {re.escape(fix_tokenizer(tokenizer_json))}",
        message,
    )
    assert found, message
    assert int(found[1]) == int(found[2]) == documents


def test_the_cli_refuses_with_one_line_and_publishes_nothing(
    shards, tokenizer_json, tmp_path, capsys
):
    prefix = copy_shard(shards[0], tmp_path / "src")
    os.truncate(f"{prefix}.bin", 10)
    out = tmp_path / "out" / "x"
    argv = ["import-megatron", "--input", str(prefix), "--tokenizer", str(tokenizer_json)]
    assert main([*argv, "--output-prefix", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"gptflow import-megatron: error: {prefix}.bin: ")
    assert published(out) == []
    assert main([*argv[:2], shards[0], *argv[3:], "--output-prefix", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{out}: {shards[0]} imported (symlinks): ")
    assert published(out) == ["x.bin", "x.idx", "x.json"]


def test_publish_symlink_replaces_a_file_or_link_atomically(tmp_path):
    final = tmp_path / "s.bin"
    final.write_text("old")
    publish_symlink("/data/a.bin", final)
    publish_symlink("/data/b.bin", final)
    assert os.readlink(final) == "/data/b.bin"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]


# --------------------------------------------------------------------------- the config


def resolve(spec: dict):
    return resolve_dataset("tok", spec, catalog={}, catalog_path="-", source="my.yaml")


def test_prefixes_become_shards_named_by_their_files(megatron_shards, monkeypatch):
    monkeypatch.setenv("MEGATRON_DATA", str(Path(megatron_shards[0]).parent))
    d = resolve({"type": "megatron", "prefixes": ["$MEGATRON_DATA/corpus_01_text_document",
                                                  megatron_shards[0]]})  # fmt: skip
    assert d.kind == "megatron"
    assert [(s.name, s.input) for s in d.shards] == [
        ("corpus_01_text_document", megatron_shards[1]),
        ("corpus_00_text_document", megatron_shards[0]),
    ]


def test_a_missing_prefix_is_named(megatron_shards, tmp_path):
    for given, missing, hint in (
        (str(tmp_path / "nowhere"), f"{tmp_path}/nowhere.idx", ""),
        (f"{megatron_shards[0]}.bin", f"{megatron_shards[0]}.bin.idx",
         " (a prefix is the path without .bin/.idx)"),
    ):  # fmt: skip
        with pytest.raises(GptflowError) as e:
            resolve({"type": "megatron", "prefixes": [megatron_shards[0], given]})
        assert str(e.value) == (
            f"my.yaml: datasets.tok.prefixes[1] is {given!r}, but {missing} does not exist "
            f"(relative to {Path.cwd()}){hint}. Fix datasets.tok.prefixes[1] in my.yaml."
        )


PLAIN = "is not a plain name (letters, digits, '.', '_' and '-', no leading '.' or '-')"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("$(touch CANARY)", PLAIN),
        ("x; touch CANARY", PLAIN),
        ("`touch CANARY`", PLAIN),
        ("-rf", PLAIN),
        (".hidden", PLAIN),
        ("x\ntouch CANARY", PLAIN),
        ("merged", "is the name of the dataset's merged shard (tokenize.merge)"),
        ("a" * 201, "is longer than 200 bytes"),
    ],
)
def test_a_hostile_or_reserved_shard_name_is_refused(name, problem, tmp_path):
    given = f"{tmp_path}/{name}"
    with pytest.raises(GptflowError) as e:
        resolve({"type": "megatron", "prefixes": [given]})
    assert str(e.value) == (
        f"my.yaml: datasets.tok.prefixes[0] is {given!r}: its file name {name!r}, the shard's "
        f"name, {problem}. Fix datasets.tok.prefixes[0] in my.yaml."
    )
    assert list(tmp_path.iterdir()) == []


def test_two_prefixes_with_one_file_name_are_refused(tmp_path):
    given = [f"{tmp_path}/a/text_document", f"{tmp_path}/b/text_document"]
    for prefix in given:
        Path(prefix).parent.mkdir()
        for ext in (".bin", ".idx"):
            Path(f"{prefix}{ext}").touch()
    with pytest.raises(GptflowError) as e:
        resolve({"type": "megatron", "prefixes": given})
    assert str(e.value) == (
        f"my.yaml: datasets.tok.prefixes[1] is {given[1]!r}: its file name 'text_document', "
        f"the shard's name, is also the shard name of prefixes[0]; shards of a dataset need "
        f"distinct file names (link one under another name) or put them in two datasets. Fix "
        f"datasets.tok.prefixes[1] in my.yaml."
    )


def load(cfg: dict) -> dict:
    return load_workflow_config(
        cfg,
        schema_path=REPO / "config/schema/config.schema.yaml",
        models_dir=REPO / "config/models",
        source="my.yaml",
    )


def test_the_schema_refuses_a_hostile_shard_name(tiny_config):
    cfg = {**tiny_config, "datasets": {**tiny_config["datasets"],
           "tok": {"type": "megatron", "prefixes": ["/data/$(touch CANARY)"]}}}  # fmt: skip
    with pytest.raises(GptflowError) as e:
        load(cfg)
    assert "datasets.tok.prefixes[0]" in str(e.value)
    assert "a path whose file name (the shard name) is letters, digits" in str(e.value)


def test_a_tokenizer_trained_now_cannot_have_made_a_megatron_dataset(tiny_config):
    cfg = yaml.safe_load(yaml.safe_dump(tiny_config))
    cfg["datasets"]["tok"] = {"type": "megatron", "prefixes": ["/data/pile_00_text_document"]}
    cfg["data"]["blend"].append({"dataset": "tok"})
    with pytest.raises(GptflowError) as e:
        load(cfg)
    assert str(e.value) == (
        "my.yaml: datasets.tok is a megatron dataset (shards already tokenized), but "
        "tokenizer.source is 'train': a tokenizer trained now did not make them. Set "
        "tokenizer.source to 'file', 'url' or 'gpt2' with the tokenizer they were made with. "
        "Fix my.yaml."
    )
