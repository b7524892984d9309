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
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from gptflow.results.study_report import (
    RUN_KEYS,
    _ablation_table,
    _fits,
    _load_run,
    study_report,
)
from tests.unit.results.test_report import assert_plot_shows, plotted_points, texts

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
              speedup: float = 1.0) -> dict[str, str]:  # fmt: skip
    """run.yaml, metrics.jsonl (an evaluation every EVAL_INTERVAL steps from 0 of series "s1",
    after the records of a stale series "old" whose losses are 0.5) and DONE.json. `optimizer`:
    train.optimizer (absent by default, as in runs from before it); `speedup`: its loss after
    s steps is the law's after speedup x s."""

    plain = functools.partial(globals()["loss"], penalty=penalty)

    def loss(preset, lr, step):
        return plain(preset, lr, step * speedup)

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


def table_rows(page: str) -> list[list[str]]:
    """The cells of the first table's body rows (the runs table), unescaped."""
    body = page.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [
        [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", body)
    ]


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
        [f"{p}-lr{lr:g}", p, f"{SIZES[p]:,}", f"{lr:g}", f"{TOKENS:,}",
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
    assert page.count("<svg") == 5 and "<?xml" not in page
    assert fit["optimizers"] == [] and "<h2>Optimizers</h2>" not in page  # AdamW alone
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
    lines = [[(math.log10(lr), loss(p, lr, 1000)) for lr in (1e-3, 3e-3)] for p in "sml"]
    assert_plot_shows(swept["loss_lr"], lines)  # one line per size: final loss against lr


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
    assert len(table_rows(page)) == 4 and page.count("<svg") == 5
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
    assert "Downstream evaluation" not in Path(study_report(
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


def test_a_data_ablation_is_tabled_per_recipe(tmp_path):
    """Runs whose run.yaml derived.data_quality differ (a data ablation): a 'Data ablation'
    table, best final loss first, with each recipe, its training data's tokens, the tokens
    trained, the loss and the harness scores; the recipe in fit.json's runs. Alike recipes: no
    table. (The page's assembly is the other tests'; this one reads the runs and tables them.)"""
    runs = grid(tmp_path, presets=("s", "m"), lrs=(1e-3,))
    recipes = {"s-lr0.001": None, "m-lr0.001": {"web": "exact + minhash", "books": "exact"}}
    for i, (name, files) in enumerate(runs.items()):
        run = yaml.safe_load(Path(files["config"]).read_text())
        run["derived"]["data_tokens"] = 1000 * (i + 1)
        if recipes[name]:
            run["derived"]["data_quality"] = recipes[name]
        Path(files["config"]).write_text(yaml.safe_dump(run))
        path = Path(files["done"]).with_name("harness.json")
        path.write_text(json.dumps({"tasks": {"mc": {"version": 1.0, "num_fewshot": 0,
                                                     "metrics": {"acc": 0.5 - i / 4}}}}))  # fmt: skip
        files["harness"] = str(path)
    loaded = [_load_run(name, files) for name, files in runs.items()]
    section = "".join(_ablation_table(loaded))
    assert section.startswith("<h2>Data ablation</h2>")
    m, s = law(SIZES["m"]) + B / TOKENS**BETA, law(SIZES["s"]) + B / TOKENS**BETA
    assert table_rows(section) == [
        ["m-lr0.001", "books: exact; web: exact + minhash", "1000", f"{TOKENS:,}", f"{m:.4f}",
         "final_val_loss", "0.5"],
        ["s-lr0.001", "raw", "2000", f"{TOKENS:,}", f"{s:.4f}", "final_val_loss", "0.25"],
    ]  # fmt: skip
    assert {"recipe", "data_tokens"} <= set(RUN_KEYS)  # fit.json's runs
    for r in loaded:
        r["recipe"] = None
    assert _ablation_table(loaded) == []
