"""What the trainer reports: the per-interval accumulators, the iteration line, metrics.jsonl
(and TensorBoard), and the throughput figures (tokens/s, TFLOP/s per device, MFU)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gptflow.fsutil import atomic_write
from gptflow.progress import hms
from gptflow.train.device import Device

log = logging.getLogger("gptflow.train")


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step or evaluation, for the current series.

    On resume at step S the records after S (written by the interrupted attempt) are dropped
    (all of them when S is -1: a fresh start), so the file always describes one trajectory;
    records of another series are archived in that series' checkpoint directory rather than
    mixed in.
    """

    def __init__(
        self,
        path: Path,
        series: str,
        series_dir: Path,
        resume_step: int,
        tensorboard_dir: Path | None = None,
    ) -> None:
        self.path = path
        self.series = series
        self.tensorboard = None
        if tensorboard_dir is not None:  # the same records as scalars "{kind}/{key}"
            from torch.utils.tensorboard import SummaryWriter

            # events past the resumed step (the interrupted attempt's) are purged
            purge = resume_step + 1 if resume_step >= 0 else None
            self.tensorboard = SummaryWriter(str(tensorboard_dir), purge_step=purge)
        kept: list[str] = []
        if path.is_file():
            lines = path.read_text().splitlines()
            first = json.loads(lines[0]) if lines else {}
            if first.get("series") not in (None, series):
                archive = series_dir.parent / first["series"] / "metrics.jsonl"
                archive.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, archive)
                lines = []
                restore = series_dir / "metrics.jsonl"
                if restore.is_file():
                    lines = restore.read_text().splitlines()
            kept = [line for line in lines if json.loads(line).get("step", 0) <= resume_step]
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            f.writelines(line + "\n" for line in kept)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"series": self.series, **record}) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "kind", "time") and isinstance(value, int | float):
                    self.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])
            self.tensorboard.flush()


class Interval:
    """What a log interval accumulates, kept on the device and read once per log line.

    Each step adds the mean loss over the ranks (one all-reduce of a scalar on the device,
    no host sync), so every rank holds the same numbers and a checkpoint can carry them: a
    run resumed in the middle of an interval logs what the uninterrupted run logs.
    Non-finite losses are counted (in total and in a row) the same way.
    """

    def __init__(self, dev: Device, saved: dict | None = None) -> None:
        self.dev = dev
        # [loss sum over the interval's steps, non-finite steps in total, ... in a row]
        self.sums = dev.zeros(3)
        self.steps = 0
        if saved:
            self.sums.copy_(torch.tensor(saved["sums"], dtype=torch.float64))
            self.steps = int(saved["steps"])
        self.started = time.perf_counter()

    def add(self, step_loss: torch.Tensor, micro_batches: int) -> None:
        """`step_loss`: this rank's loss summed over its micro-batches (a device scalar)."""
        mean = self.dev.sum_over_ranks(step_loss / micro_batches) / self.dev.world_size
        bad = (~torch.isfinite(mean)).to(torch.float64)
        self.sums[0] += mean
        self.sums[1] += bad
        self.sums[2] = (self.sums[2] + 1) * bad
        self.steps += 1

    def read(self, *extra: torch.Tensor) -> list[float]:
        """[mean loss, non-finite steps, ... in a row, *extra] in one host sync."""
        values = torch.cat([self.sums, *(e.reshape(1).to(self.sums) for e in extra)]).tolist()
        values[0] /= max(1, self.steps)
        return values

    def restart(self) -> None:
        """A new interval: the loss sum starts again, the non-finite counts go on."""
        self.sums[0] = 0.0
        self.steps = 0
        self.started = time.perf_counter()

    def state(self) -> dict:
        """For the checkpoint (read on the host when saving, not per step)."""
        return {"sums": self.sums.tolist(), "steps": self.steps}


@dataclass(frozen=True)
class Throughput:
    """Tokens/s, model TFLOP/s per device and MFU over `seconds` for `steps` steps."""

    ms_per_step: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float | None

    @classmethod
    def measure(
        cls,
        steps: int,
        seconds: float,
        tokens_per_step: int,
        flops_per_token: float,
        world_size: int,
        peak_tflops: float | None,
    ) -> Throughput:
        from gptflow.hardware import mfu

        tokens_per_s = steps * tokens_per_step / seconds
        tflops = flops_per_token * tokens_per_s / world_size / 1e12
        return cls(1000 * seconds / steps, tokens_per_s, tflops, mfu(tflops, peak_tflops))


def iteration_line(step: int, total: int, rec: dict, elapsed_s: float, remaining_s: float) -> str:
    """Megatron's iteration line, with MFU and the time spent (this attempt) and left."""
    mfu = "n/a" if rec["mfu"] is None else f"{100 * rec['mfu']:.1f}%"
    grad = "n/a" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
    return (
        f" iteration {step:8d}/{total:8d} | consumed samples: {rec['consumed_samples']:12d} | "
        f"elapsed time per iteration (ms): {rec['ms_per_step']:.1f} | learning rate: "
        f"{rec['lr']:.6E} | global batch size: {rec['global_batch_size']:5d} | lm loss: "
        f"{rec['loss']:.6E} | loss scale: {rec['loss_scale']:.1f} | grad norm: {grad} | "
        f"number of skipped iterations: {rec['skipped_iters']:3d} | number of nan iterations: "
        f"{rec['nan_iters']:3d} | tokens per second: {rec['tokens_per_s']:.0f} | TFLOP/s per "
        f"device: {rec['tflops_per_device']:.3f} | MFU: {mfu} | elapsed: "
        f"{hms(elapsed_s)} | remaining: {hms(remaining_s)} |"
    )
