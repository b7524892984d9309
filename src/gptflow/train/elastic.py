"""What a resume on another number of ranks changes and keeps -- an elastic run's change of
membership (train.elastic), or a run moved by hand: the world size, the data-parallel size and
the gradient accumulation before and after, as a metrics.jsonl record (kind "resize") and the
train log's line; and the samples each step consumed (train.log_samples), to show they are
the same whatever the number of ranks."""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path


def resize_record(
    t, saved: dict, client: dict, world_size: int, grad_accum: int, resume_mode: str
) -> dict | None:
    """The record of a resume at `world_size` ranks (`grad_accum` micro-batches a step,
    loaded the `resume_mode` way) of a checkpoint saved in layout `saved` (gptflow.train.loop
    .layout_of) with client state `client` (its step and grad accum); `t` is the run's
    TrainConfig. None at the checkpoint's own number of ranks."""
    before = saved.get("world_size")
    if before is None or before == world_size:
        return None
    tp, pp = saved.get("tensor_parallel", 1), saved.get("pipeline_parallel", 1)
    return {
        "step": int(client["step"]),
        "kind": "resize",
        "previous_world_size": before,
        "world_size": world_size,
        "previous_data_parallel": before // (tp * pp),
        "data_parallel": t.data_parallel_size(world_size),
        "previous_grad_accum": client.get("grad_accum"),  # None: saved before it was recorded
        "grad_accum": grad_accum,
        "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "resume_mode": resume_mode,
        # torchrun's restarts after failed ranks (a change of membership counts none)
        "failure_restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "time": time.time(),
    }


def resize_line(rec: dict) -> str:
    """The train log's line of :func:`resize_record`'s record."""
    return (
        f"world size changed at iteration {rec['step']}: {rec['previous_world_size']} -> "
        f"{rec['world_size']} ranks (data parallel {rec['previous_data_parallel']} -> "
        f"{rec['data_parallel']}, grad accum {rec['previous_grad_accum']} -> "
        f"{rec['grad_accum']} x micro batch {rec['micro_batch_size']}); global batch "
        f"{rec['global_batch_size']} and sample order kept; checkpoint loaded "
        f"{rec['resume_mode']}"
    )


class SampleLog:
    """train.log_samples: the samples this rank read in each step, appended to
    ``samples.jsonl`` as one line a step ({step, rank, world_size, first_step, samples:
    [[index in the training split, crc32 of its tokens], ...]}), each line one write to a
    file opened for appending, so the ranks' lines do not interleave. A rank's lines of an
    attempt after its `first_step` replace those of an earlier attempt (:func:`consumed`)."""

    def __init__(self, path: Path, rank: int, world_size: int, first_step: int) -> None:
        self.path, self.rank, self.world_size, self.first_step = path, rank, world_size, first_step
        self.seen: list[list[int]] = []

    def add(self, start: int, rows) -> None:
        """Micro-batch rows (numpy, on the host) read from sample `start` on."""
        self.seen += [[start + i, zlib.crc32(row.tobytes())] for i, row in enumerate(rows)]

    def write(self, step: int) -> None:
        line = {"step": step, "rank": self.rank, "world_size": self.world_size,
                "first_step": self.first_step, "samples": self.seen}  # fmt: skip
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        self.seen = []


def consumed(path: Path) -> dict[int, list[list[int]]]:
    """{step: its samples, in index order} from a ``samples.jsonl``: each step's lines of the
    latest attempt that ran it (the greatest first_step below it), every rank's together."""
    latest: dict[int, int] = {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    for r in lines:
        latest[r["step"]] = max(latest.get(r["step"], -1), r["first_step"])
    out: dict[int, list[list[int]]] = {}
    for r in lines:
        if r["first_step"] == latest[r["step"]]:
            out.setdefault(r["step"], []).extend(r["samples"])
    return {step: sorted(samples) for step, samples in sorted(out.items())}
