"""Real DeepSpeed training on the CPU: exact resume, preemption, the run lock, two ranks.

Every test runs `gptflow train` as a subprocess on the tiny model and real shards.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptflow.config import load_workflow_config, render_run_config, write_run_config
from gptflow.errors import GptflowError

BIN = Path(sys.executable).parent


@pytest.fixture
def make_run(repo, tiny_config, tokenizer_json, shards, tmp_path):
    def make(name="run", **train) -> Path:
        cfg = load_workflow_config(
            {**tiny_config, "train": {**tiny_config["train"], **train}},
            schema_path=repo / "config/schema/config.schema.yaml",
            models_dir=repo / "config/models",
            source="test",
        )
        run_dir = tmp_path / name
        run_dir.mkdir()
        run = render_run_config(
            cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards}, run_dir=str(run_dir)
        )
        write_run_config(run, run_dir / "run.yaml")
        return run_dir

    return make


def gptflow_train(run_dir: Path, *extra: str, **popen):
    cmd = [
        str(BIN / "gptflow"),
        "train",
        "--config",
        str(run_dir / "run.yaml"),
        "--threads",
        "1",
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **popen)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_resume_repeats_the_uninterrupted_run_bit_for_bit(make_run):
    settings = dict(
        train_iters=12, log_interval=1, eval_interval=6, eval_iters=1, save_interval=100
    )
    straight = make_run("straight", **settings)
    assert gptflow_train(straight).returncode == 0

    resumed = make_run("resumed", **settings)
    first = gptflow_train(resumed, "--exit-interval", "5")
    assert first.returncode == 75, first.stderr
    assert "exit interval 5: saved step 5" in first.stderr
    second = gptflow_train(resumed)
    assert second.returncode == 0, second.stderr
    assert "resuming from step 5" in second.stderr

    assert [r["step"] for r in records(resumed, "train")] == list(range(1, 13))
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        a = [(r["step"], r[key]) for r in records(straight, kind)]
        b = [(r["step"], r[key]) for r in records(resumed, kind)]
        assert a == b  # exact float equality, not approx
    done_a = json.loads((straight / "DONE.json").read_text())
    done_b = json.loads((resumed / "DONE.json").read_text())
    assert done_a["final_step"] == done_b["final_step"] == 12
    assert done_a["final_val_loss"] == done_b["final_val_loss"]
    assert done_b["final_val_loss"] < done_b["initial_val_loss"]


def test_preemption_signal_saves_exits_75_and_the_rerun_continues(make_run):
    """SIGUSR1 mid-run: a second trainer is refused meanwhile; the trainer saves the current
    step and exits 75; the rerun resumes from that step and finishes."""
    run_dir = make_run("pre", train_iters=400, log_interval=1, save_interval=1000)
    cmd = [str(BIN / "gptflow"), "train", "--config", str(run_dir / "run.yaml"), "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.is_file() and len(records(run_dir, "train")) >= 3:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        second = gptflow_train(run_dir)
        assert second.returncode == 1
        assert "another trainer is running this run" in second.stderr
        assert f"pid {proc.pid}" in second.stderr
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert "received signal 10" in err
    saved = int(err.split("saved step ")[1].split(";")[0])
    assert 3 <= saved < 400
    series = next((run_dir / "checkpoints").iterdir())
    assert (series / "latest").read_text() == f"step{saved:08d}"
    assert (series / f"step{saved:08d}" / "COMPLETE").is_file()
    assert not (run_dir / "train.lock").exists()  # released on the way out
    assert not (run_dir / "DONE.json").exists()
    rerun = gptflow_train(run_dir)  # what the workflow's retry does
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from step {saved};" in rerun.stderr
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 401))
    assert json.loads((run_dir / "DONE.json").read_text())["final_step"] == 400


def test_killed_trainer_leaves_a_stale_lock_that_is_taken_over(make_run):
    run_dir = make_run("killed", train_iters=400, log_interval=1, save_interval=2)
    cmd = [str(BIN / "gptflow"), "train", "--config", str(run_dir / "run.yaml"), "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(run_dir.glob("checkpoints/*/latest")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run_dir / "train.lock").exists()
    rerun = gptflow_train(
        run_dir, "--exit-interval", "2"
    )  # resume, then stop at the next even step
    assert f"took over a stale lock: process {proc.pid}" in rerun.stderr
    assert "resuming from step" in rerun.stderr and "resuming from step 0" not in rerun.stderr


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_two_ranks_match_one(make_run, zero_stage):
    """torchrun with 2 gloo ranks (ZeRO 0 and 2) follows the single-process loss curve."""
    settings = dict(
        train_iters=6, log_interval=1, eval_iters=1, eval_interval=6, global_batch_size=8
    )
    one = make_run("one", **settings)
    assert gptflow_train(one).returncode == 0
    two = make_run("two", zero_stage=zero_stage, **settings)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "gptflow",
        "train", "--config", str(two / "run.yaml"), "--threads", "1",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "2 ranks (torchrun), micro batch 4 x grad accum 1 x 2 ranks = global batch 8" in out.stderr
    )
    a = [r["loss"] for r in records(one, "train")]
    b = [r["loss"] for r in records(two, "train")]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def start_torchrun(run_dir: Path, log: Path) -> subprocess.Popen:
    """Two gloo ranks under torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "gptflow",
        "train", "--config", str(run_dir / "run.yaml"), "--threads", "1",
    ]  # fmt: skip
    with open(log, "a") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=out, env=env)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a node failure would (torchrun
    starts its workers in sessions of their own, so a process-group kill would miss them)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def consolidated_weights(run_dir: Path) -> dict:
    """fp32 weights of the run's latest checkpoint, gathered from every rank's ZeRO shards by
    DeepSpeed's own zero_to_fp32 (what an export consolidates)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    series = next(p for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    tag = (series / "latest").read_text().strip()
    return get_fp32_state_dict_from_zero_checkpoint(str(series), tag=tag)


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout: float = 180, poll=0.002):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"trainer exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(poll)


@pytest.mark.parametrize(
    "zero_stage, kills",
    [(1, ("step", "save", "step")), (2, ("save",)), (3, ("step",))],
    ids=["zero1", "zero2", "zero3"],
)
def test_sigkilled_ranks_resume_bit_for_bit(make_run, tmp_path, zero_stage, kills):
    """Two ranks with ZeRO, the whole job SIGKILLed at random steps and in the middle of a
    checkpoint save, then rerun: the logged losses and the consolidated final weights equal
    the uninterrupted run's exactly."""
    import random

    import torch

    settings = dict(
        train_iters=14, log_interval=1, eval_interval=7, eval_iters=1, save_interval=2,
        keep_last=2, global_batch_size=8, zero_stage=zero_stage,
    )  # fmt: skip
    straight = make_run("straight", **settings)
    log = tmp_path / "straight.log"
    assert start_torchrun(straight, log).wait(timeout=600) == 0, log.read_text()[-3000:]

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    killed = make_run("killed", **settings)
    log = tmp_path / "killed.log"
    reached, seen = 0, set()  # steps logged by the last attempt; step dirs seen at a kill
    for kind in kills:
        proc = start_torchrun(killed, log)
        try:
            if kind == "step":  # a random step past where the last attempt was killed
                target = rng.randint(reached + 1, min(reached + 4, 13))
                wait_for(lambda t=target: len(records(killed, "train")) >= t, proc, log, poll=0.01)
            else:  # a new step directory without COMPLETE: the ranks are writing shards

                def saving():
                    return any(
                        not (p / "COMPLETE").exists() and p.name not in seen
                        for p in killed.glob("checkpoints/*/step*")
                    )

                wait_for(saving, proc, log)
        finally:
            kill_tree(proc.pid)
            proc.wait()
        seen.update(p.name for p in killed.glob("checkpoints/*/step*"))
        reached = len(records(killed, "train"))
    assert start_torchrun(killed, log).wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert text.count("took over a stale lock") == len(kills), f"seed {seed}"

    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        a = [(r["step"], r[key]) for r in records(straight, kind)]
        b = [(r["step"], r[key]) for r in records(killed, kind)]
        assert a == b, f"seed {seed}"  # exact float equality
    want, got = consolidated_weights(straight), consolidated_weights(killed)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), f"seed {seed}"

    # what export_hf reads: the same consolidated weights, and only from inside the run
    from gptflow.export import load_checkpoint_weights

    series = next(p for p in (killed / "checkpoints").iterdir() if p.is_dir())
    ckpt = series / (series / "latest").read_text().strip()
    exported = load_checkpoint_weights(ckpt, killed)
    assert exported.keys() == got.keys()
    assert all(torch.equal(exported[k], got[k]) for k in got)
    with pytest.raises(GptflowError, match="read only from inside the run directory"):
        load_checkpoint_weights(ckpt, straight)


def test_a_diverged_run_stops_with_the_nan_steps_named(make_run):
    """An absurd learning rate makes the loss infinite: those steps' updates are skipped and the
    NaN/inf losses counted in the iteration line; after MAX_NAN_STREAK in a row the run stops
    with a clear message, no DONE.json and no checkpoint of the diverged weights."""
    from gptflow.train import MAX_NAN_STREAK

    run_dir = make_run(
        "diverged", train_iters=60, lr=1e6, min_lr=1e5, log_interval=1, save_interval=1000,
        eval_interval=1000, clip_grad=0.0,
    )  # fmt: skip
    out = gptflow_train(run_dir)
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"the loss was NaN or infinite for {MAX_NAN_STREAK + 1} steps in a row" in out.stderr
    assert "resume from the last good checkpoint with a lower train.lr" in out.stderr
    nan_counts = [r["nan_iters"] for r in records(run_dir, "train")]
    assert nan_counts[-1] == MAX_NAN_STREAK
    assert nan_counts == sorted(nan_counts) and nan_counts[0] == 0
    # the NaN/inf steps' updates were skipped (non-finite gradients), and counted as such
    assert records(run_dir, "train")[-1]["skipped_iters"] >= MAX_NAN_STREAK
    assert "number of nan iterations:  10 |" in out.stderr
    assert "TFLOP/s per device:" in out.stderr
    assert not (run_dir / "DONE.json").exists()
    assert not list(run_dir.glob("checkpoints/*/step*"))


def test_tensorboard_events_hold_the_logged_scalars(make_run):
    """train.tensorboard: the event files, read back with TensorBoard's own reader, carry the
    metrics.jsonl losses at the same steps, also across a resume (the interrupted attempt's
    later events are purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = make_run(
        "tb", train_iters=6, log_interval=1, eval_interval=3, eval_iters=1, tensorboard=True
    )
    assert gptflow_train(run_dir, "--exit-interval", "4").returncode == 75
    assert gptflow_train(run_dir).returncode == 0
    (series,) = (run_dir / "tensorboard").iterdir()
    events = EventAccumulator(str(series))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    want = [(r["step"], r["loss"]) for r in records(run_dir, "train")]
    assert [s for s, _ in loss] == [s for s, _ in want] == list(range(1, 7))
    assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(loss, want, strict=True))
    assert [e.step for e in events.Scalars("eval/val_loss")] == [0, 3, 6]
    assert "train/tflops_per_device" in events.Tags()["scalars"]
