"""A study through Snakemake on the tiny config: 3 model sizes x 2 learning rates from one
command, the data stage and the data index built once for all six runs, one run edited and
killed mid-training and rerun alone, and the study's comparison (its page and the report) in
a real browser.

The study runs once per module (`study`); a test that changes anything works on a copy."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, headless, job_counts, snakemake_cmd

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
    return {r: (wd / f"results/runs/{r}/DONE.json").stat().st_mtime_ns for r in RUNS}


def test_one_command_trains_every_run_on_data_built_once(study):
    wd, _, plan, run = study
    once = {"collect_local_documents": 2, "sample_documents": 1, "train_tokenizer": 1,
            "tokenize_shard": 2, "build_data_index": 1}  # fmt: skip
    per_run = {"render_run_config": 6, "train_gpt": 6}
    assert job_counts(run.out) == {**once, **per_run, "study_report": 1, "study": 1}
    # the plan lists every run with its size and batch split, and the study's total
    assert "gptflow study: 6 run(s), 0 trained; 1 data index(es) shared by them" in plan.out
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
    """Editing one run's lr plans that run (and the comparison) only; its training, killed
    with SIGKILL after a checkpoint, resumes from it on the rerun, and the five finished runs
    are not touched."""
    wd = tmp_path / "wd"
    shutil.copytree(study[0], wd, symlinks=True, ignore=shutil.ignore_patterns("locks"))
    before = done_mtimes(wd)
    cfg = study_config()
    edited = "small-lr0.003"
    cfg["study"]["runs"][edited]["train"].update(lr=2.0e-3, train_iters=120, save_interval=5)
    config = write_config(wd / "config.yaml", cfg)
    plan = snakemake(wd, config, "-n", "study")
    assert job_counts(plan.out) == {"render_run_config": 1, "train_gpt": 1, "study_report": 1,
                                    "study": 1}, plan.out[-3000:]  # fmt: skip
    assert f"wildcards: run={edited}" in plan.out

    run_dir = wd / "results/runs" / edited
    proc = subprocess.Popen(snakemake_cmd(wd, config, "study"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        killed_at = None
        deadline = time.time() + 300
        while time.time() < deadline and killed_at is None:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            for latest in run_dir.glob("checkpoints/*/latest"):
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

    rerun = snakemake(wd, config, "study")
    assert rerun.returncode == 0, rerun.out[-3000:]
    assert job_counts(rerun.out) == {"train_gpt": 1, "study_report": 1, "study": 1}
    log = (wd / f"logs/train_gpt/{edited}.log").read_text()
    assert int(log.split("resuming from step ")[-1].split(";")[0]) >= killed_at
    assert json.loads((run_dir / "DONE.json").read_text())["final_step"] == 120
    after = done_mtimes(wd)
    assert {r: t for r, t in after.items() if r != edited} == {
        r: t for r, t in before.items() if r != edited
    }, "a finished run was touched"
