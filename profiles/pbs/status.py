#!/usr/bin/env python3
"""Snakemake's cluster-generic status command for PBS: `status.py JOBID` prints running,
success or failed, from `qstat -f -x JOBID` (PBS Pro: -x keeps finished jobs; Torque: -x is
XML, read too), else `qstat -f JOBID` (where qstat has no -x).

A finished job (state F or C) with an exit status is a success when it is 0. Where qstat shows
none -- Slurm's Torque wrappers (slurm-wlm-torque) never do, and a job PBS has already
forgotten is unknown -- Slurm's sacct answers when it is on PATH; otherwise the job counts as
a success and Snakemake's own check of the rule's outputs decides (a job whose outputs are
missing fails there). Python's standard library only: it runs where Snakemake runs."""

import re
import shutil
import subprocess
import sys

RUNNING = set("QRHWTESUBM")  # queued, running, held, waiting, transit, exiting, suspended...
FINISHED = set("FCX")  # finished (PBS Pro), completed (Torque), expired subjob


def qstat(job: str) -> str:
    for flags in (["-f", "-x"], ["-f"]):
        out = subprocess.run(["qstat", *flags, job], capture_output=True, text=True)
        text = out.stdout + out.stderr
        # exit 153 (PBSE_UNKJOBID % 256, as PBS, Torque and Slurm's wrapper exit): unknown job
        if out.returncode in (0, 153) or re.search(r"unknown job", text, re.I):
            return text
        if not re.search(r"unknown option|usage", text, re.I):
            sys.exit(f"status.py: qstat {' '.join(flags)} {job} failed: {text.strip()}")
    return ""


def sacct(job: str) -> str | None:
    """Slurm's verdict on a job submitted through its Torque wrappers, or None."""
    if shutil.which("sacct") is None:
        return None
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "--format=State,ExitCode"],
                         capture_output=True, text=True)  # fmt: skip
    line = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
    if not line:
        return None
    state, _, code = line[0].partition("|")
    if state in ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "COMPLETING"):
        return "running"
    return "success" if state == "COMPLETED" and code == "0:0" else "failed"


def status(job: str) -> str:
    text = qstat(job)
    state = re.search(r"job_state\s*=\s*(\w)|<job_state>(\w)</job_state>", text)
    state = (state.group(1) or state.group(2)) if state else None
    if state in RUNNING:
        return "running"
    code = re.search(r"exit_status\s*=\s*(-?\d+)|<exit_status>(-?\d+)</exit_status>", text, re.I)
    if state in FINISHED and code:
        return "success" if int(code.group(1) or code.group(2)) == 0 else "failed"
    return sacct(job) or "success"


if __name__ == "__main__":
    print(status(sys.argv[1]))
