"""A PATH without Slurm: what Snakemake's Slurm executor meets on a machine that is not a
cluster, even when this one has Slurm installed (tests/slurm/start-cluster.sh)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

SLURM_COMMANDS = re.compile(
    r"s(batch|alloc|attach|bcast|cancel|control|diag|info|prio|queue|report|share|stat"
    r"|trigger|view|acct|acctmgr|run|crontab|h5util)|slurm.*|munge.*"
)


def path_without_slurm(directory: Path) -> str:
    """A PATH of one directory, `directory`, holding links to every executable of the venv and
    of $PATH (first one of a name wins) except Slurm's and munge's commands."""
    directory.mkdir(parents=True, exist_ok=True)
    for d in [str(Path(sys.executable).parent), *os.environ["PATH"].split(os.pathsep)]:
        for exe in Path(d).glob("*") if Path(d).is_dir() else ():
            link = directory / exe.name
            if (
                SLURM_COMMANDS.fullmatch(exe.name)
                or os.path.lexists(link)
                or not os.access(exe, os.X_OK)
            ):
                continue
            link.symlink_to(exe)
    for tool in ("sbatch", "sinfo", "sacct", "sacctmgr", "squeue", "scontrol", "srun"):
        assert shutil.which(tool, path=str(directory)) is None, tool
    return str(directory)
