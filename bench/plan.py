"""Planning cost: `snakemake -n` of this workflow vs plain Snakefiles with the same job count.

For each N, two gptflow configs in a scratch directory (the tiny test config otherwise):

- local: N text files, a `local` dataset split into N shards (N collect + N tokenize jobs);
- url:   a `url` dataset whose url_template expands over N parts (N download + N tokenize
         jobs; the URLs point at a closed loopback port: a dry run never opens them).

Each is timed as the whole `snakemake -n` command (process start, Snakefile parsing, DAG),
run by the same snakemake as two generated baselines with exactly the same job count:

- plain:  trivial two-step chains (one input, one output, no log, no params);
- shaped: plain strings, no functions, but gptflow's DAG shape (a fetch job with a sidecar
          and a log, a tokenize job with three outputs and a log, one job that takes all 3N
          token files, as render_run_config does; independent jobs make up the count) --
          what Snakemake itself costs for this shape.

Median of --repeats, interleaved (the host may be shared: compare ratios, not seconds). Two
values of N show whether the cost is linear: the "ms per extra job" line should match the
baselines'.

--profile writes a cProfile of one planning run per config (largest N) and prints the top
entries by cumulative and by own time.

Usage: python bench/plan.py [--sizes 250 1000] [--repeats 3] [--repo DIR] [--profile]
(--repo: plan another checkout, e.g. a scratch copy with edited rules; its src/ goes first
on PYTHONPATH.)
"""

from __future__ import annotations

import argparse
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).parent / "snakemake"


def gptflow_config(kind: str, n: int, corpus: Path) -> dict:
    cfg = yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())
    if kind == "local":
        spec = {"type": "local", "root": str(corpus), "include": ["*.txt"], "shards": n}
    else:
        spec = {
            "type": "url",
            "url_template": "http://127.0.0.1:9/corpus/part-{part:05d}.jsonl",
            "parts": [0, n - 1],
        }
    cfg["datasets"] = {"corpus": spec}
    cfg["tokenizer"]["train"]["datasets"] = ["corpus"]
    cfg["data"]["blend"] = [{"dataset": "corpus", "weight": 1.0}]
    return cfg


def plain_snakefile(jobs: int) -> str:
    """`jobs` trivial jobs: chains a -> b, and `all` (one odd job is a lone `a`)."""
    pairs, lone = divmod(jobs - 1, 2)
    return (
        f"N = {pairs}\n"
        f"LONE = {lone}\n\n"
        "rule all:\n"
        "    input:\n"
        '        expand("out/{i}.b", i=range(N)),\n'
        '        expand("out/lone{i}.a", i=range(LONE)),\n\n'
        "rule b:\n"
        '    input: "out/{i}.a"\n'
        '    output: "out/{i}.b"\n'
        '    shell: "cp {input} {output}"\n\n'
        "rule a:\n"
        '    output: "out/{i}.a"\n'
        '    shell: "echo {wildcards.i} > {output}"\n'
    )


def shaped_snakefile(jobs: int, consumers: int = 1) -> str:
    """`jobs` jobs shaped like gptflow's data stage, with plain strings for rules: N fetch jobs
    (a file and a sidecar, a log), N tokenize jobs (that file and one shared file in, three
    files and a log out), `consumers` jobs that each take all 3N files (gptflow's
    render_run_config; the jobs after it follow the shards through run.yaml), fillers to
    make up the count, and `all`."""
    n = (jobs - 2 - consumers) // 2
    fillers = jobs - 2 - consumers - 2 * n
    consumer_rules = "".join(
        f"rule consume{c}:\n"
        f"    input: expand('tok/{{i}}{{ext}}', i=range(N), ext=EXTS), 'shared'\n"
        f"    output: 'consumed{c}'\n"
        f"    log: 'logs/consume{c}.log'\n"
        f"    shell: 'touch {{output}}'\n\n"
        for c in range(consumers)
    )
    return (
        f"N = {n}\nFILLERS = {fillers}\nEXTS = ['.bin', '.idx', '.json']\n\n"
        "rule all:\n"
        "    input:\n"
        f"        {[f'consumed{c}' for c in range(consumers)]},\n"
        "        expand('filler/{i}', i=range(FILLERS)),\n\n"
        + consumer_rules
        + "rule shared:\n    output: 'shared'\n    shell: 'touch {output}'\n\n"
        "rule filler:\n    output: 'filler/{i}'\n    shell: 'touch {output}'\n\n"
        "rule tokenize:\n"
        "    input: doc='raw/{i}.jsonl', shared='shared'\n"
        "    output: multiext('tok/{i}', '.bin', '.idx', '.json')\n"
        "    log: 'logs/tokenize/{i}.log'\n"
        "    params: prefix='tok/{i}', engine='hf'\n"
        "    shell: 'touch {output}'\n\n"
        "rule fetch:\n"
        "    output: file='raw/{i}.jsonl', sha256='raw/{i}.jsonl.sha256'\n"
        "    log: 'logs/fetch/{i}.log'\n"
        "    params: url='http://127.0.0.1:9/{i}.jsonl'\n"
        "    shell: 'touch {output}'\n"
    )


JOBS = re.compile(r"^total\s+(\d+)\s*$", re.M)


def plan(snakefile: Path, workdir: Path, env: dict, configfile: Path | None = None,
         profile: Path | None = None) -> tuple[float, int]:  # fmt: skip
    cmd = [str(SNAKEMAKE)]
    if profile is not None:
        cmd = [sys.executable, "-m", "cProfile", "-o", str(profile), str(SNAKEMAKE)]
    cmd += ["--snakefile", str(snakefile), "--directory", str(workdir), "-n", "--cores", "1"]
    if configfile is not None:
        cmd += ["--configfile", str(configfile)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    m = JOBS.search(proc.stdout + proc.stderr)
    if not m:
        sys.exit(f"no job count in the output of {' '.join(cmd)}")
    return seconds, int(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[250, 1000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", nargs="+", default=["local", "url"], choices=["local", "url"])
    p.add_argument("--repo", type=Path, default=REPO, help="checkout whose Snakefile to plan")
    p.add_argument("--profile", action="store_true", help="cProfile one run per kind")
    p.add_argument("--keep-scontrol", action="store_true", help="do not stub scontrol")
    a = p.parse_args()
    repo = a.repo.resolve()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gptflow-plan-") as tmp:
        tmp = Path(tmp)
        env = dict(os.environ, PYTHONPATH=str(repo / "src"))
        if not a.keep_scontrol:
            # The Slurm executor plugin runs `scontrol show config` whenever snakemake starts
            # (timeout 10 s); with Slurm installed but its controller down that is a 10 s
            # constant in every run, ours and the baseline's alike. A stub that fails at once.
            stub = tmp / "bin"
            stub.mkdir()
            (stub / "scontrol").write_text("#!/bin/sh\nexit 1\n")
            (stub / "scontrol").chmod(0o755)
            env["PATH"] = f"{stub}{os.pathsep}{env['PATH']}"
        for n in a.sizes:
            corpus = tmp / f"corpus{n}"
            corpus.mkdir()
            for i in range(n):
                (corpus / f"doc{i:05d}.txt").write_text(f"document {i}\n")
            for kind in a.kinds:
                work = tmp / f"{kind}{n}"
                work.mkdir()
                cfg = work / "config.yaml"
                cfg.write_text(yaml.safe_dump(gptflow_config(kind, n, corpus), sort_keys=False))
                _, jobs = plan(repo / "Snakefile", work, env, cfg)
                plain, shaped = tmp / f"plain-{kind}{n}", tmp / f"shaped-{kind}{n}"
                for d, text in ((plain, plain_snakefile(jobs)), (shaped, shaped_snakefile(jobs))):
                    d.mkdir()
                    (d / "Snakefile").write_text(text)
                ours, theirs, shapes = [], [], []
                for _ in range(a.repeats):
                    s, j = plan(plain / "Snakefile", plain, env)
                    assert j == jobs, (j, jobs)
                    theirs.append(s)
                    s, j = plan(shaped / "Snakefile", shaped, env)
                    assert j == jobs, (j, jobs)
                    shapes.append(s)
                    ours.append(plan(repo / "Snakefile", work, env, cfg)[0])
                rows.append((kind, n, jobs, median(ours), median(theirs), median(shapes)))
                if a.profile and n == max(a.sizes):
                    out = tmp / f"{kind}{n}.prof"
                    plan(repo / "Snakefile", work, env, cfg, profile=out)
                    print(f"\n--- cProfile of `snakemake -n`, {kind} N={n} ({jobs} jobs) ---")
                    stats = pstats.Stats(str(out))
                    stats.sort_stats("cumulative").print_stats(r"gptflow|common\.smk|smk", 25)
                    stats.sort_stats("tottime").print_stats(18)
    print(
        f"snakemake -n, median of {a.repeats} (whole command; the box may be shared: rerun). "
        "plain: trivial 2-step chains; shaped: plain rules with gptflow's DAG shape"
    )
    print(
        f"  {'config':6} {'N':>5} {'jobs':>5} {'gptflow':>8} {'plain':>7} {'shaped':>7}"
        f" {'vs plain':>9} {'vs shaped':>10} {'ms/job':>7}"
    )
    for kind, n, jobs, ours, theirs, shape in rows:
        print(
            f"  {kind:6} {n:5d} {jobs:5d} {ours:7.2f}s {theirs:6.2f}s {shape:6.2f}s"
            f" {ours / theirs:8.2f}x {ours / shape:9.2f}x {1000 * ours / jobs:7.2f}"
        )
    for kind in a.kinds:
        mine = [r for r in rows if r[0] == kind]
        if len(mine) < 2:
            continue
        (_, n1, j1, o1, p1, s1), (_, n2, j2, o2, p2, s2) = mine[0], mine[-1]
        print(
            f"  {kind}: ms per extra job from N={n1} to N={n2}: gptflow "
            f"{1000 * (o2 - o1) / (j2 - j1):.2f}, plain {1000 * (p2 - p1) / (j2 - j1):.2f}, "
            f"shaped {1000 * (s2 - s1) / (j2 - j1):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
