"""The comparison of a study's runs on one self-contained page that adapts to what the study
varies: a data ablation leads with its recipes' losses on the shared held-out text, the tokens
each kept and each recipe's data-quality funnel; a study of several model sizes with its fitted
scaling laws and compute-optimal sizes; what cannot apply is one line. Figures: loss curves
against tokens and FLOPs, loss against lr, the L(N) fit, the optimizers.

Each run is read from what a finished run leaves (run.yaml, metrics.jsonl, DONE.json), only
the records of its finished series. The fits live in `gptflow.results.scaling`; a fit that cannot be
made (two sizes, one token budget) is said on the page in place of its numbers, so a study of
any shape renders. Every run keeps one colour and marker (gptflow.results.figures) in every
figure and table of the page, in the page's order. Everything is escaped: run names never
reach the HTML unescaped.

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
from gptflow.results.ablation import (
    ablation_section,
    harness_cells,
    harness_columns,
    intro,
    name_cell,
    number_text,
    run_noise,
    study_shape,
)
from gptflow.results.figures import (
    SeriesStyle,
    inline,
    new_figure,
    say,
    series_id,
    series_styles,
    write_svg,
)
from gptflow.results.report import STYLE, _records, _table

TWO_TERM = "L(N, D) = E + A / N<sup>α</sup> + B / D<sup>β</sup>"  # the data term's fit, as headed
DEFAULT_BUDGETS = (1e19, 1e21, 1e23)  # FLOPs; the study's own total is added
SAME_LR = (
    "Not swept: the learning rate is the same in every run,\nso there is no loss-against-lr curve."
)
FINAL_LOSS_RULE = (
    "Final loss: DONE.json's final_val_loss; when that is null (eval_iters 0), the last "
    "evaluation record of the finished series; else the last train loss (the 'from' column)."
)
LINESTYLES = ("-", "--", ":", "-.")  # the learning rate's, when it varies
FIGURES = ("loss_tokens", "loss_flops", "loss_lr", "fit", "optimizers")
ONE_OPTIMIZER = "every run has the same train.optimizer: nothing to compare"
DEFAULT_SEED = 1234  # train.seed's schema default, for a run.yaml written without the key


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
        seed = run["train"].get("seed", DEFAULT_SEED)
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
        "epochs": derived.get("epochs"), "seed": seed, "name": name, "preset": derived.get("preset"), "parameters": derived["parameters"],
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
    fig, axes = new_figure()
    ax = axes[0, 0]
    draw(ax)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return write_svg(fig, path)


def _line_kwargs(runs: list[dict], styles: dict[str, SeriesStyle]) -> dict[str, dict]:
    """Each run's plot() keywords: its colour and marker, and its learning rate's line style
    when the learning rate varies (a second cue in a sweep)."""
    lrs = sorted({r["lr"] for r in runs})
    out = {}
    for r in runs:
        kw = styles[r["name"]].kwargs()
        if len(lrs) > 1:
            kw["linestyle"] = LINESTYLES[lrs.index(r["lr"]) % len(LINESTYLES)]
        out[r["name"]] = kw
    return out


def _curve(ax, figure: str, name: str, xs: list, ys: list, kw: dict, label: str | None = None):
    """A run's curve, every point marked (every n-th of a long one), its SVG group named."""
    ax.plot(xs, ys, label=label or name, gid=series_id(figure, name), markersize=4,
            markevery=max(1, len(xs) // 12), **kw)  # fmt: skip


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


def _optimizers(runs: list[dict], rows: list[dict], kw: dict[str, dict]) -> Callable:
    def draw(ax) -> None:
        if not rows:
            say(ax, ONE_OPTIMIZER)
            return
        named = {r["name"]: r for r in runs}
        for row in rows:
            c = named[row["run"]]["curve"]
            _curve(ax, "optimizers", row["run"], c["tokens"], c["loss"], kw[row["run"]],
                   f"{row['run']} ({row['optimizer']}, lr {row['lr']:g})")  # fmt: skip
        ax.set_xscale("log")

    return draw


def _optimizers_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    head = ["preset", "parameters", "optimizer", "tuned lr", "final loss",
            "tokens to AdamW's final loss", "x AdamW's tokens"]  # fmt: skip
    body = [[r["preset"], f"{r['parameters']:,}", r["optimizer"], f"{r['lr']:g}",
             f"{r['final_val_loss']:.4f}", number_text(r["tokens_to_adamw_final"]), number_text(r["ratio"])]
            for r in rows]  # fmt: skip
    return ["<h2>Optimizers</h2>", f"<p>{html.escape(optimizer_comparison.__doc__.split('.')[0])}."
            "</p>", _table(head, body)]  # fmt: skip


def _curves(runs: list[dict], x: str, kw: dict[str, dict], figure: str) -> Callable:
    def draw(ax) -> None:
        for r in runs:
            _curve(ax, figure, r["name"], r["curve"][x], r["curve"]["loss"], kw[r["name"]])
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


def _point(ax, figure: str, r: dict, x: float, kw: dict) -> None:
    """One run as one point, in its colour and marker."""
    ax.plot([x], [r["final_val_loss"]], label=r["name"], gid=series_id(figure, r["name"]),
            markersize=7, **{**kw, "linestyle": "none"})  # fmt: skip


def _loss_lr(runs: list[dict], kw: dict[str, dict]) -> Callable:
    def draw(ax) -> None:
        if len({r["lr"] for r in runs}) < 2:
            say(ax, SAME_LR)
            return
        groups: dict[tuple, list[dict]] = {}
        for r in runs:
            groups.setdefault((r["parameters"], r["tokens"]), []).append(r)
        several_budgets = len({d for _, d in groups}) > 1
        for (_, d), rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: r["lr"])
            ax.plot([r["lr"] for r in rs], [r["final_val_loss"] for r in rs], color="0.6",
                    linewidth=1, zorder=1)  # fmt: skip
            for r in rs:
                _point(ax, "loss_lr", r, r["lr"], kw[r["name"]])
            label = f"{rs[0]['preset']}" + (f", {d:,} tokens" if several_budgets else "")
            ax.annotate(label, (rs[-1]["lr"], rs[-1]["final_val_loss"]), fontsize=7,
                        xytext=(6, 0), textcoords="offset points", va="center")  # fmt: skip
        ax.set_xscale("log")

    return draw


def _power_law_fit(runs: list[dict], fits: dict, kw: dict[str, dict]) -> Callable:
    def draw(ax) -> None:
        for r in runs:
            _point(ax, "fit", r, r["parameters"], kw[r["name"]])
        used = [r for r in runs if r["name"] in fits["points"]]
        ax.plot([r["parameters"] for r in used], [r["final_val_loss"] for r in used], "o",
                markersize=13, markerfacecolor="none", markeredgecolor="black",
                label="points of the fit")  # fmt: skip
        fit, error = fits["power_law"]
        if fit is None:
            ax.text(0.5, 0.9, f"no fit: {error}", ha="center", va="top", wrap=True,
                    transform=ax.transAxes, fontsize=8)  # fmt: skip
        else:
            lo, hi = min(r["parameters"] for r in runs), max(r["parameters"] for r in runs)
            xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
            ax.plot(xs, [fit.predict(x) for x in xs], color="black", label=_formula(fit))
        ax.set_xscale("log")

    return draw


def _formula(fit) -> str:
    return f"L(N) = {fit.E:.4g} + {fit.A:.4g} / N^{fit.alpha:.4f}"


def _figures(runs: list[dict], fits: dict, out: Path, styles: dict[str, SeriesStyle]) -> dict:
    kw = _line_kwargs(runs, styles)
    frontier = _frontier(fits["frontier"][0])

    def flops(ax) -> None:
        _curves(runs, "flops", kw, "loss_flops")(ax)
        frontier(ax)

    loss = "validation loss"
    return {
        "loss_tokens": _plot(out / "loss_tokens.svg", _curves(runs, "tokens", kw, "loss_tokens"),
                             title="validation loss against tokens", xlabel="tokens",
                             ylabel=loss),
        "loss_flops": _plot(out / "loss_flops.svg", flops,
                            title="validation loss against training FLOPs",
                            xlabel="training FLOPs", ylabel=loss),
        "loss_lr": _plot(out / "loss_lr.svg", _loss_lr(runs, kw),
                         title="final loss against learning rate", xlabel="learning rate",
                         ylabel="final loss"),
        "fit": _plot(out / "fit.svg", _power_law_fit(runs, fits, kw),
                     title="final loss against parameters", xlabel="parameters N",
                     ylabel="final loss"),
        "optimizers": _plot(out / "optimizers.svg", _optimizers(runs, fits["optimizers"], kw),
                            title="validation loss against tokens, each size's tuned run per "
                            "optimizer", xlabel="tokens", ylabel=loss),
    }  # fmt: skip


# "harness": the tasks of its harness.json (eval.harness), else null
RUN_KEYS = ("name", "preset", "parameters", "lr", "optimizer", "seed", "tokens", "training_flops",
            "final_val_loss", "final_from", "series", "harness", "recipe", "data_tokens",
            "epochs")  # fmt: skip


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
        "varies": fits["shape"]["varies"],
        "noise": {k: v for k, v in fits["noise"].items() if k != "text"},
    }


def _runs_table(runs: list[dict], styles: dict[str, SeriesStyle]) -> str:
    head = ["run", "preset", "parameters", "learning rate", "seed", "tokens", "training FLOPs",
            "final loss", "from", "series"]  # fmt: skip
    rows = [
        [name_cell(r, styles), r["preset"], f"{r['parameters']:,}", f"{r['lr']:g}", r["seed"],
         f"{r['tokens']:,}", number_text(r["training_flops"]), f"{r['final_val_loss']:.4f}",
         r["final_from"], r["series"]]
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

    parts = ["<h3>L(N) = E + A / N<sup>α</sup></h3>",
             f"<p>points: {html.escape(fits['rule'])}</p>"]  # fmt: skip
    if power is None:
        parts.append(f"<p>{err['power_law']}</p>")
    else:
        row = [number_text(x) for x in (power.E, power.A, power.alpha, power.rmse,
                                         power.max_rel_error)] + [count(power.points)]  # fmt: skip
        parts.append(_table(["E", "A", "α", *error_head], [row]))
        parts += [f"<p>warning: {html.escape(w)}</p>" for w in power.warnings]
    if "tokens" not in fits["shape"]["varies"]:
        pass  # one line under "Not made for this study" (not_made)
    elif two is None:
        parts.append(f"<h3>{TWO_TERM}</h3><p>{err['two_term']}</p>")
    else:
        row = [number_text(x) for x in (two.E, two.A, two.alpha, two.B, two.beta, two.rmse,
                                         two.max_rel_error)] + [count(two.points)]  # fmt: skip
        parts.append(f"<h3>{TWO_TERM}</h3>")
        parts.append(_table(["E", "A", "α", "B", "β", *error_head], [row]))
        parts += [f"<p>warning: {html.escape(w)}</p>" for w in two.warnings]
    parts.append("<h3>Compute frontier</h3>")
    if frontier is None:
        parts.append(f"<p>{err['frontier']}</p>")
    else:
        row = [number_text(frontier["k"]), number_text(frontier["a"]), len(frontier["budgets"])]
        parts.append(_table(["k (N_opt = k C^a)", "a", "budgets"], [row]))
    return parts


def _optimal_table(fits: dict) -> list[str]:
    rows = [[number_text(o["flops"]), number_text(o["parameters"]), number_text(o["tokens"]), number_text(o["loss"]), o["from"],
             f"{o['beyond_largest_run']:.3g}x"] for o in fits["compute_optimal"]]  # fmt: skip
    k = fits["flops_per_parameter_token"]
    return [
        "<h3>Compute-optimal size</h3>",
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


def _harness_table(runs: list[dict], styles: dict[str, SeriesStyle]) -> list[str]:
    """Each run's lm-evaluation-harness metrics on its export (± stderr), one column per task
    metric; nothing when the study ran no harness."""
    if not any(r["harness"] for r in runs):
        return []
    columns = harness_columns(runs)
    rows = [[name_cell(r, styles), f"{r['parameters']:,}", *harness_cells(r, columns)]
            for r in runs]  # fmt: skip
    head = ["run", "parameters", *(f"{task} {metric}" for task, metric in columns)]
    return [
        "<h2>Downstream evaluation</h2>",
        "<p>lm-evaluation-harness on each run's Hugging Face export (eval.harness; each run's "
        "curve over checkpoints is on its own harness page).</p>",
        _table(head, rows),
    ]


# ----------------------------------------------------------------------------- the page


def not_made(runs: list[dict], shape: dict) -> dict[str, str]:
    """The sections and figures that cannot apply to this study, each with one line why."""
    same = shape["same"]
    out = {}
    if not shape["ablation"]:
        out["ablation"] = f"Data ablation: every run cleans its data alike ({same['recipe']})."
    if not shape["scaling"]:
        out["fit"] = (
            "Scaling fits (L(N), L(N, D), the compute frontier, compute-optimal sizes): every "
            f"run has the same model size, {same['parameters']}; they need three sizes or more."
        )
    elif "tokens" not in shape["varies"]:
        out["two_term"] = (
            "L(N, D), the fit with a data term: every run trained for the same tokens "
            f"({same['tokens']}); it needs two token budgets or more."
        )
    if not shape["flops"]:
        out["loss_flops"] = (
            "Loss against training FLOPs: every run costs the same FLOPs per token, so it is "
            "the loss-against-tokens figure rescaled."
        )
    if not shape["lr"]:
        out["loss_lr"] = f"Loss against learning rate: every run has lr {same['lr']}."
    if not shape["optimizers"]:
        out["optimizers"] = (
            f"Optimizers: every run uses {same['optimizer']}." if "optimizer" in same
            else "Optimizers: no run uses AdamW, the reference the comparison measures against."
        )  # fmt: skip
    if not shape["harness"]:
        out["harness"] = (
            "Downstream evaluation: the study runs no lm-evaluation-harness task "
            "(eval.harness.tasks)."
        )
    return out


def _page(study, runs, fits, figures, styles, quality, quality_link) -> str:
    shape, noise = fits["shape"], fits["noise"]
    skipped = not_made(runs, shape)
    parts = [f"<h1>Study {html.escape(study)}</h1>", *intro(runs, shape, quality_link)]
    shown = [k for k in FIGURES if k not in skipped]
    if shape["ablation"]:
        parts += ablation_section(runs, styles, noise, quality, figures)
        shown.remove("loss_tokens")  # inline above
    elif shape["scaling"]:  # a size study leads with its fits, the L(N) figure beside them
        parts += ["<h2>Scaling fits</h2>", f"<div>{inline(Path(figures['fit']).read_text())}</div>",
                  *_fit_tables(fits), *_optimal_table(fits)]  # fmt: skip
        shown.remove("fit")
    parts += ["<h2>Runs</h2>", f"<p>{html.escape(FINAL_LOSS_RULE)}</p>",
              _runs_table(runs, styles)]  # fmt: skip
    if not shape["ablation"]:  # the ablation's table has the noise and the harness columns
        parts += [f"<p>{html.escape(noise['text'])}</p>", *_harness_table(runs, styles)]
    if shape["scaling"] and shape["ablation"]:  # a data ablation over sizes: its fits after
        parts += ["<h2>Scaling fits</h2>", *_fit_tables(fits), *_optimal_table(fits)]
    parts += _optimizers_table(fits["optimizers"])
    if shown:
        parts += ["<h2>Figures</h2>",
                  *(f"<div>{inline(Path(figures[k]).read_text())}</div>" for k in shown)]  # fmt: skip
    if skipped:
        parts += ["<h2>Not made for this study</h2>", "<ul class='not-made'>",
                  *(f"<li>{html.escape(line)}</li>" for line in skipped.values()), "</ul>"]  # fmt: skip
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
    quality: str | os.PathLike | None = None,
    quality_page: str | os.PathLike | None = None,
) -> dict[str, str]:
    """loss_tokens.svg, loss_flops.svg, loss_lr.svg, fit.svg, optimizers.svg, fit.json and
    study.html of a study's finished runs; `runs` maps a run name to its "config" (run.yaml),
    "metrics" (metrics.jsonl) and "done" (DONE.json) paths, and "harness" (harness.json) when
    the study runs lm-evaluation-harness. `quality`: the data-quality summary
    (data-quality.json) when a run has a data.quality recipe, and `quality_page` the page the
    study page links to. Returns file name (no suffix) -> path."""
    if not runs:
        raise GptflowError(f"study {study!r} has no runs; name at least one under its runs")
    declared = {name: i for i, name in enumerate(runs)}
    # the page's order, which every table and figure follows: by size, lr, tokens, then as
    # the study lists them
    loaded = sorted((_load_run(name, paths) for name, paths in runs.items()),
                    key=lambda r: (r["parameters"], r["lr"], r["tokens"], declared[r["name"]]))  # fmt: skip
    styles = series_styles([r["name"] for r in loaded])
    total = sum(r["training_flops"] for r in loaded)
    fits = _fits(loaded, list(budgets) if budgets is not None else [*DEFAULT_BUDGETS, total])
    fits["optimizers"] = optimizer_comparison(loaded)
    fits["shape"], fits["noise"] = study_shape(loaded), run_noise(loaded)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = _figures(loaded, fits, out, styles)
    paths["fit_json"] = str(out / "fit.json")
    write_json(paths["fit_json"], _fit_json(study, loaded, fits))
    summary = json.loads(Path(quality).read_text()) if quality else None
    link = os.path.relpath(quality_page, out) if quality_page else None
    paths["study"] = str(out / "study.html")
    with atomic_write(paths["study"]) as f:
        f.write(_page(study, loaded, fits, paths, styles, summary, link))
    return paths
