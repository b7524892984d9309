"""Tokenization benchmark: `gptflow tokenize` against the engine's own ceiling.

Builds a JSONL corpus (default 220 MB) of real text found on the machine -- the Python standard
library and installed packages (.py), man pages (groff) and /usr/share/doc (README, changelogs,
licences), deduplicated and interleaved -- and a 50k ByteLevel BPE trained on 40 MB of it.
Then, each as its own process:

* ``gptflow tokenize --append-eod`` with ``--engine auto`` and ``--engine hf``, at 1 and 2
  workers: wall MB/s, documents/s, peak RSS; every output must be byte-identical;
* the ceiling: gigatoken's (and tokenizers') raw ``encode_batch`` over the same documents,
  already in memory, on 1 and 2 threads -- no reading, parsing or writing.

Usage: python bench/tokenization.py [--mb 220] [--work DIR] [--skip-hf] [--repeat 3]

The gigatoken figures are the best of --repeat runs; hf runs once (minutes each).
--smoke: a 1 MB corpus, once each: seconds rather than many minutes, the test suite's run
(tests/unit/test_bench.py; give it --work), whose figures mean nothing. The tokenizer is
cached in --work per corpus size, beside the corpus.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

# --smoke: the smallest run that still prints every line (explicit options still win)
SMOKE = dict(mb=1, repeat=1)
SOURCES = [
    (Path(sysconfig.get_paths()["stdlib"]), "*.py"),
    (Path(sysconfig.get_paths()["purelib"]), "*.py"),
    (Path("/usr/share/man"), "*"),
    (Path("/usr/share/doc"), "*"),
]


def _documents(root: Path, pattern: str) -> Iterator[tuple[str, str]]:
    for path in sorted(root.rglob(pattern)):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            data = path.read_bytes()
            if path.suffix == ".gz":
                data = gzip.decompress(data)
            text = data.decode("utf-8")
        except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError):
            continue
        if text.strip() and "\0" not in text[:4096]:
            yield str(path), text


def build_corpus(path: Path, megabytes: int) -> dict:
    """Interleave the sources one document at a time until `megabytes` MB of JSONL."""
    if path.exists():
        with open(path, "rb") as f:
            lines = sum(1 for _ in f)
        return {"documents": lines, "bytes": path.stat().st_size, "reused": True}
    seen: set[bytes] = set()
    size = documents = 0
    tmp = path.with_suffix(".tmp")
    streams = [_documents(root, pat) for root, pat in SOURCES if root.is_dir()]
    with open(tmp, "w", encoding="utf-8") as f:
        for item in itertools.chain.from_iterable(itertools.zip_longest(*streams)):
            if item is None:
                continue
            source, text = item
            digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if digest in seen:
                continue
            seen.add(digest)
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode())
            documents += 1
            if size >= megabytes * 1_000_000:
                break
    if size < megabytes * 1_000_000:
        print(f"warning: only {size / 1e6:.0f} MB of text found on this machine")
    tmp.rename(path)
    return {"documents": documents, "bytes": size, "reused": False}


def build_tokenizer(corpus: Path, out: Path) -> float:
    from gptflow.data.tokenizer import sample_texts, train_bpe

    if out.exists():
        return 0.0
    t = time.perf_counter()
    train_bpe(
        sample_texts([str(corpus)], "text", 40_000_000),
        out,
        vocab_size=50257,
        special_tokens=["<|endoftext|>", "<|padding|>"],
    )
    return time.perf_counter() - t


def _tree_rss(pid: int) -> int:
    """RSS in bytes of process `pid` and all its descendants (0 once it is gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def run_tokenize(corpus: Path, tok: Path, prefix: Path, engine: str, workers: int) -> dict:
    cmd = [
        sys.executable, "-m", "gptflow", "tokenize", "--input", str(corpus),
        "--tokenizer", str(tok), "--output-prefix", str(prefix), "--append-eod",
        "--engine", engine, "--workers", str(workers),
    ]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while proc.poll() is None:  # the whole process tree: hf runs worker processes
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.05)
    wall = time.perf_counter() - t
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"gptflow tokenize failed:\n{out}")
    manifest = json.loads(Path(f"{prefix}.json").read_text())
    # peak RSS: the main process's VmHWM (its manifest records it) or, sampled every 50 ms,
    # the sum over the process and its hf workers, whichever is higher
    rss = max(manifest["peak_rss_mb"], peak / 1e6)
    return {"wall": wall, "manifest": manifest, "rss_mb": rss}


CEILING = r"""
import json, sys, time, os
engine, corpus, tok, threads = sys.argv[1:5]
import msgspec
texts = [d.text for d in msgspec.json.Decoder(msgspec.defstruct("D", [("text", str)])).decode_lines(open(corpus, "rb").read())]
size = sum(len(t.encode()) for t in texts)
if engine == "gigatoken":
    import gigatoken
    g = gigatoken.Tokenizer(tok)
    t = time.perf_counter(); g.encode_batch(texts, parallel=int(threads) > 1); dt = time.perf_counter() - t
else:
    from tokenizers import Tokenizer
    h = Tokenizer.from_file(tok)
    sample = texts[: len(texts) // 20]; size = sum(len(t.encode()) for t in sample)
    t = time.perf_counter(); h.encode_batch(sample); dt = time.perf_counter() - t
print(json.dumps({"mb_s": size / 1e6 / dt, "seconds": dt}))
"""


def ceiling(engine: str, corpus: Path, tok: Path, threads: int) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, "-c", CEILING, engine, str(corpus), str(tok), str(threads)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=220, help="corpus size in MB (>= 200 for the issue)")
    ap.add_argument(
        "--work", default="/tmp/gptflow-bench-tokenize", help="corpus, tokenizer, outputs"
    )
    ap.add_argument("--skip-hf", action="store_true", help="leave out the slow hf runs")
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="best of N for the gigatoken runs (a shared host is noisy)",
    )
    ap.add_argument("--smoke", action="store_true", help=f"seconds, not minutes: {SMOKE}")
    a = ap.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus-{a.mb}mb.jsonl"
    t = time.perf_counter()
    c = build_corpus(corpus, a.mb)
    print(
        f"corpus: {c['documents']} documents, {c['bytes'] / 1e6:.1f} MB "
        f"({'reused' if c['reused'] else f'built in {time.perf_counter() - t:.1f} s'}) -> {corpus}"
    )
    tok = work / f"tokenizer-50k-{a.mb}mb.json"  # trained on that corpus
    secs = build_tokenizer(corpus, tok)
    how = f"trained in {secs:.1f} s" if secs else "reused"
    print(f"tokenizer: 50257-token ByteLevel BPE {how}")
    print(f"machine: {os.cpu_count()} CPUs")

    print("\nceiling: raw encode_batch of the same documents, in memory (no I/O, no parsing)")
    ceilings = {}
    for engine, threads in [("gigatoken", 1), ("gigatoken", 2), ("hf", 2)]:
        repeat = a.repeat if engine == "gigatoken" else 1
        r = max(
            (ceiling(engine, corpus, tok, threads) for _ in range(repeat)), key=lambda x: x["mb_s"]
        )
        ceilings[(engine, threads)] = r["mb_s"]
        note = " (5% sample)" if engine == "hf" else ""
        print(f"  {engine:9s} {threads} thread(s): {r['mb_s']:7.1f} MB/s{note}")

    print("\ngptflow tokenize --append-eod (wall time of the whole command, start-up included)")
    print(f"  {'engine':9s} {'workers':>7s} {'wall s':>7s} {'MB/s':>7s} {'docs/s':>8s} "
          f"{'RSS MB':>7s} {'of ceiling':>10s}  engine used")  # fmt: skip
    runs = [("auto", 1), ("auto", 2)] + ([] if a.skip_hf else [("hf", 1), ("hf", 2)])
    reference = None
    for engine, workers in runs:
        prefix = work / f"out-{engine}-{workers}"
        repeat = a.repeat if engine == "auto" else 1
        r = min(
            (run_tokenize(corpus, tok, prefix, engine, workers) for _ in range(repeat)),
            key=lambda x: x["wall"],
        )
        m = r["manifest"]
        mb_s = c["bytes"] / 1e6 / r["wall"]
        used = m["engine"]["name"]
        ceil = ceilings.get((used, max(workers, 1))) or ceilings.get((used, 2))
        digest = (m["bin_sha256"], m["idx_sha256"])
        reference = reference or digest
        same = "identical" if digest == reference else "DIFFERENT BYTES"
        print(
            f"  {engine:9s} {workers:7d} {r['wall']:7.2f} {mb_s:7.1f} "
            f"{m['documents'] / r['wall']:8.0f} {r['rss_mb']:7.0f} {mb_s / ceil:9.0%}  "
            f"{used} {m['engine']['version']}, {same}, cache resets "
            f"{m['engine'].get('cache_resets', '-')}"
        )
        if digest != reference:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
