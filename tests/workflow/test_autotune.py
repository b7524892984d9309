"""Autotune through Snakemake on the tiny model (docs/autotune.md): the candidates the
preflight admits, each trained a few steps as its own train_gpt job; a candidate that runs out
of memory recorded, not failing the search; a search killed mid-way (the whole Snakemake and
its trainers, SIGKILL) rerunning only the trials that had not finished; a second invocation
running nothing; the fastest layout written as a config file that plans.

Out of memory is real, on the CPU: each trial's processes get a data-segment limit
(autotune.memory_limit_mb, RLIMIT_DATA) that a micro-batch of 4 sequences of 256 tokens fits in
(about 450-550 MB measured here; 8, a little more) and one of 128 does not (64 needed
1.0-1.3 GB): PyTorch's CPU allocator
refuses the allocation, as a GPU's would. No GPU here: what a GPU's out-of-memory error does is
the same code path (torch.OutOfMemoryError), not exercised."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, job_counts, snakemake_cmd

SEQ, GLOBAL = 256, 128
MEASURED = ["tiny.tune.mb4.z0.ac0", "tiny.tune.mb8.z0.ac0"]
OUT_OF_MEMORY = ["tiny.tune.mb128.z0.ac0"]
REFUSED = ["tiny.tune.mb3.z0.ac0"]
TRIALS = MEASURED + OUT_OF_MEMORY
WARMUP = 2


def autotune_config() -> dict:
    cfg = yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())
    cfg["train"].update(seq_length=SEQ, global_batch_size=GLOBAL, micro_batch_size=4)
    cfg["autotune"] = {
        "micro_batch_sizes": [3, 4, 8, 128],  # 3 does not split the global batch: refused
        # ZeRO 1 and 2 would run out of memory too: DeepSpeed allocates their gradient bucket
        # whole (reduce_bucket_size, 5e8 elements: 2 GB in fp32) whatever the model's size
        "zero_stages": [0],
        "activation_checkpointing": [False],
        "steps": 5,
        "warmup_steps": WARMUP,
        "memory_limit_mb": 1000,
    }
    return cfg


def trial_done(wd: Path, trial: str) -> Path:
    return wd / "results" / "runs" / trial / "DONE.json"


@pytest.fixture(scope="module")
def search(tmp_path_factory, snakemake, write_config):
    """`snakemake autotune` killed (SIGKILL to Snakemake and every trainer) once a trial has
    finished and another is training, then run again to the end."""
    wd = tmp_path_factory.mktemp("autotune")
    config = write_config(wd / "config.yaml", autotune_config())
    plan = snakemake(wd, config, "-n", "autotune")
    assert plan.returncode == 0, plan.out[-3000:]
    proc = subprocess.Popen(snakemake_cmd(wd, config, "autotune"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    finished, training = {}, None
    try:
        deadline = time.time() + 400
        while time.time() < deadline and not (finished and training):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            finished = {t: trial_done(wd, t).stat().st_mtime_ns for t in TRIALS
                        if trial_done(wd, t).is_file()}  # fmt: skip
            training = next(
                (t for t in TRIALS if t not in finished and "iteration        2/"
                 in read(wd / "results" / "runs" / t / "train.log")), None,
            )  # fmt: skip
            time.sleep(0.1)
        assert finished and training, f"no trial finished beside one training in 400 s: {finished}"
        os.killpg(proc.pid, signal.SIGKILL)
        killed_out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the kill left Snakemake's lock: what a user does next
    unlock = snakemake(wd, config, "--unlock")
    assert unlock.returncode == 0, unlock.out[-2000:]
    rerun = snakemake(wd, config, "autotune")
    assert rerun.returncode == 0, rerun.out[-5000:]
    return wd, config, plan, killed_out, finished, training, rerun


def read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def test_the_plan_names_every_candidate_and_why_one_is_refused(search):
    plan = search[2].out
    assert "gptflow autotune: 4 candidate(s) (micro batch x ZeRO stage x activation " in plan
    assert "3 admitted by the preflight, 1 refused; each a trial of 5 steps (the first 2 " in plan
    for trial in REFUSED:
        assert f"{trial}: refused: train.global_batch_size 128 is not a multiple of " in plan
    counts = job_counts(plan)
    assert {k: counts[k] for k in ("build_data_index", "render_run_config", "autotune_report",
                                   "autotune")} == {"build_data_index": 1, "render_run_config": 3,
                                                    "autotune_report": 1, "autotune": 1}  # fmt: skip
    assert counts["train_gpt"] == 3  # the admitted three, not the refused one


def test_a_killed_search_reruns_only_the_trials_that_had_not_finished(search):
    wd, _, _, _, finished, training, rerun = search
    assert job_counts(rerun.out)["train_gpt"] == len(TRIALS) - len(finished), rerun.out[-3000:]
    for trial, mtime in finished.items():  # untouched: not run again
        assert trial_done(wd, trial).stat().st_mtime_ns == mtime, trial
        assert f"wildcards: run={trial}\n" not in rerun.out
    assert f"wildcards: run={training}\n" in rerun.out  # the one killed while training
    # its second attempt started from nothing: one trajectory in its metrics
    log = read(wd / "results" / "runs" / training / "train.log")
    if training in MEASURED:
        assert log.count("starting at step 0") == 2, log[-2000:]
        steps = [
            json.loads(line)["step"]
            for line in (wd / "results" / "runs" / training / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        assert steps == [1, 2, 3, 4, 5]


def test_a_second_invocation_runs_nothing(search, snakemake):
    wd, config = search[0], search[1]
    again = snakemake(wd, config, "autotune")
    assert again.returncode == 0 and "Nothing to be done" in again.out, again.out[-3000:]
    assert job_counts(again.out) == {}


def test_a_candidate_out_of_memory_is_recorded_and_the_search_goes_on(search):
    wd = search[0]
    ranking = json.loads((wd / "results/runs/tiny/autotune/autotune.json").read_text())
    rows = {r["trial"]: r for r in ranking["candidates"]}
    for trial in OUT_OF_MEMORY:
        done = json.loads(trial_done(wd, trial).read_text())
        assert done["trial"]["status"] == "out_of_memory", done
        assert "DefaultCPUAllocator" in done["trial"]["message"] and done["trial"]["ranks"] == [0]
        assert rows[trial]["status"] == "out_of_memory" and "rank" not in rows[trial]
        log = read(wd / "logs" / "train_gpt" / f"{trial}.log")
        assert "gptflow train: error: rank 0 ran out of memory (" in log, log[-2000:]
        assert "the search goes on without it" in log and "Traceback" not in log
    for trial in MEASURED:  # a trial neither evaluates nor saves
        done = json.loads(trial_done(wd, trial).read_text())
        assert done["trial"] == {"status": "measured"} and done["checkpoint"] is None
        assert done["initial_val_loss"] is None and done["final_step"] == 5
        assert not list((wd / "results" / "runs" / trial).glob("checkpoints/*/global_step*"))
        metrics = (wd / "results" / "runs" / trial / "metrics.jsonl").read_text().splitlines()
        assert {json.loads(line)["kind"] for line in metrics} == {"train"}


def tokens_per_s(metrics: Path) -> float:
    """A trial's throughput, computed here from its records: the steps after the warm-up,
    their tokens (steps x global batch x sequence) over their time."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [r for r in records if r["kind"] == "train" and r["step"] > WARMUP]
    assert [r["step"] for r in timed] == [3, 4, 5] and all(r["timed_steps"] == 1 for r in timed)
    return len(timed) * GLOBAL * SEQ / sum(r["ms_per_step"] / 1000 for r in timed)


def test_the_ranked_table_holds_the_admitted_candidates_and_the_fastest_is_chosen(search):
    wd = search[0]
    ranking = json.loads((wd / "results/runs/tiny/autotune/autotune.json").read_text())
    rows = {r["trial"]: r for r in ranking["candidates"]}
    assert set(rows) == set(TRIALS + REFUSED)
    speeds = {t: tokens_per_s(wd / "results/runs" / t / "metrics.jsonl") for t in MEASURED}
    for trial, speed in speeds.items():
        assert rows[trial]["tokens_per_s"] == pytest.approx(speed, rel=1e-9)
    fastest = max(speeds, key=speeds.get)
    assert ranking["best"] == fastest and rows[fastest]["rank"] == 1
    assert sorted(rows[t]["rank"] for t in MEASURED) == [1, 2]
    assert ranking["candidates"][0]["trial"] == fastest
    for trial in REFUSED:
        assert rows[trial]["status"] == "refused" and "not a multiple of" in rows[trial]["refused"]
    page = (wd / "results/runs/tiny/autotune/autotune.html").read_text()
    ranked = page.split("<h2>")[0]  # the ranked table, before the other sections
    assert all(t in ranked for t in MEASURED)
    assert not any(t in ranked for t in OUT_OF_MEMORY + REFUSED)
    best = yaml.safe_load((wd / "results/runs/tiny/autotune/best.yaml").read_text())
    z = int(re.search(r"\.z(\d)\.", fastest).group(1))
    micro = int(re.search(r"\.mb(\d+)\.", fastest).group(1))
    assert best == {"model": {"activation_checkpointing": False},
                    "train": {"micro_batch_size": micro, "zero_stage": z}}  # fmt: skip


def test_the_fastest_layout_is_a_config_file_the_run_plans_with(search, snakemake, write_config):
    wd, config = search[0], search[1]
    best = yaml.safe_load((wd / "results/runs/tiny/autotune/best.yaml").read_text())
    plan = subprocess.run(
        [*snakemake_cmd(wd, config, "-n", "train"),
         "--configfile", str(config), str(wd / "results/runs/tiny/autotune/best.yaml")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout[-3000:]
    micro = best["train"]["micro_batch_size"]
    line = f"micro batch {micro} x grad accum {GLOBAL // micro} x 1 = global batch {GLOBAL}"
    assert line in plan.stdout, plan.stdout[-3000:]
    assert job_counts(plan.stdout)["train_gpt"] == 1
