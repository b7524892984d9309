"""Benchmarks that print figures (`make bench`); each compares against a baseline in-process.

1. tokenization: `gptflow tokenize` (hf engine, 1 and 2 workers) vs the per-document
   encode-and-write loop of Megatron's `preprocess_data.py` (single process, same tokenizer),
   on the embedded corpus (the Python standard library, as `make run` collects it);
   outputs must be byte-identical.
2. training step: the `small` preset, plain PyTorch AdamW step vs the same step through the
   DeepSpeed engine (ZeRO 0, fp32), same process, same batch.

Usage: python bench/run.py [--only tokenize|train] [--out DIR]
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


def corpus(out: Path) -> list[str]:
    import yaml

    from gptflow.config import expand_root
    from gptflow.data.readers import collect_local_documents
    from gptflow.data.sources import local_shards

    spec = yaml.safe_load((REPO / "config/config.yaml").read_text())["datasets"]["stdlib"]
    files = [f for shard in local_shards("stdlib", spec) for f in shard]
    path = out / "stdlib.jsonl"
    stats = collect_local_documents(files, expand_root(spec["root"]), path)
    print(f"corpus: {stats['documents']} documents, {stats['bytes'] / 1e6:.1f} MB (stdlib)")
    return [str(path)]


def tokenizer(out: Path, inputs: list[str]) -> str:
    from gptflow.data.tokenizer import sample_texts, train_bpe

    path = out / "tokenizer.json"
    t = time.perf_counter()
    train_bpe(
        sample_texts(inputs, "text", 64_000_000),
        path,
        vocab_size=8192,
        special_tokens=["<|endoftext|>", "<|padding|>"],
    )
    print(f"tokenizer: 8192-token ByteLevel BPE trained in {time.perf_counter() - t:.1f} s")
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


def bench_tokenize(out: Path) -> None:
    from gptflow.data.tokenize import tokenize_to_shard

    inputs = corpus(out)
    tok = tokenizer(out, inputs)
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


def bench_train() -> None:
    import torch

    from gptflow.config import ModelConfig, TrainConfig, load_yaml
    from gptflow.model import GPTNeoX, decay_groups

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    preset = {
        k: v for k, v in load_yaml(REPO / "config/models/small.yaml").items() if k != "description"
    }
    cfg = ModelConfig(**preset, vocab_size=8192)
    train = TrainConfig(
        train_iters=10,
        micro_batch_size=8,
        global_batch_size=8,
        seq_length=256,
        lr=1e-3,
        min_lr=1e-4,
    )
    x = torch.randint(0, 8192, (8, 256))

    def timed(step, n=6):
        for _ in range(2):
            step()
        t = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - t) / n

    torch.manual_seed(0)
    plain = GPTNeoX(cfg)
    opt = torch.optim.AdamW(decay_groups(plain, 0.1), lr=1e-3)

    def plain_step():
        loss = plain(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    from gptflow import distributed
    from gptflow import engine as ds

    distributed.export(distributed.resolve({}))
    ds.init_distributed()
    torch.manual_seed(0)
    model = GPTNeoX(cfg)
    eng = ds.build_engine(model, decay_groups(model, 0.1), train, 1)

    def ds_step():
        loss = eng(x, x)
        eng.backward(loss)
        eng.step()

    tp, td = timed(plain_step), timed(ds_step)
    tokens = x.numel()
    print(
        f"train step, `small` preset ({cfg.num_parameters() / 1e6:.1f} M params), batch 8 x 256, fp32, {torch.get_num_threads()} threads:"
    )
    print(f"  plain PyTorch AdamW:          {tp * 1000:7.1f} ms/step  {tokens / tp:8.0f} tokens/s")
    print(
        f"  DeepSpeed engine (ZeRO 0):    {td * 1000:7.1f} ms/step  {tokens / td:8.0f} tokens/s  overhead {100 * (td / tp - 1):+.1f}%"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["tokenize", "train"])
    p.add_argument("--out", help="scratch directory (default: a temporary one)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        if a.only in (None, "tokenize"):
            bench_tokenize(out)
        if a.only in (None, "train"):
            bench_train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
