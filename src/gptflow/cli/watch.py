"""``gptflow status``, ``summary`` and ``why``: watching runs, from their files
(:mod:`gptflow.watch`)."""

from __future__ import annotations

import argparse
import collections
import json
import textwrap
from pathlib import Path

from gptflow.progress import hms


def add_why_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--directory", default=".", help="the workflow's working directory")
    s.add_argument(
        "--peak-tflops", type=float, default=None, help="per GPU (default: H100 bf16, 989)"
    )
    s.add_argument("--mfu", type=float, default=None, help="model FLOPs utilization assumed (0.4)")
    s.add_argument("--json", default=None, help="also write the result as JSON here")
    s.add_argument(
        "snakemake_args", nargs=argparse.REMAINDER,
        help="after --: the Snakemake arguments of the run (profile, configfiles, targets)",
    )  # fmt: skip


def cmd_why(a: argparse.Namespace) -> int:
    from gptflow.watch.why import why

    args = a.snakemake_args[1:] if a.snakemake_args[:1] == ["--"] else a.snakemake_args
    result = why(args, workdir=a.directory, peak_tflops=a.peak_tflops, mfu=a.mfu)
    if a.json:
        from gptflow.fsutil import write_json

        write_json(a.json, result)
    return 0


def add_summary_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--results", default="results", help="results directory")


def cmd_summary(a: argparse.Namespace) -> int:
    from gptflow.watch.status import by_study, finished_runs, outputs

    for study, runs in by_study([outputs(d) for d in finished_runs(a.results)]):
        if study is not None:
            print(study_summary(study, runs, Path(a.results)))
        for o in runs:
            print(textwrap.indent(run_summary(o), "  " if study else ""))
    return 0


def study_summary(study: str, runs: list[dict], results: Path) -> str:
    """A study's line in `gptflow summary`: its finished runs' final validation losses, and
    where its comparison is."""
    from gptflow import paths

    page = results.parent / paths.STUDY_DIR.format(study=study) / "study.html"
    where = page if page.is_file() else f"{page} not made yet (snakemake target study)"
    losses = ", ".join(
        f"{o['run']} {o['done']['final_val_loss']:.4f}"
        for o in runs
        if o["done"].get("final_val_loss") is not None
    )
    return (
        f"study {study}: {len(runs)} finished run(s); final validation loss: {losses or 'n/a'}"
        f"\n  comparison: {where}"
    )


def run_summary(o: dict) -> str:
    """One finished run of `gptflow summary`: its step, losses and every output."""
    out = []
    done = o["done"]
    out.append(f"run {o['run']}: step {done['final_step']}, {done['tokens']:,} tokens")
    if done.get("initial_val_loss") is not None:
        out.append(
            f"  validation loss: {done['initial_val_loss']:.4f} at step 0 -> "
            f"{done['final_val_loss']:.4f} at step {done['final_step']}"
        )
    width = max(len(x["what"]) for x in o["outputs"]) + 1
    for x in o["outputs"]:
        label = f"{x['what']}:".ljust(width)
        if x["present"]:
            out.append(f"  {label} {x['path']}" + (f" ({x['detail']})" if x["detail"] else ""))
        else:
            out.append(f"  {label} {x['absent']}: {x['path']} ({x['made_by']})")
    return "\n".join(out)


def add_status_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("runs", nargs="*", metavar="RUN", help="run names (default: every run)")
    s.add_argument("--runs-dir", default="results/runs", help="directory of the runs")
    s.add_argument("--json", action="store_true", help="print JSON (for machines)")


def cmd_status(a: argparse.Namespace) -> int:
    from gptflow.watch.status import NO_SQUEUE, by_study, statuses

    result = statuses(a.runs_dir, a.runs)
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    for study, runs in by_study(result["runs"]):
        if study is not None:
            states = collections.Counter(r["state"] for r in runs)
            counts = ", ".join(f"{n} {state}" for state, n in states.most_common())
            print(f"study {study}: {len(runs)} run(s): {counts}")
        for run in runs:
            print(textwrap.indent("\n".join(status_lines(run)), "  " if study else ""))
    if result["slurm"] not in (None, NO_SQUEUE):
        print(f"Slurm queue not read: {result['slurm']}")
    return 0


def status_lines(r: dict) -> list[str]:
    """One run of `gptflow status`: a line, then indented details."""
    total = "?" if r["total"] is None else r["total"]
    state = r["state"]
    if state == "running" and r["eta_s"] is not None:
        state += f", ETA {hms(r['eta_s'])}"
    elif state == "stopped":
        ago = f" {ago_text(r['last_record_s'])}" if r["last_record_s"] is not None else ""
        state += f"{ago} (no live trainer; rerun the workflow to resume)"
    elif not r["exists"]:
        state += f" (no {r['dir']}/ yet)"
    lines = [f"run {r['run']}: {r['stage']}, step {r['step']}/{total}, {state}"]
    if r["loss"] is not None or r["val_loss"] is not None:
        loss = "n/a" if r["loss"] is None else f"{r['loss']:.4f}"
        val = "n/a" if r["val_loss"] is None else f"{r['val_loss']:.4f} (step {r['val_step']})"
        lines.append(f"  loss {loss}, validation loss {val}")
    if r["tokens_per_s"] is not None:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        per_step = r["seconds_per_step"]
        pace = "" if per_step is None else f", {per_step:.3g} s/step"
        lines.append(f"  {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}{pace}")
    t = r["trainer"]
    if t is not None:
        job = f", Slurm job {t['slurm_job_id']}" if t["slurm_job_id"] else ""
        last = r["last_record_s"]
        record = f", last record {ago_text(last)}" if last is not None else ""
        lines.append(f"  trainer: pid {t['pid']} on {t['host']}{job}{record}")
    for job in r["slurm_jobs"] or []:
        lines.append(
            f"  Slurm job {job['job_id']}: {job['rule']} {job['state']} for {job['elapsed']}"
        )
    return lines


def ago_text(seconds: float) -> str:
    """``40 s ago``, ``14 min ago``, ``3.5 h ago``."""
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"
