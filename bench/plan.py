"""Planning cost: `snakemake -n` of this workflow vs plain Snakefiles with the same job count.

For each N, two gptflow configs in a scratch directory (the tiny test config otherwise):

- local: N text files, a `local` dataset split into N shards (N collect + N tokenize jobs);
- url:   a `url` dataset whose url_template expands over N parts (N download + N tokenize
         jobs; the URLs point at a closed loopback port: a dry run never opens them);
- quality (with --kinds): local's N shards cleaned by FineWeb's order of data.quality steps
         (exact, minhash, the four filter rules: per shard hashes, removal, signatures,
         removal, signals, selection; per group the repeats, 14 band files and the
         clusters), then tokenized: ~8 N jobs, the data stage at Pile scale (issue 39).

Each is timed as the whole `snakemake -n` command (process start, Snakefile parsing, DAG),
run by the same snakemake as two generated baselines with exactly the same job count:

- plain:  trivial two-step chains (one input, one output, no log, no params);
- shaped: plain strings, no functions, but gptflow's DAG shape (a fetch job with a sidecar
          and a log, a tokenize job with three outputs and a log, two jobs that take every
          shard's manifest, as build_data_index and render_run_config do; independent jobs
          make up the count) -- what Snakemake itself costs for this shape.

Median of --repeats, interleaved (the host may be shared: compare ratios, not seconds). Two
values of N show whether the cost is linear: the "ms per extra job" line should match the
baselines'.

--profile writes a cProfile of one planning run per config (largest N) and prints the top
entries by cumulative and by own time.

Study mode (issue 26), --study N [N ...]: tests/config/config.yaml as a study of N runs with
the grid a user sweeping hyperparameters writes, train.lr x train.weight_decay (a x b = N, a
as close to sqrt(N) as N allows): every run reads the same samples, so all share one data
index. --vary seed makes it train.lr x train.seed: one index per seed (b build_data_index
jobs). gptflow's plan of target `all` (the data stage once; per run render_run_config,
train_gpt, evaluate, export_hf, report_assets; the index; study_report) is timed against the
same jobs written as plain rules: gptflow's rule names with the same job count per rule
(asserted), the same DAG shape and outputs, a log per job, plain string paths (a run's index
in its path), realistic params (the run's settings dict, looked up by {run}: the one function
per rule); no wildcard constraints, conda or resource functions. The table gives N, jobs,
both medians, the ratio and ms per run; two values of N give the per-run slope. --profile
profiles gptflow's plan of the largest N.

Usage: python bench/plan.py [--sizes 250 1000] [--repeats 3] [--repo DIR] [--profile]
       python bench/plan.py --study 25 100 [--vary seed] [--repeats 3] [--profile]
(--repo: plan another checkout, e.g. a scratch copy with edited rules; its src/ goes first
on PYTHONPATH. --smoke: N=10 once, every config: seconds, the test suite's run,
tests/unit/test_bench.py, whose figures mean nothing.)
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import pstats
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).parent / "snakemake"
# --smoke: the smallest run that still prints every line (explicit options still win)
KINDS = ["local", "url", "quality"]
SMOKE = dict(sizes=[10], repeats=1, kinds=KINDS)


# the quality kind's recipe (config/examples/studies/data-ablation.yaml's fullest)
QUALITY = {
    "steps": [
        {"step": "exact"},
        {"step": "minhash"},
        {"step": "filters", "rules": {"gopher_repetition": {}, "gopher_quality": {}, "c4": {"filter_no_terminal_punct": False}, "fineweb": {}}},
    ]
}  # fmt: skip


def gptflow_config(kind: str, n: int, corpus: Path) -> dict:
    cfg = yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())
    if kind == "quality":
        cfg["data"]["quality"] = QUALITY
    if kind in ("local", "quality"):
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


def shaped_snakefile(jobs: int, consumers: int = 2) -> str:
    """`jobs` jobs shaped like gptflow's data stage, with plain strings for rules: N fetch jobs
    (a file and a sidecar, a log), N tokenize jobs (that file and one shared file in, three
    files and a log out), `consumers` jobs that each take the N manifests (gptflow's
    build_data_index and render_run_config; the jobs after them follow the shards through
    the index and run.yaml), fillers to make up the count, and `all`."""
    n = (jobs - 2 - consumers) // 2
    fillers = jobs - 2 - consumers - 2 * n
    consumer_rules = "".join(
        f"rule consume{c}:\n"
        f"    input: expand('tok/{{i}}.json', i=range(N)), 'shared'\n"
        f"    output: 'consumed{c}'\n"
        f"    log: 'logs/consume{c}.log'\n"
        f"    shell: 'touch {{output}}'\n\n"
        for c in range(consumers)
    )
    return (
        f"N = {n}\nFILLERS = {fillers}\n\n"
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


STATS = re.compile(r"^Job stats:\n.*?\n-+\s+-+\n(.*?)^total\s+(\d+)\s*$", re.M | re.S)


def plan(snakefile: Path, workdir: Path, env: dict, configfile: Path | None = None,
         profile: Path | None = None) -> tuple[float, dict[str, int], float]:  # fmt: skip
    """Seconds of `snakemake -n`, its job stats (jobs per rule, and `total`) and its CPU
    seconds (user + system: steadier than the wall time on a shared host)."""
    cmd = [str(SNAKEMAKE)]
    if profile is not None:
        cmd = [sys.executable, "-m", "cProfile", "-o", str(profile), str(SNAKEMAKE)]
    cmd += ["--snakefile", str(snakefile), "--directory", str(workdir), "-n", "--cores", "1"]
    if configfile is not None:
        cmd += ["--configfile", str(configfile)]
    t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    m = STATS.search(proc.stdout + proc.stderr)
    if not m:
        sys.exit(f"no job count in the output of {' '.join(cmd)}")
    stats = {rule: int(count) for rule, count in re.findall(r"^(\S+)\s+(\d+)\s*$", m[1], re.M)}
    return seconds, {**stats, "total": int(m[2])}, cpu


def plan_env(tmp: Path, repo: Path, keep_scontrol: bool) -> dict:
    """The environment every plan runs in: repo's src/ first; scontrol stubbed unless kept."""
    env = dict(os.environ, PYTHONPATH=str(repo / "src"))
    if not keep_scontrol:
        # The Slurm executor plugin runs `scontrol show config` whenever snakemake starts
        # (timeout 10 s); with Slurm installed but its controller down that is a 10 s
        # constant in every run, ours and the baseline's alike. A stub that fails at once.
        stub = tmp / "bin"
        stub.mkdir()
        (stub / "scontrol").write_text("#!/bin/sh\nexit 1\n")
        (stub / "scontrol").chmod(0o755)
        env["PATH"] = f"{stub}{os.pathsep}{env['PATH']}"
    return env


def timed(cases: list[tuple], env: dict, repeats: int) -> list[tuple[float, float]]:
    """(median seconds, median CPU seconds) of each case (snakefile, workdir, configfile or
    None, the job stats it must plan: a subset of rule -> count), the cases interleaved within
    each repeat."""
    seconds: list[list[tuple[float, float]]] = [[] for _ in cases]
    for _ in range(repeats):
        for times, (snakefile, workdir, configfile, expected) in zip(seconds, cases, strict=True):
            s, stats, cpu = plan(snakefile, workdir, env, configfile)
            got = {rule: stats.get(rule) for rule in expected}
            assert got == expected, (snakefile, got, expected)
            times.append((s, cpu))
    return [(median(t[0] for t in times), median(t[1] for t in times)) for times in seconds]


def profile_plan(label: str, snakefile: Path, workdir: Path, env: dict, configfile: Path) -> None:
    """cProfile one `snakemake -n` and print its top entries (cumulative in gptflow's code and
    rules, then own time)."""
    out = workdir / "plan.prof"
    plan(snakefile, workdir, env, configfile, profile=out)
    print(f"\n--- cProfile of `snakemake -n`, {label} ---")
    stats = pstats.Stats(str(out))
    stats.sort_stats("cumulative").print_stats(r"gptflow|common\.smk|smk", 25)
    stats.sort_stats("tottime").print_stats(18)


def sizes_mode(a: argparse.Namespace, repo: Path, env: dict, tmp: Path) -> None:
    """The datasets' modes (local, url) against the plain and shaped baselines."""
    rows = []
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
            jobs = plan(repo / "Snakefile", work, env, cfg)[1]["total"]
            plain, shaped = tmp / f"plain-{kind}{n}", tmp / f"shaped-{kind}{n}"
            for d, text in ((plain, plain_snakefile(jobs)), (shaped, shaped_snakefile(jobs))):
                d.mkdir()
                (d / "Snakefile").write_text(text)
            expected = {"total": jobs}
            theirs, shape, ours = timed(
                [
                    (plain / "Snakefile", plain, None, expected),
                    (shaped / "Snakefile", shaped, None, expected),
                    (repo / "Snakefile", work, cfg, expected),
                ],
                env,
                a.repeats,
            )
            rows.append((kind, n, jobs, ours, theirs, shape))
            if a.profile and n == max(a.sizes):
                profile_plan(f"{kind} N={n} ({jobs} jobs)", repo / "Snakefile", work, env, cfg)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"snakemake -n, median of {a.repeats} (whole command; the box may be shared: rerun; load "
        f"average now {load}). plain: trivial 2-step chains; shaped: plain rules with gptflow's "
        "DAG shape; CPU: the ratio of the processes' CPU seconds (user + system)"
    )
    print(
        f"  {'config':7} {'N':>5} {'jobs':>5} {'gptflow':>8} {'plain':>7} {'shaped':>7}"
        f" {'vs plain':>9} {'vs shaped':>10} {'CPU vs plain':>13} {'ms/job':>7}"
    )
    for kind, n, jobs, ours, theirs, shape in rows:
        print(
            f"  {kind:7} {n:5d} {jobs:5d} {ours[0]:7.2f}s {theirs[0]:6.2f}s {shape[0]:6.2f}s"
            f" {ours[0] / theirs[0]:8.2f}x {ours[0] / shape[0]:9.2f}x"
            f" {ours[1] / theirs[1]:12.2f}x {1000 * ours[0] / jobs:7.2f}"
        )
    for kind in a.kinds:
        mine = [(k, n, j, o[0], p[0], s[0]) for k, n, j, o, p, s in rows if k == kind]
        if len(mine) < 2:
            continue
        (_, n1, j1, o1, p1, s1), (_, n2, j2, o2, p2, s2) = mine[0], mine[-1]
        print(
            f"  {kind}: ms per extra job from N={n1} to N={n2}: gptflow "
            f"{1000 * (o2 - o1) / (j2 - j1):.2f}, plain {1000 * (p2 - p1) / (j2 - j1):.2f}, "
            f"shaped {1000 * (s2 - s1) / (j2 - j1):.2f}"
        )


# --------------------------------------------------------------------------- study mode


def grid_sides(n: int) -> tuple[int, int]:
    """(a, b) with a x b = n, a the largest divisor of n not above sqrt(n)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


def study_config(n: int, vary: str) -> dict:
    """tests/config/config.yaml as study `sweep` of n runs: the grid train.lr (a values, a
    log scale) x train.<vary> (b values: weight decays, or seeds)."""
    cfg = yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())
    a, b = grid_sides(n)
    second = [round(0.01 * i, 2) for i in range(b)] if vary == "weight_decay" else list(range(b))
    cfg["run"] = "sweep"
    cfg["study"] = {
        "grid": {
            "train.lr": [float(f"{1.0e-3 * 2 ** (i / 2):.3g}") for i in range(a)],
            f"train.{vary}": second,
        }
    }
    return cfg


def study_settings(cfg: dict, vary: str) -> tuple[dict[str, dict], dict[str, str]]:
    """The baseline's runs: each run's settings (run.yaml's: the run, the study, the tokenizer,
    data, the preset's model keys, train) and its index (one, or one per seed)."""
    model = yaml.safe_load(
        (REPO / "config" / "models" / f"{cfg['model']['preset']}.yaml").read_text()
    )
    grid = cfg["study"]["grid"]
    runs, index_of = {}, {}
    for lr, value in itertools.product(grid["train.lr"], grid[f"train.{vary}"]):
        name = f"lr{lr:g}-{vary}{value:g}"
        runs[name] = {
            "run": name,
            "study": cfg["run"],
            "tokenizer": {"eod_token": cfg["tokenizer"]["eod_token"]},
            "data": cfg["data"],
            "model": {**model, **cfg["model"]},
            "train": {**cfg["train"], "lr": lr, vary: value},
        }
        index_of[name] = f"seed{value}" if vary == "seed" else "shared"
    return runs, index_of


# gptflow's study jobs as plain rules, with gptflow's rule names: the data stage once (collect
# -> sample -> tokenizer -> tokenize per shard), one build_data_index per index (taking the
# tokenizer and every shard's manifest), per run render_run_config (the same) -> train_gpt
# (+ its index) -> evaluate, export_hf -> report_assets, one study_report taking every run's
# run.yaml and DONE.json, and `all`. A run's index is part of its path (no input functions);
# its settings dict is looked up by {run} (params), as gptflow passes it.
STUDY_RULES = """
RUN = 'results/runs/{index}/{run}'
TOKENIZER = 'results/tokenizer/tokenizer.json'
MANIFESTS = expand('results/tokens/{shard}.json', shard=SHARDS)
PREFIXES = expand('results/tokens/{shard}', shard=SHARDS)


def by_run(name):
    return expand(RUN + '/' + name, zip, index=INDEX, run=RUNS)


rule all:
    input:
        by_run('DONE.json'), by_run('eval.json'), by_run('hf'), by_run('report/card.html'),
        f'results/studies/{STUDY}/study.html',

rule collect_local_documents:
    output: doc='results/documents/{shard}.jsonl', manifest='results/documents/{shard}.json'
    log: 'logs/collect_local_documents/{shard}.log'
    params: root='/usr/lib/python3', include=['json/*.py', 'email/*.py', 'http/*.py']
    shell: 'touch {output}'

rule sample_documents:
    input: expand('results/documents/{shard}.jsonl', shard=SHARDS)
    output: 'results/tokenizer/sample.jsonl'
    log: 'logs/sample_documents/stdlib.log'
    params: sample_mb=2
    shell: 'touch {output}'

rule train_tokenizer:
    input: 'results/tokenizer/sample.jsonl'
    output: TOKENIZER
    log: 'logs/train_tokenizer/tiny-bpe.log'
    params: vocab_size=512, min_frequency=2, special_tokens=['<|endoftext|>', '<|padding|>']
    shell: 'touch {output}'

rule tokenize_shard:
    input: doc='results/documents/{shard}.jsonl', tokenizer=TOKENIZER
    output: multiext('results/tokens/{shard}', '.bin', '.idx', '.json')
    log: 'logs/tokenize_shard/{shard}.log'
    params: prefix='results/tokens/{shard}', append_eod=True
    shell: 'touch {output}'

rule build_data_index:
    input: tokenizer=TOKENIZER, shards=MANIFESTS
    output: 'results/data-index/{index}.json'
    log: 'logs/build_data_index/{index}.log'
    params: settings=lambda wildcards: INDEXES[wildcards.index], shards=PREFIXES
    shell: 'touch {output}'

rule render_run_config:
    input: tokenizer=TOKENIZER, shards=MANIFESTS
    output: RUN + '/run.yaml'
    log: 'logs/render_run_config/{index}/{run}.log'
    params:
        settings=lambda wildcards: SETTINGS[wildcards.run],
        shards=PREFIXES,
        run_dir=RUN,
        data_index='results/data-index/{index}.json',
    shell: 'touch {output}'

rule train_gpt:
    input: config=RUN + '/run.yaml', index='results/data-index/{index}.json'
    output: RUN + '/DONE.json'
    log: 'logs/train_gpt/{index}/{run}.log'
    params:
        hyperparameters=lambda wildcards: SETTINGS[wildcards.run],
        launcher=['torchrun', '--nproc-per-node', '1'],
        ranks=['--threads', '1'],
    shell: 'gptflow train --config {input.config:q} {params.ranks:q} >> {log:q} 2>&1'

rule evaluate:
    input: config=RUN + '/run.yaml', done=RUN + '/DONE.json'
    output: RUN + '/eval.json'
    log: 'logs/evaluate/{index}/{run}.log'
    params: prompts=['--prompt', 'The'], new_tokens=32, max_windows=64
    shell: 'gptflow evaluate --config {input.config:q} --out {output:q} > {log:q} 2>&1'

rule export_hf:
    input: config=RUN + '/run.yaml', done=RUN + '/DONE.json'
    output: directory(RUN + '/hf')
    log: 'logs/export_hf/{index}/{run}.log'
    shell: 'gptflow export-hf --config {input.config:q} --out {output:q} > {log:q} 2>&1'

rule report_assets:
    input:
        config=RUN + '/run.yaml',
        done=RUN + '/DONE.json',
        evaluation=RUN + '/eval.json',
        hf=RUN + '/hf',
    output:
        expand(RUN + '/report/{name}', name=['loss.svg', 'lr.svg', 'throughput.svg',
               'mfu.svg', 'grad_norm.svg'], allow_missing=True),
        card=RUN + '/report/card.html',
    log: 'logs/report_assets/{index}/{run}.log'
    params: metrics=RUN + '/metrics.jsonl', out_dir=RUN + '/report', datasets=DATASETS
    shell: 'touch {output}'

rule study_report:
    input: configs=by_run('run.yaml'), done=by_run('DONE.json')
    output:
        expand('results/studies/{study}/{name}', name=['loss_tokens.svg', 'loss_flops.svg',
               'loss_lr.svg', 'fit.svg', 'fit.json'], allow_missing=True),
        page='results/studies/{study}/study.html',
    log: 'logs/study_report/{study}.log'
    params:
        runs=RUNS,
        metrics=by_run('metrics.jsonl'),
        out_dir='results/studies/{study}',
        budgets=[1.0e19, 1.0e21, 1.0e23],
    shell: 'touch {output}'
"""


def study_snakefile(cfg: dict, runs: dict[str, dict], index_of: dict[str, str], shards: int) -> str:
    """STUDY_RULES with the study's values: its name, runs (names, indexes, settings dicts),
    index settings, shard names and the datasets' report entries."""
    indexes = {index_of[name]: s["train"]["seed"] for name, s in runs.items()}
    values = {
        "STUDY": cfg["run"],
        "RUNS": list(runs),
        "INDEX": [index_of[name] for name in runs],
        "SETTINGS": runs,
        "INDEXES": {index: {**cfg["data"], "seed": seed} for index, seed in indexes.items()},
        "SHARDS": [f"{i:05d}" for i in range(shards)],
        "DATASETS": cfg["datasets"],
    }
    return "".join(f"{k} = {v!r}\n" for k, v in values.items()) + STUDY_RULES


def study_mode(a: argparse.Namespace, repo: Path, env: dict, tmp: Path) -> None:
    """gptflow's study of N runs against the same jobs as plain rules, for each N."""
    rows = []
    for n in a.study:
        work, base = tmp / f"study{n}", tmp / f"plain-study{n}"
        work.mkdir()
        base.mkdir()
        cfg = study_config(n, a.vary)
        (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        stats = plan(repo / "Snakefile", work, env, work / "config.yaml")[1]
        runs, index_of = study_settings(cfg, a.vary)
        text = study_snakefile(cfg, runs, index_of, stats["tokenize_shard"])
        (base / "Snakefile").write_text(text)
        theirs, ours = timed(
            [
                (base / "Snakefile", base, None, stats),
                (repo / "Snakefile", work, work / "config.yaml", stats),
            ],
            env,
            a.repeats,
        )
        rows.append((n, stats["total"], stats["build_data_index"], ours[0], theirs[0]))
        if a.profile and n == max(a.study):
            label = f"study of {n} runs ({stats['total']} jobs)"
            profile_plan(label, repo / "Snakefile", work, env, work / "config.yaml")
    a_, b_ = grid_sides(max(a.study))
    print(
        f"snakemake -n of a study, median of {a.repeats} (whole command; the box may be shared: "
        f"rerun). grid train.lr x train.{a.vary} (N={max(a.study)}: {a_} x {b_}); baseline: the "
        "same jobs per rule as plain rules"
    )
    print(
        f"  {'N':>5} {'jobs':>5} {'indexes':>7} {'gptflow':>8} {'baseline':>8}"
        f" {'ratio':>6} {'ms/run':>7} {'base ms/run':>11}"
    )
    for n, jobs, indexes, ours, theirs in rows:
        print(
            f"  {n:5d} {jobs:5d} {indexes:7d} {ours:7.2f}s {theirs:7.2f}s"
            f" {ours / theirs:5.2f}x {1000 * ours / n:7.1f} {1000 * theirs / n:11.1f}"
        )
    if len(rows) > 1:
        (n1, _, _, o1, b1), (n2, _, _, o2, b2) = rows[0], rows[-1]
        print(
            f"  ms per extra run from N={n1} to N={n2}: gptflow {1000 * (o2 - o1) / (n2 - n1):.1f},"
            f" baseline {1000 * (b2 - b1) / (n2 - n1):.1f}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[250, 1000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", nargs="+", default=["local", "url"], choices=KINDS)
    p.add_argument("--study", type=int, nargs="+", help="plan studies of these run counts")
    p.add_argument("--vary", default="weight_decay", choices=["weight_decay", "seed"],
                   help="the study grid's second key (seed: one data index per seed)")  # fmt: skip
    p.add_argument("--repo", type=Path, default=REPO, help="checkout whose Snakefile to plan")
    p.add_argument("--profile", action="store_true", help="cProfile one run per kind")
    p.add_argument("--keep-scontrol", action="store_true", help="do not stub scontrol")
    p.add_argument("--smoke", action="store_true", help=f"seconds: {SMOKE}")
    a = p.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        p.set_defaults(**SMOKE)
        a = p.parse_args()
    repo = a.repo.resolve()
    with tempfile.TemporaryDirectory(prefix="gptflow-plan-") as tmp:
        tmp = Path(tmp)
        env = plan_env(tmp, repo, a.keep_scontrol)
        (study_mode if a.study else sizes_mode)(a, repo, env, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
