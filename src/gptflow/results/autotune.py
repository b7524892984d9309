"""Autotune's ranking (rule autotune_report): each trial's throughput measured from its
iteration log (metrics.jsonl, one record a step), the candidates ranked, and the fastest
layout written as a config file to include (best.yaml). Written to results/runs/{run}/autotune/:
autotune.json (every candidate: measured, out of memory, or refused by the preflight, and
why), autotune.html (the ranked table, in ``snakemake --report``) and best.yaml.

A trial's tokens/s is its timed steps' tokens over their time: the steps after
``autotune.warmup_steps`` (the first, warm-up step's time is never in a record's; the next
hold compilation and allocator growth), each record's ms_per_step x its timed steps. Its
spread is the relative standard deviation of the per-step tokens/s: two candidates closer
than their spreads are a tie, and the table says so.
"""

from __future__ import annotations

import html
import json
import statistics
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write, write_json
from gptflow.results.report import STYLE, _table
from gptflow.train.trial import MEASURED, OUT_OF_MEMORY


def measure(records: list[dict], warmup_steps: int) -> dict:
    """Tokens/s of a trial's train records after step `warmup_steps`: {tokens_per_s,
    ms_per_step, mfu, steps, spread}; raises when no timed step is left."""
    timed = [
        r
        for r in records
        if r.get("kind") == "train" and r["step"] > warmup_steps and r.get("timed_steps")
        and r.get("ms_per_step")
    ]  # fmt: skip
    if not timed:
        raise GptflowError(
            f"no timed step after the first {warmup_steps} (autotune.warmup_steps) in the trial's "
            f"metrics: raise autotune.steps"
        )
    steps = sum(r["timed_steps"] for r in timed)
    seconds = sum(r["ms_per_step"] * r["timed_steps"] for r in timed) / 1000
    tokens = sum(r["tokens_per_s"] * r["ms_per_step"] * r["timed_steps"] for r in timed) / 1000
    rates = [r["tokens_per_s"] for r in timed]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "tokens_per_s": tokens / seconds,
        "ms_per_step": 1000 * seconds / steps,
        "mfu": statistics.fmean(mfus) if mfus else None,
        "steps": steps,
        "spread": statistics.pstdev(rates) / statistics.fmean(rates) if len(rates) > 1 else 0.0,
    }


def read_metrics(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line] if p.is_file() else []


def rank(candidates: list[dict], trials: dict[str, dict], warmup_steps: int) -> list[dict]:
    """Every candidate with its outcome: `trials` maps an admitted candidate's trial to its
    {"done": DONE.json, "metrics": metrics.jsonl}. Measured ones first, fastest first (their
    "rank" 1, 2, ...), then those out of memory, then those the preflight refused."""
    rows = []
    for c in candidates:
        row = dict(c)
        if c["refused"]:
            row["status"] = "refused"
        else:
            files = trials[c["trial"]]
            done = json.loads(Path(files["done"]).read_text())
            trial = done.get("trial") or {}
            row["status"] = trial.get("status", MEASURED)
            if row["status"] == OUT_OF_MEMORY:
                row["out_of_memory"] = trial.get("message", "")
            else:
                row.update(measure(read_metrics(files["metrics"]), warmup_steps))
        rows.append(row)
    order = {MEASURED: 0, OUT_OF_MEMORY: 1, "refused": 2}
    rows.sort(key=lambda r: (order[r["status"]], -r.get("tokens_per_s", 0.0)))
    for i, r in enumerate(x for x in rows if x["status"] == MEASURED):
        r["rank"] = i + 1
    return rows


def best_yaml(run: str, best: dict, rows: list[dict]) -> str:
    """The fastest layout as a config file to add after the run's (`--configfile
    config.yaml best.yaml`): the keys it sets, and a comment saying what it was measured at."""
    import yaml

    second = next((r for r in rows if r.get("rank") == 2), None)
    lead = (
        f" ({best['tokens_per_s'] / second['tokens_per_s']:.2f}x the next, {second['trial']})"
        if second else ""
    )  # fmt: skip
    settings = {
        "model": {"activation_checkpointing": best["activation_checkpointing"]},
        "train": {"micro_batch_size": best["micro_batch_size"], "zero_stage": best["zero_stage"]},
    }
    return (
        f"# gptflow autotune of run {run}: the fastest of {sum('rank' in r for r in rows)} "
        f"measured layout(s), {best['tokens_per_s']:,.0f} tokens/s{lead}.\n"
        f"# Add it after the run's config: snakemake --configfile CONFIG.yaml "
        f"results/runs/{run}/autotune/best.yaml\n" + yaml.safe_dump(settings, sort_keys=False)
    )


def page(run: str, rows: list[dict], warmup_steps: int) -> str:
    """autotune.html: the ranked table, then what ran out of memory and what was refused."""
    measured = [r for r in rows if r["status"] == MEASURED]
    best = measured[0]
    table = [
        [r["rank"], r["micro_batch_size"], r["zero_stage"], str(r["activation_checkpointing"]).lower(),
         r["grad_accum"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}",
         f"{r['ms_per_step']:.1f}", "-" if r["mfu"] is None else f"{r['mfu']:.1%}",
         f"{r['spread']:.1%}", r["memory"], r["trial"]]
        for r in measured
    ]  # fmt: skip
    parts = [
        f"<h1>Autotune of run {html.escape(run)}</h1>",
        f"<p>Fastest: micro batch {best['micro_batch_size']}, ZeRO stage {best['zero_stage']}, "
        f"activation checkpointing {str(best['activation_checkpointing']).lower()}: "
        f"{best['tokens_per_s']:,.0f} tokens/s (best.yaml). Tokens/s over each trial's steps "
        f"after the first {warmup_steps}; spread: the per-step tokens/s' relative standard "
        f"deviation (a lead smaller than it is a tie).</p>",
        _table(["rank", "micro batch", "ZeRO", "activation ckpt", "grad accum", "tokens/s",
                "x best", "ms/step", "MFU", "spread", "memory/GPU (plan)", "trial"], table),
    ]  # fmt: skip
    if oom := [r for r in rows if r["status"] == OUT_OF_MEMORY]:
        parts += ["<h2>Out of memory</h2>", _table(
            ["micro batch", "ZeRO", "activation ckpt", "memory/GPU (plan)", "error"],
            [[r["micro_batch_size"], r["zero_stage"], str(r["activation_checkpointing"]).lower(),
              r["memory"], r["out_of_memory"]] for r in oom])]  # fmt: skip
    if refused := [r for r in rows if r["status"] == "refused"]:
        parts += ["<h2>Refused by the preflight (not run)</h2>", _table(
            ["micro batch", "ZeRO", "activation ckpt", "why"],
            [[r["micro_batch_size"], r["zero_stage"], str(r["activation_checkpointing"]).lower(),
              r["refused"]] for r in refused])]  # fmt: skip
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>autotune "
        f"{html.escape(run)}</title><style>{STYLE}</style></head><body>{''.join(parts)}"
        f"</body></html>\n"
    )


def autotune_report(
    run: str,
    candidates: list[dict],
    trials: dict[str, dict],
    warmup_steps: int,
    *,
    json_out: str | Path,
    page_out: str | Path,
    best_out: str | Path,
) -> dict:
    """The three files of the ranking; returns the fastest row. Every trial out of memory
    (nothing measured) is one line saying which and how to widen the search."""
    rows = rank(candidates, trials, warmup_steps)
    measured = [r for r in rows if r["status"] == MEASURED]
    if not measured:
        raise GptflowError(
            f"autotune of run {run}: every admitted candidate ran out of memory "
            f"({', '.join(r['trial'] for r in rows if r['status'] == OUT_OF_MEMORY)}): add "
            f"smaller autotune.micro_batch_sizes, ZeRO stages or activation checkpointing"
        )
    best = measured[0]
    write_json(json_out, {"run": run, "warmup_steps": warmup_steps, "best": best["trial"],
                          "candidates": rows})  # fmt: skip
    with atomic_write(page_out) as f:
        f.write(page(run, rows, warmup_steps))
    with atomic_write(best_out) as f:
        f.write(best_yaml(run, best, rows))
    return best
