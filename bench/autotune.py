"""Autotune's cost and gain: `snakemake autotune` on this machine, each trial a train_gpt job.

The default config (config/config.yaml: the `small` model, 256-token sequences, global batch
16, micro 2, ZeRO 1) searched over micro-batch 1-16 x ZeRO 0-2 x activation checkpointing
(--smoke: the tests' tiny config, two candidates). Printed, from one search in a scratch
directory (the data stage first, outside the timing):

- each trial: its layout, tokens/s over its timed steps, the ratio to the run's own layout
  (the baseline, measured in the same search: it is one of the candidates), the spread of its
  per-step tokens/s (relative standard deviation: the noise a lead must beat), its share of the
  search's wall time (the trials run one at a time here: from the previous trial's DONE.json
  to its own) and its timed steps' seconds;
- the search: wall time, a trial's average, the share the timed steps are of it (the rest:
  starting Python, torch and DeepSpeed, the warm-up steps, Snakemake's scheduling);
- the fastest layout against the run's own: the speed-up a user gets by including best.yaml;
- a second invocation: its wall time (nothing runs).

DeepSpeed's own autotuner is not run here: it needs its launcher (pdsh) and a GPU's memory to
size its micro-batch search. Usage: python bench/autotune.py [--steps 10] [--micro-batch-sizes 1 2 4 8 16] [--zero-stages 0 1 2]
       [--checkpointing both|off] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def snakemake(wd: Path, config: Path, *args: str) -> float:
    started = time.perf_counter()
    cmd = [str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"), "--directory",
           str(wd), "--profile", str(REPO / "profiles" / "local"), "--configfile", str(config),
           "--cores", "2", *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"bench/autotune.py: snakemake {' '.join(args)} failed:\n{out.stdout[-3000:]}")
    return time.perf_counter() - started


def timed_seconds(wd: Path, trial: str) -> float:
    """The trial's timed steps' seconds (its records' ms_per_step x timed steps)."""
    path = wd / f"results/runs/{trial}/metrics.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    return (
        sum((r["ms_per_step"] or 0) * r["timed_steps"] for r in records if r["kind"] == "train")
        / 1000
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--zero-stages", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--checkpointing", choices=["both", "off"], default="both")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    if a.smoke:
        cfg = yaml.safe_load((REPO / "tests/config/config.yaml").read_text())
        spec = {"micro_batch_sizes": [4, 8], "zero_stages": [0], "activation_checkpointing": [False],
                "steps": 4, "warmup_steps": 2}  # fmt: skip
    else:
        cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
        spec = {"micro_batch_sizes": a.micro_batch_sizes, "zero_stages": a.zero_stages,
                "activation_checkpointing": [False, True] if a.checkpointing == "both" else [False],
                "steps": a.steps, "warmup_steps": 3}  # fmt: skip
    cfg["autotune"] = spec
    own = (cfg["train"]["micro_batch_size"], cfg["train"]["zero_stage"],
           bool(cfg["model"].get("activation_checkpointing", False)))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-autotune-") as tmp:
        wd = Path(tmp)
        config = wd / "config.yaml"
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        data = snakemake(wd, config, "data")
        started = time.time()
        search = snakemake(wd, config, "autotune")
        again = snakemake(wd, config, "autotune")
        ranking = json.loads((wd / f"results/runs/{cfg['run']}/autotune/autotune.json").read_text())
        rows = [r for r in ranking["candidates"] if r["status"] == "measured"]
        base = next(r for r in rows if (r["micro_batch_size"], r["zero_stage"],
                                        r["activation_checkpointing"]) == own)  # fmt: skip
        print(f"autotune of run {cfg['run']} ({'smoke: ' if a.smoke else ''}{len(rows)} trials of "
              f"{spec['steps']} steps, the first {spec['warmup_steps']} not timed; the data stage "
              f"before it took {data:.1f} s)")  # fmt: skip
        # the trials run one at a time (each takes the job's 2 cores): each one's share of the
        # search is the time from the previous one's DONE.json (or the search's start) to its own
        ended = {
            r["trial"]: (wd / f"results/runs/{r['trial']}/DONE.json").stat().st_mtime for r in rows
        }
        previous, share = started, {}
        for trial in sorted(ended, key=ended.get):
            share[trial], previous = ended[trial] - previous, ended[trial]
        print(
            f"  {'trial':34} {'tokens/s':>10} {'vs own':>7} {'spread':>7} {'search s':>9} {'timed s':>8}"
        )
        timed = 0.0
        for r in rows:
            steps = timed_seconds(wd, r["trial"])
            timed += steps
            print(f"  {r['trial']:34} {r['tokens_per_s']:>10,.0f} "
                  f"{r['tokens_per_s'] / base['tokens_per_s']:>6.2f}x {r['spread']:>7.1%} "
                  f"{share[r['trial']]:>9.1f} {steps:>8.2f}")  # fmt: skip
        print(f"  search: {search:.1f} s wall for {len(rows)} trial(s) ({search / len(rows):.1f} s a "
              f"trial), of which timed steps {timed:.1f} s ({timed / search:.0%})")  # fmt: skip
        best = rows[0]
        print(f"  fastest: {best['trial']} {best['tokens_per_s']:,.0f} tokens/s = "
              f"{best['tokens_per_s'] / base['tokens_per_s']:.2f}x the run's own layout "
              f"({base['trial']}, {base['tokens_per_s']:,.0f} tokens/s)")  # fmt: skip
        print(f"  a second invocation: {again:.1f} s, nothing run")


if __name__ == "__main__":
    main()
