"""Run Snakemake on this repository's Snakefile in a scratch working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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

    def run(workdir: Path, configfile: Path, *args: str, timeout: int = 900):
        proc = subprocess.run(
            snakemake_cmd(workdir, configfile, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
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
