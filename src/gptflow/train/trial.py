"""An autotune trial (gptflow.plan.autotune): a few steps of one layout of a run, timed, as
one ``train_gpt`` job. Its trainer (train.autotune_trial) neither evaluates nor saves. A rank
that runs out of memory (a GPU's, or the CPU allocator's under autotune.memory_limit_mb)
writes a record into the run's ``out_of_memory/`` (:func:`record_out_of_memory`) and fails;
:func:`run_trial` -- ``gptflow autotune-trial``, which the job's command starts the launcher
behind (:func:`trial_command`) -- then writes the trial's DONE.json saying so and succeeds, so
that the search goes on and the candidate is not tried again. Any other failure stays a
failure.

Imports nothing heavy: the rules read :func:`trial_command` at every plan.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gptflow import paths
from gptflow.fsutil import write_json

# what PyTorch's CPU allocator says when an allocation is refused (c10/core/impl/alloc_cpu.cpp)
CPU_ALLOCATOR_REFUSED = (
    "DefaultCPUAllocator: not enough memory",
    "DefaultCPUAllocator: can't allocate",
)
OUT_OF_MEMORY = "out_of_memory"  # a trial's DONE.json status
MEASURED = "measured"


def trial_command(run_dir: str, spec: dict, launcher: list[str]) -> list[str]:
    """The words before ``gptflow train`` in a trial's job: its launcher behind
    ``gptflow autotune-trial``."""
    limit = spec.get("memory_limit_mb")
    return [
        "gptflow", "autotune-trial", "--run-dir", run_dir,
        *(["--memory-limit-mb", str(limit)] if limit else []),
        "--", *launcher,
    ]  # fmt: skip


def is_out_of_memory(e: BaseException) -> bool:
    """`e` is an allocation refused: torch's OutOfMemoryError (a GPU's, or the CPU allocator's
    in recent PyTorch), the CPU allocator's RuntimeError, or Python's MemoryError."""
    import torch

    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in CPU_ALLOCATOR_REFUSED)


def record_out_of_memory(run_dir: Path, rank: int, e: BaseException) -> str:
    """Rank `rank`'s record that it ran out of memory (one file a rank: no two ranks write the
    same file); returns the one-line error the rank fails with."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    write_json(
        paths.in_run_dir(paths.OUT_OF_MEMORY_DIR, run_dir) / f"rank{rank}.json",
        {"rank": rank, "error": type(e).__name__, "message": first[:1000], "time": time.time()},
    )
    return f"rank {rank} ran out of memory ({type(e).__name__}: {first[:300]})"


def run_trial(run_dir: Path, command: list[str], memory_limit_mb: int | None = None) -> int:
    """Run a trial's `command` (its launcher and ``gptflow train``); returns its exit code, or
    0 after it ran out of memory, with the trial's DONE.json written saying so. SIGTERM,
    SIGINT and SIGUSR1 are passed on to it (a job cancelled, a preemption's warning)."""
    records = paths.in_run_dir(paths.OUT_OF_MEMORY_DIR, run_dir)
    for old in records.glob("rank*.json"):  # an earlier attempt's
        old.unlink()
    limit = None if memory_limit_mb is None else memory_limit_mb * 2**20

    def limited() -> None:
        if limit is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    sys.stdout.flush()
    child = subprocess.Popen(command, preexec_fn=limited)  # this process runs no thread
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    found = sorted(records.glob("rank*.json"))
    if code == 0 or not found:
        return code
    ranks = [json.loads(f.read_text()) for f in found]
    done = paths.in_run_dir(paths.DONE, run_dir)
    write_json(
        done,
        {
            "run": Path(run_dir).name,
            "trial": {
                "status": OUT_OF_MEMORY,
                "ranks": [r["rank"] for r in ranks],
                "message": ranks[0]["message"],
                "exit_code": code,
                "memory_limit_mb": memory_limit_mb,
            },
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )
    print(
        f"gptflow autotune-trial: {Path(run_dir).name} ran out of memory on rank(s) "
        f"{', '.join(str(r['rank']) for r in ranks)} ({ranks[0]['message'][:200]}); recorded in "
        f"{done}: the search goes on without it",
        flush=True,
    )
    return 0


def trial_done(run_dir: str | os.PathLike) -> dict:
    """A finished trial's DONE.json's ``trial`` record."""
    done = json.loads(paths.in_run_dir(paths.DONE, run_dir).read_text())
    return done.get("trial") or {"status": MEASURED}
