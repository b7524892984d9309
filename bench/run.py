"""Benchmarks that print figures (`make bench`); each compares against a baseline in-process.

1. tokenization: `gptflow tokenize` (hf engine, 1 and 2 workers) vs the per-document
   encode-and-write loop of Megatron's `preprocess_data.py` (single process, same tokenizer),
   on the embedded corpus (the Python standard library, as `make run` collects it);
   outputs must be byte-identical.

Training throughput (ZeRO 0-3 against a plain PyTorch loop) is bench/train.py.
Checkpoint saves (train.async_save against synchronous ones) are bench/async_save.py.

Usage: python bench/run.py [--only tokenize] [--out DIR] [--config config/config.yaml]
       [--vocab 8192] [--smoke]
(--smoke: the tests' corpus (tests/config/config.yaml's stdlib slice, under 1 MB) and a
512-token BPE: seconds rather than a minute, the test suite's run (tests/unit/test_bench.py),
whose figures mean little.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# --smoke: the smallest run that still prints every line (explicit options still win)
SMOKE = dict(config="tests/config/config.yaml", vocab=512)


def corpus(out: Path, config: str) -> list[str]:
    import yaml

    from gptflow.data.readers import collect_local_documents
    from gptflow.data.sources import expand_root, local_shards

    spec = yaml.safe_load((REPO / config).read_text())["datasets"]["stdlib"]
    files = [f for shard in local_shards("stdlib", spec) for f in shard]
    path = out / "stdlib.jsonl"
    stats = collect_local_documents(files, expand_root(spec["root"]), path)
    print(f"corpus: {stats['documents']} documents, {stats['bytes'] / 1e6:.1f} MB (stdlib)")
    return [str(path)]


def tokenizer(out: Path, inputs: list[str], vocab: int) -> str:
    from gptflow.data.tokenizer import sample_texts, train_bpe

    path = out / "tokenizer.json"
    t = time.perf_counter()
    train_bpe(
        sample_texts(inputs, "text", 64_000_000),
        path,
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|padding|>"],
    )
    print(f"tokenizer: {vocab}-token ByteLevel BPE trained in {time.perf_counter() - t:.1f} s")
    return str(path)


def baseline_megatron_loop(inputs: list[str], tok_path: str, prefix: str) -> float:
    """Megatron preprocess_data.py's inner loop: json.loads, encode one document, append EOD."""
    import json

    from tokenizers import Tokenizer

    from gptflow.data.indexed import IndexedDatasetWriter

    tok = Tokenizer.from_file(tok_path)
    eod = tok.token_to_id("<|endoftext|>")
    t = time.perf_counter()
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for path in inputs:
            with open(path) as f:
                for line in f:
                    ids = tok.encode(json.loads(line)["text"]).ids
                    if ids:
                        ids.append(eod)
                    w.add_document(np.array(ids, dtype=np.uint16))
        w.finalize()
    return time.perf_counter() - t


def bench_tokenize(out: Path, config: str, vocab: int) -> None:
    from gptflow.data.shards import tokenize_to_shard

    inputs = corpus(out, config)
    tok = tokenizer(out, inputs, vocab)
    mb = sum(os.path.getsize(p) for p in inputs) / 1e6
    base = baseline_megatron_loop(inputs, tok, str(out / "baseline"))
    print(
        f"  baseline (Megatron-style per-document loop, 1 process): {base:6.2f} s  {mb / base:6.2f} MB/s"
    )
    for workers in (1, 2):
        t = time.perf_counter()
        tokenize_to_shard(inputs, tok, str(out / f"ours{workers}"), workers=workers)
        dt = time.perf_counter() - t
        same = all(
            (out / f"ours{workers}{e}").read_bytes() == (out / f"baseline{e}").read_bytes()
            for e in (".bin", ".idx")
        )
        print(
            f"  gptflow tokenize --engine hf --workers {workers}:            {dt:6.2f} s  {mb / dt:6.2f} MB/s"
            f"  x{base / dt:.2f} vs baseline  identical bytes: {same}"
        )
        if not same:
            raise SystemExit(
                f"bench/run.py: gptflow tokenize --workers {workers} wrote other bytes"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["tokenize"])
    p.add_argument("--out", help="scratch directory (default: a temporary one)")
    p.add_argument("--config", default="config/config.yaml", help="whose stdlib dataset to read")
    p.add_argument("--vocab", type=int, default=8192, help="the BPE's vocabulary (8192)")
    p.add_argument("--smoke", action="store_true", help=f"seconds, not a minute: {SMOKE}")
    a = p.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        p.set_defaults(**SMOKE)
        a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        if a.only in (None, "tokenize"):
            bench_tokenize(out, a.config, a.vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
