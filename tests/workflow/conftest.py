"""Run Snakemake on this repository's Snakefile in a scratch working directory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.slurm_cluster import start as slurm_cluster_start

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def snakemake_cmd(workdir: Path, configfile: Path, *args: str) -> list[str]:
    return [
        str(BIN / "snakemake"),
        "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir),
        "--profile", str(REPO / "profiles" / "local"),
        "--configfile", str(configfile),
        "--cores", "2",
        *args,
    ]  # fmt: skip


@pytest.fixture(scope="session")
def snakemake():
    """snakemake(workdir, configfile, *args) -> CompletedProcess (stdout+stderr in .out)."""

    def run(workdir: Path, configfile: Path, *args: str, timeout: int = 900, env=None):
        proc = subprocess.run(
            snakemake_cmd(workdir, configfile, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            env=env,
        )
        proc.out = proc.stdout
        return proc

    return run


@pytest.fixture(scope="session")
def write_config():
    def write(path: Path, cfg: dict) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    return write


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a Snakemake run or dry run."""
    counts: dict[str, int] = {}
    lines = output.splitlines()
    if "Job stats:" not in lines:
        return counts
    for line in lines[lines.index("Job stats:") + 3 :]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit() or parts[0] == "total":
            break
        counts[parts[0]] = int(parts[1])
    return counts


def most_at_once(output: str, rules: set[str]) -> int:
    """The most jobs of `rules` a Snakemake run's log shows running at the same time: a job
    runs from its `rule NAME:` block (its `jobid: N`) to `Finished jobid: N`."""
    running: set[str] = set()
    most, rule = 0, None
    for line in output.splitlines():
        line = line.strip()
        if m := re.fullmatch(r"(?:local)?rule (\w+):", line):
            rule = m[1]
        elif (m := re.fullmatch(r"jobid: (\d+)", line)) and rule in rules:
            running.add(m[1])
            most = max(most, len(running))
            rule = None
        elif m := re.match(r"Finished jobid: (\d+)", line):
            running.discard(m[1])
    return most


@pytest.fixture(scope="session")
def chromium():
    """Debian's chromium, installed when missing (root only)."""
    path = shutil.which("chromium")
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(
            f"Debian's chromium is not installed, and installing it needs root and apt-get "
            f"(here uid {os.geteuid()}, apt-get {'present' if shutil.which('apt-get') else 'missing'}); "
            "the report is checked in a real headless browser"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"],
        check=True, env=env, timeout=900, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return shutil.which("chromium")


def headless(chromium: str, page: Path, *args: str) -> str:
    out = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
         "--window-size=1400,900", *args, page.as_uri()],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def screenshot_pixels(png: Path):
    """(height, width, 3) uint8 RGB of a PNG screenshot (Pillow, a dependency of matplotlib)."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="session")
def tiny():
    """The tests' tiny workflow config (copy before editing: it is shared)."""
    return yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory, snakemake, write_config, tiny):
    """Plan, then run, the tiny pipeline once for the session (test_pipeline and test_harness
    read it; their tests share the worker that runs it: ONE_WORKER in tests/conftest.py). Tests
    only read it; one that changes anything takes a copy."""
    wd = tmp_path_factory.mktemp("workflow")
    config = write_config(wd / "config.yaml", tiny)
    plan = snakemake(wd, config, "-n")
    run = snakemake(wd, config)
    assert run.returncode == 0, run.out[-5000:]
    return wd, config, plan, run


@pytest.fixture
def pipeline_copy(pipeline, tmp_path):
    """(workdir, config): a copy of the finished pipeline (Snakemake's metadata and every
    file's mtime kept) for a test that reruns or changes something."""
    wd, config, _, _ = pipeline
    copy_wd = tmp_path / "wd"
    shutil.copytree(wd, copy_wd, symlinks=True, ignore=shutil.ignore_patterns("locks"))
    return copy_wd, copy_wd / config.relative_to(wd)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The test Slurm cluster (tests/slurm/start-cluster.sh), with Slurm's Torque wrappers
    (qsub, qstat, qdel) in front of it; started once per session (test_slurm, test_pbs)."""
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
    out = slurm_cluster_start()  # waits for the session's early start, if there was one
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()
