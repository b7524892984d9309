"""The workflow on a real Slurm cluster: tests/slurm/start-cluster.sh starts one (slurmctld,
slurmd, slurmdbd, munge, MariaDB from Debian's packages) on 127.0.0.1, and every rule goes
through sbatch via the Snakemake Slurm plugin and tests/slurm/profile. Runs that submit jobs go
through tests/slurm/snakemake_steady_poll.py: the real CLI and plugin, with the plugin's growing
wait between status checks capped at 3 s (its docstring says why)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .conftest import BIN, REPO, job_counts

PROFILE = REPO / "tests" / "slurm" / "profile"
STEADY_POLL = REPO / "tests" / "slurm" / "snakemake_steady_poll.py"


def slurm_snakemake_cmd(workdir, configfile, *args) -> list[str]:
    return [
        str(BIN / "python"), str(STEADY_POLL), *args, "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir), "--profile", str(PROFILE), "--configfile", str(configfile),
    ]  # fmt: skip


SNAKEMAKE_ENV = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}


def slurm_snakemake(workdir, configfile, *args, timeout=900):
    """Snakemake through the Slurm profile, under a hard timeout: the plugin can wait forever
    when its status queries fail (reference/local-slurm-cluster.md)."""
    cmd = ["timeout", "-k", "30", str(timeout), *slurm_snakemake_cmd(workdir, configfile, *args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=SNAKEMAKE_ENV)


def long_training_config(wd, tiny_config, name: str, **train):
    """A config whose training runs long enough to be interrupted (a new trajectory)."""
    cfg = {**tiny_config, "train": {**tiny_config["train"], "log_interval": 1, **train}}
    path = wd / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def submitted_jobs(workdir) -> dict[str, str]:
    """{Slurm job id: rule} of every job the plugin submitted, from its per-rule log
    directories (.snakemake/slurm_logs/rule_X/[WILDCARDS/]JOBID[_TASK].log)."""
    root = workdir / ".snakemake" / "slurm_logs"
    return {
        log.stem: log.relative_to(root).parts[0].removeprefix("rule_")
        for log in root.glob("rule_*/**/*.log")
    }


def sacct_job_states(ids) -> dict[str, str]:
    """{job id: state} from Slurm's accounting (sacct -X: the jobs, not their steps)."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "--format=JobID,State", "-j", ",".join(ids)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return dict(line.split("|") for line in out.splitlines())


def sacct_states(workdir) -> dict[str, list[str]]:
    """Slurm's accounting (sacct) of every job the plugin submitted, by rule."""
    ids = submitted_jobs(workdir)
    states: dict[str, list[str]] = {}
    for job, state in sacct_job_states(ids).items():
        states.setdefault(ids[job], []).append(state)
    return states


@dataclass
class SlurmRun:
    workdir: Path
    plan: str  # the dry run's output, before the run
    out: str  # the run's output
    states: dict[str, list[str]]  # sacct's states by rule, right after the run


@pytest.fixture(scope="module")
def slurm_pipeline(slurm_cluster, tmp_path_factory, tiny_config) -> SlurmRun:
    """The tiny pipeline, planned and then run once through the Slurm profile for this module;
    sacct's view is taken before any other test submits a job."""
    wd = tmp_path_factory.mktemp("slurm")
    config = wd / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config, sort_keys=False))
    plan = slurm_snakemake(wd, config, "-n")
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-5000:]
    run = slurm_snakemake(wd, config)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    return SlurmRun(wd, plan.stdout + plan.stderr, run.stdout + run.stderr, sacct_states(wd))


@pytest.fixture(autouse=True)
def nothing_left_running(request):
    """After each test of the module's workflow directory: no Snakemake of it still running,
    no frozen process, no lock, no Slurm job. A failed test used to leave its Snakemake
    running (killing `timeout` does not kill its child), which held the directory's lock:
    in CI one failure made three more LockExceptions. Only what was left over is touched."""
    yield
    if "slurm_pipeline" not in request.fixturenames:
        return
    wd = request.getfixturevalue("slurm_pipeline").workdir
    left = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(wd).encode() in argv or any(e.startswith(b"SLURM_JOB_ID=") for e in env):
            left.append(int(proc.name))
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    if not left and not jobs.split():
        return
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    if jobs.split():
        subprocess.run(["scancel", *jobs.split()], check=False)
        deadline = time.monotonic() + 120
        while subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True,
                             text=True).stdout.split() and time.monotonic() < deadline:  # fmt: skip
            time.sleep(0.5)
    for lock in (wd / ".snakemake" / "locks").glob("*"):
        lock.unlink()


def test_the_tiny_pipeline_runs_through_sbatch_with_two_training_ranks(slurm_pipeline, tiny_config):
    tmp_path = slurm_pipeline.workdir
    done = json.loads((tmp_path / "results/runs/tiny/DONE.json").read_text())
    assert done["final_step"] == tiny_config["train"]["train_iters"]
    log = (tmp_path / "logs/train_gpt/tiny.log").read_text()
    assert "2 ranks (slurm)" in log
    # every job of the plan went through sbatch -- as many Slurm jobs (or array tasks) as the
    # plan has jobs of the rule -- but the target rule `all`, which the run did itself
    # (`localrule all:`; a dry run does not say which rules are local), and all COMPLETED
    local = re.findall(r"^localrule (\w+):$", slurm_pipeline.out, re.M)
    assert local == ["all"], local
    plan = job_counts(slurm_pipeline.plan)
    planned = {rule: n for rule, n in plan.items() if rule not in local}
    assert plan["all"] == 1
    assert {"train_gpt", "evaluate", "export_hf", "report_assets"} <= set(planned), planned
    states = slurm_pipeline.states
    assert {rule: len(s) for rule, s in states.items()} == planned, (planned, states)
    for rule, s in states.items():
        assert set(s) == {"COMPLETED"}, (rule, states)
    # the profile's slurm-array-jobs: the two shards of each per-shard rule are the tasks of
    # one job array (logs JOBID_TASK.log)
    for rule in ("collect_local_documents", "tokenize_shard"):
        assert planned[rule] == 2, planned
        logs = sorted(
            p.stem for p in (tmp_path / f".snakemake/slurm_logs/rule_{rule}").glob("*.log")
        )
        assert len(logs) == 2 and [x.split("_")[1] for x in logs] == ["1", "2"], (rule, logs)
        assert len({x.split("_")[0] for x in logs}) == 1, (rule, logs)


def train_job_ids(workdir) -> list[str]:
    root = workdir / ".snakemake" / "slurm_logs" / "rule_train_gpt"
    return sorted((p.stem for p in root.glob("**/*.log")), key=int)


def trainer_pids(workdir) -> list[int]:
    """The `gptflow train` rank processes running in `workdir` (the Python processes
    themselves, not the srun or shell lines that start them)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:  # gone, or not a process
            continue
        if (
            len(argv) > 2
            and Path(argv[0].decode()).name.startswith("python")
            and argv[1].endswith(b"/gptflow")
            and argv[2] == b"train"
            and os.path.realpath(cwd) == os.path.realpath(workdir)
        ):
            pids.append(int(proc.name))
    return sorted(pids)


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` is pending for the process (ShdPnd) or its main thread (SigPnd), from
    /proc/PID/status."""
    status = Path(f"/proc/{pid}/status").read_text()
    masks = re.findall(r"^(?:ShdPnd|SigPnd):\s*([0-9a-f]+)$", status, re.M)
    return any(int(mask, 16) & (1 << (signum - 1)) for mask in masks)


def new_train_steps(metrics: Path, old_series: str) -> list[int]:
    """Steps logged by the new trajectory (metrics.jsonl starts with the fixture's records)."""
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return [
        r["step"]
        for line in lines
        if line.endswith("}")  # not a line being written
        and (r := json.loads(line))["kind"] == "train"
        and r["series"] != old_series
    ]


@dataclass
class Signalled:
    job: str  # the training job that got USR1 first
    frozen: list[int]  # per signal, the last step the ranks had logged when they were frozen
    log: str  # results/runs/tiny/train.log from this trajectory's start on (every attempt)
    jobs: list[str]  # the training jobs this test submitted, in order
    out: str  # Snakemake's output


def usr1_mid_training(
    wd, tiny_config, name: str, seed: int, while_frozen=None, times: int = 1
) -> Signalled:
    """Train a new trajectory of 300 steps through the Slurm profile and send its job USR1
    `times` times, each once the ranks of the current attempt have logged a step past the
    last save (their handler is set); Snakemake must then finish.

    No race with the end of training: the ranks are frozen (SIGSTOP) first, `while_frozen(job)`
    runs, Slurm sends USR1, and the ranks go on (SIGCONT) only once the signal is pending in
    both, so they receive it mid-run however fast they train."""
    config = long_training_config(
        wd, tiny_config, name, seed=seed, train_iters=300, save_interval=1000, eval_interval=1000
    )
    before = set(train_job_ids(wd))
    done = wd / "results/runs/tiny/DONE.json"
    old_series = json.loads(done.read_text())["series"]
    history = wd / "results/runs/tiny/train.log"
    start = len(history.read_text())
    metrics = wd / "results/runs/tiny/metrics.jsonl"
    proc = subprocess.Popen(
        ["timeout", "-k", "30", "900", *slurm_snakemake_cmd(wd, config, "train")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=SNAKEMAKE_ENV,
    )  # fmt: skip
    ranks: list[int] = []
    frozen: list[int] = []
    last_ranks: set[int] = set()
    try:
        for k in range(times):
            deadline = time.monotonic() + 600
            while True:  # attempt k is training: its own ranks, past the step saved before
                assert proc.poll() is None, proc.communicate()[0][-5000:]
                new = set(train_job_ids(wd)) - before
                log = history.read_text()[start:]
                assert time.monotonic() < deadline, (
                    f"attempt {k} never got going",
                    sorted(new),
                    trainer_pids(wd),
                    log[-3000:],
                )
                saved = [int(n) for n in re.findall(r"received signal 10: saved step (\d+);", log)]
                steps = new_train_steps(metrics, old_series)
                if (
                    new
                    and log.count("resuming from step") == k
                    and steps
                    and max(steps) > (saved[-1] if saved else 0)
                ):
                    ranks = trainer_pids(wd)
                    if len(ranks) == 2 and not set(ranks) & last_ranks:
                        break
                time.sleep(0.2)
            job = min(new, key=int)
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
            frozen.append(max(new_train_steps(metrics, old_series)))
            assert frozen[-1] < 300, frozen
            if while_frozen:
                while_frozen(job)
            sent = subprocess.run(["scancel", "--signal=USR1", job], capture_output=True, text=True)
            assert sent.returncode == 0, (sent.stderr, squeue_line(job))
            while not all(signal_pending(pid, signal.SIGUSR1) for pid in ranks):
                assert time.monotonic() < deadline, ("USR1 never reached the frozen ranks",
                                                     ranks, squeue_line(job))  # fmt: skip
                time.sleep(0.1)
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
            last_ranks, ranks = set(ranks), []
        out, _ = proc.communicate(timeout=900)
    finally:
        for pid in ranks:  # never leave a stopped rank behind
            os.kill(pid, signal.SIGCONT)
        proc.kill()
    assert proc.returncode == 0, out[-5000:]
    assert json.loads(done.read_text())["final_step"] == 300
    jobs = sorted(set(train_job_ids(wd)) - before, key=int)
    return Signalled(jobs[0], frozen, history.read_text()[start:], jobs, out)


def squeue_line(job: str) -> str:
    """Slurm's view of `job` now (its state and reason), for a failure's message."""
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T %r %M"], capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def saved_steps(signalled: Signalled, how: str) -> list[int]:
    """The steps the trainer saved on each USR1 (its 'received signal 10' lines, each ending
    with `how`), each where the ranks were frozen, and from which the next attempt resumed."""
    log = signalled.log
    received = [int(n) for n in re.findall(rf"received signal 10: saved step (\d+); {how}", log)]
    assert len(received) == len(signalled.frozen), f"{received}:\n{log[-3000:]}"
    for i, (frozen, saved) in enumerate(zip(signalled.frozen, received, strict=True)):
        assert frozen <= saved <= frozen + 2 < 300, (frozen, saved)  # saved where it stopped
        after = log.split("received signal 10")[i + 1]
        assert f"resuming from step {saved};" in after, log[-3000:]
    assert log.count("starting at step 0") == 1  # one trajectory
    return received


def sacct_records(job: str) -> list[str]:
    """Every accounting record of `job` and its steps, requeued runs included (sacct -D)."""
    return subprocess.run(
        ["sacct", "-D", "-n", "-P", "--format=JobID,State,ExitCode", "-j", job],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip


def test_usr1_saves_and_the_job_requeues_itself_and_resumes(slurm_pipeline, tiny_config):
    """What a time limit does (the profile sends USR1 before it): the ranks save, rank 0 puts
    the job back in the queue (`scontrol requeue`: same job id) and it exits 75; the job runs
    again, resumes from the saved step and finishes -- one Slurm job, no Snakemake retry. Twice
    here: a retry would show as another job id (asserted), so a second requeue is what shows
    that a requeued run can itself requeue."""
    wd = slurm_pipeline.workdir
    signalled = usr1_mid_training(wd, tiny_config, "requeue.yaml", seed=11, times=2)
    saved = saved_steps(signalled, f"requeued Slurm job {signalled.job} to resume")
    assert saved == sorted(saved) and len(set(saved)) == 2, saved
    records = sacct_records(signalled.job)
    job = signalled.job
    # Slurm's account first: when a run of the job did not end as REQUEUED (or the last as
    # COMPLETED), that is what made Snakemake submit another job, and the message says which
    why = "\n".join(
        line for line in signalled.out.splitlines() if re.search(r"(?i)error|fail|SLURM-job", line)
    )
    assert [r for r in records if r.startswith(f"{job}|")] == [
        f"{job}|REQUEUED|0:0",
        f"{job}|REQUEUED|0:0",
        f"{job}|COMPLETED|0:0",
    ], (records, why[-3000:])
    # requeued, not resubmitted
    others = {j: sacct_records(j) for j in signalled.jobs if j != job}
    assert signalled.jobs == [job], (others, why[-3000:])
    # each requeued run's training step (srun, JOBID.0) ended with EXIT_PREEMPTED -- or, when
    # one rank exited 75 a moment before the other, srun's --kill-on-bad-exit ended it
    steps = [r for r in records if r.startswith(f"{job}.0|")]
    for step in steps[:2]:
        assert step in (f"{job}.0|FAILED|75:0", f"{job}.0|CANCELLED|0:15"), records
    assert steps[2:] == [f"{job}.0|COMPLETED|0:0"], records


def test_usr1_when_the_requeue_is_refused_exits_75_and_snakemakes_retry_resumes(
    slurm_pipeline, tiny_config
):
    """The fallback: a job Slurm will not requeue (here made so with `scontrol update
    Requeue=0` while its ranks are frozen) saves on USR1 and exits 75; the plugin reports the
    job failed, Snakemake's retry submits a new job, which resumes from the saved step."""
    wd = slurm_pipeline.workdir

    def not_requeueable(job: str) -> None:
        subprocess.run(["scontrol", "update", f"JobId={job}", "Requeue=0"], check=True)

    signalled = usr1_mid_training(
        wd, tiny_config, "retry.yaml", seed=12, while_frozen=not_requeueable
    )
    assert f"could not requeue the job (scontrol requeue {signalled.job}:" in signalled.log
    saved_steps(signalled, "exiting with code 75 so the workflow retries and resumes")
    jobs = signalled.jobs
    assert len(jobs) == 2 and jobs[0] == signalled.job, jobs  # the signalled job and its retry
    states = sacct_job_states(jobs)
    assert [states[j] for j in jobs] == ["FAILED", "COMPLETED"], states
    step = next(r for r in sacct_records(jobs[0]) if r.startswith(f"{jobs[0]}.0|"))
    assert step in (f"{jobs[0]}.0|FAILED|75:0", f"{jobs[0]}.0|CANCELLED|0:15"), step


def test_snakemake_killed_during_training_then_rerun_never_runs_two_trainers(
    slurm_pipeline, tiny_config
):
    """SIGKILL to the Snakemake process while its training job runs: the Slurm job goes on.
    Snakemake started again submits the job again; that trainer waits for the lock of the
    live one instead of training beside it, then resumes from its final checkpoint.

    Without a race: the first job's ranks are frozen (SIGSTOP) from the controller's death
    until the second trainer says it waits, so the first is still running however long the
    second takes to start."""
    wd = slurm_pipeline.workdir
    config = long_training_config(
        wd, tiny_config, "killed.yaml", train_iters=60, save_interval=30, eval_interval=5000
    )
    before = set(train_job_ids(wd))
    proc = subprocess.Popen(
        slurm_snakemake_cmd(wd, config, "train"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=SNAKEMAKE_ENV,
    )  # fmt: skip
    history = wd / "results/runs/tiny/train.log"
    start = len(history.read_text()) if history.is_file() else 0
    frozen: list[int] = []
    rerun = None
    try:
        deadline = time.monotonic() + 600
        while not (set(train_job_ids(wd)) - before and " iteration       20/      60" in
                   (history.read_text()[start:] if history.is_file() else "")
                   and len(trainer_pids(wd)) == 2):  # fmt: skip
            assert proc.poll() is None, "snakemake ended before training got going"
            assert time.monotonic() < deadline, "training never got going"
            time.sleep(0.2)
        frozen = trainer_pids(wd)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        proc.kill()  # the controller dies; its Slurm job does not
        proc.wait()
        (first,) = set(train_job_ids(wd)) - before
        assert subprocess.run(["squeue", "-h", "-j", first], capture_output=True,
                              text=True).stdout  # fmt: skip
        # a killed Snakemake leaves its working-directory lock; it says to run --unlock
        assert slurm_snakemake(wd, config, "--unlock").returncode == 0
        rerun = subprocess.Popen(
            ["timeout", "-k", "30", "900", *slurm_snakemake_cmd(wd, config, "train")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=SNAKEMAKE_ENV,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while "another trainer is running this run" not in history.read_text()[start:]:
            assert rerun.poll() is None, rerun.communicate()[0][-5000:]
            assert time.monotonic() < deadline, "the rerun's trainer never reached the lock"
            time.sleep(0.2)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        frozen = []
        out, _ = rerun.communicate(timeout=900)
    finally:
        for pid in frozen:  # never leave a stopped rank behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        proc.kill()
        if rerun is not None:
            rerun.kill()
    assert rerun.returncode == 0, out[-5000:]
    log = history.read_text()[start:]
    assert "another trainer is running this run" in log and "waiting up to" in log
    first_done = log.index("done: step 60")
    assert log.index("resuming from step 60;") > first_done  # after the first one finished
    assert log.count("starting at step 0") == 1  # one trajectory, trained once
    jobs = sorted(set(train_job_ids(wd)) - before, key=int)
    assert jobs[0] == first and len(jobs) == 2, jobs  # the first job and the rerun's
    assert sacct_job_states(jobs) == dict.fromkeys(jobs, "COMPLETED")
    assert json.loads((wd / "results/runs/tiny/DONE.json").read_text())["final_step"] == 60


def job_pids(job: str) -> list[int]:
    """Every process of Slurm job `job` on this node (SLURM_JOB_ID in its environment)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env:
            pids.append(int(proc.name))
    return pids


def test_a_job_requeued_after_its_ranks_died_resumes_without_waiting_on_its_own_lock(
    slurm_pipeline, tiny_config
):
    """A node lost, or an operator's `scontrol requeue` after the ranks died: the killed
    ranks leave the run's lock behind, naming this very job -- which squeue shows RUNNING
    again once it restarts. The requeued run (SLURM_RESTART_COUNT 1) takes the lock of its
    run 0 over at once instead of waiting on itself, and resumes from the last checkpoint:
    one Slurm job, no Snakemake retry.

    Without a race: once a checkpoint of the new trajectory exists, every process of the job
    is frozen (so the batch step cannot notice and fail the job first), the ranks are
    SIGKILLed, and the job is requeued while it still counts as running."""
    wd = slurm_pipeline.workdir
    config = long_training_config(
        wd, tiny_config, "killed.yaml", seed=13, train_iters=200, save_interval=10,
        eval_interval=1000,
    )  # fmt: skip
    before = set(train_job_ids(wd))
    done = wd / "results/runs/tiny/DONE.json"
    checkpoints = wd / "results/runs/tiny/checkpoints"
    old_series = {p.name for p in checkpoints.iterdir()}  # this module's earlier trajectories
    history = wd / "results/runs/tiny/train.log"
    start = len(history.read_text())
    proc = subprocess.Popen(
        ["timeout", "-k", "30", "900", *slurm_snakemake_cmd(wd, config, "train")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=SNAKEMAKE_ENV,
    )  # fmt: skip
    frozen: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.communicate()[0][-5000:]
            assert time.monotonic() < deadline, "training never saved a checkpoint"
            new = set(train_job_ids(wd)) - before
            saved = [p for p in checkpoints.glob("*/latest") if p.parent.name not in old_series]
            if new and saved and len(trainer_pids(wd)) == 2:
                break
            time.sleep(0.2)
        (job,) = new
        frozen = job_pids(job)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        lock = json.loads((wd / "results/runs/tiny/train.lock").read_text())
        assert (lock["slurm_job_id"], lock["slurm_restart_count"]) == (job, 0), lock
        for pid in trainer_pids(wd):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["scontrol", "requeue", job], check=True)
        for pid in frozen:  # what is left of the job's first run dies as Slurm ends it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        frozen = []
        out, _ = proc.communicate(timeout=900)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        proc.kill()
    assert proc.returncode == 0, out[-5000:]
    log = history.read_text()[start:]
    assert (
        f"took over a stale lock: Slurm job {job} was requeued (restart 1); the lock is its run "
        f"0's" in log
    ), log[-3000:]
    resumed = int(log.split("resuming from step ")[1].split(";")[0])
    assert resumed >= 10 and resumed % 10 == 0, log[-3000:]
    assert "waiting up to" not in log  # never waited on its own lock
    assert json.loads(done.read_text())["final_step"] == 200
    assert sorted(set(train_job_ids(wd)) - before, key=int) == [job]  # no Snakemake retry
    records = [r for r in sacct_records(job) if r.startswith(f"{job}|")]
    assert [r.split("|")[1] for r in records] == ["REQUEUED", "COMPLETED"], records


# ----------------------------------------------------------------------------- the quick start


def plan_through(profile: Path, workdir: Path, config: Path, *args: str):
    """`snakemake train [args]` through `profile` (the target first: --configfile takes a list)."""
    cmd = [
        "timeout", "-k", "30", "300", str(BIN / "snakemake"), "train", *args, "--snakefile",
        str(REPO / "Snakefile"), "--directory", str(workdir), "--profile", str(profile),
        "--configfile", str(config),
    ]  # fmt: skip
    return subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=SNAKEMAKE_ENV
    )


def test_the_readme_quick_start_plans_on_the_test_cluster(slurm_cluster, tmp_path, tiny_config):
    """A new user's first plan: profiles/slurm with only the lines the README's quick start
    names (tests/support/profiles.py checks the set), filled with this cluster's values,
    planned with sinfo and sacctmgr on PATH -- the preflight checks the profile against the
    real cluster and passes. A value the cluster cannot give (more memory than its node has)
    is refused by name at -n, before anything is queued."""
    import copy

    from tests.support.profiles import TEST_CLUSTER, edited_slurm_profile

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config, sort_keys=False))
    profile = edited_slurm_profile(tmp_path / "profile", TEST_CLUSTER)
    plan = plan_through(profile, tmp_path / "wd", config, "-n")
    assert plan.returncode == 0, plan.stdout[-4000:]
    assert (
        "gptflow preflight: train_gpt on 1 node(s) x 2 rank(s) = 2 data parallel; micro batch 4 "
        "x grad accum 1 x 2 = global batch 8; 165,632 parameters" in plan.stdout
    )
    assert "srun --kill-on-bad-exit=1 --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 gptflow" in (
        plan.stdout
    )
    assert "edit the Slurm profile first" not in plan.stdout
    assert not (tmp_path / "wd" / ".snakemake" / "slurm_logs").exists()

    greedy = copy.deepcopy(TEST_CLUSTER)
    greedy["set-resources"]["train_gpt"]["mem_mb"] = 10_000_000
    refused = plan_through(edited_slurm_profile(tmp_path / "greedy", greedy), tmp_path / "wd",
                           config, "-n")  # fmt: skip
    assert refused.returncode != 0
    assert re.search(
        r"set-resources train_gpt asks for 10000000 MB of memory per node but the nodes of "
        r"partition 'debug' have at most \d+; lower mem_mb",
        refused.stdout,
    ), refused.stdout[-3000:]


def test_an_unedited_profile_submits_nothing(slurm_cluster, tmp_path, tiny_config):
    """The shipped profile as it comes (<account>, <cpu partition>, <gpu partition>): -n names
    the placeholders first and plans; a real run stops before its first submission (the
    Snakefile's onstart), naming them; no job reaches Slurm."""
    config = tmp_path / "config.yaml"
    cfg = {**tiny_config, "train": {**tiny_config["train"], "global_batch_size": 32}}  # 8 ranks
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    profile = REPO / "profiles" / "slurm"
    plan = plan_through(profile, tmp_path / "wd", config, "-n")
    assert plan.returncode == 0, plan.stdout[-4000:]
    first = next(line for line in plan.stdout.splitlines() if line.startswith("gptflow"))
    assert first.startswith(
        "gptflow: edit the Slurm profile first: default-resources slurm_account is <account>; "
        "default-resources slurm_partition is <cpu partition>; set-resources train_gpt "
        "slurm_partition is <gpu partition>"
    ), first
    run = plan_through(profile, tmp_path / "wd", config)
    assert run.returncode != 0
    assert "gptflow: not submitted: edit the profile first: default-resources slurm_account is " \
        "<account>" in run.stdout, run.stdout[-3000:]  # fmt: skip
    assert not (tmp_path / "wd" / ".snakemake" / "slurm_logs").exists()
    assert not (tmp_path / "wd" / "results").exists()


def test_a_submission_sbatch_refuses_is_explained_in_the_jobs_own_log(
    slurm_cluster, tmp_path, tiny_config
):
    """A job Slurm will not take (a node feature no node has: sbatch's "Invalid feature
    specification", which no preflight can know): Snakemake tries it retries + 1 times and
    points at the job's log; the log then holds sbatch's reason and the attempts."""
    import copy

    from tests.support.profiles import TEST_CLUSTER, edited_slurm_profile

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config, sort_keys=False))
    profile = edited_slurm_profile(tmp_path / "profile", copy.deepcopy(TEST_CLUSTER))
    cfg = yaml.safe_load((profile / "config.yaml").read_text())
    cfg["set-resources"]["collect_local_documents"] = {"constraint": "nonexistent"}
    cfg["slurm-init-seconds-before-status-checks"] = 1
    (profile / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [
        "timeout", "-k", "30", "300", str(BIN / "snakemake"),
        "results/documents/stdlib/00000.jsonl", "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(tmp_path / "wd"), "--profile", str(profile), "--configfile", str(config),
    ]  # fmt: skip
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=SNAKEMAKE_ENV)  # fmt: skip
    assert run.returncode != 0
    log = (tmp_path / "wd/logs/collect_local_documents/stdlib/00000.log").read_text()
    assert log.startswith(
        "gptflow: Slurm never ran this collect_local_documents job: its submission was refused "
        "4 time(s) with\n  SLURM sbatch failed. The error message was 'sbatch: error: Batch job "
        "submission failed: Invalid feature specification'."
    ), log


# Last in the module: its trials are train_gpt jobs in the shared working directory, which the
# tests above count.
def test_autotune_trials_are_slurm_jobs_and_one_out_of_memory_is_recorded(
    slurm_pipeline, tiny_config
):
    """`snakemake autotune` through the Slurm profile, on the pipeline's data: each admitted
    candidate is a train_gpt job of its own (sbatch, then srun's two ranks: the profile's);
    micro batch 8 is refused (4 sequences a rank of the global batch 8); ZeRO 1 runs out of
    memory under autotune.memory_limit_mb (DeepSpeed's gradient bucket, 2 GB whatever the model,
    against a 1,000 MB data segment that srun gives both ranks): a rank's record, srun's
    --kill-on-bad-exit ending the step, the trial recorded as out of memory and the search
    going on to its ranking. ZeRO 0 is measured."""
    wd = slurm_pipeline.workdir
    cfg = {**tiny_config, "autotune": {"micro_batch_sizes": [4, 8], "zero_stages": [0, 1],
           "activation_checkpointing": [False], "steps": 4, "warmup_steps": 2,
           "memory_limit_mb": 1000}}  # fmt: skip
    config = wd / "autotune.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    before = set(train_job_ids(wd))
    run = slurm_snakemake(wd, config, "autotune")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    assert "tiny.tune.mb8.z0.ac0: refused: train.global_batch_size 8 is not a multiple" in out
    trials = [job for job in train_job_ids(wd) if job not in before]
    assert len(trials) == 2, trials  # the two admitted, each its own Slurm job
    assert set(sacct_job_states(trials).values()) == {"COMPLETED"}
    measured = json.loads((wd / "results/runs/tiny.tune.mb4.z0.ac0/DONE.json").read_text())
    assert measured["trial"] == {"status": "measured"}
    log = (wd / "logs/train_gpt/tiny.tune.mb4.z0.ac0.log").read_text()
    assert "2 ranks (slurm)" in log
    oom = json.loads((wd / "results/runs/tiny.tune.mb4.z1.ac0/DONE.json").read_text())["trial"]
    assert oom["status"] == "out_of_memory" and set(oom["ranks"]) <= {0, 1}, oom
    assert "2000000000 bytes" in oom["message"], oom  # the bucket, 5e8 fp32 elements
    ranking = json.loads((wd / "results/runs/tiny/autotune/autotune.json").read_text())
    assert ranking["best"] == "tiny.tune.mb4.z0.ac0"
