"""tokenizer.source url and gpt2 through Snakemake, beyond a dry run: the files are really
downloaded from an HTTP server on loopback (tests/support/faultserver.py, which also drops a
connection mid-body), and the shards made with the result are the reference tokens of the
original tokenizer."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from gptflow.data.indexed import IndexedDataset
from gptflow.data.readers import iter_texts
from gptflow.data.shards import reference_tokens
from tests.support.faultserver import FaultServer

from .conftest import job_counts


@pytest.fixture(scope="module")
def server():
    s = FaultServer()
    yield s
    s.close()


def tokenizer_config(tiny_config: dict, tokenizer: dict) -> dict:
    cfg = copy.deepcopy(tiny_config)
    cfg["tokenizer"] = {"eod_token": "<|endoftext|>", **tokenizer}
    return cfg


def check_shards_use(wd, name: str, original) -> None:
    """Both shards of the stdlib corpus, tokenized with tokenizer `name`, hold the reference
    tokens of the `original` tokenizer.json, document by document."""
    for shard in ("00000", "00001"):
        texts = list(iter_texts(wd / f"results/documents/stdlib/{shard}.jsonl"))
        expected = reference_tokens(texts, str(original), "<|endoftext|>")
        ds = IndexedDataset(wd / f"results/tokens/{name}/stdlib/{shard}")
        assert len(texts) > 10 and ds.num_documents == len(texts), shard
        assert [ds[i].tolist() for i in range(len(ds))] == [e for e in expected if e], shard
        manifest = json.loads((wd / f"results/tokens/{name}/stdlib/{shard}.json").read_text())
        assert manifest["tokenizer"]["eod_id"] == 0 and manifest["tokenizer"]["vocab_size"] == 512


def test_a_url_tokenizer_is_downloaded_resumed_verified_and_used(
    tmp_path, server, snakemake, write_config, tiny_config, tokenizer_json
):
    """The first response breaks off after 1,000 bytes; the download resumes with Range,
    records the file's sha256 in SHA256SUMS, and import_tokenizer publishes it unchanged."""
    data = tokenizer_json.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    url = server.add("url/tokenizer.json", data, ("drop", 1000))
    cfg = tokenizer_config(tiny_config, {"name": "dl-bpe", "source": "url", "url": {"url": url}})
    config = write_config(tmp_path / "config.yaml", cfg)
    wd = tmp_path / "wd"
    plan = snakemake(wd, config, "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    assert job_counts(plan.out) == {
        "collect_local_documents": 2,
        "download_tokenizer_file": 1,
        "import_tokenizer": 1,
        "tokenize_shard": 2,
        "data": 1,
    }
    assert not server.requests("url/tokenizer.json")  # a dry run downloads nothing
    run = snakemake(wd, config, "data")
    assert run.returncode == 0, run.out[-5000:]

    requests = server.requests("url/tokenizer.json")
    assert [r["action"] for r in requests] == [("drop", 1000), "ok"], requests
    assert requests[0]["range"] is None and requests[1]["range"] == "bytes=1000-", requests
    downloaded = wd / "resources/tokenizers/dl-bpe/url/tokenizer.json"
    assert downloaded.read_bytes() == data
    assert (wd / "results/tokenizers/dl-bpe/tokenizer.json").read_bytes() == data
    sums = (wd / "resources/tokenizers/dl-bpe/SHA256SUMS").read_text()
    assert f"{sha}  tokenizer.json" in sums.splitlines(), sums
    assert not list(downloaded.parent.glob("*.part"))
    check_shards_use(wd, "dl-bpe", tokenizer_json)
    for shard in ("00000", "00001"):
        manifest = json.loads((wd / f"results/tokens/dl-bpe/stdlib/{shard}.json").read_text())
        assert manifest["tokenizer"]["sha256"] == sha

    again = snakemake(wd, config, "data")
    assert again.returncode == 0 and "Nothing to be done" in again.out, again.out[-3000:]
    assert len(server.requests("url/tokenizer.json")) == 2  # no second download


def test_a_gpt2_tokenizer_from_a_downloaded_vocab_and_local_merges_tokenizes_as_the_original(
    tmp_path, server, snakemake, write_config, tiny_config, tokenizer_json
):
    """tokenizer.source gpt2: vocab.json by URL (downloaded), merges.txt by path;
    convert_gpt2_tokenizer builds the tokenizer.json, and the shards equal the reference tokens
    of the trained tokenizer the two files were taken from."""
    from gptflow.data.tokenizer import load_tokenizer

    model = json.loads(load_tokenizer(tokenizer_json).to_str())["model"]
    vocab = json.dumps(model["vocab"]).encode()
    merges = tmp_path / "merges.txt"
    lines = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    merges.write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    vocab_sha = hashlib.sha256(vocab).hexdigest()
    url = server.add("gpt2/vocab.json", vocab)
    cfg = tokenizer_config(
        tiny_config,
        {"name": "gpt2-bpe", "source": "gpt2", "vocab": {"url": url, "sha256": vocab_sha},
         "merges": {"path": str(merges)}},
    )  # fmt: skip
    config = write_config(tmp_path / "config.yaml", cfg)
    wd = tmp_path / "wd"
    run = snakemake(wd, config, "data")
    assert run.returncode == 0, run.out[-5000:]
    assert job_counts(run.out) == {
        "collect_local_documents": 2,
        "convert_gpt2_tokenizer": 1,
        "download_tokenizer_file": 1,
        "tokenize_shard": 2,
        "data": 1,
    }
    assert len(server.requests("gpt2/vocab.json")) == 1
    assert (wd / "resources/tokenizers/gpt2-bpe/vocab/vocab.json").read_bytes() == vocab
    converted = load_tokenizer(wd / "results/tokenizers/gpt2-bpe/tokenizer.json")
    assert converted.get_vocab() == model["vocab"]
    check_shards_use(wd, "gpt2-bpe", tokenizer_json)
