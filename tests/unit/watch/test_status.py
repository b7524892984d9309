"""`gptflow status` and `gptflow summary`: a run's stage, progress and outputs from its files,
while a real trainer appends to them, after it stops, and when it never started.

Every `gptflow` here runs with a fake `squeue` first on PATH (a script printing a fixed queue,
or failing as one does without a controller): Slurm itself is not what these tests check, and
a real squeue on the machine would make the output depend on its queue."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gptflow.errors import GptflowError
from gptflow.progress import human_bytes
from gptflow.watch.status import RunFiles, eta_seconds, read_records, seconds_per_step, stage
from tests.unit.train.test_train import BIN, gptflow_train, records, wait_for


def fake_squeue(directory: Path, stdout: str = "", exit_code: int = 0, stderr: str = "") -> dict:
    """An environment whose `squeue` prints `stdout` (and `stderr`) and exits `exit_code`."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "squeue"
    script.write_text(
        f"#!/bin/sh\nprintf '%s' '{stdout}'\nprintf '%s' '{stderr}' >&2\nexit {exit_code}\n"
    )
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


def gptflow(*args: str, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "gptflow"), *args], capture_output=True, text=True, env=env, cwd=cwd,
        timeout=120,
    )  # fmt: skip


def status_json(runs_dir: Path, *runs: str, env: dict) -> dict:
    out = gptflow("status", "--runs-dir", str(runs_dir), "--json", *runs, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_while_a_run_trains_and_after_it_stops(make_run, tmp_path):
    """A real trainer appending to metrics.jsonl: status says training, running, step of
    total, its last loss and validation loss, tokens/s, MFU n/a (CPU), an ETA from the
    records' times, and the lock's live pid. After SIGUSR1 it has saved and exited 75: no
    live trainer, so "stopped N s ago", no ETA."""
    env = fake_squeue(tmp_path / "bin")
    run_dir = make_run("live", train_iters=2000, log_interval=2, eval_interval=10, eval_iters=1,
                       save_interval=5000)  # fmt: skip
    log = tmp_path / "live.log"
    cmd = [str(BIN / "gptflow"), "train", "--config", str(run_dir / "run.yaml"), "--threads", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    try:
        wait_for(lambda: len(records(run_dir, "eval")) >= 3, proc, log, timeout=180, poll=0.05)
        (live,) = status_json(tmp_path, "live", env=env)["runs"]
        text = gptflow("status", "--runs-dir", str(tmp_path), "live", env=env)
        seen = records(run_dir, "train")
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=120) == 75, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()

    assert (live["stage"], live["state"], live["total"]) == ("training", "running", 2000)
    assert live["trainer"]["pid"] == proc.pid
    assert live["step"] in [r["step"] for r in seen]  # a record the trainer wrote
    got = next(r for r in seen if r["step"] == live["step"])
    assert (live["loss"], live["tokens_per_s"], live["mfu"]) == (
        got["loss"], got["tokens_per_s"], None,
    )  # fmt: skip
    assert live["val_step"] % 10 == 0 and live["val_loss"] > 0
    # the ETA: the steps left at the measured pace, counted from the last record
    pace = live["seconds_per_step"]
    assert 0 < pace < 10
    assert 0 < live["eta_s"] <= pace * (2000 - live["step"])
    # the printed status, taken a moment later: the same facts of a later record
    assert text.returncode == 0, text.stderr
    first, loss_line, speed_line, trainer_line = text.stdout.splitlines()
    # h:mm:ss, whatever the hours: the ETA of 2000 steps passes an hour on a machine that is
    # busy enough (its value is checked above)
    step = int(re.fullmatch(r"run live: training, step (\d+)/2000, running, ETA \d+:\d\d:\d\d",
                            first)[1])  # fmt: skip
    rec = next(r for r in records(run_dir, "train") if r["step"] == step)
    # the last evaluation written then: at the step, or (not written yet) the one before
    val_step = int(re.search(r"\(step (\d+)\)$", loss_line)[1])
    assert val_step in (step - step % 10, step - step % 10 - 10)
    val = next(r for r in records(run_dir, "eval") if r["step"] == val_step)
    assert loss_line == (
        f"  loss {rec['loss']:.4f}, validation loss {val['val_loss']:.4f} (step {val_step})"
    )
    assert speed_line.startswith(f"  {rec['tokens_per_s']:,.0f} tokens/s, MFU n/a, ")
    assert trainer_line.startswith(f"  trainer: pid {proc.pid} on ")

    time.sleep(1.5)
    (after,) = status_json(tmp_path, "live", env=env)["runs"]
    saved = int(log.read_text().split("saved step ")[1].split(";")[0])
    assert (after["stage"], after["state"], after["trainer"], after["eta_s"]) == (
        "training", "stopped", None, None,
    )  # fmt: skip
    assert after["step"] == records(run_dir, "train")[-1]["step"] <= saved
    assert after["last_record_s"] >= 1.5
    first = gptflow("status", "--runs-dir", str(tmp_path), "live", env=env).stdout.split("\n")[0]
    m = re.fullmatch(
        rf"run live: training, step {after['step']}/2000, stopped (\d+) s ago "
        r"\(no live trainer; rerun the workflow to resume\)",
        first,
    )
    assert m and int(m[1]) >= 1, first


def test_status_of_runs_that_never_started(make_run, tmp_path):
    """run.yaml only: indexing, step 0 of run.yaml's train_iters, not started; with the
    indices' record: indices built; a named run without a directory yet: tokenizing. No
    metrics, no trainer, no ETA."""
    env = fake_squeue(tmp_path / "bin")
    make_run("fresh", train_iters=37)
    indexed = make_run("indexed", train_iters=38)
    (indexed / "data-index.json").write_text("{}")
    runs = {
        r["run"]: r for r in status_json(tmp_path, "fresh", "indexed", "later", env=env)["runs"]
    }
    expect = {
        "fresh": ("indexing", 37),
        "indexed": ("indices built", 38),
        "later": ("tokenizing", None),
    }
    for name, (stage_name, total) in expect.items():
        r = runs[name]
        assert (r["stage"], r["state"], r["step"], r["total"]) == (
            stage_name, "not started", 0, total,
        ), r  # fmt: skip
        assert r["loss"] is r["eta_s"] is r["trainer"] is r["tokens_per_s"] is None
    out = gptflow("status", "--runs-dir", str(tmp_path), "fresh", "later", env=env)
    assert out.stdout.splitlines() == [
        "run fresh: indexing, step 0/37, not started",
        f"run later: tokenizing, step 0/?, not started (no {tmp_path}/later/ yet)",
    ]


def test_status_without_runs_says_how_to_make_one(tmp_path):
    env = fake_squeue(tmp_path / "bin")
    out = gptflow("status", env=env, cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "gptflow status: error: no runs under results/runs/; start one (`make run`, or "
        "snakemake with your profile) or pass --runs-dir DIR"
    ]


def test_the_run_s_slurm_jobs_come_from_the_plugin_s_comment(make_run, tmp_path):
    """A fake squeue (no Slurm needed): the jobs whose comment the Slurm executor plugin made
    for a rule of this run are listed under it; another run's and a job without that comment
    are not. A squeue that fails is said once, and status still answers."""
    make_run("tiny")
    queue = (
        "101|RUNNING|1:02:03|rule_train_gpt_wildcards_tiny\n"
        "102|PENDING|0:00|rule_evaluate_wildcards_tiny\n"
        "103|RUNNING|5:00|rule_train_gpt_wildcards_tiny_big\n"
        "104|RUNNING|7:00|interactive\n"
        "105|PENDING|0:00|rule_tokenize_shard_wildcards_gpt2_pile_00\n"
    )
    env = fake_squeue(tmp_path / "bin", queue)
    result = status_json(tmp_path, "tiny", env=env)
    assert result["slurm"] is None
    assert result["runs"][0]["slurm_jobs"] == [
        {"job_id": "101", "state": "RUNNING", "elapsed": "1:02:03", "rule": "train_gpt"},
        {"job_id": "102", "state": "PENDING", "elapsed": "0:00", "rule": "evaluate"},
    ]
    lines = gptflow("status", "--runs-dir", str(tmp_path), "tiny", env=env).stdout.splitlines()
    assert lines[-2:] == [
        "  Slurm job 101: train_gpt RUNNING for 1:02:03",
        "  Slurm job 102: evaluate PENDING for 0:00",
    ]

    env = fake_squeue(
        tmp_path / "bin2", "", 1, "slurm_load_jobs error: Unable to contact slurm controller"
    )
    out = gptflow("status", "--runs-dir", str(tmp_path), "tiny", env=env)
    assert out.returncode == 0
    assert out.stdout.splitlines()[-1] == (
        "Slurm queue not read: squeue failed (exit 1): slurm_load_jobs error: Unable to "
        "contact slurm controller"
    )
    assert status_json(tmp_path, "tiny", env=env)["runs"][0]["slurm_jobs"] is None


def test_metrics_being_appended_and_damaged(tmp_path, write_jsonl):
    """A last line the trainer is still writing is left out (a whole last record without its
    newline is kept); a damaged line before the last is an error naming it."""
    path = write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "kind": "train"}])
    with open(path, "a") as f:
        f.write('{"step": 2, "kind": "tra')
    assert read_records(path) == [{"step": 1, "kind": "train"}]
    with open(path, "a") as f:
        f.write('in"}')
    assert [r["step"] for r in read_records(path)] == [1, 2]
    write_jsonl(path, [{"step": 1}, '{"step": 2', {"step": 3}])
    with pytest.raises(GptflowError, match=r"metrics.jsonl:2: not a JSON record"):
        read_records(path)
    assert read_records(tmp_path / "absent.jsonl") == []


def test_eta_is_the_median_pace_over_recent_records():
    """Records every 2 s per step (logged every 5 steps), a restart costing 1,000 s between
    steps 25 and 30, a slow evaluation interval: the pace is the median, 2 s per step; the ETA
    counts the steps left from the last record's time."""
    t, trains = 0.0, []
    for step in range(5, 55, 5):
        t += 10 + (1000 if step == 30 else 0) + (20 if step == 40 else 0)
        trains.append({"step": step, "time": t})
    assert seconds_per_step(trains) == 2.0
    last = trains[-1]["time"]
    assert eta_seconds(trains, 100, now=last + 30) == 2.0 * 50 - 30
    assert eta_seconds(trains, 100, now=last + 1000) == 0.0  # overdue
    assert seconds_per_step(trains[:1]) is None and eta_seconds(trains[:1], 100, 0) is None


def test_stage_is_the_furthest_file_not_older_than_training(tmp_path):
    """After DONE.json: evaluated, exported, report made as their files appear; an
    evaluation older than DONE.json (training ran again) does not count."""
    files = RunFiles(tmp_path / "r")
    files.dir.mkdir()
    assert stage(files) == "tokenizing"
    files.run_yaml.write_text("train: {train_iters: 3}\n")
    assert stage(files) == "indexing"
    files.data_index.write_text("{}")
    assert stage(files) == "indices built"
    files.metrics.write_text("")
    assert stage(files) == "training"
    files.done.write_text("{}")
    assert stage(files) == "trained"
    files.eval.write_text("{}")
    assert stage(files) == "evaluated"
    files.hf.mkdir()
    assert stage(files) == "exported"
    files.report_card.parent.mkdir()
    files.report_card.write_text("")
    assert stage(files) == "report made"
    assert stage(files, trainer_alive=True) == "training"
    for path in (files.eval, files.hf, files.report_card):
        os.utime(path, (1, 1))
    assert stage(files) == "trained"


def test_summary_lists_every_output_and_what_is_missing(make_run, tmp_path):
    """A finished run in a workflow directory: summary names its run config, checkpoint (step
    and digest of DONE.json), metrics (the records counted), train log, job log, evaluation
    (test perplexity), HF export and report card, each present one with its path and each
    absent one with what makes it; an export made later (a real `gptflow export-hf`) appears
    as its files."""
    env = fake_squeue(tmp_path / "bin")
    (tmp_path / "results" / "runs").mkdir(parents=True)
    run_dir = make_run("results/runs/tiny", train_iters=6, log_interval=2, eval_interval=3,
                       eval_iters=1)  # fmt: skip
    assert gptflow_train(run_dir).returncode == 0
    done = json.loads((run_dir / "DONE.json").read_text())
    (run_dir / "eval.json").write_text(
        json.dumps({"test": {"stdlib": {"perplexity": 123.456, "loss": 4.8}}})
    )
    out = gptflow("summary", env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    r = "results/runs/tiny"
    ckpt = f"{r}/checkpoints/{done['series']}/step00000006"
    assert out.stdout.splitlines() == [
        "run tiny: step 6, 3,072 tokens",
        f"  validation loss: {done['initial_val_loss']:.4f} at step 0 -> "
        f"{done['final_val_loss']:.4f} at step 6",
        f"  run config:  {r}/run.yaml",
        f"  checkpoint:  {ckpt} (step 6, sha256 {done['checkpoint_sha256'][:16]})",
        f"  metrics:     {r}/metrics.jsonl (3 train records, 3 evaluations)",
        f"  train log:   {r}/train.log (every attempt)",
        "  job log:     missing: logs/train_gpt/tiny.log (Snakemake's rule train_gpt)",
        f"  evaluation:  {r}/eval.json (test perplexity 123.5 (stdlib))",
        f"  HF export:   not made yet: {r}/hf (rule export_hf; snakemake target export or all)",
        f"  report card: not made yet: {r}/report/card.html (rule report_assets; snakemake "
        "target all)",
    ]
    export = gptflow("export-hf", "--config", f"{r}/run.yaml", "--out", f"{r}/hf", env=env,
                     cwd=tmp_path)  # fmt: skip
    assert export.returncode == 0, export.stderr[-2000:]
    hf = [p for p in (run_dir / "hf").iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in hf)
    line = gptflow("summary", env=env, cwd=tmp_path).stdout.splitlines()[8]
    assert line == f"  HF export:   {r}/hf ({len(hf)} files, {human_bytes(size)})"
    assert len(hf) >= 3 and size > 165_632 * 4  # config, weights (fp32), tokenizer
    # a run that used eval.harness (an intermediate step evaluated, the page not made yet)
    mc = {"metrics": {"acc": 0.5, "acc_stderr": 0.25, "acc_norm": 0.5}}
    ppl = {"metrics": {"word_perplexity": 12345.678, "word_perplexity_stderr": None}}
    (run_dir / "harness.json").write_text(json.dumps({"tasks": {"mc": mc, "ppl": ppl}}))
    (run_dir / "harness").mkdir()
    (run_dir / "harness/step3.json").write_text("{}")
    lines = gptflow("summary", env=env, cwd=tmp_path).stdout.splitlines()
    assert lines[10:] == [
        f"  harness:      {r}/harness.json (mc acc 0.5 ± 0.25, ppl word_perplexity 1.235e+04)",
        f"  harness page: not made yet: {r}/report/harness.html (rule harness_report; "
        "snakemake target all)",
    ], lines
