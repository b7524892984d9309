"""What the trainer reports: the per-interval accumulators, the iteration line, metrics.jsonl
(and TensorBoard, W&B), and the throughput figures (tokens/s, TFLOP/s per device, MFU)."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write
from gptflow.progress import hms
from gptflow.train.device import Device
from gptflow.train.run_config import RunConfig

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
        wandb: WandbRun | None = None,
    ) -> None:
        self.path = path
        self.series = series
        self.wandb = wandb  # the same records, as W&B history
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
            for key, value in scalars(record).items():
                self.tensorboard.add_scalar(key, value, record["step"])
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(record)

    def close(self) -> None:
        """At the end of an attempt (finished or stopped to resume)."""
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl record as ``{kind}/{key}`` scalars (what TensorBoard and
    W&B get): step, kind and time are the record's coordinates, and a null (MFU on a CPU) is
    no value."""
    return {
        f"{record['kind']}/{key}": value
        for key, value in record.items()
        if key not in ("step", "kind", "time")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    }


class WandbRun:
    """train.wandb: the metrics.jsonl records as the history of a W&B run (rank 0 only).

    One W&B run per checkpoint series; its id is kept in ``wandb/{series}.id`` in the run
    directory, so every attempt (restart, requeue, retry) resumes the same W&B run. W&B
    cannot rewind a run: the steps an attempt repeats after resuming from its last checkpoint
    are the ones W&B already holds, with the same values (resume is exact). Offline, each
    attempt is its own directory under ``wandb/`` with the same id, which ``wandb sync``
    uploads as one run. The API key is W&B's own reading of $WANDB_API_KEY; gptflow never
    handles it. Git metadata (a remote URL may carry a token) and console capture (the job
    log has it) are off.
    """

    def __init__(self, cfg: RunConfig) -> None:
        from gptflow.config.settings import check_wandb

        check_wandb(cfg.train.wandb, str(cfg.run_yaml_path))
        import wandb

        w = cfg.train.wandb
        id_path = cfg.wandb_dir / f"{cfg.series}.id"
        if id_path.is_file():
            run_id = id_path.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:12]  # W&B's ids: letters and digits
            id_path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(id_path) as f:
                f.write(run_id + "\n")
        try:
            self.run = wandb.init(
                project=w.project,
                entity=w.entity,
                name=w.name or f"{cfg.run}-{cfg.series}",
                id=run_id,
                resume="allow",
                mode=w.mode,
                dir=str(cfg.wandb_dir.parent),
                config=_wandb_config(cfg),
                settings=wandb.Settings(console="off", disable_git=True, save_code=False),
            )
        except Exception as e:  # wandb raises its own errors (CommError, UsageError, ...)
            reason = str(e).splitlines()[0][:300] if str(e) else ""
            raise GptflowError(
                f"train.wandb: W&B could not start run {run_id} in {w.mode} mode "
                f"({type(e).__name__}: {reason}); check the network and $WANDB_API_KEY, or set "
                f"train.wandb.mode: offline and upload later with `wandb sync`"
            ) from None
        log.info("W&B run %s (%s, project %s) in %s", run_id, w.mode, w.project, self.run.dir)

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def finish(self) -> None:
        self.run.finish()


def _wandb_config(cfg: RunConfig) -> dict:
    """What the W&B run shows as its config: run.yaml without the shard list (thousands of
    entries for a large corpus), which the datasets' names, weights and totals stand for."""
    d = cfg.to_dict()
    d["data"] = {
        "split": cfg.split,
        "datasets": [
            {"name": b.name, "weight": b.weight, "shards": len(b.shards),
             "tokens": sum(s.tokens for s in b.shards)}
            for b in cfg.datasets
        ],
    }  # fmt: skip
    d["series"] = cfg.series
    return d


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
        self.restart_clock()
        if self.steps:  # resumed inside an interval: its earlier steps were timed by no one
            self.leave_out(0.0, "the steps before the resume", steps=self.steps)

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
        self.restart_clock()

    def restart_clock(self) -> None:
        self.started = time.perf_counter()
        self.excluded = 0.0  # seconds of the interval that were not training
        self.untimed = 0  # steps whose time is not in the interval's (e.g. warm-up)
        self.left_out: list[str] = []  # what the excluded time was, for the log line

    def leave_out(self, seconds: float, what: str, steps: int = 0) -> None:
        """Take `seconds` spent on `what` (an evaluation, a save, the warm-up step) out of the
        interval's time, and `steps` steps out of its timed ones: tokens/s and MFU are of
        training alone."""
        self.excluded += seconds
        self.untimed += steps
        if what not in self.left_out:
            self.left_out.append(what)

    def timed(self) -> tuple[int, float]:
        """(steps timed, seconds they took): the interval's wall time less what was left out."""
        seconds = time.perf_counter() - self.started - self.excluded
        return self.steps - self.untimed, seconds

    def state(self) -> dict:
        """For the checkpoint (read on the host when saving, not per step)."""
        return {"sums": self.sums.tolist(), "steps": self.steps}


@dataclass(frozen=True)
class Throughput:
    """Tokens/s, model TFLOP/s per device and MFU over `seconds` for `steps` steps; all None
    when no step was timed (an interval of the warm-up step alone)."""

    ms_per_step: float | None
    tokens_per_s: float | None
    tflops_per_device: float | None
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

        if steps <= 0 or seconds <= 0:
            return cls(None, None, None, None)
        tokens_per_s = steps * tokens_per_step / seconds
        tflops = flops_per_token * tokens_per_s / world_size / 1e12
        return cls(1000 * seconds / steps, tokens_per_s, tflops, mfu(tflops, peak_tflops))


def iteration_line(step: int, total: int, rec: dict, elapsed_s: float, remaining_s: float) -> str:
    """Megatron's iteration line, with MFU, what its timing left out, and the time spent (this
    attempt) and left."""
    mfu = "n/a" if rec["mfu"] is None else f"{100 * rec['mfu']:.1f}%"
    grad = "n/a" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
    ms, tokens, tflops = (
        ("n/a", "n/a", "n/a")
        if rec["tokens_per_s"] is None
        else (f"{rec['ms_per_step']:.1f}", f"{rec['tokens_per_s']:.0f}",
              f"{rec['tflops_per_device']:.3f}")
    )  # fmt: skip
    left_out = rec["timing_excludes"]
    timing = f"timed without {', '.join(left_out)}" if left_out else "timed: all of it"
    if rec.get("save_blocked_s") is not None:
        timing += f" | checkpoint save blocked: {rec['save_blocked_s']:.2f} s"
    return (
        f" iteration {step:8d}/{total:8d} | consumed samples: {rec['consumed_samples']:12d} | "
        f"elapsed time per iteration (ms): {ms} | learning rate: "
        f"{rec['lr']:.6E} | global batch size: {rec['global_batch_size']:5d} | lm loss: "
        f"{rec['loss']:.6E} | loss scale: {rec['loss_scale']:.1f} | grad norm: {grad} | "
        f"number of skipped iterations: {rec['skipped_iters']:3d} | number of nan iterations: "
        f"{rec['nan_iters']:3d} | tokens per second: {tokens} | TFLOP/s per "
        f"device: {tflops} | MFU: {mfu} | {timing} | elapsed: "
        f"{hms(elapsed_s)} | remaining: {hms(remaining_s)} |"
    )


def save_summary(saves: list[dict], mode: str) -> dict:
    """The checkpoint saves of the series (metrics.jsonl's "save" records, every attempt):
    how many, and the seconds each held training -- for DONE.json and the run card."""
    blocked = sorted(r["blocked_s"] for r in saves)
    return {
        "mode": mode,
        "count": len(blocked),
        "blocked_s_median": blocked[len(blocked) // 2] if blocked else None,
        "blocked_s_max": blocked[-1] if blocked else None,
        "blocked_s_total": sum(blocked),
    }


def parallel_line(t, dp: int) -> str:
    """` = 2 tensor x 4 data parallel` (only the model-parallel sizes in use), or nothing."""
    sizes = [(t.tensor_parallel, "tensor"), (t.pipeline_parallel, "pipeline")]
    used = [f"{n} {kind}" for n, kind in sizes if n > 1]
    return f" = {' x '.join([*used, f'{dp} data'])} parallel" if used else ""
