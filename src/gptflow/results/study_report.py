"""The comparison of a study's runs: loss curves against tokens and FLOPs, loss against lr,
the fitted scaling laws and the compute-optimal sizes they give, on one self-contained page.

Each run is read from what a finished run leaves (run.yaml, metrics.jsonl, DONE.json), only
the records of its finished series. The fits live in `gptflow.results.scaling`; a fit that cannot be
made (two sizes, one token budget) is said on the page in place of its numbers, so a study of
any shape renders. Everything is escaped: run names never reach the HTML unescaped.

Over 500 lines: one page -- the runs read, the fits attempted, the figures, the tables of runs,
fits, optimizers and ablations -- as short functions that :func:`study_report` puts together;
split, the page would be read from several modules.
"""

from __future__ import annotations

import html
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write, write_json
from gptflow.results.report import STYLE, _records, _table, harness_metric_names, metric_text

DEFAULT_BUDGETS = (1e19, 1e21, 1e23)  # FLOPs; the study's own total is added
SAME_LR = (
    "Not swept: the learning rate is the same in every run,\nso there is no loss-against-lr curve."
)
FINAL_LOSS_RULE = (
    "Final loss: DONE.json's final_val_loss; when that is null (eval_iters 0), the last "
    "evaluation record of the finished series; else the last train loss (the 'from' column)."
)
LINESTYLES = ("-", "--", ":", "-.")
FIGURES = ("loss_tokens", "loss_flops", "loss_lr", "fit", "optimizers")
ONE_OPTIMIZER = "every run has the same train.optimizer: nothing to compare"


def _load_run(name: str, paths: dict[str, str]) -> dict:
    """One run's numbers and its validation curve (tokens, FLOPs, loss) of its finished series."""
    import yaml

    try:
        run = yaml.safe_load(Path(paths["config"]).read_text())
        done = json.loads(Path(paths["done"]).read_text())
        derived, series = run["derived"], done["series"]
        per_token = derived["training_flops"] / derived["total_tokens"]
        per_step = derived["tokens_per_step"]
        lr, tokens = run["train"]["lr"], done["tokens"]
        optimizer = run["train"].get("optimizer", "adamw")  # runs from before the key
    except KeyError as e:
        raise GptflowError(
            f"study run {name!r}: {paths['config']} or {paths['done']} has no key {e}; "
            "rerun render_run_config and train_gpt for it"
        ) from None
    records = [r for r in _records(Path(paths["metrics"])) if r.get("series") == series]
    evals = [r for r in records if r["kind"] == "eval" and r.get("val_loss") is not None]
    train = [r for r in records if r["kind"] == "train" and r.get("loss") is not None]
    final, source = done.get("final_val_loss"), "final_val_loss"
    if final is None and evals:
        final, source = evals[-1]["val_loss"], "last evaluation"
    if final is None:
        final, source = (train[-1]["loss"] if train else done["train_loss"]), "last train loss"
    curve = [(r["step"] * per_step, r["val_loss"]) for r in evals if r["step"] > 0]
    harness = json.loads(Path(paths["harness"]).read_text()) if paths.get("harness") else None
    return {
        "harness": harness["tasks"] if harness else None,
        # a data ablation: each dataset's recipe and the tokens of its training shards
        "recipe": derived.get("data_quality"), "data_tokens": derived.get("data_tokens"),
        "name": name, "preset": derived.get("preset"), "parameters": derived["parameters"],
        "lr": lr, "optimizer": optimizer, "tokens": tokens, "training_flops": tokens * per_token,
        "final_val_loss": final, "final_from": source, "series": series,
        "curve": {"tokens": [t for t, _ in curve], "flops": [t * per_token for t, _ in curve],
                  "loss": [v for _, v in curve]},
    }  # fmt: skip


def _size_points(runs: list[dict]) -> tuple[list[dict], str]:
    """The run standing for each size in L(N): the lowest final loss over the other varied
    settings (lr) at the largest token budget every size trained for; and that rule in words."""
    budgets: dict[int, set] = {}
    for r in runs:
        budgets.setdefault(r["parameters"], set()).add(r["tokens"])
    common = set.intersection(*budgets.values()) if budgets else set()
    if common:
        budget = max(common)
        rule = (
            f"per size, the lowest final loss over the learning rates at {budget:,} tokens, "
            "the largest token budget every size trained for"
        )
        pool = [r for r in runs if r["tokens"] == budget]
    else:
        rule = (
            "per size, the lowest final loss at that size's own largest token budget "
            "(the sizes share no token budget)"
        )
        pool = [r for r in runs if r["tokens"] == max(budgets[r["parameters"]])]
    best: dict[int, dict] = {}
    for r in pool:
        if (
            r["parameters"] not in best
            or r["final_val_loss"] < best[r["parameters"]]["final_val_loss"]
        ):
            best[r["parameters"]] = r
    return [best[n] for n in sorted(best)], rule


def _attempt(fit: Callable, *args):
    """(result, None), or (None, the reason) when the fit raises GptflowError."""
    try:
        return fit(*args), None
    except GptflowError as e:
        return None, str(e)


def _fits(runs: list[dict], budgets: list[float]) -> dict:
    """L(N) over the size points, L(N, D) when tokens vary, the compute frontier of the
    curves, and the compute-optimal size for each budget from each fit that could be made."""
    from gptflow.results.scaling import (
        compute_frontier,
        fit_power_law,
        fit_two_term,
        optimal_size,
    )

    points, rule = _size_points(runs)
    power, power_error = _attempt(
        fit_power_law, [r["parameters"] for r in points], [r["final_val_loss"] for r in points]
    )
    best: dict[tuple, float] = {}  # (N, D) -> lowest final loss over the learning rates
    for r in runs:
        key = (r["parameters"], r["tokens"])
        best[key] = min(best.get(key, r["final_val_loss"]), r["final_val_loss"])
    # by (N, D): with two budgets E, B and beta are not separately identifiable, and the
    # minimiser's answer then depends on the points' order; a set of runs gives one answer
    best = dict(sorted(best.items()))
    two, two_error = None, "every run trained for the same tokens (L(N, D) needs two budgets)"
    if len({d for _, d in best}) >= 2:
        two, two_error = _attempt(
            fit_two_term, [n for n, _ in best], [d for _, d in best], list(best.values())
        )
    curves = {r["name"]: (r["parameters"], r["curve"]["flops"], r["curve"]["loss"]) for r in runs}
    frontier, frontier_error = _attempt(compute_frontier, curves)
    # the study's own FLOPs per parameter per token (6 plus attention), not the textbook 6
    k = statistics.median(r["training_flops"] / (r["parameters"] * r["tokens"]) for r in runs)
    optimal = []
    largest = max(r["training_flops"] for r in runs)  # how far each budget extrapolates
    for c in budgets:
        if two is not None:
            optimal.append({**two.compute_optimal(c, flops_per_param_token=k), "from": "two_term"})
        if frontier is not None:
            n = optimal_size(frontier, c)
            optimal.append({"flops": c, "parameters": n, "tokens": c / (k * n), "loss": None,
                            "from": "frontier"})  # fmt: skip
    return {
        "rule": rule, "points": [r["name"] for r in points], "flops_per_parameter_token": k,
        "power_law": (power, power_error), "two_term": (two, two_error),
        "frontier": (frontier, frontier_error),
        "compute_optimal": [{**o, "beyond_largest_run": o["flops"] / largest} for o in optimal],
    }  # fmt: skip


def _plot(path: Path, draw: Callable, *, title: str, xlabel: str, ylabel: str) -> str:
    """One figure drawn by `draw(ax)`, written as SVG atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    draw(ax)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_write(path, "w") as f:
        fig.savefig(f, format="svg")
    plt.close(fig)
    return str(path)


def _say(ax, text: str) -> None:
    """A figure that says why it has no points."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def optimizer_comparison(runs: list[dict]) -> list[dict]:
    """Per size and optimizer, its best run (the lowest final loss over the learning rates at
    the largest token budget every run of the size trained for: each optimizer at its tuned
    lr), and, against AdamW's best, the tokens it needed to reach AdamW's final loss (the first
    crossing of its validation curve, linear between evaluations; None if it never did) and
    their ratio to AdamW's tokens. Empty unless AdamW and another optimizer both ran."""
    if len({r["optimizer"] for r in runs}) < 2 or "adamw" not in {r["optimizer"] for r in runs}:
        return []
    rows = []
    for n in sorted({r["parameters"] for r in runs}):
        size = [r for r in runs if r["parameters"] == n]
        budget = min(max(r["tokens"] for r in size if r["optimizer"] == o)
                     for o in {r["optimizer"] for r in size})  # fmt: skip
        best: dict[str, dict] = {}
        for r in size:
            if r["tokens"] == budget and (
                r["optimizer"] not in best
                or r["final_val_loss"] < best[r["optimizer"]]["final_val_loss"]
            ):
                best[r["optimizer"]] = r
        if "adamw" not in best:
            continue
        target = best["adamw"]["final_val_loss"]
        for opt, r in sorted(best.items(), key=lambda kv: kv[0] != "adamw"):
            reached = tokens_to_reach(r["curve"]["tokens"], r["curve"]["loss"], target)
            rows.append({"preset": r["preset"], "parameters": n, "optimizer": opt,
                         "run": r["name"], "lr": r["lr"], "final_val_loss": r["final_val_loss"],
                         "tokens": r["tokens"], "tokens_to_adamw_final": reached,
                         "ratio": None if reached is None else reached / best["adamw"]["tokens"]})  # fmt: skip
    return rows


def tokens_to_reach(tokens: list[float], losses: list[float], target: float) -> float | None:
    """The first token count at which a validation curve is at or below `target`, linear
    between its evaluations (the curve starts after step 0); None if it never is."""
    for i, (t, v) in enumerate(zip(tokens, losses, strict=True)):
        if v <= target:
            if i == 0 or losses[i - 1] == v:
                return float(t)
            t0, v0 = tokens[i - 1], losses[i - 1]
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
    return None


def _optimizers(runs: list[dict], rows: list[dict]) -> Callable:
    def draw(ax) -> None:
        if not rows:
            _say(ax, ONE_OPTIMIZER)
            return
        sizes = sorted({r["parameters"] for r in rows})
        optimizers = sorted({r["optimizer"] for r in rows})
        named = {r["name"]: r for r in runs}
        for row in rows:
            c = named[row["run"]]["curve"]
            ax.plot(c["tokens"], c["loss"], color=f"C{sizes.index(row['parameters']) % 10}",
                    linestyle=LINESTYLES[optimizers.index(row["optimizer"]) % len(LINESTYLES)],
                    marker="o" if len(c["tokens"]) < 30 else None, markersize=3,
                    label=f"{row['preset']} {row['optimizer']} lr {row['lr']:g}")  # fmt: skip
        ax.set_xscale("log")

    return draw


def _optimizers_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    head = ["preset", "parameters", "optimizer", "tuned lr", "final loss",
            "tokens to AdamW's final loss", "x AdamW's tokens"]  # fmt: skip
    body = [[r["preset"], f"{r['parameters']:,}", r["optimizer"], f"{r['lr']:g}",
             f"{r['final_val_loss']:.4f}", _g(r["tokens_to_adamw_final"]), _g(r["ratio"])]
            for r in rows]  # fmt: skip
    return ["<h2>Optimizers</h2>", f"<p>{html.escape(optimizer_comparison.__doc__.split('.')[0])}."
            "</p>", _table(head, body)]  # fmt: skip


def _styles(runs: list[dict]) -> dict[str, dict]:
    """Colour by size, line style by lr, so a run's line reads the same in every figure."""
    sizes = sorted({r["parameters"] for r in runs})
    lrs = sorted({r["lr"] for r in runs})
    return {
        r["name"]: {
            "color": f"C{sizes.index(r['parameters']) % 10}",
            "linestyle": LINESTYLES[lrs.index(r["lr"]) % len(LINESTYLES)],
        }
        for r in runs
    }


def _curves(runs: list[dict], x: str) -> Callable:
    def draw(ax) -> None:
        style = _styles(runs)
        for r in runs:
            c = r["curve"]
            ax.plot(c[x], c["loss"], marker="o" if len(c[x]) < 30 else None, markersize=3,
                    label=r["name"], **style[r["name"]])  # fmt: skip
        ax.set_xscale("log")
        if x == "flops":
            ax.set_yscale("log")

    return draw


def _frontier(frontier: dict | None) -> Callable:
    def draw(ax) -> None:
        if frontier is not None:
            ax.plot(frontier["budgets"], frontier["best_loss"], color="black", linewidth=2,
                    alpha=0.5, label="compute frontier")  # fmt: skip

    return draw


def _loss_lr(runs: list[dict]) -> Callable:
    def draw(ax) -> None:
        if len({r["lr"] for r in runs}) < 2:
            _say(ax, SAME_LR)
            return
        groups: dict[tuple, list[dict]] = {}
        for r in runs:
            groups.setdefault((r["parameters"], r["tokens"]), []).append(r)
        several_budgets = len({d for _, d in groups}) > 1
        for (n, d), rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: r["lr"])
            label = f"{rs[0]['preset']} ({n:,} parameters)"
            label += f", {d:,} tokens" if several_budgets else ""
            ax.plot([r["lr"] for r in rs], [r["final_val_loss"] for r in rs], marker="o",
                    label=label)  # fmt: skip
        ax.set_xscale("log")

    return draw


def _power_law_fit(runs: list[dict], fits: dict) -> Callable:
    def draw(ax) -> None:
        ax.plot([r["parameters"] for r in runs], [r["final_val_loss"] for r in runs], "o",
                color="0.7", label="every run")  # fmt: skip
        used = [r for r in runs if r["name"] in fits["points"]]
        ax.plot([r["parameters"] for r in used], [r["final_val_loss"] for r in used], "o",
                color="C0", label="points of the fit")  # fmt: skip
        fit, error = fits["power_law"]
        if fit is None:
            ax.text(0.5, 0.9, f"no fit: {error}", ha="center", va="top", wrap=True,
                    transform=ax.transAxes, fontsize=8)  # fmt: skip
        else:
            lo, hi = min(r["parameters"] for r in runs), max(r["parameters"] for r in runs)
            xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
            ax.plot(xs, [fit.predict(x) for x in xs], color="C1", label=_formula(fit))
        ax.set_xscale("log")

    return draw


def _formula(fit) -> str:
    return f"L(N) = {fit.E:.4g} + {fit.A:.4g} / N^{fit.alpha:.4f}"


def _figures(runs: list[dict], fits: dict, out: Path) -> dict[str, str]:
    frontier = _frontier(fits["frontier"][0])

    def flops(ax) -> None:
        _curves(runs, "flops")(ax)
        frontier(ax)

    loss = "validation loss"
    return {
        "loss_tokens": _plot(out / "loss_tokens.svg", _curves(runs, "tokens"),
                             title="validation loss against tokens", xlabel="tokens",
                             ylabel=loss),
        "loss_flops": _plot(out / "loss_flops.svg", flops,
                            title="validation loss against training FLOPs",
                            xlabel="training FLOPs", ylabel=loss),
        "loss_lr": _plot(out / "loss_lr.svg", _loss_lr(runs),
                         title="final loss against learning rate", xlabel="learning rate",
                         ylabel="final loss"),
        "fit": _plot(out / "fit.svg", _power_law_fit(runs, fits),
                     title="final loss against parameters", xlabel="parameters N",
                     ylabel="final loss"),
        "optimizers": _plot(out / "optimizers.svg", _optimizers(runs, fits["optimizers"]),
                            title="validation loss against tokens, each size's tuned run per "
                            "optimizer", xlabel="tokens", ylabel=loss),
    }  # fmt: skip


# "harness": the tasks of its harness.json (eval.harness), else null
RUN_KEYS = ("name", "preset", "parameters", "lr", "optimizer", "tokens", "training_flops", "final_val_loss",
            "final_from", "series", "harness", "recipe", "data_tokens")  # fmt: skip


def _fit_json(study: str, runs: list[dict], fits: dict) -> dict:
    def result(key: str) -> dict:
        fit, error = fits[key]
        if fit is None:
            return {"error": error}
        return fit if isinstance(fit, dict) else fit.to_json()

    return {
        "study": study,
        "runs": [{k: r[k] for k in RUN_KEYS} for r in runs],
        "size_points": {"rule": fits["rule"], "runs": fits["points"]},
        "power_law": result("power_law"),
        "two_term": result("two_term"),
        "frontier": result("frontier"),
        "flops_per_parameter_token": fits["flops_per_parameter_token"],
        "compute_optimal": fits["compute_optimal"],
        "optimizers": fits["optimizers"],
    }


def _g(x) -> str:
    """A number as the page shows it: 4 significant digits, '—' for none."""
    return "—" if x is None else f"{x:.4g}"


def _runs_table(runs: list[dict]) -> str:
    head = ["run", "preset", "parameters", "learning rate", "tokens", "training FLOPs",
            "final loss", "from", "series"]  # fmt: skip
    rows = [
        [r["name"], r["preset"], f"{r['parameters']:,}", f"{r['lr']:g}", f"{r['tokens']:,}",
         _g(r["training_flops"]), f"{r['final_val_loss']:.4f}", r["final_from"], r["series"]]
        for r in runs
    ]  # fmt: skip
    return _table(head, rows)


def _fit_tables(fits: dict) -> list[str]:
    """Each fit's parameters and errors, or 'no fit:' and why."""
    power, two, frontier = (fits[k][0] for k in ("power_law", "two_term", "frontier"))
    err = {k: html.escape(f"no fit: {fits[k][1]}") for k in ("power_law", "two_term", "frontier")}
    error_head = ["RMSE", "max relative error", "points"]

    def count(points) -> int:
        return len(points) if isinstance(points, list | tuple) else points

    parts = ["<h2>L(N) = E + A / N<sup>α</sup></h2>",
             f"<p>points: {html.escape(fits['rule'])}</p>"]  # fmt: skip
    if power is None:
        parts.append(f"<p>{err['power_law']}</p>")
    else:
        row = [_g(power.E), _g(power.A), _g(power.alpha), _g(power.rmse),
               _g(power.max_rel_error), count(power.points)]  # fmt: skip
        parts.append(_table(["E", "A", "α", *error_head], [row]))
        parts += [f"<p>warning: {html.escape(w)}</p>" for w in power.warnings]
    parts.append("<h2>L(N, D) = E + A / N<sup>α</sup> + B / D<sup>β</sup></h2>")
    if two is None:
        parts.append(f"<p>{err['two_term']}</p>")
    else:
        row = [_g(two.E), _g(two.A), _g(two.alpha), _g(two.B), _g(two.beta), _g(two.rmse),
               _g(two.max_rel_error), count(two.points)]  # fmt: skip
        parts.append(_table(["E", "A", "α", "B", "β", *error_head], [row]))
        parts += [f"<p>warning: {html.escape(w)}</p>" for w in two.warnings]
    parts.append("<h2>Compute frontier</h2>")
    if frontier is None:
        parts.append(f"<p>{err['frontier']}</p>")
    else:
        row = [_g(frontier["k"]), _g(frontier["a"]), len(frontier["budgets"])]
        parts.append(_table(["k (N_opt = k C^a)", "a", "budgets"], [row]))
    return parts


def _optimal_table(fits: dict) -> list[str]:
    rows = [[_g(o["flops"]), _g(o["parameters"]), _g(o["tokens"]), _g(o["loss"]), o["from"],
             f"{o['beyond_largest_run']:.3g}x"] for o in fits["compute_optimal"]]  # fmt: skip
    k = fits["flops_per_parameter_token"]
    return [
        "<h2>Compute-optimal size</h2>",
        f"<p>training FLOPs C = {k:.3g} × N × D (this study's median FLOPs per parameter "
        "per token, from each run's derived.training_flops). A budget far beyond the study's "
        "largest run is an extrapolation of the fit, as good as its exponents.</p>",
        _table(
            ["FLOPs", "parameters", "tokens", "predicted loss", "from", "FLOPs / largest run's"],
            rows,
        )
        if rows
        else "<p>none: neither L(N, D) nor the compute frontier could be fitted</p>",
    ]


def recipe_text(recipe: dict[str, str] | None) -> str:
    """A run's data.quality in a few words: one recipe for every dataset, else per dataset."""
    if not recipe:
        return "raw"
    labels = set(recipe.values())
    if len(labels) == 1:
        return labels.pop()
    return "; ".join(f"{name}: {text}" for name, text in recipe.items())


def _harness_columns(runs: list[dict]) -> list[tuple[str, str]]:
    """(task, metric) of every harness metric any run has, in first-seen order."""
    return list(dict.fromkeys(
        (task, metric) for r in runs for task, record in (r["harness"] or {}).items()
        for metric in harness_metric_names(record)
    ))  # fmt: skip


def _ablation_table(runs: list[dict]) -> list[str]:
    """A data ablation (runs whose data.quality differs): per run its recipe, the tokens of
    its training shards and trained, the final validation loss on the shared held-out text,
    and its harness metrics; nothing when every run cleans alike."""
    if len({recipe_text(r["recipe"]) for r in runs}) < 2:
        return []
    columns = _harness_columns(runs)
    rows = []
    for r in sorted(runs, key=lambda r: r["final_val_loss"]):
        row = [r["name"], recipe_text(r["recipe"]), _g(r["data_tokens"]), f"{r['tokens']:,}",
               f"{r['final_val_loss']:.4f}", r["final_from"]]  # fmt: skip
        row += [metric_text((r["harness"] or {}).get(task, {}), metric) for task, metric in columns]
        rows.append(row)
    head = ["run", "recipe", "training data tokens", "tokens trained", "final loss", "from",
            *(f"{task} {metric}" for task, metric in columns)]  # fmt: skip
    return [
        "<h2>Data ablation</h2>",
        "<p>Each run trained on the shards of its own data.quality recipe; every run's "
        "validation loss is on the same held-out text, the validation split of the base "
        "config's shards, and its harness scores on the same tasks.</p>",
        _table(head, rows),
    ]


def _harness_table(runs: list[dict]) -> list[str]:
    """Each run's lm-evaluation-harness metrics on its export (± stderr), one column per task
    metric; nothing when the study ran no harness."""
    if not any(r["harness"] for r in runs):
        return []
    columns = _harness_columns(runs)
    rows = []
    for r in runs:
        row = [r["name"], f"{r['parameters']:,}"]
        row += [metric_text((r["harness"] or {}).get(task, {}), metric) for task, metric in columns]
        rows.append(row)
    head = ["run", "parameters", *(f"{task} {metric}" for task, metric in columns)]
    return [
        "<h2>Downstream evaluation</h2>",
        "<p>lm-evaluation-harness on each run's Hugging Face export (eval.harness; each run's "
        "curve over checkpoints is on its own harness page).</p>",
        _table(head, rows),
    ]


def _inline(svg: str) -> str:
    """An SVG file's <svg> element, without the XML declaration and doctype."""
    text = Path(svg).read_text()
    return text[text.index("<svg") :]


def _page(study: str, runs: list[dict], fits: dict, figures: dict[str, str]) -> str:
    parts = [
        f"<h1>Study {html.escape(study)}</h1>",
        "<h2>Runs</h2>",
        f"<p>{html.escape(FINAL_LOSS_RULE)}</p>",
        _runs_table(runs),
        *_ablation_table(runs),
        *_harness_table(runs),
        *_fit_tables(fits),
        *_optimal_table(fits),
        *_optimizers_table(fits["optimizers"]),
        "<h2>Figures</h2>",
        *(f"<div>{_inline(path)}</div>" for path in figures.values()),
    ]
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>study "
        f"{html.escape(study)}</title><style>{STYLE}</style></head><body>"
        f"{''.join(parts)}</body></html>\n"
    )


def study_report(
    study: str,
    runs: dict[str, dict[str, str]],
    out_dir: str | os.PathLike,
    *,
    budgets: list[float] | None = None,
) -> dict[str, str]:
    """loss_tokens.svg, loss_flops.svg, loss_lr.svg, fit.svg, optimizers.svg, fit.json and study.html of a
    study's finished runs; `runs` maps a run name to its "config" (run.yaml), "metrics"
    (metrics.jsonl) and "done" (DONE.json) paths, and "harness" (harness.json) when the study
    runs lm-evaluation-harness. Returns file name (no suffix) -> path."""
    if not runs:
        raise GptflowError(f"study {study!r} has no runs; name at least one under its runs")
    loaded = sorted((_load_run(name, paths) for name, paths in runs.items()),
                    key=lambda r: (r["parameters"], r["lr"], r["tokens"], r["name"]))  # fmt: skip
    total = sum(r["training_flops"] for r in loaded)
    fits = _fits(loaded, list(budgets) if budgets is not None else [*DEFAULT_BUDGETS, total])
    fits["optimizers"] = optimizer_comparison(loaded)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = _figures(loaded, fits, out)
    paths["fit_json"] = str(out / "fit.json")
    write_json(paths["fit_json"], _fit_json(study, loaded, fits))
    paths["study"] = str(out / "study.html")
    with atomic_write(paths["study"]) as f:
        f.write(_page(study, loaded, fits, {k: paths[k] for k in FIGURES}))
    return paths
