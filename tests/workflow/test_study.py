"""A study through Snakemake on the tiny config: 3 model sizes x 2 learning rates from one
command, the data stage and the data index built once for all six runs, one run edited and
killed mid-training and rerun alone, and the study's comparison (its page and the report) in
a real browser.

The study runs once per module (`study`); a test that changes anything works on a copy."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import BIN, REPO, headless, job_counts, snakemake_cmd

SIZES = ("tiny", "small", "pythia-14m")
LRS = (1.0e-3, 3.0e-3)
RUNS = [f"{size}-lr{lr:g}" for size in SIZES for lr in LRS]


def study_config() -> dict:
    """The tiny config as a study of six named runs (what study.grid would expand to; named,
    so that one run's lr can be edited alone), 16 steps each."""
    cfg = yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())
    cfg["run"] = "sweep"
    cfg["train"].update(train_iters=16, log_interval=4, eval_interval=8, save_interval=8)
    cfg["study"] = {
        "runs": {
            f"{size}-lr{lr:g}": {"model": {"preset": size}, "train": {"lr": lr}}
            for size in SIZES
            for lr in LRS
        }
    }
    return cfg


@pytest.fixture(scope="module")
def study(tmp_path_factory, snakemake, write_config):
    """The six runs and the study report, from one `snakemake study` in a fresh directory."""
    wd = tmp_path_factory.mktemp("study")
    config = write_config(wd / "config.yaml", study_config())
    plan = snakemake(wd, config, "-n", "study")
    run = snakemake(wd, config, "study")
    assert run.returncode == 0, run.out[-5000:]
    return wd, config, plan, run


def done_mtimes(wd: Path) -> dict[str, int]:
    """Each run's DONE.json mtime (a run retraining has none: Snakemake removed it)."""
    files = {r: wd / f"results/runs/{r}/DONE.json" for r in RUNS}
    return {r: f.stat().st_mtime_ns for r, f in files.items() if f.is_file()}


def test_one_command_trains_every_run_on_data_built_once(study):
    wd, _, plan, run = study
    once = {"collect_local_documents": 2, "sample_documents": 1, "train_tokenizer": 1,
            "tokenize_shard": 2, "build_data_index": 1}  # fmt: skip
    per_run = {"render_run_config": 6, "train_gpt": 6}
    assert job_counts(run.out) == {**once, **per_run, "study_report": 1, "study": 1}
    # the plan lists every run with its size and batch split, and the study's total
    assert (
        "gptflow study: 6 run(s), 0 finished (a DONE.json; one whose settings changed trains again); 1 data index(es) shared by them"
        in plan.out
    )
    for name in RUNS:
        assert f"  {name} " in plan.out, name
    indices = set()
    for name, size, lr in [(f"{s}-lr{lr:g}", s, lr) for s in SIZES for lr in LRS]:
        cfg = yaml.safe_load((wd / f"results/runs/{name}/run.yaml").read_text())
        assert (cfg["derived"]["preset"], cfg["train"]["lr"], cfg["study"]) == (size, lr, "sweep")
        indices.add(cfg["data_index"])
        done = json.loads((wd / f"results/runs/{name}/DONE.json").read_text())
        assert done["final_step"] == 16 and done["final_val_loss"] < done["initial_val_loss"]
    assert len(indices) == 1 and (wd / indices.pop()).is_file()


def test_status_and_summary_list_the_study_together(study):
    wd = study[0]
    gptflow = str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "gptflow")
    gptflow = gptflow if Path(gptflow).exists() else shutil.which("gptflow")
    status = subprocess.run([gptflow, "status"], cwd=wd, capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == "study sweep: 6 run(s): 6 finished", lines[:3]
    assert sum(line.startswith("  run ") for line in lines) == 6
    summary = subprocess.run([gptflow, "summary"], cwd=wd, capture_output=True, text=True)
    assert summary.returncode == 0, summary.stderr
    assert summary.stdout.startswith("study sweep: 6 finished run(s); final validation loss: ")
    assert "results/studies/sweep/study.html" in summary.stdout


def test_an_edited_run_reruns_alone_and_a_killed_run_resumes(study, tmp_path, snakemake,
                                                              write_config):  # fmt: skip
    """Editing one run's lr plans that run (and the comparison) only; made longer too (its
    own data index: more samples), its training, killed with SIGKILL after a checkpoint,
    resumes from it on the rerun (taking over the dead trainer's lock, one trajectory in
    metrics.jsonl); another edited run trains in the same invocation although the first
    failed (keep-going), and the four others are not touched."""
    wd = tmp_path / "wd"
    shutil.copytree(study[0], wd, symlinks=True, ignore=shutil.ignore_patterns("locks"))
    before = done_mtimes(wd)
    cfg = study_config()
    edited = "small-lr0.003"
    cfg["study"]["runs"][edited]["train"]["lr"] = 2.0e-3
    why = subprocess.run(
        [str(BIN / "gptflow"), "why", "--directory", str(wd), "--json", str(tmp_path / "w.json"),
         "--", "study", "--snakefile", str(REPO / "Snakefile"),
         "--profile", str(REPO / "profiles/local"),
         "--configfile", str(write_config(wd / "lr.yaml", cfg))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert why.returncode == 0, why.stderr[-3000:]
    result = json.loads((tmp_path / "w.json").read_text())
    jobs = {(j["rule"], j["outputs"][0]): j for j in result["jobs"]}
    assert sorted(r for r, _ in jobs) == ["render_run_config", "study_report", "train_gpt"]
    key = [f"runs.{edited}.train.lr", 0.003, 0.002]
    assert jobs["train_gpt", f"results/runs/{edited}/DONE.json"]["keys"] == [key], why.stdout
    # the plan's study lines: every run (all six have a DONE.json)
    assert "study: 6 run(s), 6 finished" in why.stdout, why.stdout  # why drops "gptflow "
    assert f"config {key[0]}: 0.003 -> 0.002" in why.stdout

    # longer than the 16 steps it had: 30 steps after the kill at >= 10 (0.1-0.3 s a step)
    cfg["study"]["runs"][edited]["train"].update(train_iters=40, save_interval=5)
    other = "tiny-lr0.001"  # edited too: it trains in the same invocation, killed run or not
    cfg["study"]["runs"][other]["train"]["lr"] = 2.0e-3
    config = write_config(wd / "config.yaml", cfg)

    run_dir = wd / "results/runs" / edited
    old_series = {p.name for p in (run_dir / "checkpoints").iterdir()}  # of the 16-step run
    proc = subprocess.Popen(snakemake_cmd(wd, config, "study"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        killed_at = None
        deadline = time.time() + 300
        while time.time() < deadline and killed_at is None:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            for latest in run_dir.glob("checkpoints/*/latest"):
                if latest.parent.name in old_series:
                    continue
                step = int(latest.read_text()[4:])
                if step >= 10:
                    trainer = json.loads((run_dir / "train.lock").read_text())["pid"]
                    os.kill(trainer, signal.SIGKILL)
                    killed_at = step
            time.sleep(0.2)
        assert killed_at is not None, "no checkpoint at step 10 or later within 300 s"
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "Error in rule train_gpt" in out
    # keep-going (the profile's): the failed run did not stop the other one
    assert done_mtimes(wd).get(other, before[other]) != before[other], out[-3000:]

    rerun = snakemake(wd, config, "study")
    assert rerun.returncode == 0, rerun.out[-3000:]
    assert job_counts(rerun.out) == {"train_gpt": 1, "study_report": 1, "study": 1}
    log = (wd / f"logs/train_gpt/{edited}.log").read_text()
    assert int(log.split("resuming from step ")[-1].split(";")[0]) >= killed_at
    assert f"took over a stale lock: process {trainer}" in log
    assert json.loads((run_dir / "DONE.json").read_text())["final_step"] == 40
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == list(range(4, 44, 4)), "metrics.jsonl must hold one trajectory"
    after = done_mtimes(wd)
    assert {r: t for r, t in after.items() if r not in (edited, other)} == {
        r: t for r, t in before.items() if r not in (edited, other)
    }, "a finished run was touched"


def test_the_comparison_holds_the_real_losses_and_the_report_shows_it(
    study, snakemake, chromium, tmp_path
):
    """fit.json's runs are the runs' own final losses; L(N) is fitted on the three sizes (the
    best of the two lrs each) and predicts those points within its own stated error; the page
    and `snakemake --report` render in a real browser."""
    wd, config, _, _ = study
    out = wd / "results/studies/sweep"
    fit = json.loads((out / "fit.json").read_text())
    by_name = {r["name"]: r for r in fit["runs"]}
    assert sorted(by_name) == sorted(RUNS)
    best = {}
    for name in RUNS:
        done = json.loads((wd / f"results/runs/{name}/DONE.json").read_text())
        cfg = yaml.safe_load((wd / f"results/runs/{name}/run.yaml").read_text())
        r = by_name[name]
        assert r["final_val_loss"] == done["final_val_loss"], name
        assert r["parameters"] == cfg["derived"]["parameters"], name
        n = r["parameters"]
        best[n] = min(best.get(n, float("inf")), r["final_val_loss"])
    law = fit["power_law"]
    assert law["points"] == 3, law
    for n, loss in best.items():
        predicted = law["E"] + law["A"] / n ** law["alpha"]
        assert abs(predicted - loss) <= law["rmse"] * 3**0.5 + 1e-9, (n, loss, predicted)

    page = headless(chromium, out / "study.html", "--dump-dom")
    for want in ("Study sweep", *RUNS, "L(N) = E + A / N"):
        assert want in page, want
    assert page.count("<svg") >= 4  # the four figures, inline
    assert_each_run_has_its_own_colour(page, ("loss_tokens", "loss_flops", "loss_lr", "fit"))
    assert "no fit" not in page and "<h2>Data ablation" not in page  # a size study: its fits
    assert page.index("<h2>Scaling fits</h2>") < page.index("<h2>Runs</h2>")
    for href in re.findall(r"<a href=\"([^\"#]+)\"", page):  # every link resolves
        assert (out / href).is_file(), href
    report = tmp_path / "report.html"
    made = snakemake(wd, config, "--report", str(report), "study")
    assert made.returncode == 0, made.out[-3000:]
    dom = headless(chromium, report, "--dump-dom")
    assert "Snakemake Report" in dom and "Study" in dom


def assert_each_run_has_its_own_colour(page: str, figures: tuple[str, ...]) -> None:
    """As a browser has the study page: in each figure every run's series (its group
    FIGURE:RUN) is drawn in a colour no other run has, the same in every figure, and the runs
    table leads each run with its mark in that colour, in the table's order."""
    marks = re.findall(r'<span class="mark" style="color:(#[0-9a-f]{6})" title="(.*?) in the', page)
    table = dict((name, colour) for colour, name in marks)
    assert sorted(table) == sorted(RUNS) and len(set(table.values())) == len(RUNS), marks
    for figure in figures:
        drawn = {}
        for name in RUNS:
            group = re.search(rf'<g id="{figure}:{re.escape(name)}">(.*?)</g>', page, re.S)
            assert group, (figure, name)
            drawn[name] = re.search(r"stroke: ?(#[0-9a-f]{6})", group[1])[1]
        assert drawn == table, (figure, drawn, table)


def test_the_pythia_suite_plans_through_the_shipped_slurm_profile(tmp_path):
    """config/examples/studies/pythia-suite.yaml after its data recipe, planned with
    profiles/slurm as shipped but for nodes: 8 (what the example says to set), on a PATH
    without Slurm: the eight sizes fit an 80 GB GPU at their layouts and batch splits, and
    the plan lists each with the suite's total GPU-hours (no GPU or cluster here: a plan)."""
    from tests.support.noslurm import path_without_slurm

    profile = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    profile["set-resources"]["train_gpt"]["nodes"] = 8
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile/config.yaml").write_text(yaml.safe_dump(profile))
    examples = REPO / "config/examples"
    cmd = [
        str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(tmp_path), "--profile", str(tmp_path / "profile"),
        "--configfile", str(examples / "neox-pile-enwik8.yaml"),
        str(examples / "studies/pythia-suite.yaml"), "--replace-workflow-config", "-n", "study",
    ]  # fmt: skip
    env = {**os.environ, "PATH": path_without_slurm(tmp_path / "bin")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("gptflow study: "))
    assert lines[head].startswith("gptflow study: 8 run(s), 0 finished")
    rows = {line.split()[0]: line for line in lines[head + 2 : head + 10]}
    sizes = ["70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b"]
    assert list(rows) == [f"pythia-{s}" for s in sizes]
    assert "8 x 8 x 16" in rows["pythia-12b"] and "16 x 1 x 64" in rows["pythia-70m"]
    assert all(line.endswith("to train") and "GiB of 80.0 GiB" in line for line in rows.values())
    assert job_counts(out.stdout)["train_gpt"] == 8
