"""Run lock and checkpoint bookkeeping (without DeepSpeed; training tests use the real thing)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from gptflow.config.settings import TrainConfig
from gptflow.errors import GptflowError
from gptflow.train.checkpoint import COMPLETE, CheckpointSeries, RunLock, checkpoint_digest


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    path = tmp_path / "train.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path.write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
        with pytest.raises(
            GptflowError, match=rf"another trainer is running this run \(host .*, pid {holder.pid}"
        ):
            RunLock(path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(path)
    lock.acquire()
    assert lock.took_over["reason"] == f"process {holder.pid} on {socket.gethostname()} is gone"
    assert json.loads(path.read_text())["pid"] == os.getpid()
    with pytest.raises(GptflowError, match="another trainer"):
        RunLock(path).acquire()  # we hold it now
    lock.release()
    assert not path.exists()


def test_lock_of_another_host_goes_stale_without_heartbeat(tmp_path):
    path = tmp_path / "train.lock"
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(GptflowError, match=r"another trainer is running this run \(host elsewhere"):
        RunLock(path, stale_s=600).acquire()
    old = path.stat().st_mtime - 700
    os.utime(path, (old, old))
    lock = RunLock(path, stale_s=600)
    lock.acquire()
    assert "no heartbeat" in lock.took_over["reason"]
    lock.release()


def test_latest_ignores_incomplete_saves(tmp_path):
    series = CheckpointSeries(tmp_path, {"a": 1}, keep_last=2)
    for step, complete in [(10, True), (20, True), (30, False)]:
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        if complete:
            (d / COMPLETE).write_text("{}")
    (tmp_path / "latest").write_text("step00000030")  # what DeepSpeed's non-atomic pointer can say
    assert series.latest_step() == 20
    (tmp_path / "latest").write_text("step00000010")
    assert series.latest_step() == 10


def test_fingerprint_mismatch_is_explained(tmp_path):
    (tmp_path / "fingerprint.json").write_text(
        json.dumps({"model": {"hidden_size": 64}, "seed": 1})
    )
    with pytest.raises(GptflowError, match=r"differs in model\.hidden_size"):
        CheckpointSeries(
            tmp_path, {"model": {"hidden_size": 128}, "seed": 1}, 1
        ).check_fingerprint()


def test_prune_keeps_the_newest_complete_steps_and_clears_debris(tmp_path):
    """keep_last 2 after saving step 50: steps 40 and 50 stay; older complete steps and the
    debris of interrupted saves before 50 go; an unfinished save after 50 is left alone
    (pruning clears only debris older than the step just saved)."""
    series = CheckpointSeries(tmp_path, {"a": 1}, keep_last=2)
    for step, complete in [
        (10, True),
        (20, False),
        (30, True),
        (40, True),
        (50, True),
        (60, False),
    ]:
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
        if complete:
            (d / COMPLETE).write_text("{}")
    (tmp_path / "notastep").mkdir()
    series.prune(keep=50)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"step00000040", "step00000050", "step00000060", "notastep"}


def test_prune_keeps_the_steps_kept_for_good(tmp_path):
    """keep_last 1, keep_every 20 (TrainConfig.kept_for_good) after saving step 50: 20 and 40
    stay beside 50, as TrainConfig.kept_steps planned."""
    t = TrainConfig(train_iters=50, save_interval=10, keep_last=1, keep_every=20)
    series = CheckpointSeries(tmp_path, {"a": 1}, keep_last=1, kept_for_good=t.kept_for_good)
    for step in (10, 20, 30, 40, 50):
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        (d / COMPLETE).write_text("{}")
    series.prune(keep=50)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step{s:08d}" for s in t.kept_steps()]
    assert t.kept_steps() == [20, 40, 50]


def test_prune_never_deletes_the_step_just_saved(tmp_path):
    """A resumed run that saves an older step than the newest on disk keeps that step."""
    series = CheckpointSeries(tmp_path, {"a": 1}, keep_last=1)
    for step in (10, 20):
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        (d / COMPLETE).write_text("{}")
    series.prune(keep=10)
    assert {p.name for p in tmp_path.iterdir()} == {"step00000010", "step00000020"}


def test_a_requeued_job_takes_over_the_lock_of_its_own_earlier_run(tmp_path, monkeypatch):
    """`scontrol requeue` (or a preemption with requeue) keeps the job id: squeue shows the job
    RUNNING, as the new run itself. The lock written by the job's earlier run (lower
    SLURM_RESTART_COUNT) is stale -- decided without asking Slurm -- so no rank waits on its own
    lock; a lock of the same run of the job (the same restart count) is not."""
    path = tmp_path / "train.lock"
    # the earlier run's pid on this host now belongs to a live process (pids are reused after
    # a requeue): the job id and restart count decide, not the pid
    path.write_text(
        json.dumps(
            {"host": socket.gethostname(), "pid": os.getppid(), "slurm_job_id": "777",
             "slurm_restart_count": 0}
        )
    )  # fmt: skip
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue: the verdict needs no Slurm command
    lock = RunLock(path)
    started = time.monotonic()
    lock.wait_while_held(timeout_s=30, poll_s=60)  # nothing to wait for: no 60 s poll
    assert time.monotonic() - started < 5
    lock.acquire()
    assert (
        lock.took_over["reason"]
        == "Slurm job 777 was requeued (restart 1); the lock is its run 0's"
    )
    record = json.loads(path.read_text())
    assert (record["slurm_job_id"], record["slurm_restart_count"]) == ("777", 1)
    lock.release()

    path.write_text(
        json.dumps({"host": "node7", "pid": 4242, "slurm_job_id": "777", "slurm_restart_count": 1})
    )
    with pytest.raises(GptflowError, match=r"another trainer is running this run \(host node7"):
        RunLock(path).acquire()  # same run of the job, another node: its heartbeat is fresh


def test_a_requeued_job_never_takes_over_a_different_live_jobs_lock(tmp_path, monkeypatch):
    """Requeued job 777 (restart 1) meets a lock of job 555's first run: not its own earlier
    run, so the requeue rule does not apply and 555 is alive -- by its live pid on this host,
    or by a fresh heartbeat on another host with no Slurm to ask. The lock is refused, not
    taken over: two trainers never share a run."""
    path = tmp_path / "train.lock"
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue, no scontrol
    for holder in (
        {"host": socket.gethostname(), "pid": os.getppid(), "slurm_job_id": "555"},
        {"host": "node7", "pid": 4242, "slurm_job_id": "555", "slurm_restart_count": 0},
    ):
        path.write_text(json.dumps(holder))
        assert RunLock(path).stale_reason(holder) is None
        with pytest.raises(
            GptflowError, match=rf"another trainer is running this run \(host {holder['host']}, "
            rf"pid {holder['pid']}, Slurm job 555\)"
        ):  # fmt: skip
            RunLock(path).acquire()
        assert json.loads(path.read_text()) == holder  # left as it was


def test_a_lock_whose_pid_now_belongs_to_another_process_is_stale(tmp_path):
    """Same host, the recorded pid alive -- but started at another time than the recorded
    holder (the pid was reused, e.g. after a reboot): the lock is taken over, not waited for."""
    path = tmp_path / "train.lock"
    holder = {"host": socket.gethostname(), "pid": os.getppid(), "proc_start": "1"}
    path.write_text(json.dumps(holder))
    lock = RunLock(path)
    assert lock.stale_reason(holder) == f"pid {os.getppid()} was reused by another process"
    lock.acquire()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


def test_release_leaves_a_lock_another_trainer_took_over(tmp_path):
    """A trainer whose lock was taken over (its heartbeat stopped: a stalled file system)
    does not delete the new holder's lock when it exits."""
    path = tmp_path / "train.lock"
    lock = RunLock(path)
    lock.acquire()
    theirs = {"host": "node7", "pid": 4242, "slurm_job_id": "555"}
    path.write_text(json.dumps(theirs))
    lock.release()
    assert json.loads(path.read_text()) == theirs


def test_the_digest_of_a_step_is_its_saved_files_and_nothing_derived_later(tmp_path):
    """checkpoint_digest hashes each file the save wrote, by name and content; what is added
    inside the step later (the universal conversion, DeepSpeed's pointer to it, a hidden
    temporary) leaves it as it was."""
    step = tmp_path / "step00000004"
    step.mkdir()
    (step / COMPLETE).write_text('{"step": 4}')
    (step / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    digest = checkpoint_digest(step)
    (step / "universal" / "zero" / "w").mkdir(parents=True)
    (step / "universal" / "zero" / "w" / "fp32.pt").write_bytes(b"converted")
    (step / "latest_universal").write_text("universal.host.1234.tmp")
    (step / ".writing-rank0").mkdir()
    (step / ".writing-rank0" / "x.pt").write_bytes(b"half")
    assert checkpoint_digest(step) == digest
    (step / "mp_rank_00_model_states.pt").write_bytes(b"weightz")
    assert checkpoint_digest(step) != digest
    (step / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (step / "mp_rank_00_model_states.pt").rename(step / "mp_rank_01_model_states.pt")
    assert checkpoint_digest(step) != digest
