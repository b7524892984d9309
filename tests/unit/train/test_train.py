"""Real DeepSpeed training on the CPU: exact resume, preemption, the run lock, two ranks.

Every test runs `gptflow train` as a subprocess on the tiny model and real shards.
"""

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptflow.errors import GptflowError
from gptflow.train.run_config import RunConfig
from tests.support.in_turn import copy_run, train_in_turn

BIN = Path(sys.executable).parent


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


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP took effect): state T in /proc/<pid>/stat."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def step_dirs(run_dir: Path) -> set[str]:
    """The step directories left in the run's (single) checkpoint series."""
    (series,) = [p for p in (run_dir / "checkpoints").iterdir() if p.is_dir()]
    return {p.name for p in series.glob("step*")}


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


KFAC_RESUME = {"factor_update_steps": 2, "inv_update_steps": 3, "damping": 0.01,
               "factor_decay": 0.9}  # fmt: skip
RESUMES = {"log1": (1, None), "log4": (4, None), "log4-kfac": (4, "on")}


@pytest.fixture(scope="module")
def resume_runs(make_module_run, tmp_path_factory):
    """For each of RESUMES: the uninterrupted run ("straight") and one stopped by the exit
    interval at step 5 ("stopped"), all fresh starts, trained in one process
    (tests/support/in_turn.py)."""
    runs, order = {}, []
    for name, (log_interval, kfac) in RESUMES.items():
        settings = dict(
            train_iters=12, log_interval=log_interval, eval_interval=6, eval_iters=1,
            save_interval=4, keep_last=1, keep_every=8, kfac=KFAC_RESUME if kfac else None,
        )  # fmt: skip
        runs[name] = {
            k: make_module_run(f"{name}-{k}", **settings) for k in ("straight", "stopped")
        }
        order += [(runs[name]["straight"], None), (runs[name]["stopped"], 5)]
    rec = train_in_turn(order, 1, tmp_path_factory.mktemp("resume") / "rec")
    codes = {r.name: rec[r.name][0]["code"] for r, _ in order}
    assert codes == {r.name: 75 if exit_at else 0 for r, exit_at in order}, codes
    return runs


@pytest.mark.parametrize(("log_interval", "kfac"), RESUMES.values(), ids=RESUMES.keys())
def test_resume_repeats_the_uninterrupted_run_bit_for_bit(
    resume_runs, tmp_path, log_interval, kfac
):
    """With dropout (the tiny model's 0.1), so the per-step reseed is what makes it exact; the
    steps saved before the end (4, and 5 at the exit) are pruned (keep_last 1) except step 8,
    kept for good (keep_every 8); DONE.json's digest is the final checkpoint's. With train.kfac
    (factors every 2 steps, eigenbases every 3) the exit at step 5 resumes on the eigenbases
    of step 3 and the factors of step 4, from the checkpoint: the final weights and factors
    are the uninterrupted run's bit for bit. The resume is a process of its own, on a copy of
    the stopped run."""
    (runs,) = [r for n, r in resume_runs.items() if RESUMES[n] == (log_interval, kfac)]
    straight = runs["straight"]
    resumed = copy_run(runs["stopped"], tmp_path / "resumed")  # exited 75: resume_runs
    assert "exit interval 5: saved step 5" in (resumed / "train.log").read_text()
    second = gptflow_train(resumed)
    assert second.returncode == 0, second.stderr
    assert "resuming from step 5" in second.stderr

    # with log_interval 4 the exit at step 5 falls inside the interval 5-8: its loss is the
    # mean over steps 5-8, as in the uninterrupted run (the interval's sums are checkpointed)
    assert [r["step"] for r in records(resumed, "train")] == list(
        range(log_interval, 13, log_interval)
    )
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        a = [(r["step"], r[key]) for r in records(straight, kind)]
        b = [(r["step"], r[key]) for r in records(resumed, kind)]
        assert a == b  # exact float equality, not approx
    if log_interval == 4:
        # tokens/s at step 8 is over steps 7-8: 5 was the last attempt's, 6 is warm-up, and
        # the evaluation at step 6 is left out
        (at_8,) = [r for r in records(resumed, "train") if r["step"] == 8]
        assert at_8["timed_steps"] == 2
        assert at_8["timing_excludes"] == [
            "the steps before the resume", "the warm-up step", "evaluation"
        ]  # fmt: skip
    done_a = json.loads((straight / "DONE.json").read_text())
    done_b = json.loads((resumed / "DONE.json").read_text())
    assert done_a["final_step"] == done_b["final_step"] == 12
    assert done_a["final_val_loss"] == done_b["final_val_loss"]
    assert done_b["final_val_loss"] < done_b["initial_val_loss"]
    assert step_dirs(straight) == step_dirs(resumed) == {"step00000008", "step00000012"}
    for run_dir, done in ((straight, done_a), (resumed, done_b)):
        assert done["checkpoint"] == str(next((run_dir / "checkpoints").iterdir()) / "step00000012")
        assert done["checkpoint_sha256"] == directory_digest(Path(done["checkpoint"]))
    if kfac:
        import torch

        a, b = (torch_load(next(Path(d["checkpoint"]).glob("mp_rank_00_model_states.pt")))
                for d in (done_a, done_b))  # fmt: skip
        assert a["module"].keys() == b["module"].keys()
        assert all(torch.equal(a["module"][k], b["module"][k]) for k in a["module"])
        for key in ("factors", "eigen"):
            assert torch.equal(a["kfac"][key], b["kfac"][key])
        assert not torch.equal(a["kfac"]["eigen"][:4], torch.tensor([1.0, 0, 0, 0]))  # updated


def directory_digest(root: Path) -> str:
    """DONE.json's checkpoint digest, computed here independently: sha256 over every file's
    relative name and sha256, in sorted order."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(hashlib.sha256(f.read_bytes()).hexdigest().encode())
    return h.hexdigest()


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_preemption_signal_saves_exits_75_and_the_rerun_continues(make_run, signum):
    """SIGUSR1 (Slurm's warning before a time limit) or SIGTERM (preemption) mid-run, while a
    checkpoint is written in the background: a second trainer is refused meanwhile; the
    trainer saves the current step, waits for its write (and the one in flight), marks it
    complete and only then exits 75; the rerun resumes from that step and finishes.

    A checkpoint every step, in the background (train.async_save true): the trainer is frozen (SIGSTOP)
    from its third logged step while its writer thread has a file open in the step's hidden
    ``.writing-rank0`` (a write that ended meanwhile is let go and the next one caught) until
    the signal is pending, so it cannot finish first however fast the machine is."""
    run_dir = make_run("pre", train_iters=40, log_interval=1, save_interval=1, async_save=True)
    cmd = [str(BIN / "gptflow"), "train", "--config", str(run_dir / "run.yaml"), "--threads", "1"]
    log = run_dir.parent / "pre.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    try:
        wait_for(lambda: len(records(run_dir, "train")) >= 3, proc, log, timeout=120, poll=0.01)
        writing = freeze_mid_write(run_dir, proc, log)
        frozen_at = len(records(run_dir, "train"))
        assert frozen_at < 40
        second = gptflow_train(run_dir)
        assert second.returncode == 1
        assert "another trainer is running this run" in second.stderr
        assert f"pid {proc.pid}" in second.stderr
        proc.send_signal(signum)
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    err = log.read_text()
    assert proc.returncode == 75, err[-3000:]
    assert f"received signal {int(signum)}" in err
    saved = int(err.split("saved step ")[1].split(";")[0])
    # the step in flight is finished, then saved (the one after it when frozen between the
    # signal check and the metrics record of a step, or in the save waiting for the write)
    assert saved in (frozen_at + 1, frozen_at + 2), (saved, frozen_at)
    assert writing < saved <= writing + 2, (writing, saved)
    series = next((run_dir / "checkpoints").iterdir())
    assert (series / "latest").read_text() == f"step{saved:08d}"
    assert (series / f"step{saved:08d}" / "COMPLETE").is_file()
    assert not list(series.glob("step*/.writing-rank*"))
    # the exit waited for the write: the step was complete before the exit was announced
    complete = f"step{saved:08d} complete after a wait of "
    assert complete in err and err.index(complete) < err.index(f"saved step {saved};"), err[-3000:]
    assert not (run_dir / "train.lock").exists()  # released on the way out
    assert not (run_dir / "DONE.json").exists()
    rerun = gptflow_train(run_dir)  # what the workflow's retry does
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from step {saved};" in rerun.stderr
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 41))
    assert json.loads((run_dir / "DONE.json").read_text())["final_step"] == 40


def freeze_mid_write(run_dir: Path, proc: subprocess.Popen, log: Path) -> int:
    """SIGSTOP the trainer while its writer thread writes a checkpoint (a ``.writing-rank0``
    directory in a step); returns that step. A write that ends before the stop is let go."""

    def writing():
        return list(run_dir.glob("checkpoints/*/step*/.writing-rank0"))

    while True:
        wait_for(writing, proc, log, poll=0.001)
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: stopped(proc.pid), proc, log, timeout=30)
        if found := writing():
            return int(found[0].parent.name.removeprefix("step"))
        proc.send_signal(signal.SIGCONT)


def test_killed_trainer_leaves_a_stale_lock_that_is_taken_over(make_run):
    run_dir = make_run("killed", train_iters=400, log_interval=1, save_interval=2)
    cmd = [str(BIN / "gptflow"), "train", "--config", str(run_dir / "run.yaml"), "--threads", "1"]
    log = run_dir.parent / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    try:
        wait_for(lambda: bool(list(run_dir.glob("checkpoints/*/latest"))), proc, log, poll=0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (run_dir / "train.lock").exists()
    # resume, then stop at the next even step
    rerun = gptflow_train(run_dir, "--exit-interval", "2")
    assert rerun.returncode == 75, rerun.stderr[-3000:]
    assert f"took over a stale lock: process {proc.pid}" in rerun.stderr
    resumed = int(rerun.stderr.split("resuming from step ")[1].split(";")[0])
    assert resumed >= 2 and resumed % 2 == 0
    assert f"exit interval 2: saved step {resumed + 2};" in rerun.stderr


def test_a_rendezvous_port_in_use_is_named_not_a_traceback(make_run):
    """A rank whose MASTER_PORT another process holds (two jobs on one host, or a stray
    launcher variable): exit 1 with the address, the port and the fix; nothing written."""
    import socket

    run_dir = make_run("port", train_iters=8)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        out = gptflow_train(run_dir, env=env)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert (
        f"rank 0 of 1 could not reach the rendezvous at MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
    ) in out.stderr
    assert "set MASTER_PORT to a free one below 32768" in out.stderr
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


MATCH = dict(
    train_iters=6, log_interval=1, eval_iters=1, eval_interval=6, global_batch_size=8,
    peak_tflops=0.5,
)  # fmt: skip


@pytest.fixture(scope="module")
def match_runs(make_module_run, tmp_path_factory):
    """test_two_ranks_match_one's runs, trained once: "one" by `gptflow train` (and its
    stderr, "single"), in one launch of 2 torchrun ranks (tests/support/in_turn.py) ZeRO 0, 2
    and 3 saving in the background, and in a launch of its own "sync", ZeRO 0 saving
    synchronously (the same bytes as ZeRO 0's from another process)."""
    one = make_module_run("match-one", **MATCH)
    single = gptflow_train(one)
    assert single.returncode == 0, single.stderr[-3000:]
    two = {z: make_module_run(f"match-zero{z}", zero_stage=z, async_save=True, **MATCH)
           for z in (0, 2, 3)}  # fmt: skip
    sync = make_module_run("match-zero0-sync", zero_stage=0, async_save=False, **MATCH)
    where = tmp_path_factory.mktemp("match")
    rec = train_in_turn([(r, None) for r in two.values()], 2, where / "rec")
    rec |= train_in_turn([(sync, None)], 2, where / "rec-sync")
    assert [r["code"] for run in [*two.values(), sync] for r in rec[run.name]] == [0] * 8
    return {"one": one, "single": single.stderr, "sync": sync, **two}


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_two_ranks_match_one(match_runs, zero_stage):
    """torchrun with 2 gloo ranks (ZeRO 0, 2 and 3) follows the single-process loss curve, and
    reports the parameters, FLOPs per token and MFU of the one-process run: counted from the
    model config, not from live parameters (ZeRO-3 partitions them). At ZeRO 0 (not among
    test_sigkilled_ranks_resume_bit_for_bit's layouts) the same 2-rank run saving
    synchronously (train.async_save false) repeats it exactly and writes the same bytes.
    (The 2-rank runs are logged in their train.log: rank 0's log lines.)"""
    one, two = match_runs["one"], match_runs[zero_stage]
    log = (two / "train.log").read_text()
    assert "2 ranks (torchrun), micro batch 4 x grad accum 1 x 2 ranks = global batch 8" in log
    a = [r["loss"] for r in records(one, "train")]
    b = [r["loss"] for r in records(two, "train")]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    if zero_stage == 0:
        sync = match_runs["sync"]
        assert "written in the background" in log
        assert "written in the background" not in (sync / "train.log").read_text()
        assert [r["loss"] for r in records(sync, "train")] == b  # exact
        assert step_dirs(sync) == step_dirs(two) == {"step00000006"}
        assert series_digest(sync, "step00000006") == series_digest(two, "step00000006")

    # tiny, vocabulary padded to 512: 165,632 parameters; per token 3 x [2 layers x (2 x (4 x
    # 64^2 + 2 x 64 x 256) + 4 x 64 x 64) + 2 x 64 x 512] = 3 x 294,912 = 884,736 FLOPs
    for err in (match_runs["single"], log):
        assert "; 165,632 parameters;" in err
        assert "884,736 FLOPs per token" in err
        assert "MFU against 0.5 TFLOP/s (train.peak_tflops)" in err
    for rec in records(one, "train") + records(two, "train"):
        if rec["step"] == 1:  # an interval of the warm-up step alone: not timed
            assert rec["timed_steps"] == 0 and rec["mfu"] is rec["tokens_per_s"] is None
            continue
        assert rec["mfu"] > 0 and rec["mfu"] == rec["tflops_per_device"] / 0.5
        assert rec["tflops_per_device"] == pytest.approx(
            884_736 * rec["tokens_per_s"] / rec["world_size"] / 1e12, rel=1e-12
        )


# DeepSpeed torch.compiles its Muon update (~17 s of inductor in every process on this CPU;
# nothing else these runs call compiles): eager in the runs that train with it, but for the
# SIGKILLed Muon runs, compiled as users run them (compiled_as_users)
NO_COMPILE = {"TORCH_COMPILE_DISABLE": "1"}


def start_torchrun(run_dir: Path, log: Path, compiled: bool = False) -> subprocess.Popen:
    """Two gloo ranks under torchrun; `compiled`: torch.compile on, as users run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if compiled else NO_COMPILE)}
    cmd = [
        str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "gptflow",
        "train", "--config", str(run_dir / "run.yaml"), "--threads", "1",
    ]  # fmt: skip
    with open(log, "a") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=out, env=env)


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (torchrun starts its workers in sessions of their
    own, so a process-group signal would miss them)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return pids


def signal_tree(pids: list[int], signum: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signum)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a node failure would: all are
    stopped first, so that none sees another die. Killed one by one, a rank 0 whose peer's
    socket closed first raised, ran its `finally` and released the run lock before its own kill
    came: seen on a loaded machine (milliseconds between the kills), as an attempt that took
    over no stale lock."""
    signal_tree(process_tree(pid), signal.SIGSTOP)
    signal_tree(process_tree(pid), signal.SIGKILL)


def kill_mid_save(run_dir: Path, proc: subprocess.Popen, log: Path, seen: set[str]) -> str:
    """SIGKILL the job while its ranks' writer threads write a checkpoint, and return that
    step's name.

    Waits for a step directory not seen before, without COMPLETE, in which a writer thread
    has begun (its ``.writing-rank{r}`` directory, or files already renamed into place; an
    empty directory is DeepSpeed's, made while the snapshot is taken), freezes the whole job
    (SIGSTOP), and confirms that still holds before the kill; a save that finished in between
    is let go and the next one is caught."""
    while True:

        def writing():
            return [
                p
                for p in run_dir.glob("checkpoints/*/step*")
                if p.name not in seen and begun(p) and not (p / "COMPLETE").exists()
            ]

        wait_for(writing, proc, log)
        pids = process_tree(proc.pid)
        signal_tree(pids, signal.SIGSTOP)
        wait_for(lambda p=pids: all(map(stopped_or_gone, p)), proc, log, timeout=30)
        if unfinished := writing():
            signal_tree(pids, signal.SIGKILL)
            proc.wait()
            assert not (unfinished[0] / "COMPLETE").exists()
            return unfinished[0].name
        seen.update(p.name for p in run_dir.glob("checkpoints/*/step*"))
        signal_tree(pids, signal.SIGCONT)


def complete_step(run_dir: Path) -> int:
    """The newest complete checkpoint of the run's series (0: none yet), as a resume finds
    it."""
    from gptflow.train.checkpoint import CheckpointSeries

    series = [p for p in run_dir.glob("checkpoints/*") if p.is_dir()]
    if not series:
        return 0
    return CheckpointSeries(series[0], {}, 1).latest_step() or 0


def series_digest(run_dir: Path, step: str) -> str:
    """checkpoint_digest of a step of the run's (single) checkpoint series."""
    from gptflow.train.checkpoint import checkpoint_digest

    (series,) = [p for p in (run_dir / "checkpoints").iterdir() if p.is_dir()]
    return checkpoint_digest(series / step)


def begun(step_dir: Path) -> bool:
    """Something is in the step directory (it may be pruned meanwhile)."""
    try:
        return any(step_dir.iterdir())
    except FileNotFoundError:
        return False


def stopped_or_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in "TtZX"  # stopped, or exited


def muon_momenta(run_dir: Path, step: str) -> list:
    """Every Muon momentum buffer (``momentum_buffer``) in the optimizer-state files of a step
    of the run's (single) checkpoint series, rank by rank, as DeepSpeed saved them."""
    import torch

    (series,) = [p for p in (run_dir / "checkpoints").iterdir() if p.is_dir()]
    found = []

    def walk(x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                found.append(v) if k == "momentum_buffer" else walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    for f in sorted((series / step).glob("*optim_states.pt")):
        walk(torch.load(f, map_location="cpu", weights_only=False))
    return found


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


# K-FAC's factors every step and eigenbases every 3rd: a resume that lost them would differ
KFAC = {"factor_update_steps": 1, "inv_update_steps": 3, "damping": 0.003, "factor_decay": 0.95}


# (ZeRO stage, tensor parallel, pipeline parallel, kills, K-FAC, precision) by test id
SIGKILLED = {
    "zero1": (1, 1, 1, ("step", "save", "step"), None, "fp32"),
    "zero2-kfac": (2, 1, 1, ("save", "step"), KFAC, "fp32"),
    "zero3": (3, 1, 1, ("step",), None, "fp32"),
    "zero1-tp2": (1, 2, 1, ("step", "save"), None, "fp32"),
    "zero1-pp2": (1, 1, 2, ("save", "step"), None, "fp32"),
    # train.optimizer muon: a kill at a random step, then one mid-save (the momentum is
    # written by the same writer threads as AdamW's moments); its launches are Muon's alone
    "zero2-muon": (2, 1, 1, ("step", "save"), None, "fp32"),
}


def sigkilled_settings(layout: str) -> dict:
    zero_stage, tp, pp, _, kfac, precision = SIGKILLED[layout]
    # Muon's momentum: in the saved optimizer state, so in the byte-identical kept steps
    muon = {"optimizer": "muon", "clip_grad": 0.0} if layout.endswith("-muon") else {}
    return dict(
        train_iters=14, log_interval=1, eval_interval=7, eval_iters=1, save_interval=2,
        keep_last=2, global_batch_size=8, zero_stage=zero_stage, tensor_parallel=tp,
        pipeline_parallel=pp, kfac=kfac, precision=precision, **muon,
    )  # fmt: skip


def compiled_as_users(layout: str) -> bool:
    """Whether a SIGKILLED layout's runs compile what a user's run compiles: Muon's (DeepSpeed
    torch.compiles its Newton-Schulz in every Muon run; an AdamW run with train.compile false,
    the default, compiles nothing)."""
    return layout.endswith("-muon")


def launch_of(layout: str) -> tuple:
    """What the uninterrupted runs trained in one launch share: the model split, and Muon or
    not. A Muon run trained in the process after the ZeRO 1-3 AdamW runs ends ~1 ulp away
    from the same run alone (measured: the loss of step 11 of 14, at ZeRO 2), which the
    SIGKILLed run's fresh processes repeat; so it has a launch of its own."""
    return (*SIGKILLED[layout][1:3], layout.endswith("-muon"))


@pytest.fixture(scope="module")
def sigkilled_straight(make_module_run, tmp_path_factory):
    """straight(layout) -> the uninterrupted 2-rank run of a SIGKILLED layout, saving
    synchronously: at the first ask the runs of every SIGKILLED layout with its tensor and
    pipeline parallel sizes (the data-parallel ones: ZeRO 1, 2 with K-FAC, 3) are trained in
    one launch (tests/support/in_turn.py: one model split per launch)."""
    made: dict[str, Path] = {}

    def straight(layout: str) -> Path:
        if layout not in made:
            split = launch_of(layout)
            runs = {n: make_module_run(f"sigkilled-{n}", async_save=False, **sigkilled_settings(n))
                    for n in SIGKILLED if launch_of(n) == split}  # fmt: skip
            where = tmp_path_factory.mktemp("sigkilled") / "rec"
            env = {**os.environ, **({} if compiled_as_users(layout) else NO_COMPILE)}
            rec = train_in_turn([(r, None) for r in runs.values()], 2, where, env=env)
            assert [r["code"] for run in runs.values() for r in rec[run.name]] == [0] * 2 * len(
                runs
            )
            made.update(runs)
        return made[layout]

    return straight


@pytest.mark.parametrize("layout", SIGKILLED)
def test_sigkilled_ranks_resume_bit_for_bit(make_run, tmp_path, sigkilled_straight, layout):
    """Two ranks with ZeRO (or one tensor-parallel pair,
    or two pipeline stages; at ZeRO 2 with K-FAC on, or with Muon), the whole job SIGKILLed at random steps and in the middle of a checkpoint save
    (saves are asynchronous: the kill lands while the ranks' writer threads write the
    snapshot), then rerun: the logged losses and the consolidated final weights equal the
    uninterrupted run's exactly. The uninterrupted run saves synchronously (train.async_save
    false), so the kept steps' files being byte-identical (checkpoint_digest) also says that a
    snapshot written in the background is the file torch.save writes, in every layout."""
    import random

    import torch

    from gptflow.results.export import load_checkpoint_weights

    _, tp, pp, kills, _, _ = SIGKILLED[layout]
    settings = sigkilled_settings(layout)
    straight = sigkilled_straight(layout)

    seed = random.randrange(2**32)
    print(f"kill points drawn with seed {seed}")  # shown by pytest when the test fails
    rng = random.Random(seed)
    killed = make_run("killed", async_save=True, **settings)  # auto is off on CPUs
    log = tmp_path / "killed.log"
    reached, seen = 0, set()  # steps logged by the last attempt; step dirs seen at a kill
    interrupted = []  # the saves the kills interrupted
    resumes = []  # per attempt after the first: the step it must resume from (0: none saved)
    for kind in kills:
        proc = start_torchrun(killed, log, compiled_as_users(layout))
        try:
            if kind == "step":  # a random step past where the last attempt was killed, once
                # this attempt has completed a save of its own: the next one must resume
                target = rng.randint(reached + 1, min(reached + 4, 13))
                before = complete_step(killed)
                wait_for(lambda t=target, b=before: len(records(killed, "train")) >= t
                         and complete_step(killed) > b, proc, log, poll=0.01)  # fmt: skip
            else:  # a new step directory without COMPLETE: the ranks are writing shards
                interrupted.append(kill_mid_save(killed, proc, log, seen))
        finally:
            kill_tree(proc.pid)
            proc.wait()
        seen.update(p.name for p in killed.glob("checkpoints/*/step*"))
        reached = len(records(killed, "train"))
        resumes.append(complete_step(killed))
    last = start_torchrun(killed, log, compiled_as_users(layout))
    assert last.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    # each attempt after a kill resumed from the newest complete save, a step kill's never 0
    starts = re.findall(r"(resuming from step \d+|starting at step 0)", text)
    assert starts == ["starting at step 0"] + [
        f"resuming from step {n}" if n else "starting at step 0" for n in resumes
    ], (starts, resumes, f"seed {seed}")
    assert all(n for kind, n in zip(kills, resumes, strict=True) if kind == "step"), resumes
    assert text.count("took over a stale lock") == len(kills), f"seed {seed}"
    assert len(interrupted) == kills.count("save")
    # keep_last 2: the interrupted saves were redone or cleared, older steps pruned
    assert step_dirs(straight) == step_dirs(killed) == {"step00000012", "step00000014"}
    assert (
        "written in the background" in text
        and "written in the background" not in (straight / "train.log").read_text()
    )
    for step in step_dirs(killed):  # saved synchronously / in the background: the same bytes
        assert series_digest(straight, step) == series_digest(killed, step), (step, f"seed {seed}")
    if settings.get("optimizer") == "muon":  # the momentum itself, read back from every rank
        for step in step_dirs(killed):
            want, got = muon_momenta(straight, step), muon_momenta(killed, step)
            assert len(want) == len(got) > 0 and all(m.abs().sum() > 0 for m in want), step
            assert all(map(torch.equal, want, got)), (step, f"seed {seed}")

    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        a = [(r["step"], r[key]) for r in records(straight, kind)]
        b = [(r["step"], r[key]) for r in records(killed, kind)]
        assert a == b, f"seed {seed}"  # exact float equality
    series = next(p for p in (killed / "checkpoints").iterdir() if p.is_dir())
    ckpt = series / (series / "latest").read_text().strip()
    if tp > 1 or pp > 1:  # zero_to_fp32 knows no slices or stages: the export's merge of them
        (other,) = (straight / "checkpoints").iterdir()
        want = load_checkpoint_weights(other / ckpt.name, straight)
        got = load_checkpoint_weights(ckpt, killed)
    else:
        want, got = consolidated_weights(straight), consolidated_weights(killed)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), f"seed {seed}"

    # what export_hf reads: the same consolidated weights, and only from inside the run
    exported = load_checkpoint_weights(ckpt, killed)
    assert exported.keys() == got.keys()
    assert all(torch.equal(exported[k], got[k]) for k in got)
    with pytest.raises(GptflowError, match="read only from inside the run directory"):
        load_checkpoint_weights(ckpt, straight)


def test_a_diverged_run_stops_with_the_nan_steps_named(make_run):
    """An absurd learning rate makes the loss infinite: those steps' updates are skipped and the
    NaN/inf losses counted in the iteration line; after MAX_NAN_STREAK in a row the run stops
    with a clear message, no DONE.json and no checkpoint of the diverged weights."""
    from gptflow.train.loop import MAX_NAN_STREAK

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

    # a retry (Snakemake's retries, a resubmission) stops before training: it would diverge
    # the same way; a new run name or a changed train.lr (another series) starts afresh
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    retry = gptflow_train(run_dir)
    assert retry.returncode == 1
    assert "DIVERGED.json: an earlier attempt stopped: the loss was NaN or infinite" in retry.stderr
    assert "starting at step 0" not in retry.stderr
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before


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


# in_turn.py hooks: every host read of a tensor (Tensor.item/tolist/__float__/__int__/__bool__)
# made by gptflow's code, counted in the running run's record by the function that made it
SYNC_HOOKS = """
import os, sys, torch
import gptflow

GPTFLOW = os.path.dirname(gptflow.__file__) + os.sep

def probe(name):
    plain = getattr(torch.Tensor, name)
    def read(self, *a, **k):
        frame = sys._getframe(1)  # the code that asked for the value
        if frame.f_code.co_filename.startswith(GPTFLOW) and "record" in current:
            calls = current["record"].setdefault("calls", {})
            calls[frame.f_code.co_qualname] = calls.get(frame.f_code.co_qualname, 0) + 1
        return plain(self, *a, **k)
    setattr(torch.Tensor, name, read)

for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
    probe(name)
"""


@pytest.fixture(scope="module")
def sync_runs(make_module_run, tmp_path_factory):
    """{ZeRO stage: (run directory, [each rank's host reads by function])}: the runs of
    test_the_loop_reads_the_device_once_per_log_interval, at ZeRO 0 and 2, in one launch of 2
    torchrun ranks (tests/support/in_turn.py), each counted apart."""
    settings = dict(
        train_iters=12, log_interval=4, eval_interval=6, eval_iters=1, save_interval=6,
        async_save=True,  # as on GPUs
    )  # fmt: skip
    runs = {z: make_module_run(f"sync-zero{z}", zero_stage=z, **settings) for z in (0, 2)}
    rec = train_in_turn([(r, None) for r in runs.values()], 2,
                        tmp_path_factory.mktemp("sync") / "rec", hooks=SYNC_HOOKS)  # fmt: skip
    assert [r["code"] for run in runs.values() for r in rec[run.name]] == [0] * 4
    return {z: (run, [r["calls"] for r in rec[run.name]]) for z, run in runs.items()}


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_the_loop_reads_the_device_once_per_log_interval(sync_runs, zero_stage):
    """Host syncs (a tensor read on the host: item, tolist, float, int, bool) made by gptflow's
    code, counted per function on two gloo ranks: none in the step (micro-batches, forward,
    backward, update, the interval's sums), one per log line, one per evaluation and per
    save; the per-step stop check (which also carries the background write's state) reads
    only a CPU tensor (gloo; no GPU stream to wait for).

    The optimizer's skip verdict (gptflow.train.engine.skip_verdict, SkippingAdamW's): at ZeRO 2 DeepSpeed's optimizer
    decides it for the whole step and ours reads nothing (it read once per parameter group);
    at ZeRO 0 ours decides and DeepSpeed's engine takes it as a bool, once per step.

    Not counted: reads inside DeepSpeed and torch.optim (DeepSpeed's ZeRO optimizers read
    their overflow verdict once per step; torch's AdamW reads its CPU step counters)."""
    run_dir, per_rank = sync_runs[zero_stage]
    assert len(per_rank) == 2
    for calls in per_rank:
        assert calls == {
            "Interval.read": 3,  # steps 4, 8, 12
            "evaluate": 3,  # steps 0, 6, 12
            "Interval.state": 2,  # saves at 6 and 12
            # the stop check of each step, the lock's verdict, and each wait for the background
            # write (train.async_save): before the saves at 6 and 12, and before the end
            "Device.any_rank": 12 + 1 + 3,
            **({"skip_verdict": 12} if zero_stage == 0 else {}),
        }, calls
    assert [r["step"] for r in records(run_dir, "train")] == [4, 8, 12]


def test_a_compiled_model_trains_the_same_steps(make_run, tmp_path):
    """train.compile: DeepSpeed's engine.compile (torch.compile, inductor's CPU C++ backend
    here) in place of the eager module. Without dropout (inductor draws its own random numbers)
    the compiled run's losses follow the eager run's within fp32 kernel rounding, and its
    checkpoint holds the module's own parameter names (the export reads them)."""
    settings = dict(train_iters=6, log_interval=1, eval_iters=0, save_interval=100)
    no_dropout = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    eager = make_run("eager", model=no_dropout, **settings)
    compiled = make_run("compiled", model=no_dropout, compile=True, **settings)
    # one process, eager first (tests/support/in_turn.py): compiling leaves dynamo's state
    rec = train_in_turn([(eager, None), (compiled, None)], 1, tmp_path / "rec")
    assert [rec[r.name][0]["code"] for r in (eager, compiled)] == [0, 0]
    assert "model compiled (torch.compile through DeepSpeed's engine.compile)" in (
        (compiled / "train.log").read_text()
    )
    assert "model compiled" not in (eager / "train.log").read_text()
    a = [r["loss"] for r in records(eager, "train")]
    b = [r["loss"] for r in records(compiled, "train")]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)
    import torch

    (series,) = (compiled / "checkpoints").iterdir()
    states = torch.load(
        series / "step00000006" / "mp_rank_00_model_states.pt", weights_only=True, mmap=True
    )
    assert "gpt_neox.embed_in.weight" in states["module"]
    assert not any("_orig_mod" in k for k in states["module"])


def test_auto_precision_trains_fp32_on_a_cpu_in_the_fp32_series(make_run):
    """`train.precision: auto` (the default) is decided by the trainer on its device and logged;
    on this CPU it is fp32, and the checkpoints land in the series an explicit fp32 config
    names (the fingerprint holds the decided precision, not "auto")."""
    short = dict(zero_stage=1, train_iters=2, lr_warmup_iters=1, log_interval=1, eval_interval=2,
                 eval_iters=1)  # fmt: skip
    auto = make_run("auto", precision="auto", **short)
    explicit = make_run("fp32", precision="fp32", **short)
    result = gptflow_train(auto)
    assert result.returncode == 0, result.stderr
    assert "precision fp32: auto on a CPU" in (auto / "train.log").read_text()
    (series,) = (auto / "checkpoints").iterdir()
    assert series.name == RunConfig.load(explicit / "run.yaml").series
    assert series.name != RunConfig.load(auto / "run.yaml").series
    fingerprint = json.loads((series / "fingerprint.json").read_text())
    assert fingerprint["optimizer"]["precision"] == "fp32"
    assert json.loads((auto / "DONE.json").read_text())["series"] == series.name


class FakeH100:
    """Stands in for a CUDA device (no GPU exists here): what `on_device` asks of one."""

    name = "NVIDIA H100 80GB HBM3"
    capability = (9, 0)


def test_auto_precision_on_a_gpu_names_the_bf16_series(make_run):
    from gptflow.train.main import on_device

    auto = RunConfig.load(make_run("auto", precision="auto", zero_stage=1) / "run.yaml")
    bf16 = RunConfig.load(make_run("bf16", precision="bf16", zero_stage=1) / "run.yaml")
    decided = on_device(auto, FakeH100(), rank=1)
    assert decided.train.precision == "bf16"
    assert decided.series == bf16.series
    # auto decided: bf16, and saves in the background (async_save auto with GPUs)
    assert decided.train == dataclasses.replace(bf16.train, async_save=True)


def test_throughput_leaves_out_evaluations_saves_and_the_warm_up_step(make_run):
    """tokens/s, ms per step and MFU are of training alone: the step-0 evaluation, the first
    (warm-up) step, every later evaluation and save are taken out of their log interval's
    time, and the iteration line says what was. Evaluations here are slow (many batches)
    against a step: an interval that still held one would report at least half an
    evaluation's time per step (measured before the change: 1394 and 1498 ms against 20-70
    ms for the others, evaluations of 2.6 s)."""
    run_dir = make_run(
        "speed", train_iters=12, log_interval=2, eval_interval=6, eval_iters=150, save_interval=8
    )
    out = gptflow_train(run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    train = records(run_dir, "train")
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert [r["timed_steps"] for r in train] == [1, 2, 2, 2, 2, 2]
    assert [r["timing_excludes"] for r in train] == [
        ["evaluation", "the warm-up step"], [], [], ["evaluation"], ["checkpoint saves"], []
    ]  # fmt: skip
    assert "| timed without evaluation, the warm-up step |" in out.stderr
    assert "| timed without checkpoint saves |" in out.stderr
    evals = [float(line.rsplit("|", 1)[1].split()[0]) for line in out.stderr.splitlines()
             if " validation at iteration " in line]  # fmt: skip
    after_eval = [train[0]["ms_per_step"], train[3]["ms_per_step"]]  # steps 1-2 and 7-8
    assert max(after_eval) < 1000 * min(evals) / 4, (evals, after_eval)


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)
