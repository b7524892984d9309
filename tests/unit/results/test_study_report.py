"""The study report from hand-made run files whose losses follow a known L(N) = E + A / N^alpha
plus a learning-rate penalty (no training needed). The assertions on fitted numbers are in their
own tests: they hold `gptflow.results.scaling` to the synthetic law, the others the page and files."""

from __future__ import annotations

import functools
import html
import json
import math
import random
import re
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from gptflow.results.study_report import (
    _fits,
    _load_run,
    study_report,
)
from tests.unit.results.test_report import (
    SVG,
    assert_affine,
    assert_plot_shows,
    plotted_points,
    texts,
)

E, A, ALPHA = 1.8, 60.0, 0.3
B, BETA = 50.0, 0.3  # the data term: a run's loss after D tokens is L(N) + B / D^BETA
SIZES = {"s": 1_000_000, "m": 4_000_000, "l": 16_000_000}
PENALTY = {1e-3: 0.0, 3e-3: 0.07}  # 1e-3 is the best lr at every size
PER_STEP = 512  # tokens per step
EVAL_INTERVAL = 100  # steps
FLOPS_PER_PARAMETER_TOKEN = 6.5


def law(n: int) -> float:
    return E + A / n**ALPHA


def loss(preset: str, lr: float, step: int, penalty=None) -> float:
    """The validation loss of a run after `step` steps (9.0 before training); `penalty` maps
    (preset, lr) to the lr's penalty at that size (default: PENALTY's, the same at every size)."""
    extra = penalty[preset, lr] if penalty else PENALTY[lr]
    return law(SIZES[preset]) + B / (step * PER_STEP) ** BETA + extra if step else 9.0


def write_run(root: Path, name: str, preset: str, lr: float, *, steps: int = 1000,
              null_final: bool = False, penalty=None, optimizer: str | None = None,
              speedup: float = 1.0, offset: float = 0.0) -> dict[str, str]:  # fmt: skip
    """run.yaml, metrics.jsonl (an evaluation every EVAL_INTERVAL steps from 0 of series "s1",
    after the records of a stale series "old" whose losses are 0.5) and DONE.json. `optimizer`:
    train.optimizer (absent by default, as in runs from before it); `speedup`: its loss after
    s steps is the law's after speedup x s; `offset`: added to every loss."""

    plain = functools.partial(globals()["loss"], penalty=penalty)

    def loss(preset, lr, step):
        return plain(preset, lr, step * speedup) + offset

    n, tokens = SIZES[preset], steps * PER_STEP
    d = root / f"{len(list(root.glob('*'))) if root.is_dir() else 0}"
    d.mkdir(parents=True)
    run = {
        "run": name, "model": {"num_layers": 2},
        "train": {"lr": lr, "train_iters": steps, **({"optimizer": optimizer} if optimizer else {})},
        "derived": {"preset": preset, "parameters": n, "tokens_per_step": PER_STEP,
                    "total_tokens": tokens,
                    "training_flops": FLOPS_PER_PARAMETER_TOKEN * n * tokens},
    }  # fmt: skip
    (d / "run.yaml").write_text(yaml.safe_dump(run))
    records = [{"series": "old", "kind": "eval", "step": s, "val_loss": 0.5} for s in (0, 4000)]
    for step in range(0, steps + 1, EVAL_INTERVAL):
        records.append({"series": "s1", "kind": "eval", "step": step,
                        "val_loss": loss(preset, lr, step)})  # fmt: skip
    records.append({"series": "s1", "kind": "train", "step": steps, "tokens": tokens,
                    "loss": loss(preset, lr, steps) - 0.1, "lr": lr})  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    final = None if null_final else loss(preset, lr, steps)
    done = {"series": "s1", "final_step": steps, "tokens": tokens,
            "train_loss": loss(preset, lr, steps) - 0.1, "final_val_loss": final}  # fmt: skip
    (d / "DONE.json").write_text(json.dumps(done))
    return {"config": str(d / "run.yaml"), "metrics": str(d / "metrics.jsonl"),
            "done": str(d / "DONE.json")}  # fmt: skip


def grid(root: Path, presets=("s", "m", "l"), lrs=(1e-3, 3e-3), steps=(1000,)) -> dict:
    """Every preset x lr x steps run, listed largest first (the report sorts by size then lr);
    the medium size's 3e-3 runs have final_val_loss null, as with eval_iters 0."""
    return {
        f"{p}-lr{lr:g}" + (f"-{t}" if len(steps) > 1 else ""): write_run(
            root / "runs", f"{p}-lr{lr:g}", p, lr, steps=t, null_final=(p, lr) == ("m", 3e-3)
        )
        for p in reversed(presets) for lr in lrs for t in steps
    }  # fmt: skip


MARK = re.compile(r"<span class='mark' style='color:(#[0-9a-f]{6})' title='[^']*'>(.)</span> ")


def table_rows(page: str, after: str = "<h2>Runs</h2>") -> list[list[str]]:
    """The cells of the body rows of the first table after `after` (the runs table; of a
    section without it, its first table), unescaped, without the mark that leads a run's
    name (marks(): those)."""
    body = page.split(after, 1)[-1].split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [
        [html.unescape(MARK.sub("", c)) for c in re.findall(r"<td>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", body)
    ]


def series_points(svg, figure: str) -> dict[str, list[tuple[float, float]]]:
    """{series: its points in pixels} of a figure's series groups (FIGURE:SERIES ids), in
    drawing order."""
    axes = ET.parse(svg).getroot().find(f".//{SVG}g[@id='axes_1']")
    return {
        g.get("id").split(":", 1)[1]: [(float(u.get("x")), float(u.get("y")))
                                       for u in g.iter(f"{SVG}use")]
        for g in axes.findall(f"{SVG}g") if g.get("id", "").startswith(f"{figure}:")
    }  # fmt: skip


def series_colours(svg, figure: str) -> dict[str, str]:
    """{series: the stroke colour of its line (or its markers' fill, for points)}."""
    axes = ET.parse(svg).getroot().find(f".//{SVG}g[@id='axes_1']")
    out = {}
    for g in axes.findall(f"{SVG}g"):
        if g.get("id", "").startswith(f"{figure}:"):
            styles = " ".join(e.get("style", "") for e in g.iter() if e.get("style"))
            out[g.get("id").split(":", 1)[1]] = re.search(
                r"(?:stroke|fill): (#[0-9a-f]{6})", styles
            )[1]
    return out


def marks(page: str) -> list[tuple[str, str]]:
    """(colour, marker character) leading each body row of the first table."""
    body = page.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [MARK.search(row).groups() for row in re.findall(r"<tr>(.*?)</tr>", body)]


ORDER = [(p, lr) for p in ("s", "m", "l") for lr in (1e-3, 3e-3)]  # by size, then lr
TOKENS = 1000 * PER_STEP


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[str, str]:
    """The report of the 3 sizes x 2 lrs study, made once for the tests that only read it."""
    root = tmp_path_factory.mktemp("sweep")
    return study_report("sweep", grid(root), root / "out")


def test_every_file_parses_and_the_runs_table_holds_the_inputs(sweep):
    """The files exist and parse; the runs table lists every run by size then lr with its
    inputs; the medium size's 3e-3 run (final_val_loss null) takes its series' last
    evaluation, not the stale series' 0.5; the curves are each run's evaluations after step 0."""
    paths = sweep
    assert set(paths) == {"loss_tokens", "loss_flops", "loss_lr", "fit", "optimizers", "fit_json",
                          "study"}  # fmt: skip
    for name in ("loss_tokens", "loss_flops", "loss_lr", "fit", "optimizers"):
        assert ET.parse(paths[name]).getroot().tag.endswith("svg")
    fit = json.loads(Path(paths["fit_json"]).read_text())
    page = Path(paths["study"]).read_text()
    want = [
        [f"{p}-lr{lr:g}", p, f"{SIZES[p]:,}", f"{lr:g}", "1234", f"{TOKENS:,}",
         f"{FLOPS_PER_PARAMETER_TOKEN * SIZES[p] * TOKENS:.4g}", f"{loss(p, lr, 1000):.4f}",
         "last evaluation" if (p, lr) == ("m", 3e-3) else "final_val_loss", "s1"]
        for p, lr in ORDER
    ]  # fmt: skip
    assert table_rows(page) == want
    assert [r["name"] for r in fit["runs"]] == [w[0] for w in want]
    for r, (p, lr) in zip(fit["runs"], ORDER, strict=True):
        assert (r["parameters"], r["lr"], r["tokens"], r["series"]) == (SIZES[p], lr, TOKENS, "s1")
        assert math.isclose(r["final_val_loss"], loss(p, lr, 1000))
        assert math.isclose(r["training_flops"], FLOPS_PER_PARAMETER_TOKEN * SIZES[p] * TOKENS)
    assert fit["study"] == "sweep"
    assert "same tokens" in fit["two_term"]["error"]  # one token budget: L(N, D) not attempted
    # every figure but the optimizers' (AdamW alone: one line under "Not made for this study")
    assert page.count("<svg") == 4 and "<?xml" not in page
    assert fit["optimizers"] == [] and "<h2>Optimizers</h2>" not in page
    assert "<li>Optimizers: every run uses adamw.</li>" in page
    assert fit["varies"] == ["parameters", "lr"] and fit["noise"]["sigma"] is None
    steps = range(EVAL_INTERVAL, 1001, EVAL_INTERVAL)
    curves = [[(math.log10(s * PER_STEP), loss(p, lr, s)) for s in steps] for p, lr in ORDER]
    assert_plot_shows(paths["loss_tokens"], curves)
    log_curves = [
        [(math.log10(FLOPS_PER_PARAMETER_TOKEN * SIZES[p] * s * PER_STEP), math.log10(v))
         for (_, v), s in zip(line, steps, strict=True)]
        for line, (p, _) in zip(curves, ORDER, strict=True)
    ]  # fmt: skip
    frontier = plotted_points(paths["loss_flops"])[len(log_curves) :]
    assert frontier in ([], [[]])  # drawn after the runs, without markers, when it was fitted
    assert_plot_shows(paths["loss_flops"], log_curves + frontier)


def test_the_lr_figure_says_so_when_the_lr_does_not_vary(tmp_path, sweep):
    same = study_report("sizes", grid(tmp_path, lrs=(1e-3,)), tmp_path / "out")
    assert "the learning rate is the same in every run" in " ".join(texts(same["loss_lr"]))
    assert plotted_points(same["loss_lr"]) == []
    swept = sweep
    assert "the learning rate is the same" not in " ".join(texts(swept["loss_lr"]))
    # each run one point (its final loss at its lr), in the runs' order; a grey line per size
    drawn = series_points(swept["loss_lr"], "loss_lr")
    assert list(drawn) == [f"{p}-lr{lr:g}" for p, lr in ORDER]
    pairs = [((math.log10(lr), loss(p, lr, 1000)), drawn[f"{p}-lr{lr:g}"][0]) for p, lr in ORDER]
    assert_affine([(want[0], got[0]) for want, got in pairs], "lr")
    assert_affine([(want[1], got[1]) for want, got in pairs], "final loss")


def test_a_run_name_with_markup_is_escaped(tmp_path):
    runs = grid(tmp_path)
    evil = "<script>alert(1)</script>&"
    runs[evil] = runs.pop("s-lr0.001")
    paths = study_report("<b>study</b>", runs, tmp_path / "out")
    page = Path(paths["study"]).read_text()
    assert "<script" not in page and "<b>study" not in page
    assert html.escape(evil) in page and "&lt;b&gt;study&lt;/b&gt;" in page
    assert evil in [row[0] for row in table_rows(page)]
    assert evil in [r["name"] for r in json.loads(Path(paths["fit_json"]).read_text())["runs"]]


def test_two_sizes_render_with_no_fit_and_its_reason(tmp_path):
    """L(N) needs three sizes: the page says "no fit:" and the fit's own reason, and every
    figure is still drawn."""
    paths = study_report("pair", grid(tmp_path, presets=("s", "m")), tmp_path / "out")
    reason = json.loads(Path(paths["fit_json"]).read_text())["power_law"]["error"]
    assert reason
    page = Path(paths["study"]).read_text()
    assert f"<p>{html.escape(f'no fit: {reason}')}</p>" in page  # in the text, not only fit.svg
    assert len(table_rows(page)) == 4 and page.count("<svg") == 4  # not the optimizers
    assert any(t.startswith("no fit:") for t in texts(paths["fit"]))


def test_the_fit_recovers_the_synthetic_power_law(sweep):
    """Fit-dependent: the L(N) points are each size's 1e-3 run (its best lr), and the fitted
    alpha is the synthetic one within 0.02; the formula is in fit.svg's legend."""
    paths = sweep
    fit = json.loads(Path(paths["fit_json"]).read_text())
    assert fit["size_points"]["runs"] == ["s-lr0.001", "m-lr0.001", "l-lr0.001"]
    assert f"learning rates at {TOKENS:,} tokens" in fit["size_points"]["rule"]
    assert abs(fit["power_law"]["alpha"] - ALPHA) < 0.02
    assert abs(fit["power_law"]["E"] - (E + B / TOKENS**BETA)) < 0.05  # the data term at D
    assert any(t.startswith("L(N) = ") for t in texts(paths["fit"]))
    page = Path(paths["study"]).read_text()
    assert "no fit:" not in page.split("L(N, D)")[0]  # L(N) fitted: its table is shown
    # a size study leads with its fits (the L(N) figure beside them); L(N, D), which one token
    # budget cannot fit, is one line at the end, not a heading with "no fit"
    heads = re.findall(r"<h2>(.*?)</h2>", page)
    assert heads == ["Scaling fits", "Runs", "Figures", "Not made for this study"], heads
    fits = page.split("<h2>Scaling fits</h2>", 1)[1].split("<h2>Runs</h2>")[0]
    assert "<svg" in fits and "L(N) = " in "".join(re.findall(r"<!-- (.*?) -->", fits))
    assert "no fit" not in page and "<h3>L(N, D)" not in page
    assert "<li>L(N, D), the fit with a data term: every run trained for the same tokens" in page


def test_compute_optimal_rows_for_the_default_budgets(sweep):
    """Fit-dependent: the frontier of the curves gives one compute-optimal row per default
    budget (1e19, 1e21, 1e23 FLOPs and the study's own total), at this study's FLOPs per
    parameter per token."""
    paths = sweep
    fit = json.loads(Path(paths["fit_json"]).read_text())
    total = sum(FLOPS_PER_PARAMETER_TOKEN * n * TOKENS for n in SIZES.values()) * 2
    assert math.isclose(fit["flops_per_parameter_token"], FLOPS_PER_PARAMETER_TOKEN)
    rows = [o for o in fit["compute_optimal"] if o["from"] == "frontier"]
    assert [o["flops"] for o in rows] == [1e19, 1e21, 1e23, total]
    largest = FLOPS_PER_PARAMETER_TOKEN * max(SIZES.values()) * TOKENS
    for o in rows:
        assert math.isclose(o["flops"], FLOPS_PER_PARAMETER_TOKEN * o["parameters"] * o["tokens"])
        assert math.isclose(o["beyond_largest_run"], o["flops"] / largest)  # extrapolation


def test_two_token_budgets_fit_the_data_term(tmp_path):
    """Fit-dependent: runs of 100 and 1000 steps are two token budgets, so L(N, D) is fitted
    (through every point: RMSE < 0.01; with two budgets E, B and beta are not separately
    identifiable, so only alpha is held to the law) and gives compute-optimal rows; L(N)
    takes the 1000-step runs, the largest budget every size has."""
    paths = study_report("budgets", grid(tmp_path, steps=(100, 1000)), tmp_path / "out")
    fit = json.loads(Path(paths["fit_json"]).read_text())
    assert fit["two_term"]["rmse"] < 0.01, fit["two_term"]
    assert abs(fit["two_term"]["alpha"] - ALPHA) < 0.02
    assert [o["from"] for o in fit["compute_optimal"]].count("two_term") == 4
    assert fit["size_points"]["runs"] == ["s-lr0.001-1000", "m-lr0.001-1000", "l-lr0.001-1000"]


def test_the_fits_take_the_best_lr_per_size_and_tokens_in_any_order(tmp_path):
    """3 sizes x 2 token budgets x 3 learning rates, the best lr a different one per size (the
    smallest lr at s, the middle at m, the largest at l; ties nowhere): L(N)'s points are each
    size's best run at the largest budget, L(N, D) is fitted to each (size, tokens)'s best loss
    (the numbers fit_two_term gives on those points alone), and the compute-optimal rows
    follow from it. _fits itself, given the runs in another order, gives the same points and
    the same L(N, D) (its points sorted: with two budgets the minimiser's answer depended on
    their order)."""
    from gptflow.results.scaling import fit_two_term

    lrs = (1e-3, 3e-3, 1e-2)
    best = {"s": 1e-3, "m": 3e-3, "l": 1e-2}
    penalty = {(p, lr): 0.0 if lr == best[p] else 0.05 + 0.02 * i
               for p in SIZES for i, lr in enumerate(lrs)}  # fmt: skip
    runs = {
        f"{p}-lr{lr:g}-{t}": write_run(tmp_path / "runs", f"{p}-lr{lr:g}-{t}", p, lr, steps=t,
                                       penalty=penalty)
        for p in SIZES for lr in lrs for t in (100, 1000)
    }  # fmt: skip
    shuffled = random.Random(3).sample(list(runs), len(runs))
    paths = study_report("lrs", {n: runs[n] for n in shuffled}, tmp_path / "out")
    fit = json.loads(Path(paths["fit_json"]).read_text())
    assert fit["size_points"]["runs"] == [f"{p}-lr{best[p]:g}-1000" for p in SIZES]
    points = [(SIZES[p], t * PER_STEP, loss(p, best[p], t, penalty))
              for p in SIZES for t in (100, 1000)]  # fmt: skip
    want = fit_two_term(*zip(*points, strict=True))
    numbers = {k: v for k, v in want.to_json().items() if isinstance(v, float)}
    assert {k: fit["two_term"][k] for k in numbers} == pytest.approx(numbers, rel=1e-9, abs=1e-12)
    optimal = [o for o in fit["compute_optimal"] if o["from"] == "two_term"]
    k = fit["flops_per_parameter_token"]
    assert [o["parameters"] for o in optimal] == pytest.approx(
        [want.compute_optimal(o["flops"], flops_per_param_token=k)["parameters"] for o in optimal]
    )
    # the fits themselves (study_report sorts the runs first) over the runs in any order
    loaded = [_load_run(name, files) for name, files in runs.items()]
    for order in (loaded[::-1], random.Random(4).sample(loaded, len(loaded))):
        again = _fits(order, [1e21])
        assert again["points"] == fit["size_points"]["runs"]
        refit = again["two_term"][0].to_json()
        assert {k: refit[k] for k in numbers} == pytest.approx(numbers, rel=1e-9, abs=1e-12)


def test_each_runs_harness_metrics_are_tabled_and_in_fit_json(tmp_path):
    """With eval.harness, each run's harness.json: a 'Downstream evaluation' table (one column
    per task metric, value ± stderr, '—' where a run lacks a task) and the tasks in fit.json."""
    runs = grid(tmp_path, presets=("s", "m"), lrs=(1e-3,))
    for i, files in enumerate(runs.values()):
        tasks = {"mc": {"version": 1.0, "num_fewshot": 0, "metrics": {
            "acc": 0.25 + i / 4, "acc_stderr": 0.125, "word_perplexity": 7.0,
            "word_perplexity_stderr": None}}}  # fmt: skip
        if i == 0:
            tasks["<i>ppl</i>"] = {"version": 1.0, "num_fewshot": 0,
                                   "metrics": {"bits_per_byte": 3.5}}  # fmt: skip
        path = Path(files["done"]).with_name("harness.json")
        path.write_text(json.dumps({"tasks": tasks}))
        files["harness"] = str(path)
    paths = study_report("evals", runs, tmp_path / "out")
    page = Path(paths["study"]).read_text()
    section = page.split("<h2>Downstream evaluation</h2>", 1)[1]
    assert "<th>mc acc</th><th>mc word_perplexity</th><th>&lt;i&gt;ppl&lt;/i&gt; bits_per_byte" in (
        section
    )
    rows = table_rows(section)
    assert rows == [["s-lr0.001", "1,000,000", "0.5 ± 0.12", "7", "—"],
                    ["m-lr0.001", "4,000,000", "0.25 ± 0.12", "7", "3.5"]], rows  # fmt: skip
    fit = json.loads(Path(paths["fit_json"]).read_text())
    assert {r["name"]: r["harness"]["mc"]["metrics"]["acc"] for r in fit["runs"]} == {
        "s-lr0.001": 0.5, "m-lr0.001": 0.25,
    }  # fmt: skip
    assert "<h2>Downstream evaluation</h2>" not in Path(study_report(
        "none", grid(tmp_path / "b", presets=("s", "m"), lrs=(1e-3,)), tmp_path / "o2"
    )["study"]).read_text()  # fmt: skip


def test_each_optimizers_tuned_run_and_the_tokens_to_adamws_final_loss(tmp_path):
    """AdamW and Muon x 2 sizes x 2 lrs, Muon's loss after s steps AdamW's after 1.6 s: per size
    each optimizer's best lr is taken, and Muon reaches AdamW's final loss at 1000 / 1.6 = 625
    steps (0.625 x AdamW's tokens; between evaluations linear, so to ~1 %); the page tables it
    and the figure draws each size's two tuned curves."""
    runs = {
        f"{p}-{o}-lr{lr:g}": write_run(tmp_path / "runs", f"{p}-{o}-lr{lr:g}", p, lr,
                                       optimizer=o, speedup=1.6 if o == "muon" else 1.0)
        for p in ("s", "m") for o in ("adamw", "muon") for lr in (1e-3, 3e-3)
    }  # fmt: skip
    paths = study_report("opt", runs, tmp_path / "out")
    rows = json.loads(Path(paths["fit_json"]).read_text())["optimizers"]
    assert [(r["preset"], r["optimizer"], r["lr"]) for r in rows] == [
        ("s", "adamw", 1e-3),
        ("s", "muon", 1e-3),
        ("m", "adamw", 1e-3),
        ("m", "muon", 1e-3),
    ]
    for r in rows:
        want = 1.0 if r["optimizer"] == "adamw" else 1 / 1.6
        assert r["ratio"] == pytest.approx(want, rel=0.02), r
    page = Path(paths["study"]).read_text()
    assert "<h2>Optimizers</h2>" in page and page.count("<svg") == 5
    steps = range(EVAL_INTERVAL, 1001, EVAL_INTERVAL)
    curves = [[(math.log10(s * PER_STEP), loss(p, 1e-3, s * k)) for s in steps]
              for p in ("s", "m") for k in (1.0, 1.6)]  # fmt: skip
    assert_plot_shows(paths["optimizers"], curves)


RECIPES = {"raw": None, "exact": {"web": "exact"}, "clean": {"web": "exact + minhash"}}
OFFSETS = {"raw": 0.05, "exact": 0.0, "clean": 0.3}  # exact lowest, clean 0.3 above it
KEPT = {"raw": (12, 12), "exact": (12, 9), "clean": (12, 3)}  # documents: collected, kept


def quality_summary_file(root: Path) -> Path:
    """data-quality.json of the three recipes, from hand-made manifests (gptflow's own
    summary: the study page's funnel must be the manifests' numbers): exact removes 3 of 12
    documents of web's two shards, minhash 6 of the 9 left; bytes are 10 a document."""
    from gptflow.results.quality_report import quality_summary

    def manifest(step, shard, n_in, n_out, reason):
        m = {"step": step, "dataset": "web", "shard": shard, "documents_in": n_in,
             "documents_out": n_out, "bytes_in": 10 * n_in, "bytes_out": 10 * n_out,
             "removed": {reason: n_in - n_out}, "examples": {reason: ["gone"]}}  # fmt: skip
        path = root / f"{step}-{shard}.manifest.json"
        path.write_text(json.dumps(m))
        return path

    manifests = [manifest("01-exact-a", "00000", 7, 5, "exact"),
                 manifest("01-exact-a", "00001", 5, 4, "exact"),
                 manifest("02-minhash-b", "00000", 5, 1, "minhash"),
                 manifest("02-minhash-b", "00001", 4, 2, "minhash")]  # fmt: skip
    exact = {"name": "01-exact-a", "kind": "exact", "describe": "exact"}
    minhash = {"name": "02-minhash-b", "kind": "minhash", "describe": "minhash"}
    recipes = [{"label": "study runs raw", "runs": ["raw"], "datasets": {"web": []}},
               {"label": "study runs exact", "runs": ["exact"], "datasets": {"web": [exact]}},
               {"label": "study runs clean", "runs": ["clean"],
                "datasets": {"web": [exact, minhash]}}]  # fmt: skip
    path = root / "data-quality.json"
    path.write_text(json.dumps({"recipes": quality_summary(recipes, manifests)}))
    return path


def ablation_runs(root: Path, seeds: dict[str, int] | None = None) -> dict[str, dict]:
    """The three recipes' runs (one size, lr and budget), listed raw, exact, clean; `seeds`:
    more runs, each repeating the named run's recipe with another train.seed and a loss 0.02
    higher per seed step."""
    runs = {}
    for name, base, seed in [(n, n, 1234) for n in RECIPES] + [
        (f"{b}-s{k}", b, k) for b, k in (seeds or {}).items()
    ]:
        files = write_run(root / "runs", name, "s", 1e-3,
                          offset=OFFSETS[base] + 0.02 * (seed != 1234))  # fmt: skip
        run = yaml.safe_load(Path(files["config"]).read_text())
        run["train"]["seed"] = seed
        run["derived"]["data_tokens"] = 100 * KEPT[base][1]
        run["derived"]["epochs"] = TOKENS / (100 * KEPT[base][1])
        if RECIPES[base]:
            run["derived"]["data_quality"] = RECIPES[base]
        Path(files["config"]).write_text(yaml.safe_dump(run))
        runs[name] = files
    return runs


def test_a_data_ablation_leads_with_its_recipes_and_says_the_rest_in_one_line(tmp_path):
    """Runs whose derived.data_quality differ (a data ablation) at one size and lr: the page
    leads with the recipes (after its one-paragraph intro): the answer (the lowest final loss
    and each other run's difference from it), the table in the page's order (as listed: raw,
    exact, clean) with the documents each recipe kept (the manifests' numbers), the tokens and
    epochs, the loss, its difference from the lowest; the noise said not measured; each
    recipe's funnel; then the loss curves. The fits, the lr and FLOPs figures and the
    optimizers are one line each under "Not made for this study", not sections."""
    out = tmp_path / "results/studies/abl"
    quality = quality_summary_file(tmp_path)
    page_path = tmp_path / "results/quality/report/data-quality.html"
    paths = study_report("abl", ablation_runs(tmp_path), out, quality=quality,
                         quality_page=page_path)  # fmt: skip
    page = Path(paths["study"]).read_text()
    heads = re.findall(r"<h2>(.*?)</h2>", page)
    assert heads == ["Data ablation: which recipe gives the lowest loss on the same held-out text",
                     "Runs", "Not made for this study"]  # fmt: skip
    assert "<h3>" not in page and "no fit" not in page and "Not swept" not in page
    not_made = re.findall(r"<li>(.*?):", page.split("Not made for this study")[1])
    assert not_made == ["Scaling fits (L(N), L(N, D), the compute frontier, compute-optimal sizes)",
                        "Loss against training FLOPs", "Loss against learning rate",
                        "Optimizers", "Downstream evaluation"]  # fmt: skip
    # the link resolves from the page's own directory
    href = re.search(r"<a href='([^']+)'>the data-quality page</a>", page)[1]
    assert href == "../../quality/report/data-quality.html"
    assert (out / href).resolve() == page_path.resolve()

    section = page.split("<h2>Data ablation", 1)[1].split("<h2>Runs</h2>")[0]
    final = {n: law(SIZES["s"]) + B / TOKENS**BETA + OFFSETS[n] for n in RECIPES}
    answer = html.unescape(
        re.sub(r"<[^>]+>", "", section.split("<p class='answer'>")[1].split("</p>")[0])
    )
    assert answer == (
        f"Lowest final validation loss on the shared held-out text: ■ exact (exact), "
        f"{final['exact']:.4f}; then ● raw +0.0500, ▲ clean +0.3000 (run-to-run noise not "
        "measured: see below)."
    )
    rows = table_rows(section)
    assert [r[:9] for r in rows] == [
        [n, "raw" if n == "raw" else RECIPES[n]["web"],
         f"{KEPT[n][1]:,} of {KEPT[n][0]:,} ({KEPT[n][1] / KEPT[n][0]:.1%})",
         f"{100 * KEPT[n][1]:,}", f"{TOKENS:,}", f"{TOKENS / (100 * KEPT[n][1]):.4g}",
         f"{final[n]:.4f}", "lowest" if n == "exact" else f"+{final[n] - final['exact']:.4f}",
         "final_val_loss"]
        for n in RECIPES
    ]  # fmt: skip
    assert "Run-to-run noise is not measured: no two runs differ only in train.seed" in section
    # one colour and marker per run, the same in the table, the loss figure and the funnel
    shown = marks(section)
    assert len(set(shown)) == 3 and len({c for c, _ in shown}) == 3
    colours = series_colours(paths["loss_tokens"], "loss_tokens")
    assert list(colours) == list(RECIPES)  # the figure's order is the table's
    assert [colours[n] for n in RECIPES] == [c for c, _ in shown]
    assert "<svg" in section.split("<table")[1]  # the funnel and the curves under the table
    fit = json.loads(Path(paths["fit_json"]).read_text())
    assert fit["varies"] == ["recipe"] and fit["noise"] == {"sigma": None, "groups": []}


def test_the_ablation_funnel_is_each_recipes_manifest_counts(tmp_path):
    """The study page's funnel: each recipe's documents and bytes collected and after each
    step, as the manifests count them (12 -> 9 -> 3 documents, 10 bytes each), drawn in its
    run's colour, the raw recipe flat at the collected 12."""
    from gptflow.results.figures import series_styles

    quality = quality_summary_file(tmp_path)
    paths = study_report("abl", ablation_runs(tmp_path), tmp_path / "out", quality=quality)
    page = Path(paths["study"]).read_text()
    svg = page[page.index("<svg", page.index("<h2>Data ablation")) :]
    svg = svg[: svg.index("</svg>") + 6]
    (tmp_path / "funnel.svg").write_text(svg)
    root = ET.parse(tmp_path / "funnel.svg").getroot()
    styles = series_styles(list(RECIPES))
    want = {"raw": [12], "exact": [12, 9], "clean": [12, 9, 3]}
    for key, scale in (("documents", 1), ("bytes", 10 / (1 << 20))):
        axes = root.find(f".//{SVG}g[@id='axes_{1 if key == 'documents' else 2}']")
        groups = {g.get("id").split(":", 1)[1]: g for g in axes.findall(f"{SVG}g")
                  if g.get("id", "").startswith(f"study-funnel-{key}:")}  # fmt: skip
        assert list(groups) == list(RECIPES)
        pairs = []
        width = 0.8 / len(RECIPES)  # the recipes' bars side by side at each step
        for j, (name, g) in enumerate(groups.items()):
            points = [(float(u.get("x")), float(u.get("y"))) for u in g.iter(f"{SVG}use")]
            assert len(points) == len(want[name]), (key, name, points)
            x = [i - 0.4 + width * (j + 0.5) for i in range(len(points))]
            pairs += [
                ((x[i], n * scale), p)
                for i, (n, p) in enumerate(zip(want[name], points, strict=True))
            ]
            assert styles[name].color in "".join(e.get("style", "") for e in g.iter()), name
        assert_affine([(w[0], p[0]) for w, p in pairs], f"{key} x")
        assert_affine([(w[1], p[1]) for w, p in pairs], f"{key} y")


def test_seeds_measure_the_noise_and_the_differences_are_read_against_it(tmp_path):
    """Runs repeating a recipe with another train.seed measure run-to-run noise: the pooled
    standard deviation of the final loss within each recipe's seeds, which the page states
    and the table divides each difference by."""
    runs = ablation_runs(tmp_path, seeds={"exact": 7, "clean": 7})
    paths = study_report("abl", runs, tmp_path / "out")
    fit = json.loads(Path(paths["fit_json"]).read_text())
    final = {n: law(SIZES["s"]) + B / TOKENS**BETA + OFFSETS[n] for n in RECIPES}
    # two groups of two runs 0.02 apart: each variance 0.0002, pooled over 2 degrees of freedom
    sigma = statistics.stdev([final["exact"], final["exact"] + 0.02])
    assert fit["noise"]["sigma"] == pytest.approx(sigma)
    assert fit["noise"]["groups"] == [["exact", "exact-s7"], ["clean", "clean-s7"]]
    page = Path(paths["study"]).read_text()
    assert f"Run-to-run noise: σ = {sigma:.3g}, the pooled standard deviation" in page
    rows = {r[0]: r for r in table_rows(page, after="<h2>Data ablation")}
    assert rows["clean"][8] == f"{0.3 / sigma:.1f}σ" and rows["exact"][8] == "0.0σ"
    assert len(set(marks(page.split("<h2>Data ablation", 1)[1]))) == 5
