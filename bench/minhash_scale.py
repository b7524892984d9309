"""MinHash's stages after the signatures at scale (issue 48): buckets, clustering and the
removal list's read, today's (gptflow.data.quality.buckets/clusters/removal) against the former
code (tests/support/minhash_baseline.py), in one command, each stage in a child process of
its own (forked, its peak RSS reset through /proc/self/clear_refs) so that its peak RSS
(VmHWM) above what it started with and its /proc/self/io are its alone.

Corpus: synthetic signatures (the text stage is bench/quality.py's): D originals with k
near-copies each; a near-copy keeps each of its original's 14 bands with probability 1/2
(J ~ 0.92: 0.92^8), else fresh values, so a copy pairs with its original in ~7 bands, as the
planted near-copies of tests/unit/data/quality/test_quality_dedup.py at J >= 0.9 do; 5 % of the
documents too short to sign; all shuffled over 16 shards and written in both layouts (band-major for
today's, row-major for the former). Three corpus sizes at k = 4, and one size with k = 1, 4
and 16 (the documents fixed, the pairs growing with k).

Per size and implementation:

* buckets (band 0), in 13 passes as at the Pile's 210 M documents: wall and CPU seconds,
  peak RSS, and the bytes read. ``read_bytes`` (storage) is the figure compared, with the
  signature files' page cache dropped (posix_fadvise DONTNEED) before every pass, as a
  corpus larger than memory would be (188 GB for the Pile): the former code maps the files,
  and reads through a map are invisible to ``rchar`` (read syscalls), so its maps are made
  afresh each pass here (one per pass, as eviction would make them at scale); today's reads
  are explicit, so ``rchar`` (also printed) counts them exactly. Then the same job in one
  pass: its peak RSS per document held.
* clustering of all 14 bands' pairs: peak RSS and CPU seconds.
* a removal job's read of the group's list (the middle shard's slice), cold.

Then the clustering alone on larger groups (--cluster-documents: 1, 4 and 16 M documents at 2
pairs a document, and 4 M documents at 1, 4 and 16 pairs a document): random pairs of 1,000
shards' documents, each pair's first the earlier, in 14 band files; peak RSS and CPU seconds
of both implementations, and their bytes per document and per pair.

Both implementations' pairs (band 0) and removal lists are compared: identical, or the bench
fails. Ratios are former / today's.

Usage: python bench/minhash_scale.py [--sizes 100000 400000 1600000] [--copies-at 400000]
       [--cluster-documents 1000000 4000000 16000000] [--json] [--smoke]
(--smoke: 4,000-16,000 documents, clusterings of 10,000-160,000: seconds; figures mean
nothing)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import scipy.sparse.csgraph  # noqa: F401  (both clusterings' import, paid before the forks)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support: the former code, kept as the baseline

from gptflow.data.quality import buckets, clusters, minhash, removal  # noqa: E402
from tests.support import minhash_baseline as baseline  # noqa: E402

BANDS, ROWS, SHARDS, PASSES = 14, 8, 16, 13
MIB = 2**20


# ------------------------------------------------------------------ the corpus


def corpus(originals: int, copies: int, seed: int = 48) -> list[np.ndarray]:
    """Each shard's (documents, 112) uint64 signatures: the module docstring's corpus."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**64 - 1, (originals, BANDS * ROWS), dtype=np.uint64)
    docs = np.repeat(base, copies + 1, axis=0)
    copy = np.ones(len(docs), dtype=bool)
    copy[:: copies + 1] = False
    for band in range(BANDS):
        fresh = copy & (rng.random(len(docs)) < 0.5)
        cols = slice(band * ROWS, (band + 1) * ROWS)
        docs[fresh, cols] = rng.integers(0, 2**64 - 1, (int(fresh.sum()), ROWS), dtype=np.uint64)
    docs[rng.random(len(docs)) < 0.05] = minhash.NO_SIGNATURE
    docs = docs[rng.permutation(len(docs))]
    return np.array_split(docs, SHARDS)


def write_corpus(shards: list[np.ndarray], work: Path) -> tuple[list[str], list[str]]:
    """(band-major files, row-major files)."""
    new, old = [], []
    for i, sigs in enumerate(shards):
        new.append(str(work / f"{i:05d}.new.npy"))
        minhash.write_signatures(new[-1], [sigs], BANDS, ROWS)
        old.append(str(work / f"{i:05d}.old.npy"))
        np.save(old[-1], sigs)
    return new, old


# ------------------------------------------------------------------ the children


def io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        out[key] = int(value)
    return out


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def drop_cache(paths: list[str]) -> None:
    """Evict the files' pages (clean: written and synced) from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def former_band_job(files: list[str], band: int, out: str, rows_per_pass: int) -> int:
    """baseline.band_pairs, its maps made afresh and the cache dropped before each pass."""
    total = sum(np.load(p, mmap_mode="r").shape[0] for p in files)
    passes = max(1, -(-total // rows_per_pass))
    found = []
    for p in range(passes):
        drop_cache(files)
        sigs = [np.load(path, mmap_mode="r") for path in files]
        found.append(baseline._band_pairs_in_range(sigs, band, ROWS, p, passes))
        del sigs
    pairs = np.concatenate(found)
    baseline.save(out, pairs)
    return len(pairs)


def today_band_job(files: list[str], band: int, out: str, rows_per_pass: int) -> int:
    drop_cache(files)  # each byte is read once: no pass re-reads what another read
    return buckets.band_pairs(files, band, ROWS, out, rows_per_pass=rows_per_pass)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def child(kind: str, args: tuple) -> dict:
    """One stage, measured (in the forked child): its result and figures."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = rss()
    before, cpu, wall = io(), time.process_time(), time.perf_counter()
    if kind == "buckets-today":
        result = today_band_job(*args)
    elif kind == "buckets-former":
        result = former_band_job(*args)
    elif kind == "cluster-today":
        result = clusters.cluster(*args)
    elif kind == "cluster-former":
        result = baseline.cluster(*args)
    elif kind in ("remove-today", "remove-former"):
        drop_cache([args[0]])
        f = removal.removed_in_shard if kind == "remove-today" else baseline.removed_in_shard
        result = len(f(*args))
    else:
        raise ValueError(kind)
    after = io()
    return {
        "result": result,
        "cpu_s": time.process_time() - cpu,
        "wall_s": time.perf_counter() - wall,
        "peak_mib": (peak_rss() - start) / MIB,  # above the forked process's start
        "start_mib": start / MIB,
        "rchar": after["rchar"] - before["rchar"],
        "read_bytes": after["read_bytes"] - before["read_bytes"],
    }


def run_child(kind: str, *args) -> dict:
    """:func:`child` in a forked process (the imports are paid once, in this one). This
    process's free heap is returned to the system first: the child would reuse it without
    its RSS growing, and its peak would read low."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its figures down the pipe, then gone without cleanup
        code = 0
        try:
            os.close(read)
            with os.fdopen(write, "w") as f:
                f.write(json.dumps(child(kind, args)))
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if status:
        sys.exit(f"bench/minhash_scale.py: the {kind} child failed ({status})")
    return json.loads(text)


# ------------------------------------------------------------------ one corpus


def measure(originals: int, copies: int, work: Path) -> dict:
    """Every stage of both implementations on one corpus."""
    shards = corpus(originals, copies)
    documents = [len(s) for s in shards]
    total = sum(documents)
    signed = sum(int((s[:, 0] != minhash.NO_SIGNATURE).sum()) for s in shards)
    new, old = write_corpus(shards, work)
    del shards
    per_pass = -(-total // PASSES)
    out = {"originals": originals, "copies": copies, "documents": total, "signed": signed}
    out["band_bytes"] = signed * minhash.record_dtype(ROWS).itemsize
    out["signature_bytes_row_major"] = sum(os.path.getsize(p) for p in old)
    for who, files in (("today", new), ("former", old)):
        job = run_child(f"buckets-{who}", files, 0, str(work / f"{who}.b0.npy"), per_pass)
        one = run_child(f"buckets-{who}", files, 0, str(work / f"{who}.b0.one.npy"), total)
        out[f"buckets_{who}"], out[f"buckets_one_pass_{who}"] = job, one
    same = np.array_equal(np.load(work / "today.b0.npy"), np.load(work / "former.b0.npy"))
    pair_files = [str(work / "today.b0.npy")]
    for band in range(1, BANDS):  # today's, in this process: the same pairs as the former's
        pair_files.append(str(work / f"today.b{band}.npy"))
        buckets.band_pairs(new, band, ROWS, pair_files[-1])
    out["pairs"] = sum(np.load(p, mmap_mode="r").shape[0] for p in pair_files)
    out["cluster_today"] = run_child("cluster-today", pair_files, documents, work / "t.npy")
    out["cluster_former"] = run_child("cluster-former", pair_files, work / "f.npy")
    same &= np.array_equal(np.load(work / "t.npy"), np.load(work / "f.npy"))
    same &= out["cluster_today"]["result"] == out["cluster_former"]["result"]
    out["removed"] = out["cluster_today"]["result"]["removed"]
    for who in ("today", "former"):
        out[f"remove_{who}"] = run_child(f"remove-{who}", work / "t.npy", SHARDS // 2)
    out["removal_list_bytes"] = os.path.getsize(work / "t.npy")
    out["identical"] = bool(same)
    for path in work.iterdir():
        path.unlink()
    return out


def cluster_sweep(documents: int, per_document: int, work: Path) -> dict:
    """Both clusterings of `per_document` random pairs a document among `documents` (1,000
    shards): the figures of each, and whether their lists agree."""
    rng = np.random.default_rng(documents + per_document)
    shards = np.full(1000, documents // 1000)
    total = documents // 1000 * 1000
    pairs = total * per_document
    files = []
    for band, count in enumerate(np.diff(np.linspace(0, pairs, BANDS + 1).astype(np.int64))):
        ends = np.sort(rng.integers(0, total, (count, 2)), axis=1)
        ends = ends[ends[:, 0] != ends[:, 1]]
        p = np.empty((len(ends), 4), dtype=np.uint32)
        p[:, 0], p[:, 1] = np.divmod(ends[:, 0], shards[0])
        p[:, 2], p[:, 3] = np.divmod(ends[:, 1], shards[0])
        files.append(str(work / f"band{band:03d}.npy"))
        np.save(files[-1], p)
        del ends, p
    out = {"documents": total, "pairs": sum(np.load(f, mmap_mode="r").shape[0] for f in files)}
    out["today"] = run_child("cluster-today", files, shards.tolist(), work / "t.npy")
    out["former"] = run_child("cluster-former", files, work / "f.npy")
    out["identical"] = bool(
        np.array_equal(np.load(work / "t.npy"), np.load(work / "f.npy"))
        and out["today"]["result"] == out["former"]["result"]
    )
    for path in work.iterdir():
        path.unlink()
    return out


# ------------------------------------------------------------------ the tables


def mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def print_rows(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"  {'documents':>10} {'copies':>6} {'pairs':>10} | bucket job, 13 passes: MiB read "
          f"(storage, cold) today / former, ratio; rchar today; band MiB | wall s today / "
          f"former")  # fmt: skip
    for r in rows:
        t, f = r["buckets_today"], r["buckets_former"]
        print(f"  {r['documents']:>10,} {r['copies']:>6} {r['pairs']:>10,} | "
              f"{mib(t['read_bytes'])} / {mib(f['read_bytes'])} MiB, "
              f"{f['read_bytes'] / max(t['read_bytes'], 1):,.1f}x; rchar {mib(t['rchar'])}; "
              f"band {mib(r['band_bytes'])} | {t['wall_s']:.2f} / {f['wall_s']:.2f} s")  # fmt: skip
    print(f"  {'documents':>10} {'copies':>6} {'pairs':>10} | clustering peak RSS MiB today / "
          f"former (above the child's start), ratio; CPU s today / former | bucket job in 1 pass: peak MiB "
          f"today / former")  # fmt: skip
    for r in rows:
        t, f = r["cluster_today"], r["cluster_former"]
        bt, bf = r["buckets_one_pass_today"], r["buckets_one_pass_former"]
        print(f"  {r['documents']:>10,} {r['copies']:>6} {r['pairs']:>10,} | "
              f"{t['peak_mib']:,.0f} / {f['peak_mib']:,.0f}, "
              f"{f['peak_mib'] / t['peak_mib']:.1f}x; {t['cpu_s']:.2f} / {f['cpu_s']:.2f} s | "
              f"{bt['peak_mib']:,.0f} / {bf['peak_mib']:,.0f}")  # fmt: skip
    print(f"  {'documents':>10} {'copies':>6} {'removed':>10} | a removal job's read of the list: "
          f"KiB (storage, cold) today / former; list KiB")  # fmt: skip
    for r in rows:
        t, f = r["remove_today"], r["remove_former"]
        print(f"  {r['documents']:>10,} {r['copies']:>6} {r['removed']:>10,} | "
              f"{t['read_bytes'] / 1024:,.0f} / {f['read_bytes'] / 1024:,.0f} KiB; "
              f"{r['removal_list_bytes'] / 1024:,.0f} KiB")  # fmt: skip


def print_clusterings(rows: list[dict]) -> None:
    print("\nclustering alone, random pairs among 1,000 shards' documents")
    print(f"  {'documents':>11} {'pairs':>11} | peak RSS MiB today / former (above the child's "
          f"start), ratio | peak / documents today, / pairs former (B) | CPU s today / former")  # fmt: skip
    for r in rows:
        t, f = r["today"], r["former"]
        print(f"  {r['documents']:>11,} {r['pairs']:>11,} | {t['peak_mib']:,.0f} / "
              f"{f['peak_mib']:,.0f}, {f['peak_mib'] / t['peak_mib']:.1f}x | "
              f"{t['peak_mib'] * MIB / r['documents']:.1f}, {f['peak_mib'] * MIB / r['pairs']:.1f} | "
              f"{t['cpu_s']:.2f} / {f['cpu_s']:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs=3, default=[100_000, 400_000, 1_600_000],
                        help="documents of the three corpora (k = 4)")  # fmt: skip
    parser.add_argument("--copies-at", type=int, default=400_000,
                        help="documents of the corpus with 1, 4 and 16 copies")  # fmt: skip
    parser.add_argument("--cluster-documents", type=int, nargs=3,
                        default=[1_000_000, 4_000_000, 16_000_000],
                        help="documents of the three clusterings at 2 pairs a document; the "
                             "second also at 1, 4 and 16")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="4,000-16,000 documents")
    parser.add_argument("--json", action="store_true", help="a JSON line of the figures, last")
    args = parser.parse_args()
    if not (Path("/proc/self/clear_refs").exists() and hasattr(os, "posix_fadvise")):
        sys.exit("bench/minhash_scale.py cannot run here: it needs Linux's /proc/self/io, "
                 "/proc/self/clear_refs and posix_fadvise")  # fmt: skip
    sizes, at = ([4_000, 8_000, 16_000], 8_000) if args.smoke else (args.sizes, args.copies_at)
    sweep = [10_000, 40_000, 160_000] if args.smoke else args.cluster_documents
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {SHARDS} shards, "
          f"{BANDS} x {ROWS}, {PASSES} passes")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        by_size = [measure(n // 5, 4, work) for n in sizes]
        by_copies = [
            by_size[sizes.index(at)] if k == 4 and at in sizes else measure(at // (k + 1), k, work)
            for k in (1, 4, 16)
        ]
        clusterings = [cluster_sweep(n, 2, work) for n in sweep]
        clusterings += [cluster_sweep(sweep[1], k, work) for k in (1, 4, 16)]
    print_rows(by_size, "three corpus sizes, 4 near-copies per original")
    print_rows(by_copies, f"~{at:,} documents, 1, 4 and 16 near-copies per original")
    print_clusterings(clusterings)
    identical = all(r["identical"] for r in by_size + by_copies + clusterings)
    print(f"\nidentical pairs (band 0), removal lists and counts: {'yes' if identical else 'NO'}")
    if args.json:
        figures = {"by_size": by_size, "by_copies": by_copies, "clusterings": clusterings}
        print(json.dumps({**figures, "identical": identical}))
    if not identical:
        sys.exit("bench/minhash_scale.py: today's stages decided otherwise than the former's")


if __name__ == "__main__":
    main()
