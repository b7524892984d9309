"""The training loop: resume -> for each step: batches -> forward/backward/step -> log -> eval
-> save. Each stage is a short function below; :func:`run` reads as the list of them.

Data order is a pure function of (seed, consumed samples): step s of every rank reads samples
``[s * global_batch, (s+1) * global_batch)`` of the training split, rank r's micro-batch m being
the slice ``(m * ranks + r) * micro_batch`` of it (Megatron's pretraining sampler). Dropout RNG is
reseeded from (seed, step, micro-batch, data-parallel rank): under tensor parallel the same on
the ranks of a group, the attention's dropout (its heads are split) drawing from a fork of it
per tensor-parallel rank (:func:`gptflow.train.model_parallel.split_region_rng`). Together with
DeepSpeed's model, optimizer and scheduler state and the log interval's sums (saved with each
checkpoint) that makes a resumed run repeat the uninterrupted one bit for bit.

The loop reads the device once per log interval (:class:`~gptflow.train.metrics.Interval`);
every tensor it makes comes from :class:`~gptflow.train.device.Device`.

Over 500 lines: the loop's named steps (building, one step, reporting, saving and stopping),
each a short function, so that :func:`run` reads as the list of them on one screen.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gptflow.config.settings import MUON_NS_STEPS, check_kfac, training_flops_per_token
from gptflow.data.dataset import run_split_datasets
from gptflow.environment import versions
from gptflow.errors import GptflowError
from gptflow.fsutil import write_json
from gptflow.hardware import background_saves, peak_tflops
from gptflow.train import distributed
from gptflow.train import engine as ds
from gptflow.train.checkpoint import CheckpointSeries, checkpoint_digest, resume_mode, tag_for
from gptflow.train.device import Device
from gptflow.train.elastic import SampleLog, resize_line, resize_record
from gptflow.train.kfac import Kfac
from gptflow.train.metrics import (
    Interval,
    MetricsLog,
    Throughput,
    WandbRun,
    iteration_line,
    parallel_line,
    save_summary,
)
from gptflow.train.model_parallel import use_split_region_rng
from gptflow.train.run_config import RunConfig
from gptflow.train.saves import Saves

log = logging.getLogger("gptflow.train")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved after a signal; run again to resume
MAX_NAN_STREAK = 10  # NaN/inf losses in a row before the run stops (diverged)
DIVERGED = "DIVERGED.json"  # in the series' directory: the run stopped for good
signals_received: list[int] = []  # appended to by the SIGUSR1/SIGTERM handler


@dataclass
class Trainer:
    """What the loop works with, built once by :func:`build`."""

    cfg: RunConfig
    dev: Device
    rank: int
    launcher: str
    engine: object
    series: CheckpointSeries
    train_data: object
    valid_data: object | None
    gas: int  # micro-batches per step on each rank
    flops_per_token: float
    peak_tflops: float | None
    exit_interval: int | None
    resume_from: int | None  # the newest complete step of the series
    resume_mode: str  # how it loads: "native", or "universal" (saved in another layout)
    saves: Saves  # synchronous, or in the background (train.async_save)
    metrics: MetricsLog | None = None  # rank 0
    sample_log: SampleLog | None = None  # train.log_samples
    kfac: Kfac | None = None  # train.kfac's preconditioner


@dataclass
class Progress:
    """Where the run is: the step done, and the current log interval."""

    step: int
    interval: Interval
    lr: float = 0.0
    grad_norm: torch.Tensor | None = None  # of the last step, when it is to be logged
    started: float = field(default_factory=time.perf_counter)  # this attempt
    first_step: int = 0  # of this attempt
    save_blocked: list[float] = field(default_factory=list)  # seconds, saves of the interval


def run(cfg: RunConfig, dev: Device, rank: int, launcher: str, exit_interval: int | None) -> int:
    """Train to ``train_iters`` (or to a stop); returns the process exit code."""
    t = cfg.train
    tr = build(cfg, dev, rank, launcher, exit_interval)
    prog = resume(tr)
    trial = t.autotune_trial  # timed steps only, no evaluation, no save (gptflow.train.trial)
    if prog.step == 0 and not trial:
        evaluate_and_log(tr, prog)
    while prog.step < t.train_iters:
        timed_step(tr, prog)
        stop = stop_reason(tr, prog.step)
        if prog.step % t.log_interval == 0 or prog.step == t.train_iters:
            log_progress(tr, prog)
        if (prog.step % t.eval_interval == 0 or prog.step == t.train_iters) and not trial:
            evaluate_and_log(tr, prog)
        if (stop or prog.step % t.save_interval == 0 or prog.step == t.train_iters) and not trial:
            save(tr, prog)
        if stop:
            tr.saves.settle()  # the save is on disk and complete before the exit
            code = announce_stop(tr, prog.step, stop)
            tr.saves.close()
            return code
    tr.saves.settle()
    finish(tr, prog.step)
    tr.saves.close()  # no writer thread is left when the process group goes and Python exits
    return 0


# ----------------------------------------------------------------------------- building


def build(
    cfg: RunConfig, dev: Device, rank: int, launcher: str, exit_interval: int | None
) -> Trainer:
    """Data indices, the model, the DeepSpeed engine and the checkpoint series."""
    t = cfg.train
    series = CheckpointSeries(cfg.checkpoint_dir, cfg.fingerprint(), t.keep_last, t.kept_for_good)
    series.check_fingerprint()
    if (series.dir / DIVERGED).is_file():  # retrying would diverge the same way
        earlier = json.loads((series.dir / DIVERGED).read_text())["message"]
        raise GptflowError(f"{series.dir / DIVERGED}: an earlier attempt stopped: {earlier}")
    resume_from, mode = series.latest_step(), "native"
    if resume_from is not None:
        saved = series.saved_layout(resume_from)
        now = layout_of(t, dev.world_size)
        mode = resume_mode(saved, now, series.dir / tag_for(resume_from))
    # The indices are normally built by the build_data_index rule before this job; rank 0
    # builds any that are missing (a direct `gptflow train`), the others then load them.
    data = run_split_datasets(cfg) if rank == 0 else None
    dev.barrier()
    if rank != 0:
        data = run_split_datasets(cfg, build_allowed=False)
    torch.manual_seed(t.seed)  # identical initialisation on every rank
    with initial_weights(cfg, rank, resume_from) as init:
        model = ds.build_model(cfg.model, t, dev.world_size, dev.device, init)
    use_split_region_rng(model, t, dev.device)  # attention dropout per tensor-parallel rank
    groups = ds.optimizer_groups(model, cfg.model, t)
    if rank == 0:
        log_optimizer(t, groups)
    engine = ds.build_engine(model, groups, t, dev.world_size, mode == "universal", dev.device)
    if t.pipeline_parallel > 1 and engine.grid.get_data_parallel_rank() != t.data_parallel_rank(
        rank, dev.world_size
    ):  # the data order assumes DeepSpeed's pipe-major layout of the ranks
        raise GptflowError(
            f"rank {rank}: DeepSpeed's pipeline grid makes it data-parallel rank "
            f"{engine.grid.get_data_parallel_rank()}, gptflow expected "
            f"{t.data_parallel_rank(rank, dev.world_size)}; this DeepSpeed lays ranks out "
            f"differently (report it with the DeepSpeed version)"
        )
    kfac = build_kfac(cfg, engine, dev, rank)
    in_background = background_saves(t.async_save, dev.name is not None)[0]
    gas = t.grad_accum_steps(dev.world_size)
    peak, source = peak_tflops(dev.name, t.peak_tflops)
    if rank == 0 and t.compile and engine.is_compiled:
        log.info("model compiled (torch.compile through DeepSpeed's engine.compile)")
    if rank == 0:
        log.info("MFU against %s", f"{peak:g} TFLOP/s ({source})" if peak else f"n/a: {source}")
    return Trainer(
        cfg=cfg,
        dev=dev,
        rank=rank,
        launcher=launcher,
        engine=engine,
        series=series,
        train_data=data["train"],
        valid_data=data["valid"],
        gas=gas,
        flops_per_token=training_flops_per_token(cfg.model, t),  # Newton-Schulz's too
        peak_tflops=peak,
        exit_interval=exit_interval,
        resume_from=resume_from,
        resume_mode=mode,
        saves=Saves(
            series, rank, in_background, dev.any_rank, dev.barrier, pins=dev.device.type == "cuda"
        ),
        kfac=kfac,
    )


def log_optimizer(t, groups: list[dict]) -> None:
    """With train.optimizer muon: which tensors each half steps (this rank's), and Muon's lrs."""
    if t.optimizer != "muon":
        return
    muon = [g for g in groups if g.get("use_muon")]
    log.info(
        "Muon on %d matrices, AdamW on %d tensors (rank 0's); Muon lr %s (%s), momentum %g, "
        "Newton-Schulz %s x %d, weight decay %g (x %s)",
        sum(len(g["params"]) for g in muon),
        sum(len(g["params"]) for g in groups if not g.get("use_muon")),
        "/".join(f"{g['lr']:.4g}" for g in muon),
        "RMS-matched to train.lr" if t.muon.lr is None else "train.muon.lr",
        t.muon.momentum, t.muon.ns_method, MUON_NS_STEPS,
        t.weight_decay if t.muon.weight_decay is None else t.muon.weight_decay,
        "train.lr" if t.muon.lr is None else "train.muon.lr",
    )  # fmt: skip


def build_kfac(cfg: RunConfig, engine, dev: Device, rank: int) -> Kfac | None:
    """train.kfac's hooks on the engine's module (refused in the layouts it does not support,
    also when a run.yaml is started by hand)."""
    t = cfg.train
    if t.kfac is None:
        return None
    check_kfac(cfg.model, t)
    kfac = Kfac(engine.module, t.kfac, dev.device)
    kfac.check_count(cfg.model)
    if rank == 0:
        log.info(
            "K-FAC on %d nn.Linear layers: factors every %d steps, eigendecomposition every %d, "
            "damping %g, decay %g; %.1f MiB of fp32 state per rank",
            len(kfac.layers), t.kfac.factor_update_steps, t.kfac.inv_update_steps,
            t.kfac.damping, t.kfac.factor_decay, 4 * kfac.numel() / 2**20,
        )  # fmt: skip
    return kfac


@contextlib.contextmanager
def initial_weights(cfg: RunConfig, rank: int, resume_from: int | None):
    """What build_model initialises the model from: model.init_from's Hugging Face weights at
    step 0 (each rank reads the parameters it holds), else its random initialisation (None).
    A run with a checkpoint does not read model.init_from: the checkpoint has the weights."""
    info = cfg.init_from
    if info is None or resume_from is not None:
        if info is not None and rank == 0:
            log.info("model.init_from %s not read: resuming from step %d", info.path, resume_from)
        yield None
        return
    from gptflow.train.init_from import HFWeights

    started = time.perf_counter()
    with HFWeights(info) as weights:
        yield weights
    if rank == 0:
        log.info(
            "model: step 0 from the Hugging Face checkpoint %s (weights sha256 %s, %s on disk, "
            "read as fp32; %.1f s)",
            info.path, info.sha256[:12], "/".join(sorted(weights.dtypes)) or "nothing read",
            time.perf_counter() - started,
        )  # fmt: skip


def layout_of(t, world_size: int) -> dict:
    """What a checkpoint's files depend on beyond the trajectory (kept in its COMPLETE), and
    what decides how it loads into another layout (:func:`gptflow.train.checkpoint.resume_mode`):
    the optimizer too, whose state a layout change must carry."""
    return {
        "world_size": world_size,
        "zero_stage": t.zero_stage,
        "precision": t.precision,
        "tensor_parallel": t.tensor_parallel,
        "pipeline_parallel": t.pipeline_parallel,
        "optimizer": t.optimizer,
    }


def layout(tr: Trainer) -> dict:
    return layout_of(tr.cfg.train, tr.dev.world_size)


def resume(tr: Trainer) -> Progress:
    """Load the newest complete checkpoint of the series, if any; open metrics.jsonl."""
    t, cfg = tr.cfg.train, tr.cfg
    step, saved_interval, resized = 0, None, None
    resumed_from = tr.resume_from
    if resumed_from is not None:
        path = tr.series.dir / tag_for(resumed_from)
        tag = tag_for(resumed_from)
        if tr.resume_mode == "universal":
            if tr.rank == 0:
                log.info("%s was saved in layout %s, this run's is %s: loading it through "
                         "DeepSpeed's universal checkpoint", path,
                         tr.series.saved_layout(resumed_from), layout(tr))  # fmt: skip
            tag = tr.series.universal_tag(
                resumed_from, tr.rank, ds.convert_to_universal, cfg.model.num_layers
            )
        load_path, client = tr.engine.load_checkpoint(
            str(tr.series.dir), tag=tag, load_module_strict=True
        )
        if load_path is None:
            raise GptflowError(f"{path}: DeepSpeed could not load it")
        step, saved_interval = int(client["step"]), client.get("interval")
        if tr.kfac is not None:
            tr.kfac.load_state_dict(client.get("kfac"), str(path))
        saved = tr.series.saved_layout(resumed_from) or {}  # another number of ranks: say so
        resized = resize_record(t, saved, client, tr.dev.world_size, tr.gas, tr.resume_mode)
    if t.log_samples:
        tr.sample_log = SampleLog(cfg.samples_path, tr.rank, tr.dev.world_size, step)
    if tr.rank == 0:
        # a fresh start (no complete checkpoint, e.g. killed in its first save) keeps nothing
        kept = step if resumed_from is not None else -1
        tb_dir = cfg.tensorboard_dir / cfg.series if t.tensorboard else None
        wb = WandbRun(cfg) if t.wandb.enabled else None
        tr.metrics = MetricsLog(cfg.metrics_path, cfg.series, tr.series.dir, kept, tb_dir, wb)
        log_start(tr, step, resumed_from is not None)
        if resized is not None:
            log.info(resize_line(resized))
            tr.metrics.write(resized)
    return Progress(step=step, interval=Interval(tr.dev, saved_interval), first_step=step)


def log_start(tr: Trainer, step: int, resumed: bool) -> None:
    cfg, t = tr.cfg, tr.cfg.train
    total_tokens = t.train_iters * t.tokens_per_step
    data_tokens = sum(d.tokens for d in cfg.datasets)
    dp = t.data_parallel_size(tr.dev.world_size)
    log.info(
        "run %s, series %s: %s; %s parameters; %d ranks (%s)%s, micro batch %d x grad accum %d "
        "x %d ranks = global batch %d; %d tokens/step; %d steps = %.3g tokens (%.2f epochs of "
        "%.3g data tokens); %s FLOPs per token, %.3g training FLOPs",
        cfg.run,
        cfg.series,
        f"resuming from step {step}" if resumed else "starting at step 0",
        f"{cfg.model.num_parameters():,}",
        tr.dev.world_size,
        tr.launcher,
        parallel_line(t, dp),
        t.micro_batch_size,
        tr.gas,
        dp,
        t.global_batch_size,
        t.tokens_per_step,
        t.train_iters,
        total_tokens,
        total_tokens / max(1, data_tokens),
        data_tokens,
        f"{tr.flops_per_token:,.0f}",
        tr.flops_per_token * total_tokens,
    )


# ----------------------------------------------------------------------------- one step


def reseed(seed: int, step: int, micro: int, rank: int, world: int, gas: int) -> None:
    """Dropout's RNG for one micro-batch: the same sample gets the same mask whatever the
    number of ranks (micro-batch m of one rank is micro-batch 0 of rank m of several).
    `rank` and `world` are data-parallel: a tensor-parallel group shares the stream (its
    replicated regions' masks agree; :func:`gptflow.train.model_parallel.split_region_rng`
    forks it)."""
    torch.manual_seed(seed * 1_000_003 + (step * gas + micro) * world + rank)


def batch(
    dataset, start: int, count: int, dev: Device, seen: SampleLog | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [start, start + count) as (inputs, labels) on the device, noted in `seen`."""
    rows = np.stack([dataset[i] for i in range(start, start + count)])
    if seen is not None:
        seen.add(start, rows)
    rows = dev.put(torch.from_numpy(rows))  # (B, T+1)
    return rows[:, :-1], rows[:, 1:]


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """Global L2 norm of the gradients, on their device (read with the log line)."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def micro_batch_start(t, step: int, micro: int, rank: int, world: int) -> int:
    """The first sample of micro-batch `micro` of data-parallel rank `rank` (of `world`) in
    optimizer step `step` (Megatron's pretraining sampler)."""
    return step * t.global_batch_size + (micro * world + rank) * t.micro_batch_size


WARM_UP = "the warm-up step"  # the attempt's first: allocations, DeepSpeed's lazy set-up


def timed_step(tr: Trainer, prog: Progress) -> None:
    """:func:`train_step`; the attempt's first step is warm-up, left out of the throughput."""
    started = time.perf_counter()
    train_step(tr, prog)
    if tr.sample_log is not None:  # train.log_samples: this rank's samples of the step
        tr.sample_log.write(prog.step)
    if prog.step == prog.first_step + 1:
        prog.interval.leave_out(time.perf_counter() - started, WARM_UP, steps=1)


def train_step(tr: Trainer, prog: Progress) -> None:
    """One optimizer step: `gas` micro-batches forward and backward, then the update."""
    t = tr.cfg.train
    if t.pipeline_parallel > 1:
        return pipeline_step(tr, prog)
    # the ranks of a model-parallel group read the same samples: the data-parallel rank's
    rank = t.data_parallel_rank(tr.rank, tr.dev.world_size)
    world = t.data_parallel_size(tr.dev.world_size)
    logs_next = (prog.step + 1) % t.log_interval == 0 or prog.step + 1 == t.train_iters
    step_loss = tr.dev.zeros()
    if tr.kfac is not None:
        tr.kfac.begin(prog.step)  # its hooks gather this step's statistics or not
    for micro in range(tr.gas):
        reseed(t.seed, prog.step, micro, rank, world, tr.gas)
        start = micro_batch_start(t, prog.step, micro, rank, world)
        x, y = batch(tr.train_data, start, t.micro_batch_size, tr.dev, tr.sample_log)
        loss = tr.engine(x, y)
        tr.engine.backward(loss)
        if micro == tr.gas - 1:
            if tr.kfac is not None:  # the accumulated gradients, before the update
                # fp16's scale as DeepSpeed holds it (a tensor stays on the device)
                scale = ds.loss_scale_value(tr.engine) if t.precision == "fp16" else None
                tr.kfac.step(prog.step, 1.0 if scale is None else scale)
            prog.lr = tr.engine.get_lr()[0]  # not lr_at(step): skipped steps hold the schedule
            own_norm = t.zero_stage == 0 and t.precision == "fp32" and t.tensor_parallel == 1
            if logs_next and own_norm:
                prog.grad_norm = grad_norm(tr.engine.module)  # DeepSpeed does not report it
        tr.engine.step()
        step_loss += loss.detach()
    prog.step += 1
    prog.interval.add(step_loss, tr.gas)


def pipeline_step(tr: Trainer, prog: Progress) -> None:
    """One optimizer step through the pipeline: DeepSpeed's ``train_batch`` runs this
    data-parallel rank's `gas` micro-batches under its 1F1B schedule (the first stage reads the
    inputs, the last the labels) and returns their mean loss, averaged over the data-parallel
    ranks and sent to every stage. Dropout is reseeded once per step, not per micro-batch (the
    schedule interleaves them): its masks differ from other layouts', the resume stays exact."""
    t = tr.cfg.train
    rank = t.data_parallel_rank(tr.rank, tr.dev.world_size)
    world = t.data_parallel_size(tr.dev.world_size)
    reseed(t.seed, prog.step, 0, rank, world, tr.gas)
    size = t.micro_batch_size
    starts = [micro_batch_start(t, prog.step, m, rank, world) for m in range(tr.gas)]
    micro_batches = (batch(tr.train_data, s, size, tr.dev, tr.sample_log) for s in starts)
    prog.lr = tr.engine.get_lr()[0]
    loss = tr.engine.train_batch(data_iter=micro_batches)
    prog.step += 1
    prog.interval.add(loss.detach().reshape(()) * tr.gas, tr.gas)


def stop_reason(tr: Trainer, step: int) -> str | None:
    """Why to save and exit after this step, agreed by all ranks: a signal reached any rank
    (Slurm's warning before the time limit, a preemption), or the exit interval is due. The
    same all-reduce carries the background checkpoint write's state (:class:`Saves`): a
    failed write stops training here, a finished one is marked complete."""
    signalled, *saves = tr.dev.any_rank(bool(signals_received), *tr.saves.flags())
    tr.saves.agreed(*saves)
    if signalled:
        return f"received signal {signals_received[0] if signals_received else 'on another rank'}"
    if tr.exit_interval and step % tr.exit_interval == 0 and step < tr.cfg.train.train_iters:
        return f"exit interval {tr.exit_interval}"
    return None


# ----------------------------------------------------------------------------- reporting


def log_progress(tr: Trainer, prog: Progress) -> None:
    """The log line and metrics record of the interval: the loop's one host sync."""
    t = tr.cfg.train
    norm = prog.grad_norm if prog.grad_norm is not None else ds.global_grad_norm(tr.engine)
    on_device = isinstance(norm, torch.Tensor)
    loss, nan_iters, nan_streak, *read = prog.interval.read(*([norm] if on_device else []))
    norm = read[0] if on_device else norm  # a float or None already
    if nan_streak > MAX_NAN_STREAK:
        message = (
            f"the loss was NaN or infinite for {int(nan_streak)} steps in a row (steps "
            f"{prog.step - int(nan_streak) + 1}-{prog.step}); the weights have diverged. Stopped "
            f"without saving: resume from the last good checkpoint with a lower train.lr, "
            f"longer warmup or train.precision bf16, under a new run name"
        )
        if tr.rank == 0:  # a retry of this job stops at once, before any training
            tr.series.dir.mkdir(parents=True, exist_ok=True)
            write_json(tr.series.dir / DIVERGED, {"step": prog.step, "message": message})
        raise GptflowError(message)
    timed_steps, seconds = prog.interval.timed()
    speed = Throughput.measure(
        timed_steps,
        seconds,
        t.tokens_per_step,
        tr.flops_per_token,
        tr.dev.world_size,
        tr.peak_tflops,
    )
    consumed = prog.step * t.global_batch_size
    rec = {
        "step": prog.step,
        "kind": "train",
        "consumed_samples": consumed,
        "tokens": consumed * t.seq_length,
        "loss": loss,
        "lr": prog.lr,
        "grad_norm": norm,
        "global_batch_size": t.global_batch_size,
        "world_size": tr.dev.world_size,
        "ms_per_step": speed.ms_per_step,
        "tokens_per_s": speed.tokens_per_s,
        "tflops_per_device": speed.tflops_per_device,
        "mfu": speed.mfu,
        "timed_steps": timed_steps,  # the steps the four figures above are over
        "timing_excludes": prog.interval.left_out,  # what their time leaves out
        "loss_scale": ds.loss_scale(tr.engine),
        "skipped_iters": ds.skipped_steps(tr.engine),
        "nan_iters": int(nan_iters),
        # the seconds the interval's checkpoint saves held training (train.async_save)
        "save_blocked_s": sum(prog.save_blocked) if prog.save_blocked else None,
        "time": time.time(),
    }
    prog.grad_norm = None
    prog.save_blocked.clear()
    prog.interval.restart()
    if tr.rank == 0:
        elapsed = time.perf_counter() - prog.started
        left = elapsed / max(1, prog.step - prog.first_step) * (t.train_iters - prog.step)
        log.info(iteration_line(prog.step, t.train_iters, rec, elapsed, left))
        tr.metrics.write(rec)


def evaluate(tr: Trainer, dataset) -> float:
    """Mean loss over the first `eval_iters` global batches of `dataset` (the same every time)."""
    t = tr.cfg.train
    # a model-parallel group evaluates the same rows
    rank = t.data_parallel_rank(tr.rank, tr.dev.world_size)
    per_rank = t.global_batch_size // t.data_parallel_size(tr.dev.world_size)
    parts = [  # (first sample, sequences) of each of this rank's micro-batches
        (it * t.global_batch_size + rank * per_rank + off, min(t.micro_batch_size, per_rank - off))
        for it in range(t.eval_iters)
        for off in range(0, per_rank, t.micro_batch_size)
    ]
    sums = tr.dev.zeros(2)  # [loss x sequences, sequences]
    tr.engine.eval()
    with torch.no_grad():
        if t.pipeline_parallel > 1:
            sequences = sum(n for _, n in parts)
            sums[0] += pipeline_eval_loss(tr, dataset, parts) * sequences
            sums[1] += sequences
        else:
            for start, n in parts:
                x, y = batch(dataset, start, n, tr.dev)
                sums[0] += tr.engine(x, y).detach() * n
                sums[1] += n
    tr.engine.train()
    total, count = tr.dev.sum_over_ranks(sums).tolist()
    return total / max(1, count)


def pipeline_eval_loss(tr: Trainer, dataset, parts: list[tuple[int, int]]) -> torch.Tensor:
    """The mean loss of all of an evaluation's micro-batches (equal in size: the global batch
    splits into whole micro-batches) in one pass of DeepSpeed's ``eval_batch`` -- one schedule
    and one barrier, not one per micro-batch -- the last stage's, averaged over the
    data-parallel ranks and sent to every stage. The micro-batches are read when the schedule
    loads them: by the first stage (inputs) and the last (labels) only."""
    micro_batches = (batch(dataset, start, n, tr.dev) for start, n in parts)
    loss = tr.engine.eval_batch(micro_batches, num_micro_batches=len(parts))
    return loss.detach().reshape(())


def evaluate_and_log(tr: Trainer, prog: Progress) -> None:
    """Evaluate, log the result; its time is left out of the log interval's throughput."""
    t, step = tr.cfg.train, prog.step
    if t.eval_iters == 0 or tr.valid_data is None:
        return
    started = time.perf_counter()
    loss = evaluate(tr, tr.valid_data)
    if tr.rank == 0:
        ppl = math.exp(min(loss, 50))
        log.info(
            " validation at iteration %d | lm loss: %.6E | lm loss PPL: %.6E | %.1f s",
            step,
            loss,
            ppl,
            time.perf_counter() - started,
        )
        tr.metrics.write({"step": step, "kind": "eval", "val_loss": loss, "val_ppl": ppl})
    prog.interval.leave_out(time.perf_counter() - started, "evaluation")


# ----------------------------------------------------------------------------- saving, stopping


def save(tr: Trainer, prog: Progress) -> None:
    t = tr.cfg.train
    client = {
        "step": prog.step,
        "consumed_samples": prog.step * t.global_batch_size,
        "fingerprint": tr.cfg.fingerprint(),
        "layout": layout(tr),
        "grad_accum": tr.gas,  # what a resume on another number of ranks recomputes
        "interval": prog.interval.state(),
        **({"kfac": tr.kfac.state_dict()} if tr.kfac is not None else {}),
    }
    started = time.perf_counter()
    path, waited = tr.saves.save(tr.engine, prog.step, client, layout(tr))
    blocked = time.perf_counter() - started
    prog.save_blocked.append(blocked)
    if tr.rank == 0:
        if tr.saves.in_background:
            log.info(
                "checkpoint %s: training blocked %.2f s (%.2f s of it waiting for the previous "
                "write; snapshot %.3g GB on rank 0, in %.3g GB of host buffers kept for the "
                "next), written in the background",
                path, blocked, waited, tr.saves.writer.snapshot_bytes / 1e9,
                tr.saves.writer.pool.held_bytes() / 1e9,
            )  # fmt: skip
        else:
            log.info("saved checkpoint %s in %.2f s", path, blocked)
        tr.metrics.write({"step": prog.step, "kind": "save", "blocked_s": blocked,
                          "waited_s": waited, "mode": save_mode(tr), "time": time.time()})  # fmt: skip
    prog.interval.leave_out(blocked, "checkpoint saves")


def save_mode(tr: Trainer) -> str:
    return "async" if tr.saves.in_background else "sync"


def announce_stop(tr: Trainer, step: int, reason: str) -> int:
    """After the save: rank 0 requeues the Slurm job or leaves the resume to a retry; every
    rank then waits for it and exits 75. Without the wait a rank's early exit 75 would make
    srun (``--kill-on-bad-exit``) kill rank 0 before its requeue, failing the job."""
    if tr.rank == 0:
        tr.metrics.close()
        requeue_or_retry(tr, step, reason)
    tr.dev.barrier()
    return EXIT_PREEMPTED


def requeue_or_retry(tr: Trainer, step: int, reason: str) -> None:
    """SIGUSR1 is the profile's warning before the time limit: put the job back in the queue
    (same id) and the next allocation resumes, as many times as the run needs, without using
    one of Snakemake's retries. A preemption (SIGTERM) is requeued by Slurm itself when the
    cluster is set up for it. Otherwise, or when the requeue is refused (a job submitted
    without --requeue, no scontrol in the container), the workflow's retry resumes."""
    tr.series.finish_pruning()
    job = os.environ.get("SLURM_JOB_ID")
    if job and signals_received[:1] == [signal.SIGUSR1]:
        refused = distributed.requeue_job(job)
        if refused is None:
            log.warning("%s: saved step %d; requeued Slurm job %s to resume", reason, step, job)
            return
        log.warning("could not requeue the job (%s); leaving it to the workflow's retry", refused)
    log.warning(
        "%s: saved step %d; exiting with code %d so the workflow retries and resumes",
        reason,
        step,
        EXIT_PREEMPTED,
    )


def finish(tr: Trainer, step: int) -> None:
    """DONE.json, the train rule's only output: written last, by rank 0, after the last
    collective (hashing the checkpoint keeps no other rank waiting)."""
    if tr.rank != 0:
        return
    cfg = tr.cfg
    tr.series.finish_pruning()
    records = []
    if cfg.metrics_path.is_file():
        records = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines() if line]
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    saves = [r for r in records if r.get("kind") == "save"]
    ckpt = None if cfg.train.autotune_trial else tr.series.dir / tag_for(step)
    done = {
        "run": cfg.run,
        "series": cfg.series,
        "final_step": step,
        "checkpoint": str(ckpt) if ckpt else None,
        "checkpoint_sha256": checkpoint_digest(ckpt) if ckpt else None,
        "train_loss": trains[-1]["loss"] if trains else None,
        "initial_val_loss": evals[0]["val_loss"] if evals else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "tokens": step * cfg.train.tokens_per_step,
        "saves": save_summary(saves, save_mode(tr)),
        "metrics": str(cfg.metrics_path),
        "run_config": str(cfg.run_yaml_path),
        **({"trial": {"status": "measured"}} if cfg.train.autotune_trial else {}),
        "versions": versions(),  # what trained it, for the run card
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tr.metrics.close()
    write_json(cfg.done_path, done)
    log.info("done: step %d, final validation loss %s (from %s); checkpoint %s", step,
             done["final_val_loss"], done["initial_val_loss"], ckpt or "none (a trial)")  # fmt: skip
