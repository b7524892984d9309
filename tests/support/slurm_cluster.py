"""The test cluster (tests/slurm/start-cluster.sh), started once per test session.

Snakemake imports every installed executor plugin on each run, and the Slurm plugin (2.8.0)
runs `scontrol show config` as it is imported. Where Slurm's commands are installed but no
controller answers, that call waits about 9 s (10 s where Slurm is not configured): every
`snakemake` the suite starts, and every `gptflow why`, paid it: about 11 of the 40 minutes
of a run that began with the cluster stopped (as CI's do).
So where this machine's Slurm is the test cluster (its slurm.conf was written by
start-cluster.sh), the session starts the cluster as it begins, in the background, and the
Slurm tests' fixture waits for that start instead of making its own. A machine without Slurm
installed pays nothing (no scontrol to call) and starts nothing early. Under pytest-xdist the
controller starts it early; a worker's fixture runs the script, which waits on its own lock
while that start runs (tests/slurm/start-cluster.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START = REPO / "tests" / "slurm" / "start-cluster.sh"
OURS = "# written by gptflow tests/slurm/start-cluster.sh"
SLURM_CONF = Path("/etc/slurm/slurm.conf")

_early: subprocess.Popen | None = None


def ours_installed() -> bool:
    """Root, Slurm's daemons installed, and the slurm.conf the test cluster wrote."""
    try:
        first = SLURM_CONF.read_text().split("\n", 1)[0]
    except OSError:
        return False
    return os.geteuid() == 0 and shutil.which("slurmctld") is not None and first == OURS


def start_early() -> None:
    """Start the test cluster in the background if this machine's Slurm is it."""
    global _early
    if _early is None and ours_installed():  # its output: start() runs the script again
        _early = subprocess.Popen(["bash", str(START)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)  # fmt: skip


def start(timeout: int = 600) -> subprocess.CompletedProcess:
    """The cluster up: waits for the early start when there was one, then runs start-cluster.sh
    (about 1 s when everything runs; it installs, configures and starts what does not)."""
    global _early
    if _early is not None:
        early, _early = _early, None
        try:
            early.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            early.kill()
    return subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip
