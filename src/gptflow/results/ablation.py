"""What a study varies and a data ablation's lead section of the study page
(gptflow.results.study_report): which settings differ between the runs and which every run
shares, the run-to-run noise as far as the study measures it (runs differing only in
train.seed), and, when the runs differ in their data.quality recipe, the recipes' comparison on
the shared held-out text -- the lowest loss and each other's difference next to that noise, the
documents each recipe keeps, the training data's tokens, the harness scores, each recipe's
data-quality funnel (gptflow.results.quality_report). Everything is escaped.
"""

from __future__ import annotations

import html
import statistics
from pathlib import Path

from gptflow.results.figures import SeriesStyle, inline
from gptflow.results.report import Html, _table, harness_metric_names, metric_text, recipe_text


def number_text(x) -> str:
    """A number as the page shows it: 4 significant digits, '—' for none."""
    return "—" if x is None else f"{x:.4g}"


def name_cell(r: dict, styles: dict[str, SeriesStyle]) -> Html:
    """A run's name led by its mark in the figures."""
    return Html(f"{styles[r['name']].mark(r['name'])} {html.escape(r['name'])}")


def harness_columns(runs: list[dict]) -> list[tuple[str, str]]:
    """(task, metric) of every harness metric any run has, in first-seen order."""
    return list(dict.fromkeys(
        (task, metric) for r in runs for task, record in (r["harness"] or {}).items()
        for metric in harness_metric_names(record)
    ))  # fmt: skip


def harness_cells(r: dict, columns: list[tuple[str, str]]) -> list[str]:
    return [metric_text((r["harness"] or {}).get(task, {}), metric) for task, metric in columns]


# ----------------------------------------------------------------------------- what it varies

VARIED = {  # a run's key -> what the page calls it
    "recipe": "data.quality recipe", "parameters": "model size", "lr": "learning rate",
    "tokens": "tokens trained", "optimizer": "optimizer", "seed": "seed",
}  # fmt: skip


def _value(r: dict, key: str) -> str:
    if key == "recipe":
        return recipe_text(r["recipe"])
    if key == "parameters":
        return f"{r['preset']} ({r['parameters']:,} parameters)"
    if key == "tokens":
        return f"{r['tokens']:,}"
    return f"{r[key]:g}" if isinstance(r[key], float) else str(r[key])


def study_shape(runs: list[dict]) -> dict:
    """What the study varies and what every run shares: {"varies": [keys of VARIED whose
    value differs between runs], "same": {key: the one value}}, and the sections that apply."""
    values = {key: list(dict.fromkeys(_value(r, key) for r in runs)) for key in VARIED}
    varies = [key for key, v in values.items() if len(v) > 1]
    per_token = {round(r["training_flops"] / r["tokens"], 6) for r in runs if r["tokens"]}
    optimizers = {r["optimizer"] for r in runs}
    return {
        "varies": varies,
        "same": {key: v[0] for key, v in values.items() if len(v) == 1},
        "ablation": "recipe" in varies,
        "scaling": "parameters" in varies,
        "lr": "lr" in varies,
        "flops": len(per_token) > 1,  # else loss against FLOPs is loss against tokens rescaled
        "optimizers": len(optimizers) > 1 and "adamw" in optimizers,
        "harness": any(r["harness"] for r in runs),
    }


def intro(runs: list[dict], shape: dict, quality_link: str | None) -> list[str]:
    varied = (
        "; ".join(
            f"{VARIED[k]} ({len({_value(r, k) for r in runs})}: "
            f"{', '.join(dict.fromkeys(_value(r, k) for r in runs))})"
            for k in shape["varies"]
        )
        or "nothing (the runs are alike)"
    )
    same = "; ".join(f"{VARIED[k]} {v}" for k, v in shape["same"].items())
    parts = [f"<p>{len(runs)} runs. Varied: {html.escape(varied)}. The same in every run: "
             f"{html.escape(same)}.</p>"]  # fmt: skip
    if quality_link:
        parts.append(
            f"<p>What each data.quality recipe keeps, step by step: <a href='"
            f"{html.escape(quality_link)}'>the data-quality page</a>.</p>"
        )
    return parts


def run_noise(runs: list[dict]) -> dict:
    """Run-to-run noise of the final loss, as far as the study measures it: the pooled
    standard deviation over the groups of runs that differ only in train.seed (same recipe,
    size, lr, optimizer and tokens); sigma None when no group has two seeds. With "text", the
    page's sentence saying how it is known, or that it is not."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        key = (recipe_text(r["recipe"]), r["parameters"], r["lr"], r["optimizer"], r["tokens"])
        groups.setdefault(key, []).append(r)
    replicated = [g for g in groups.values() if len({r["seed"] for r in g}) > 1]
    if not replicated:
        seeds = sorted({r["seed"] for r in runs})
        return {"sigma": None, "groups": [], "text": (
            "Run-to-run noise is not measured: no two runs differ only in train.seed (seed "
            f"{', '.join(map(str, seeds))}), so how far another seed would move a final loss is "
            "unknown and a small difference may be noise. To measure it, add runs that repeat "
            "one (its data.quality, model and train keys) with another train.seed."
        )}  # fmt: skip
    dof = sum(len(g) - 1 for g in replicated)
    sigma = (sum(statistics.variance([r["final_val_loss"] for r in g]) * (len(g) - 1)
                 for g in replicated) / dof) ** 0.5  # fmt: skip
    described = "; ".join(
        f"{', '.join(r['name'] for r in g)} (seeds {', '.join(str(r['seed']) for r in g)})"
        for g in replicated
    )
    return {"sigma": sigma, "groups": [[r["name"] for r in g] for g in replicated], "text": (
        f"Run-to-run noise: σ = {sigma:.3g}, the pooled standard deviation of the final loss "
        f"of runs that differ only in train.seed ({described}; {dof} degree(s) of freedom). "
        f"A difference under 2σ = {2 * sigma:.3g} is not told apart from it."
    )}  # fmt: skip


# ----------------------------------------------------------------------------- data ablation


def _run_entries(name: str, quality: dict | None) -> list[dict]:
    """The data-quality summary's entries of a run's recipe (one per set of datasets)."""
    return [e for e in (quality or {}).get("recipes", []) if name in e["runs"]]


def _kept(name: str, quality: dict | None) -> str:
    """'24 of 789' documents a run's recipe keeps, from the data-quality summary."""
    entries = [e for e in _run_entries(name, quality) if e["funnel"]]
    if not entries:
        return "—"
    start = sum(e["funnel"][0]["documents"] for e in entries)
    end = sum(e["funnel"][-1]["documents"] for e in entries)
    return f"{end:,} of {start:,} ({end / start:.1%})" if start else "—"


def _answer(runs: list[dict], styles: dict[str, SeriesStyle], noise: dict) -> str:
    """The ablation's answer in one paragraph: the lowest final loss and how far each other
    run is from it, next to the noise."""
    ranked = sorted(runs, key=lambda r: r["final_val_loss"])
    best = ranked[0]
    others = ", ".join(
        f"{styles[r['name']].mark(r['name'])} {html.escape(r['name'])} "
        f"+{r['final_val_loss'] - best['final_val_loss']:.4f}"
        for r in ranked[1:]
    )
    sigma = noise["sigma"]
    scale = (f" (σ = {sigma:.3g} between seeds)" if sigma is not None
             else " (run-to-run noise not measured: see below)")  # fmt: skip
    return (
        f"<p class='answer'>Lowest final validation loss on the shared held-out text: "
        f"{styles[best['name']].mark(best['name'])} <b>{html.escape(best['name'])}</b> "
        f"({html.escape(recipe_text(best['recipe']))}), {best['final_val_loss']:.4f}; then "
        f"{others}{html.escape(scale)}.</p>"
    )


def _ablation_rows(runs, styles, noise, quality, columns) -> list[list]:
    best = min(r["final_val_loss"] for r in runs)
    sigma = noise["sigma"]
    rows = []
    for r in runs:
        diff = r["final_val_loss"] - best
        row = [name_cell(r, styles), recipe_text(r["recipe"]), _kept(r["name"], quality),
               "—" if r["data_tokens"] is None else f"{r['data_tokens']:,}", f"{r['tokens']:,}",
               number_text(r["epochs"]),
               f"{r['final_val_loss']:.4f}", "lowest" if diff == 0 else f"+{diff:.4f}"]  # fmt: skip
        if sigma is not None:
            row.append(f"{diff / sigma:.1f}σ" if sigma else "—")
        rows.append([*row, r["final_from"], *harness_cells(r, columns)])
    return rows


def ablation_section(runs, styles, noise, quality, figures) -> list[str]:
    """A data ablation's lead: the answer, the recipes' table in the page's order (documents
    kept, the training data's tokens, tokens trained and epochs over them, the final loss on
    the shared held-out text and its difference from the lowest, the harness scores), the
    noise, each recipe's funnel and the loss curves."""
    columns = harness_columns(runs)
    head = ["run", "recipe", "documents kept", "training data tokens", "tokens trained",
            "epochs over its data", "final loss", "difference from the lowest",
            *(["difference / σ"] if noise["sigma"] is not None else []), "from",
            *(f"{task} {metric}" for task, metric in columns)]  # fmt: skip
    parts = [
        "<h2>Data ablation: which recipe gives the lowest loss on the same held-out text</h2>",
        _answer(runs, styles, noise),
        "<p>Each run trained on the shards of its own data.quality recipe for the same number "
        "of tokens (a recipe that keeps less is seen more often: the epochs column); every "
        "run's validation loss is on the same held-out text, the validation split of the base "
        "config's shards, and its harness scores on the same tasks.</p>",
        _table(head, _ablation_rows(runs, styles, noise, quality, columns)),
        f"<p>{html.escape(noise['text'])}</p>",
    ]
    if quality:
        parts += [_funnel(runs, styles, quality)]
    parts.append(f"<div>{inline(Path(figures['loss_tokens']).read_text())}</div>")
    return parts


def _funnel(runs, styles, quality) -> str:
    """Each recipe's documents and bytes after each step (the data-quality page's funnel), in
    the colour of its first run; runs sharing a recipe share its line."""
    from gptflow.results.quality_report import funnel_figure

    series, seen = [], set()
    for r in runs:
        for e in _run_entries(r["name"], quality):
            key = (tuple(e["runs"]), tuple(e["datasets"]))
            if key in seen or not e["funnel"]:
                continue
            seen.add(key)
            names = [n for n in e["runs"] if n in styles]
            several = len(_run_entries(r["name"], quality)) > 1
            label = ", ".join(names) + (f": {', '.join(e['datasets'])}" if several else "")
            series.append((label, styles[r["name"]], e["funnel"]))
    return f"<div>{inline(funnel_figure(series, figure='study-funnel'))}</div>"
