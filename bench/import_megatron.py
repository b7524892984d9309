"""Import of an existing Megatron shard: how fast the .bin is checked (gptflow.data.shard_import).

Writes a synthetic shard of --mb MB (uint16 ids below 50,277 in documents of ~2,000 tokens,
gptflow's writer), then times, best of --repeats:

- the structure checks of the .idx (every length, pointer and document boundary);
- the vocabulary scan of the .bin with its sha256 on a second thread (what an import pays),
  with the file in the page cache and, after posix_fadvise(DONTNEED) on it, from storage;
- for scale, sha256 alone and numpy's max alone over the same memory-mapped chunks.

The tokenizer round trip is not timed here: it decodes and encodes at most 2^20 tokens per
shard, whatever the shard's size (under a second with a 50k BPE).

Each rate is printed with its ratio to sha256 alone (the hash an import cannot skip).

Usage: python bench/import_megatron.py [--mb 2048] [--repeats 3] [--dir DIR] [--smoke]
(--smoke: a 4 MB shard once: the test suite's run, tests/unit/test_bench.py, whose figures mean
nothing.)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from gptflow.data.indexed import IndexedDataset, IndexedDatasetWriter
from gptflow.data.shard_import import SCAN_CHUNK_BYTES, check_structure, scan_tokens
from gptflow.data.tokenizer import TokenizerInfo

REPO = Path(__file__).resolve().parents[1]

VOCAB = 50277  # GPT-NeoX-20B's tokenizer
# --smoke: the smallest run that still prints every line (explicit options still win)
SMOKE = dict(mb=4, repeats=1)


def write_shard(prefix: Path, mb: int) -> None:
    rng = np.random.default_rng(0)
    tokens = mb * 1_000_000 // 2
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for start in range(0, tokens, 1 << 24):
            n = min(1 << 24, tokens - start)
            flat = rng.integers(0, VOCAB, size=n, dtype=np.uint16)
            lengths = np.full(n // 2000, 2000, dtype=np.int64)
            lengths[-1] += n - lengths.sum()
            w.add_flat(flat, lengths)
        w.finalize()


def evict(path: Path) -> None:
    """Drop this file's pages from the page cache (this file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def best(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def chunks(path: Path):
    data = np.memmap(path, mode="r", dtype=np.uint16)
    step = SCAN_CHUNK_BYTES // 2
    for start in range(0, len(data), step):
        yield data[start : start + step]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=2048, help="size of the synthetic .bin in MB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write it (default a temporary dir)")
    ap.add_argument("--smoke", action="store_true", help=f"seconds: {SMOKE}")
    a = ap.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        prefix = Path(tmp) / "synthetic_text_document"
        t0 = time.perf_counter()
        write_shard(prefix, a.mb)
        bin_file = Path(f"{prefix}.bin")
        size = bin_file.stat().st_size
        ds = IndexedDataset(prefix)
        print(f"shard: {size / 1e6:,.0f} MB, {len(ds):,} sequences, written in "
              f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
        info = TokenizerInfo("synthetic", "0" * 64, VOCAB, 0, "<|endoftext|>")

        print(f"structure checks (.idx)   {best(lambda: check_structure(ds), a.repeats):.3f} s")
        scan_tokens(ds, info)  # into the page cache
        cached = best(lambda: scan_tokens(ds, info), a.repeats)
        cold = best(lambda: scan_tokens(ds, info), a.repeats, before=lambda: evict(bin_file))

        def sha_only():
            h = hashlib.sha256()
            for c in chunks(bin_file):
                h.update(c)

        def max_only():
            for c in chunks(bin_file):
                c.max()

        sha, top = best(sha_only, a.repeats), best(max_only, a.repeats)
        for label, seconds in [("scan + sha256, cached", cached), ("scan + sha256, from disk", cold),
                               ("sha256 alone, cached", sha), ("numpy max alone, cached", top)]:  # fmt: skip
            print(f"{label:<25} {size / 1e6 / seconds:8,.0f} MB/s ({seconds:.2f} s) "
                  f"{sha / seconds:6.2f}x sha256 alone's rate")  # fmt: skip


if __name__ == "__main__":
    main()
