"""``gptflow train``: set up the rank, take the run's lock, run the loop
(:mod:`gptflow.train.loop`).

SIGUSR1/SIGTERM (Slurm's warning before a time limit, or preemption) make every rank finish the
current step, save, and exit with :data:`~gptflow.train.loop.EXIT_PREEMPTED`, so the workflow
retries and resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from pathlib import Path

import torch

from gptflow.data.indexed import idx_path
from gptflow.errors import GptflowError
from gptflow.fsutil import sha256_file
from gptflow.hardware import background_saves, training_precision
from gptflow.train import device, distributed, trial
from gptflow.train.checkpoint import RunLock
from gptflow.train.loop import run, signals_received
from gptflow.train.run_config import RunConfig

log = logging.getLogger("gptflow.train")


def train(
    config_path: str | os.PathLike,
    threads: int | None = None,
    exit_interval: int | None = None,
    wait_for_lock: float = 0,
) -> int:
    """Train (or resume) the run described by `config_path`; returns the process exit code.

    `exit_interval` (Megatron's ``--exit-interval``): save and exit with EXIT_PREEMPTED after a
    step that is a multiple of it, for time-boxed allocations. `wait_for_lock`: seconds to wait
    for a live trainer of the same run to finish before taking the lock (0: refuse at once).
    """
    compile_each_shape_alone()
    cfg = RunConfig.load(config_path)
    env = distributed.resolve()
    try:
        return _train(cfg, env, threads, exit_interval, wait_for_lock)
    except Exception as e:
        if not (cfg.train.autotune_trial and trial.is_out_of_memory(e)):
            raise
        # an autotune trial's candidate that does not fit: recorded for `gptflow
        # autotune-trial`, which ends the trial with it (its peers are stopped by the launcher)
        raise GptflowError(trial.record_out_of_memory(cfg.run_dir, env.rank, e)) from None


def _train(cfg: RunConfig, env, threads, exit_interval, wait_for_lock) -> int:
    """:func:`train` once the run config is read and the rank known."""
    distributed.export(env)
    setup_logging(env.rank, cfg.train_log_path)
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    check_shards(cfg)
    cfg.train.grad_accum_steps(env.world_size)  # the batch splits over the ranks, or say why

    lock = RunLock(cfg.lock_path)
    if wait_for_lock:  # every rank, read-only, before any collective can time out
        lock.wait_while_held(wait_for_lock)
    dev = device.setup(env, cfg.train.distributed_timeout_minutes)
    cfg = on_device(cfg, dev, env.rank)
    failure = ""
    if env.rank == 0:
        try:
            lock.acquire()
        except GptflowError as e:
            failure = str(e)
    if dev.any_rank(bool(failure))[0]:
        raise GptflowError(failure or "rank 0 could not take the run lock")
    if lock.took_over:
        log.warning("took over a stale lock: %s", lock.took_over["reason"])
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: signals_received.append(signum))
    try:
        code = run(cfg, dev, env.rank, env.launcher, exit_interval)
        dev.shutdown()
        return code
    finally:
        if env.rank == 0:
            lock.release()


def compile_each_shape_alone() -> None:
    """Every ``torch.compile`` in this process (DeepSpeed's Muon update and Newton-Schulz in
    every Muon run; the model with train.compile) compiles one kernel per input shape, never
    a shape-generic one, so which kernel computes a step depends on the step's shapes only,
    not on what the process compiled before: a resumed process computes its first step as
    the uninterrupted one did (the bit-exact resume that checkpoints promise).

    With torch's default (``automatic_dynamic_shapes``), the first shape a function sees
    gets a kernel for that shape, and a second shape recompiles it shape-generic, which then
    serves the first shape too: DeepSpeed's Newton-Schulz gave a (192, 64) matrix a result
    1e-4 away on its first call from every later one (measured here), so a run resumed at
    step N rounded step N differently from its uninterrupted twin (seen at ZeRO 1: 10 of 27
    losses equal). The cost is a compile per distinct shape (four matrix shapes a GPT-NeoX
    layer), within torch's recompile limit (8 per function)."""
    import torch._dynamo.config

    torch._dynamo.config.automatic_dynamic_shapes = False


def setup_logging(rank: int, history: Path | None = None) -> None:
    """Log to stderr; rank 0 also appends to `history` (``results/runs/{run}/train.log``),
    which outlives attempts: Snakemake empties the job's own log before a retry, and with it
    the lines that say why the last attempt stopped."""
    fmt = "%(asctime)s %(name)s: %(message)s"
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=fmt,
        datefmt="%H:%M:%S",
        force=True,
    )
    if rank == 0 and history is not None:
        history.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(history)
        handler.setFormatter(logging.Formatter(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
        logging.getLogger().addHandler(handler)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def on_device(cfg: RunConfig, dev: device.Device, rank: int) -> RunConfig:
    """`cfg` with ``train.precision: auto`` decided for this device: before the checkpoint
    series is named, since the precision is part of its fingerprint (an fp32 run on a CPU and
    a bf16 run on GPUs are different trajectories, each resuming its own checkpoints)."""
    t = cfg.train
    precision, why = training_precision(t.precision, t.zero_stage, dev.name, dev.capability)
    if rank == 0 and t.precision == "auto":
        log.info("precision %s: %s", precision, why)
    in_background, saves_why = background_saves(t.async_save, dev.name is not None)
    if rank == 0:
        how = "in the background" if in_background else "synchronous"
        log.info("checkpoint saves %s: %s", how, saves_why)
    t = dataclasses.replace(t, precision=precision, async_save=in_background)
    return dataclasses.replace(cfg, train=t)


def check_shards(cfg: RunConfig) -> None:
    """The shards on disk are the ones run.yaml was rendered from (cheap: .idx checksums)."""
    for d in cfg.datasets:
        for s in d.shards:
            path = idx_path(s.prefix)
            if not path.is_file():
                raise GptflowError(f"{path}: shard missing; re-run the workflow's tokenization")
            if sha256_file(path) != s.idx_sha256:
                raise GptflowError(
                    f"{path}: changed since the run config was rendered; re-run the workflow "
                    f"(snakemake re-renders results/runs/{cfg.run}/run.yaml)"
                )
