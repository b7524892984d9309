"""The training loop: resume -> for each step: batches -> forward/backward/step -> log -> eval -> save.

Data order is a pure function of (seed, consumed samples): step s of every rank reads samples
``[s * global_batch, (s+1) * global_batch)`` of the training split, rank r's micro-batch m being
the slice ``(m * ranks + r) * micro_batch`` of it (Megatron's pretraining sampler). Dropout RNG is
reseeded from (seed, step, micro-batch, rank). Together with DeepSpeed's model, optimizer and
scheduler state that makes a resumed run repeat the uninterrupted one bit for bit.

SIGUSR1/SIGTERM (Slurm's warning before a time limit, or preemption) make every rank finish the
current step, save, and exit with :data:`EXIT_PREEMPTED`, so the workflow retries and resumes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from gptflow import distributed
from gptflow import engine as ds
from gptflow.checkpoint import CheckpointSeries, RunLock, checkpoint_digest, tag_for
from gptflow.config import RunConfig
from gptflow.data.dataset import run_split_datasets
from gptflow.data.indexed import idx_path
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write, sha256_file, write_json
from gptflow.model import GPTNeoX, decay_groups

log = logging.getLogger("gptflow.train")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved after a signal; run again to resume
MAX_NAN_STREAK = 10  # NaN/inf losses in a row before the run stops (diverged)
_signal_received: list[int] = []


def _on_signal(signum, _frame) -> None:
    _signal_received.append(signum)


# ----------------------------------------------------------------------------- metrics


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step or evaluation, for the current series.

    On resume at step S the records after S (written by the interrupted attempt) are dropped
    (all of them when S is -1: a fresh start), so the file always describes one trajectory; records of another series are archived in
    that series' checkpoint directory rather than mixed in.
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
            for line in lines:
                rec = json.loads(line)
                if rec.get("step", 0) <= resume_step:
                    kept.append(line)
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


# ----------------------------------------------------------------------------- helpers


def _setup_logging(rank: int, history: Path | None = None) -> None:
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


def _check_shards(cfg: RunConfig) -> None:
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


def _batch(dataset, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([dataset[i] for i in range(start, start + count)])  # (B, T+1)
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _reseed(seed: int, step: int, micro: int, rank: int, world: int, gas: int) -> None:
    torch.manual_seed(seed * 1_000_003 + (step * gas + micro) * world + rank)


def _all_reduce_mean(values: list[float], world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t)
    return (t / world).tolist()


def _any_rank(flags: list[bool], world: int) -> list[bool]:
    """Each flag OR-ed over the ranks, in one all-reduce."""
    if world == 1:
        return list(flags)
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def flops_per_token(model_cfg, n_params: int, seq_length: int) -> float:
    """Training FLOPs per token: 6 x the parameters that multiply (all but the input
    embedding) plus attention's 12 x layers x hidden x sequence (PaLM, appendix B)."""
    matmul_params = n_params - model_cfg.vocab_size * model_cfg.hidden_size
    return 6.0 * matmul_params + 12.0 * model_cfg.num_layers * model_cfg.hidden_size * seq_length


def evaluate(engine, dataset, cfg: RunConfig, rank: int, world: int) -> float:
    """Mean loss over the first `eval_iters` global batches of `dataset` (the same every time)."""
    t = cfg.train
    per_rank = t.global_batch_size // world
    total, count = 0.0, 0
    engine.eval()
    with torch.no_grad():
        for it in range(t.eval_iters):
            base = it * t.global_batch_size + rank * per_rank
            for off in range(0, per_rank, t.micro_batch_size):
                n = min(t.micro_batch_size, per_rank - off)
                x, y = _batch(dataset, base + off, n)
                total += float(engine(x.to(engine.device), y.to(engine.device))) * n
                count += n
    engine.train()
    (mean,) = _all_reduce_mean([total / max(1, count)], world)
    return mean


def _grad_norm(model: torch.nn.Module) -> float:
    """Global L2 norm of the gradients (one fused computation, one host sync)."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0)) if grads else 0.0


# ----------------------------------------------------------------------------- main loop


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
    cfg = RunConfig.load(config_path)
    t = cfg.train
    env = distributed.resolve()
    distributed.export(env)
    rank, world = env.rank, env.world_size
    _setup_logging(rank, Path(cfg.run_dir) / "train.log")
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    _check_shards(cfg)
    gas = t.grad_accum_steps(world)

    lock = RunLock(cfg.lock_path)
    if wait_for_lock:  # every rank, read-only, before any collective can time out
        lock.wait_while_held(wait_for_lock)
    ds.init_distributed()

    failure = ""
    if rank == 0:
        try:
            lock.acquire()
        except GptflowError as e:
            failure = str(e)
    if _any_rank([bool(failure)], world)[0]:
        raise GptflowError(failure or "rank 0 could not take the run lock")
    if lock.took_over:
        log.warning("took over a stale lock: %s", lock.took_over["reason"])
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    try:
        return _train(cfg, env, gas, exit_interval)
    finally:
        if rank == 0:
            lock.release()


def _train(cfg: RunConfig, env, gas: int, exit_interval: int | None) -> int:
    t = cfg.train
    rank, world = env.rank, env.world_size
    series = CheckpointSeries(cfg.checkpoint_dir, cfg.fingerprint(), t.keep_last)
    series.check_fingerprint()

    # Data: the indices are normally built by the build_data_index rule before this job; rank
    # 0 builds any that are missing (a direct `gptflow train`), the others then load them.
    t0 = time.perf_counter()
    data = run_split_datasets(cfg) if rank == 0 else None
    dist.barrier()
    if rank != 0:
        data = run_split_datasets(cfg, build_allowed=False)
    train_ds, valid_ds = data["train"], data["valid"]
    index_s = time.perf_counter() - t0

    torch.manual_seed(t.seed)  # identical initialisation on every rank
    model = GPTNeoX(cfg.model)
    engine = ds.build_engine(model, decay_groups(model, t.weight_decay), t, world)

    step = 0
    resumed_from = series.latest_step()
    if resumed_from is not None:
        load_path, client = engine.load_checkpoint(
            str(series.dir), tag=tag_for(resumed_from), load_module_strict=True
        )
        if load_path is None:
            raise GptflowError(f"{series.dir / tag_for(resumed_from)}: DeepSpeed could not load it")
        layout = client.get("layout", {})
        if layout.get("world_size") != world and t.zero_stage > 0:
            raise GptflowError(
                f"{load_path}: saved by {layout.get('world_size')} ranks with ZeRO stage "
                f"{t.zero_stage}, now {world} ranks; resume with the same number of ranks"
            )
        step = int(client["step"])
    consumed = step * t.global_batch_size

    metrics = None
    if rank == 0:
        # a fresh start (no complete checkpoint, e.g. killed in its first save) keeps nothing
        kept = step if resumed_from is not None else -1
        tb_dir = Path(cfg.run_dir) / "tensorboard" / cfg.series if t.tensorboard else None
        metrics = MetricsLog(cfg.metrics_path, cfg.series, series.dir, kept, tb_dir)
        n_params = sum(p.numel() for p in model.parameters())
        total_tokens = t.train_iters * t.tokens_per_step
        data_tokens = sum(d.tokens for d in cfg.datasets)
        log.info(
            "run %s, series %s: %s; %s parameters; %d ranks (%s), micro batch %d x grad accum %d "
            "x %d ranks = global batch %d; %d tokens/step; %d steps = %.3g tokens (%.2f epochs of "
            "%.3g data tokens); %.3g training FLOPs (6ND); data indices in %.2f s",
            cfg.run,
            cfg.series,
            f"resuming from step {step}" if resumed_from is not None else "starting at step 0",
            f"{n_params:,}",
            world,
            env.launcher,
            t.micro_batch_size,
            gas,
            world,
            t.global_batch_size,
            t.tokens_per_step,
            t.train_iters,
            total_tokens,
            total_tokens / max(1, data_tokens),
            data_tokens,
            6.0 * n_params * total_tokens,
            index_s,
        )

    def eval_and_log(at_step: int) -> float | None:
        if t.eval_iters == 0 or valid_ds is None:
            return None
        te = time.perf_counter()
        loss = evaluate(engine, valid_ds, cfg, rank, world)
        if rank == 0:
            log.info(
                " validation at iteration %d | lm loss: %.6E | lm loss PPL: %.6E | %.1f s",
                at_step,
                loss,
                math.exp(min(loss, 50)),
                time.perf_counter() - te,
            )
            metrics.write(
                {
                    "step": at_step,
                    "kind": "eval",
                    "val_loss": loss,
                    "val_ppl": math.exp(min(loss, 50)),
                }
            )
        return loss

    def save(at_step: int) -> None:
        client = {
            "step": at_step,
            "consumed_samples": at_step * t.global_batch_size,
            "fingerprint": cfg.fingerprint(),
            "layout": {"world_size": world, "zero_stage": t.zero_stage, "precision": t.precision},
        }
        ts = time.perf_counter()
        path = series.save(engine, at_step, client, rank, dist.barrier)
        if rank == 0:
            log.info("saved checkpoint %s in %.2f s", path, time.perf_counter() - ts)

    if step == 0:
        eval_and_log(0)

    interval_loss, interval_steps, interval_t = 0.0, 0, time.perf_counter()
    nan_iters = nan_streak = 0
    flops_token = flops_per_token(
        cfg.model, sum(p.numel() for p in model.parameters()), t.seq_length
    )
    while step < t.train_iters:
        grad_norm = None
        step_loss = torch.zeros((), dtype=torch.float64)
        for micro in range(gas):
            _reseed(t.seed, step, micro, rank, world, gas)
            start = consumed + (micro * world + rank) * t.micro_batch_size
            x, y = _batch(train_ds, start, t.micro_batch_size)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            if micro == gas - 1:
                lr_used = engine.get_lr()[0]  # not lr_at(step): skipped steps hold the schedule
                if t.zero_stage == 0 and t.precision == "fp32":
                    grad_norm = _grad_norm(engine.module)  # DeepSpeed does not report it here
            engine.step()
            step_loss += loss.detach().double()
        step += 1
        consumed += t.global_batch_size
        interval_loss += float(step_loss) / gas
        interval_steps += 1
        if grad_norm is None:
            grad_norm = ds.global_grad_norm(engine)

        preempted, bad_loss = _any_rank(
            [bool(_signal_received), not math.isfinite(float(step_loss))], world
        )
        if bad_loss:
            nan_iters += 1
            nan_streak += 1
            if nan_streak > MAX_NAN_STREAK:
                raise GptflowError(
                    f"the loss was NaN or infinite for {nan_streak} steps in a row (steps "
                    f"{step - nan_streak + 1}-{step}); the weights have diverged. Stopped "
                    f"without saving: resume from the last good checkpoint with a lower "
                    f"train.lr, longer warmup or train.precision bf16, under a new run name"
                )
        else:
            nan_streak = 0

        if step % t.log_interval == 0 or step == t.train_iters:
            (mean_loss,) = _all_reduce_mean([interval_loss / interval_steps], world)
            elapsed = time.perf_counter() - interval_t
            ms = 1000 * elapsed / interval_steps
            tok_s = interval_steps * t.tokens_per_step / elapsed
            tflops = flops_token * tok_s / world / 1e12
            lr = lr_used
            scale = ds.loss_scale(engine)
            skipped = ds.skipped_steps(engine)
            if rank == 0:
                log.info(
                    " iteration %8d/%8d | consumed samples: %12d | elapsed time per iteration (ms): "
                    "%.1f | learning rate: %.6E | global batch size: %5d | lm loss: %.6E | loss "
                    "scale: %s | grad norm: %s | number of skipped iterations: %3d | number of nan "
                    "iterations: %3d | tokens per second: %.0f | TFLOP/s per device: %.3f |",
                    step,
                    t.train_iters,
                    consumed,
                    ms,
                    lr,
                    t.global_batch_size,
                    mean_loss,
                    f"{scale:.1f}",
                    "n/a" if grad_norm is None else f"{grad_norm:.3f}",
                    skipped,
                    nan_iters,
                    tok_s,
                    tflops,
                )
                metrics.write(
                    {
                        "step": step,
                        "kind": "train",
                        "consumed_samples": consumed,
                        "tokens": consumed * t.seq_length,
                        "loss": mean_loss,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "ms_per_step": ms,
                        "tokens_per_s": tok_s,
                        "tflops_per_device": tflops,
                        "loss_scale": scale,
                        "skipped_iters": skipped,
                        "nan_iters": nan_iters,
                        "time": time.time(),
                    }
                )
            interval_loss, interval_steps, interval_t = 0.0, 0, time.perf_counter()

        if step % t.eval_interval == 0 or step == t.train_iters:
            eval_and_log(step)
            interval_t = time.perf_counter()

        stop = preempted or bool(
            exit_interval and step % exit_interval == 0 and step < t.train_iters
        )
        if step % t.save_interval == 0 or step == t.train_iters or stop:
            save(step)
            interval_t = time.perf_counter()
        if stop:
            if rank == 0:
                why = (
                    f"received signal {_signal_received[0] if _signal_received else 'on another rank'}"
                    if preempted
                    else f"exit interval {exit_interval}"
                )
                log.warning(
                    "%s: saved step %d; exiting with code %d so the workflow retries and resumes",
                    why,
                    step,
                    EXIT_PREEMPTED,
                )
            return EXIT_PREEMPTED

    if rank == 0:
        _write_done(cfg, series, step)
    dist.barrier()
    return 0


def _write_done(cfg: RunConfig, series: CheckpointSeries, step: int) -> None:
    """DONE.json, the train rule's only output: written last, atomically."""
    records = []
    if cfg.metrics_path.is_file():
        records = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines() if line]
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    ckpt = series.dir / tag_for(step)
    done = {
        "run": cfg.run,
        "series": cfg.series,
        "final_step": step,
        "checkpoint": str(ckpt),
        "checkpoint_sha256": checkpoint_digest(ckpt),
        "train_loss": trains[-1]["loss"] if trains else None,
        "initial_val_loss": evals[0]["val_loss"] if evals else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "tokens": step * cfg.train.tokens_per_step,
        "metrics": str(cfg.metrics_path),
        "run_config": str(Path(cfg.run_dir) / "run.yaml"),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(cfg.done_path, done)
    log.info(
        "done: step %d, final validation loss %s (from %s); checkpoint %s",
        step,
        done["final_val_loss"],
        done["initial_val_loss"],
        ckpt,
    )
