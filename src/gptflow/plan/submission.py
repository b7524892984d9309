"""Jobs the cluster never ran: a submission sbatch (or the Slurm plugin) refused.

Snakemake reports such a job as failed, retries it (``retries``) and then points at the job's
log "for error details" -- a log the job never wrote. After a failed run (the Snakefile's
``onerror``), this copies the refusal and the number of attempts into each such log, so the
file the user is sent to holds the reason.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# the first line of the messages Snakemake's Slurm plugin gives a refused submission
REFUSED = re.compile(r"(SLURM sbatch failed\. .*|Job submission failed with exception: .*)")


@dataclass
class Refusal:
    rule: str
    log: str
    message: str
    attempts: int = 1


def refused_submissions(snakemake_log: str) -> list[Refusal]:
    """The refused submissions of a Snakemake run's output (its log file), by job log."""
    found: dict[str, Refusal] = {}
    for block in re.split(r"^Error in rule ", snakemake_log, flags=re.M)[1:]:
        rule = block.split(":", 1)[0]
        message = REFUSED.search(block.split("\n    jobid:", 1)[0])
        log = re.search(r"^    log: (.+?) \(check log file", block, re.M)
        if not message or not log:
            continue
        text = message[1].split("For further error details")[0].strip()
        if log[1] in found:
            found[log[1]].attempts += 1
        else:
            found[log[1]] = Refusal(rule, log[1], text)
    return list(found.values())


def record_refusals(snakemake_log: str | os.PathLike, workdir: str | os.PathLike = ".") -> int:
    """Append each refused submission's reason to its job's log; returns how many."""
    path = Path(snakemake_log)
    if not path.is_file():
        return 0
    refusals = refused_submissions(path.read_text(errors="replace"))
    for r in refusals:
        log = Path(workdir) / r.log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(
                f"gptflow: Slurm never ran this {r.rule} job: its submission was refused "
                f"{r.attempts} time(s) with\n  {r.message}\nFix what that names (often the "
                f"profile: partition, account, gres, time, constraint, QOS) and run again.\n"
            )
    return len(refusals)
