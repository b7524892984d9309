"""The workflow on a real Slurm cluster: tests/slurm/start-cluster.sh starts one (slurmctld,
slurmd, slurmdbd, munge, MariaDB from Debian's packages) on 127.0.0.1, and every rule goes
through sbatch via the Snakemake Slurm plugin and tests/slurm/profile."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .conftest import BIN, REPO, job_counts

START = REPO / "tests" / "slurm" / "start-cluster.sh"
PROFILE = REPO / "tests" / "slurm" / "profile"


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip(
            f"runs as uid {os.geteuid()}: tests/slurm/start-cluster.sh must be root to install "
            "Debian's slurm-wlm, munge and mariadb packages and start slurmctld, slurmd and slurmdbd"
        )
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip(
            "neither slurmctld nor apt-get is on PATH: the local cluster is built from Debian's "
            "slurm-wlm packages, which this system cannot install"
        )
    out = subprocess.run(
        ["bash", str(START)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


def slurm_snakemake_cmd(workdir, configfile, *args) -> list[str]:
    return [
        str(BIN / "snakemake"), *args, "--snakefile", str(REPO / "Snakefile"),
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


def test_usr1_checkpoints_and_the_retry_resumes(slurm_pipeline, tiny_config):
    """What a time limit does (profiles/slurm sends USR1 before it): the Slurm job's ranks get
    USR1, save and exit 75; the plugin reports the job failed, Snakemake's retry submits it
    again, and the new job resumes from the saved step and finishes.

    No race with the end of training: once the ranks have logged a step (their handler is
    set), they are frozen (SIGSTOP), Slurm sends USR1, and they are let go (SIGCONT) only when
    the signal is pending in both, so they receive it mid-run however fast they train."""
    wd = slurm_pipeline.workdir
    config = long_training_config(
        wd, tiny_config, "long.yaml", train_iters=300, save_interval=1000, eval_interval=1000
    )
    before = set(train_job_ids(wd))
    old_series = json.loads((wd / "results/runs/tiny/DONE.json").read_text())["series"]
    metrics = wd / "results/runs/tiny/metrics.jsonl"
    proc = subprocess.Popen(
        ["timeout", "-k", "30", "900", *slurm_snakemake_cmd(wd, config, "train")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=SNAKEMAKE_ENV,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.communicate()[0][-5000:]
            assert time.monotonic() < deadline, "training never got going"
            new = set(train_job_ids(wd)) - before
            if new and new_train_steps(metrics, old_series):
                ranks = trainer_pids(wd)
                if len(ranks) == 2:
                    break
            time.sleep(0.2)
        (job,) = new
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        frozen = max(new_train_steps(metrics, old_series))
        assert frozen < 300, frozen
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        while not all(signal_pending(pid, signal.SIGUSR1) for pid in ranks):
            assert time.monotonic() < deadline, "USR1 never reached the frozen ranks"
            time.sleep(0.1)
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        ranks = []
        out, _ = proc.communicate(timeout=900)
    finally:
        for pid in ranks:  # never leave a stopped rank behind
            os.kill(pid, signal.SIGCONT)
        proc.kill()
    assert proc.returncode == 0, out[-5000:]
    # the run's own log keeps every attempt (Snakemake empties logs/train_gpt/ before a retry)
    log = (wd / "results/runs/tiny/train.log").read_text()
    received = re.findall(r"received signal 10: saved step (\d+);", log)
    assert len(received) == 1, f"the trainer did not report USR1 once: {received}\n{log[-3000:]}"
    saved = int(received[0])
    assert frozen <= saved <= frozen + 2 < 300, (frozen, saved)  # saved where it was stopped
    assert f"resuming from step {saved};" in log.split("received signal 10")[1]
    done = json.loads((wd / "results/runs/tiny/DONE.json").read_text())
    assert done["final_step"] == 300
    jobs = [j for j in train_job_ids(wd) if j not in before]
    assert len(jobs) == 2, jobs  # the signalled job and its retry
    states = sacct_job_states(jobs)
    assert [states[j] for j in jobs] == ["FAILED", "COMPLETED"], states
    steps = subprocess.run(
        ["sacct", "-n", "-P", "--format=JobID,State,ExitCode", "-j", jobs[0]],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    # the training step (srun, JOBID.0) ended with EXIT_PREEMPTED, as Slurm recorded it -- or,
    # when one rank exited 75 a moment before the other, srun's --kill-on-bad-exit ended it
    step = next(line for line in steps if line.startswith(f"{jobs[0]}.0|"))
    assert step in (f"{jobs[0]}.0|FAILED|75:0", f"{jobs[0]}.0|CANCELLED|0:15"), steps


def test_snakemake_killed_during_training_then_rerun_never_runs_two_trainers(
    slurm_pipeline, tiny_config
):
    """SIGKILL to the Snakemake process while its training job runs: the Slurm job goes on.
    Snakemake started again submits the job again; that trainer waits for the lock of the
    live one instead of training beside it, then resumes from its final checkpoint."""
    wd = slurm_pipeline.workdir
    config = long_training_config(
        wd, tiny_config, "killed.yaml", train_iters=1500, save_interval=500, eval_interval=5000
    )
    before = set(train_job_ids(wd))
    proc = subprocess.Popen(
        slurm_snakemake_cmd(wd, config, "train"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=SNAKEMAKE_ENV,
    )  # fmt: skip
    history = wd / "results/runs/tiny/train.log"
    start = len(history.read_text()) if history.is_file() else 0
    try:
        deadline = time.monotonic() + 600
        while not (set(train_job_ids(wd)) - before and " iteration       20/    1500" in
                   (history.read_text()[start:] if history.is_file() else "")):  # fmt: skip
            assert proc.poll() is None, "snakemake ended before training got going"
            assert time.monotonic() < deadline, "training never got going"
            time.sleep(0.5)
    finally:
        proc.kill()  # the controller dies; its Slurm job does not
        proc.wait()
    (first,) = set(train_job_ids(wd)) - before
    assert subprocess.run(["squeue", "-h", "-j", first], capture_output=True, text=True).stdout
    # a killed Snakemake leaves its working-directory lock; it says to run --unlock
    assert slurm_snakemake(wd, config, "--unlock").returncode == 0
    rerun = slurm_snakemake(wd, config, "train")
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-5000:]
    log = history.read_text()[start:]
    assert "another trainer is running this run" in log and "waiting up to" in log
    first_done = log.index("done: step 1500")
    assert log.index("resuming from step 1500;") > first_done  # after the first one finished
    assert log.count("starting at step 0") == 1  # one trajectory, trained once
    jobs = sorted(set(train_job_ids(wd)) - before, key=int)
    assert jobs[0] == first and len(jobs) == 2, jobs  # the first job and the rerun's
    assert sacct_job_states(jobs) == dict.fromkeys(jobs, "COMPLETED")
    assert json.loads((wd / "results/runs/tiny/DONE.json").read_text())["final_step"] == 1500
