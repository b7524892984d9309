"""`snakemake` as the Slurm tests run it: the real CLI and the real Slurm plugin, with one change,
the wait between two status checks capped at CAP seconds.

The plugin (2.8.0) adds 10 s to that wait after every check that finds no job finished, up to
180 s: right for a busy cluster, but on the test cluster a 60 s training job was noticed up to
30 s after it ended and a chain of ten short jobs waited about 12 s on each. Submission, the
sacct/squeue queries, the states read and every decision stay the plugin's own; only how long
Snakemake sleeps between them differs. Jobs run `python -m snakemake`, not this file."""

import sys

from snakemake.cli import main
from snakemake_executor_plugin_slurm import Executor

CAP = 3  # seconds; the test profile's slurm-init-seconds-before-status-checks is 2

_wait = Executor.next_seconds_between_status_checks
Executor.next_seconds_between_status_checks = _wait.setter(
    lambda self, seconds: _wait.fset(self, None if seconds is None else min(seconds, CAP))
)

if __name__ == "__main__":
    sys.exit(main())
