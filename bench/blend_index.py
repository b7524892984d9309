"""Blend index: gptflow's numpy `blending_indices` vs megatron-core's C++ `build_blending_indices`.

For each blend (3 and 5 random weights, The Pile's 22) and size (default 1M and 10M samples):
both builders, interleaved, best of --repeats each, as wall time and as CPU time (the CPU time
is the steadier figure on a shared machine), their ratio, and a check that the two outputs are
identical. Then what the trainer pays instead: memory-mapping the cached .npy files. With
--loop, the per-sample Python loop gptflow used before, once, at the smallest size.

megatron-core's compiled helpers are loaded from its wheel's .so (or compiled by its Makefile).

Usage: python bench/blend_index.py [--sizes 1000000 10000000] [--repeats 5] [--loop] [--smoke]
(--smoke: 1,000 samples once: the test suite's run, tests/unit/test_bench.py, whose figures mean
nothing. Without megatron-core it says so in one line and exits 1.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support: the reference loader

import numpy as np  # noqa: E402

from gptflow.data.blend import blending_indices  # noqa: E402
from tests.support.megatron import helpers_cpp, megatron_blend  # noqa: E402

# --smoke: the smallest run that still prints every line (explicit options still win)
SMOKE = dict(sizes=[1000], repeats=1)

PILE = [18.11, 14.40, 12.07, 10.01, 8.96, 7.59, 6.12, 5.13, 3.65, 3.07, 2.17, 1.55, 1.53, 1.24]
PILE += [0.88, 0.75, 0.73, 0.62, 0.60, 0.38, 0.30, 0.14]  # The Pile's 22 components, in %


def python_loop(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """gptflow's blending_indices before it was vectorised (a numpy argmax per sample)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    counts = np.zeros(len(w), dtype=np.int64)
    for s in range(size):
        i = int(np.argmax(w * max(s, 1) - counts))
        dataset_index[s] = i
        dataset_sample_index[s] = counts[i]
        counts[i] += 1
    return dataset_index, dataset_sample_index


def timed(fn, *args) -> tuple[float, float, tuple]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loop", action="store_true", help="also time the old per-sample loop")
    p.add_argument("--smoke", action="store_true", help=f"seconds: {SMOKE}")
    a = p.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        p.set_defaults(**SMOKE)
        a = p.parse_args()
    try:
        helpers = helpers_cpp()
    except (ImportError, OSError, subprocess.CalledProcessError) as e:  # the baseline is missing
        sys.exit(f"bench/blend_index.py cannot run here: megatron-core's C++ helpers: {e}")
    rng = np.random.default_rng(0)
    blends = {
        "3 random": list(rng.random(3)),
        "5 random": list(rng.random(5)),
        "Pile (22)": PILE,
    }
    print(f"{'blend':>10} {'samples':>11} | {'ours ms':>8} {'C++ ms':>8} {'ratio':>5} (wall)"
          f" | {'ours ms':>8} {'C++ ms':>8} {'ratio':>5} (CPU) | identical")  # fmt: skip
    for size in a.sizes:
        for name, weights in blends.items():
            ours, theirs = [], []
            for _ in range(a.repeats):  # interleaved: the same background load for both
                *t, mine = timed(blending_indices, weights, size)
                ours.append(t)
                *t, ref = timed(megatron_blend, helpers, weights, size)
                theirs.append(t)
            same = all(np.array_equal(x, y) for x, y in zip(mine, ref, strict=True))
            (ow, oc), (cw, cc) = (np.min(ours, axis=0), np.min(theirs, axis=0))
            print(
                f"{name:>10} {size:>11,} | {ow * 1e3:8.1f} {cw * 1e3:8.1f} {ow / cw:5.2f}       "
                f"| {oc * 1e3:8.1f} {cc * 1e3:8.1f} {oc / cc:5.2f}      | {same}"
            )
            if not same:
                return 1
    size, weights = max(a.sizes), blends["5 random"]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"{n}.npy" for n in ("dataset_index", "dataset_sample_index")]
        for path, array in zip(paths, blending_indices(weights, size), strict=True):
            np.save(path, array)
        wall, _, _ = timed(lambda: [np.load(f, mmap_mode="r") for f in paths])
        print(f"trainer, cached {size:,}-sample index: memory-mapped in {wall * 1e3:.2f} ms")
    if a.loop:
        size = min(a.sizes)
        wall, _, _ = timed(python_loop, weights, size)
        print(f"before (per-sample loop), 5 random, {size:,} samples: {wall:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
