"""Training throughput: our trainer's step at ZeRO 0/1/2/3 against a plain PyTorch loop.

One process, one rank (gloo, world size 1), --threads torch threads (default 1), fp32. Every
configuration gets the same model (a preset from config/models, initialised from the same seed),
the same micro batch and sequence length and the same token batches (random token ids from a fixed
numpy seed: the compute of a dense model does not depend on which ids it sees, and no tokenizer
or corpus has to be built), and does the same optimizer steps:

* baseline, "plain PyTorch": ``torch.optim.AdamW`` over ``decay_groups`` with the trainer's LR
  schedule (``LambdaLR``), per micro-batch the trainer's dropout reseed, forward and
  ``loss.backward()``, then ``clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``,
  ``zero_grad``;
* ours: the engine of ``gptflow.train.engine.build_engine`` at each ZeRO stage, stepped by the
  trainer's own ``gptflow.train.loop.train_step`` (reseed, batch from the samples, forward,
  ``engine.backward``, ``engine.step``, the interval's device sums); reading data from shards
  and the log line (once per ``log_interval``) are left out of both.

All configurations are built first (each holds its own copy of the model and optimizer), then run
--warmup untimed steps, then --repeat rounds of one block of --steps timed steps each, interleaved
(plain, ZeRO-0, ..., ZeRO-3, the order rotating per round) so that load from other processes hits all of them
alike. Printed per configuration: the best block's ms/step and tokens/s, the median block's
ms/step, the best block's process CPU ms/step, and the ratio to the plain loop, both best block
to best block and as the median over rounds of the ratio within a round (paired: robust when the
load changes between rounds). A stage that cannot run here is reported with the reason.
Then, as a check that all did the same work, the max |parameter difference| of each engine's
model from the plain loop's after the same steps; last, what the ZeRO-0 step adds to the plain
one (gradient all-reduce, DeepSpeed's clipping, the trainer's grad norm), each timed alone.

With --kfac-steps > 0 (the default) every stage runs a second time with ``train.kfac``'s
preconditioner (kfac-pytorch's defaults: factors every 5 steps, eigendecomposition every 50), as
the trainer builds it; a stage train.kfac is refused at (ZeRO 3: ``check_kfac``, the
preflight's own check) prints that refusal as its row. Then the K-FAC loss table: AdamW against
K-FAC at two settings over --kfac-steps steps of byte-level text.

Then, in the same run, bench/parallel.py's tables: tokens/s of tensor parallel 2, pipeline
parallel 2 and both together against data parallel on the same ranks (2 and 4 torchrun ranks).

Usage: python bench/train.py [--preset small] [--seq-length 256] [--micro-batch 8]
       [--grad-accum 1] [--steps 2] [--warmup 2] [--repeat 20] [--threads 1] [--zero 0,1,2,3]
       [--layouts 2,4] [--kfac-steps 300] [--smoke]
(--smoke: the tiny preset and a few steps, seconds rather than minutes: the test suite's run,
tests/unit/test_bench.py; its figures mean nothing. A stage that fails makes the exit status 1.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# --smoke: the smallest run that still prints every table (explicit options still win)
SMOKE = dict(preset="tiny", vocab=512, seq_length=32, micro_batch=2, steps=1, warmup=1, repeat=2,
             layouts="none", kfac_steps=10, muon_steps=4)  # fmt: skip


class Runner:
    """One configuration under test: `step(i)` does optimizer step i; `model` is its module."""

    def __init__(
        self, name: str, step=None, model=None, gathered=None, engine=None, error: str = "",
        refused: str = "",
    ) -> None:  # fmt: skip
        self.name = name
        self.refused = refused  # gptflow refuses this layout (check_kfac's line): not a failure
        self.step: Callable[[int], None] | None = step
        self.model = model
        self.engine = engine
        self.gathered = gathered  # () -> context manager exposing ZeRO-3's partitioned parameters
        self.error = error or refused
        self.wall: list[float] = []  # s/step of each timed block
        self.cpu: list[float] = []


def plain_runner(cfg, train, batches, gas: int) -> Runner:
    import torch

    from gptflow.train.loop import reseed
    from gptflow.train.model import GPTNeoX, decay_groups

    torch.manual_seed(train.seed)
    model = GPTNeoX(cfg)
    opt = torch.optim.AdamW(
        decay_groups(model, train.weight_decay),
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: train.lr_at(s) / train.lr)
    params = list(model.parameters())

    def step(i: int) -> None:
        for micro in range(gas):
            reseed(train.seed, i, micro, 0, 1, gas)
            x, y = batches[i * gas + micro]
            loss = model(x, y)
            (loss if gas == 1 else loss / gas).backward()
        torch.nn.utils.clip_grad_norm_(params, train.clip_grad)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return Runner("plain PyTorch AdamW loop", step, model)


def engine_runner(cfg, train, rows, gas: int, stage: int, kfac=None) -> tuple[Runner, float]:
    """The trainer's own step (gptflow.train.loop.train_step) around build_engine's engine;
    `kfac` (a KfacConfig): with train.kfac's preconditioner, as the trainer builds it."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from gptflow.train import engine as ds
    from gptflow.train.device import Device
    from gptflow.train.kfac import Kfac
    from gptflow.train.loop import Progress, Trainer, train_step
    from gptflow.train.metrics import Interval
    from gptflow.train.model import GPTNeoX, decay_groups

    t = dataclasses.replace(train, zero_stage=stage, kfac=kfac)
    torch.manual_seed(t.seed)
    model = GPTNeoX(cfg)
    t0 = time.perf_counter()
    engine = ds.build_engine(model, decay_groups(model, t.weight_decay), t, 1)
    built = time.perf_counter() - t0
    dev = Device(torch.device("cpu"), 1)
    trainer = Trainer(
        cfg=SimpleNamespace(train=t), dev=dev, rank=0, launcher="single", engine=engine,
        series=None, train_data=rows, valid_data=None, gas=gas, flops_per_token=0.0,
        peak_tflops=None, exit_interval=None, resume_from=None, resume_mode="native",
        saves=None,  # the bench never saves: train_step does not touch them
        kfac=Kfac(engine.module, kfac, dev.device) if kfac else None,
    )  # fmt: skip
    progress = Progress(step=0, interval=Interval(dev))

    def step(i: int) -> None:
        progress.step = i
        train_step(trainer, progress)

    gathered = None
    if stage == 3:
        import deepspeed

        def gathered():
            return deepspeed.zero.GatheredParameters(list(engine.module.parameters()))

    name = f"trainer, DeepSpeed ZeRO-{stage}" + (" + K-FAC" if kfac else "")
    runner = Runner(name, step, engine.module, gathered, engine)
    runner.progress = progress  # its interval holds the steps' loss sums
    return runner, built


def counted(least: int):
    """An argparse type: an integer >= `least` (argparse's one-line error otherwise)."""

    def parse(text: str) -> int:
        n = int(text)
        if n < least:
            raise argparse.ArgumentTypeError(f"{text} is below {least}")
        return n

    parse.__name__ = f"integer >= {least}"
    return parse


def run_block(r: Runner, start: int, n: int) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    for i in range(start, start + n):
        r.step(i)
    return (time.perf_counter() - w) / n, (time.process_time() - c) / n


def max_param_diff(r: Runner, ref: dict) -> float:
    import contextlib

    with r.gathered() if r.gathered else contextlib.nullcontext():
        diffs = [
            float((p.detach() - ref[name]).abs().max()) for name, p in r.model.named_parameters()
        ]
    return max(diffs) if diffs else float("nan")


def zero0_extras(r: Runner, batch, plain_ms: float) -> str:
    """Per-step costs the ZeRO-0 engine and the trainer add to the plain loop's step, each timed
    alone on real gradients (median of 20 calls)."""
    import torch
    from deepspeed.runtime.utils import clip_grad_norm_ as ds_clip

    from gptflow.train.loop import grad_norm as log_grad_norm

    eng = r.engine
    eng.backward(eng(*batch))  # gradients to work on; after the parameter check

    def ms(f) -> float:
        f()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    params = list(eng.module.parameters())
    parts = {}
    if eng.enable_backward_allreduce:  # build_engine turns it off for one rank at ZeRO 0
        parts["gradient all-reduce, 1 rank (flatten, gloo, copy back)"] = ms(
            eng.allreduce_gradients
        )
    parts |= {
        "DeepSpeed clip_grad_norm_": ms(lambda: ds_clip(params, 1.0)),
        "minus torch clip_grad_norm_ (the plain loop's)": -ms(
            lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)
        ),
        "gptflow.train.loop.grad_norm (for the log)": ms(lambda: log_grad_norm(eng.module)),
    }
    eng.zero_grad()
    net = sum(parts.values())
    lines = [f"  {k:<56} {abs(v):6.2f} ms" for k, v in parts.items()]
    lines.append(
        f"  {'net extra per step':<56} {net:6.2f} ms = {100 * net / plain_ms:.1f}% of the plain step"
    )
    return "\n".join(lines)


def main() -> int:
    import dataclasses

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="config/models/<preset>.yaml (default small)")
    p.add_argument("--vocab", type=int, default=8192, help="tokenizer vocabulary (default 8192)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=counted(1), default=2, help="timed optimizer steps per block")
    p.add_argument("--warmup", type=counted(0), default=2, help="untimed optimizer steps first")
    p.add_argument("--repeat", type=counted(1), default=20, help="rounds of timed blocks")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to run (default 0,1,2,3)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--layouts", default="2,4",
        help="then bench/parallel.py's tables of model-parallel layouts on these rank counts "
        "(default 2,4; none to skip)",
    )  # fmt: skip
    p.add_argument(
        "--kfac-steps", type=int, default=300,
        help="then the K-FAC loss table: AdamW against train.kfac over this many steps of "
        "byte-level text (default 300; 0 to skip)",
    )  # fmt: skip
    p.add_argument("--kfac-lr", type=float, default=1e-3, help="its peak lr (default 1e-3)")
    p.add_argument(
        "--muon-steps", type=int, default=300,
        help="then the Muon table: AdamW, train.optimizer muon and a plain torch.optim.Muon loop "
        "over this many steps of the K-FAC table's text, at --kfac-lr (default 300; 0 to skip)",
    )  # fmt: skip
    p.add_argument("--smoke", action="store_true", help=f"seconds, not minutes: {SMOKE}")
    a = p.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        p.set_defaults(**SMOKE)
        a = p.parse_args()

    import warnings

    import torch

    # DeepSpeed's ZeRO calls deprecated torch.distributed collectives: noise, not findings.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")

    from gptflow.config.schema import load_yaml
    from gptflow.config.settings import (
        KfacConfig,
        ModelConfig,
        TrainConfig,
        check_kfac,
        padded_vocab_size,
    )
    from gptflow.errors import GptflowError
    from gptflow.train import distributed

    torch.set_num_threads(a.threads)
    preset = load_yaml(REPO / "config/models" / f"{a.preset}.yaml") or {}
    multiple = preset.get("make_vocab_size_divisible_by", 128)
    cfg = ModelConfig(**{**preset, "vocab_size": padded_vocab_size(a.vocab, multiple)})
    gas = a.grad_accum
    total = a.warmup + a.repeat * a.steps
    train = TrainConfig(
        train_iters=total,
        seed=a.seed,
        seq_length=a.seq_length,
        micro_batch_size=a.micro_batch,
        global_batch_size=a.micro_batch * gas,
    )
    rows = np.random.default_rng(a.seed).integers(
        0, a.vocab, size=(total * gas, a.micro_batch, a.seq_length + 1), dtype=np.int64
    )
    batches = [
        (torch.from_numpy(r[:, :-1].copy()), torch.from_numpy(r[:, 1:].copy())) for r in rows
    ]
    samples = rows.reshape(-1, a.seq_length + 1)  # the trainer's dataset: sample i -> (T+1,)
    tokens = train.tokens_per_step

    # One rank of gloo, as `gptflow train` under a plain `python` sets it up.
    from gptflow.train import device

    env = distributed.resolve({})
    distributed.export(env)
    t0 = time.perf_counter()
    device.setup(env, timeout_minutes=30)
    init_s = time.perf_counter() - t0

    print(
        f"training throughput: preset {a.preset} ({cfg.num_parameters() / 1e6:.2f} M parameters, "
        f"{cfg.num_layers} layers x {cfg.hidden_size}, vocab {cfg.vocab_size}), "
        f"{a.micro_batch} x {a.seq_length} tokens x grad accum {gas} = {tokens} tokens/step, "
        f"fp32, 1 process, {torch.get_num_threads()} thread(s)"
    )
    print(
        f"data: random token ids (numpy seed {a.seed}), {total * gas} micro-batches, the same for "
        f"every configuration; AdamW lr {train.lr:g} {train.lr_decay_style}, weight decay "
        f"{train.weight_decay:g}, clip {train.clip_grad:g}"
    )
    print(
        f"timing: {a.warmup} warm-up steps, then {a.repeat} rounds of one block of {a.steps} "
        f"steps per configuration (order rotating)"
    )

    runners = [plain_runner(cfg, train, batches, gas)]
    init = {n: p.detach().clone() for n, p in runners[0].model.named_parameters()}
    setup = [f"deepspeed import + init_distributed {init_s:.2f} s"]
    stages = [int(s) for s in a.zero.split(",") if s.strip()]
    # every stage without, then with train.kfac (llm-pytorch's 5 / 50 steps)
    for kfac in [None] + ([KfacConfig()] if a.kfac_steps else []):
        for stage in stages:
            name = f"trainer, DeepSpeed ZeRO-{stage}" + (" + K-FAC" if kfac else "")
            try:  # the layouts gptflow refuses train.kfac with, refused as the preflight does
                check_kfac(cfg, dataclasses.replace(train, zero_stage=stage, kfac=kfac))
            except GptflowError as e:
                runners.append(Runner(name, refused=str(e)))
                continue
            try:
                r, built = engine_runner(cfg, train, samples, gas, stage, kfac)
                setup.append(f"{name.split(', ')[1]} engine {built:.2f} s")
            except Exception as e:  # report, do not crash: the other stages still run
                r = Runner(name, error=f"build: {e!r}")
            runners.append(r)
    print("setup: " + ", ".join(setup))

    def guarded(r: Runner, start: int, n: int) -> tuple[float, float] | None:
        try:
            return run_block(r, start, n)
        except Exception as e:
            r.error = f"step: {e!r}"
            return None

    for r in runners:
        if not r.error and a.warmup:
            guarded(r, 0, a.warmup)
    live = [r for r in runners if not r.error]
    for b in range(a.repeat if live else 0):
        start = a.warmup + b * a.steps
        for r in live[b % len(live) :] + live[: b % len(live)]:
            if not r.error and (res := guarded(r, start, a.steps)):
                r.wall.append(res[0])
                r.cpu.append(res[1])

    base = runners[0]
    print(
        f"\n  {'configuration':<42} {'ms/step':>8} {'tokens/s':>9} {'median ms':>10} "
        f"{'CPU ms':>7} {'vs plain':>9} {'paired':>7}"
    )
    for r in runners:
        if r.refused:
            print(f"  {r.name:<42} refused by gptflow: {r.refused}")
            continue
        if r.error or not r.wall:
            print(f"  {r.name:<42} cannot run here: {r.error}")
            continue
        w = min(r.wall)
        ratio = paired = ""
        if base.wall and not base.error:
            ratio = f"{min(base.wall) / w:.3f}x"
            # a stage that failed mid-way has fewer blocks: pair its rounds with the first ones
            pairs = zip(base.wall, r.wall, strict=False)
            paired = f"{statistics.median(b / o for b, o in pairs):.3f}x"
        print(
            f"  {r.name:<42} {1000 * w:8.1f} {tokens / w:9.0f} "
            f"{1000 * statistics.median(r.wall):10.1f} {1000 * min(r.cpu):7.1f} {ratio:>9} "
            f"{paired:>7}"
        )
    print(
        "  ms/step, tokens/s: best block; median ms: median block; CPU ms: best block's process\n"
        "  CPU time per step; vs plain: tokens/s ratio to the plain loop (best blocks, > 1 is\n"
        "  faster); paired: median over rounds of the ratio within the round"
    )

    if not base.error:
        ref = {n: p.detach().clone() for n, p in base.model.named_parameters()}
        checks = [
            f"ZeRO-{r.name.rsplit('-', 1)[1]} {max_param_diff(r, ref):.2e}"
            for r in runners[1:]
            if not r.error and "K-FAC" not in r.name  # K-FAC takes other steps by design
        ]
        moved = max(float((p - init[n]).abs().max()) for n, p in ref.items())
        if checks:
            print(
                f"check after the same {total} steps (which moved the parameters by up to "
                f"{moved:.2e}), max |parameter - plain loop's|: " + ", ".join(checks)
            )
    z0 = next((r for r in runners if r.name.endswith("ZeRO-0") and r.wall), None)
    if z0 and base.wall:
        print("ZeRO-0 extras per step, each timed alone (median of 20 calls):")
        print(zero0_extras(z0, batches[0], 1000 * min(base.wall)))
    if a.kfac_steps:
        kfac_loss_table(a, cfg)
    if a.muon_steps:
        muon_loss_table(a, cfg)
    failed = any(r.error and not r.refused for r in runners)
    if a.layouts != "none":  # tensor and pipeline parallel, on 2 and 4 torchrun ranks
        layouts = _bench_module("parallel")
        failed |= not layouts.layout_tables(
            argparse.Namespace(
                preset=a.preset, vocab=a.vocab, seq_length=a.seq_length, global_batch=8,
                micro_batch=2, steps=10, warmup=2, threads=a.threads,
            ),
            [int(n) for n in a.layouts.split(",")],
        )  # fmt: skip
    return 1 if failed else 0


def byte_rows(seq_length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Real text, no tokenizer: the bytes of some of the running Python's standard library
    (the test corpus's files), as sequences of seq_length + 1 token ids < 256; the first 90%
    of the bytes for training, the rest held out."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for pat in ("json/*.py", "email/*.py", "http/*.py", "logging/*.py")
             for f in sorted(root.glob(pat))]  # fmt: skip
    ids = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8).astype(np.int64)
    cut = len(ids) * 9 // 10
    rng = np.random.default_rng(seed)

    def rows(part: np.ndarray, n: int) -> np.ndarray:
        starts = rng.integers(0, len(part) - seq_length - 1, size=n)
        return np.stack([part[s : s + seq_length + 1] for s in starts])

    return rows(ids[:cut], 1 << 14), rows(ids[cut:], 64)


def kfac_loss_table(a, preset_cfg) -> None:
    """AdamW against train.kfac at two settings, each the trainer's ZeRO-0 step on the same
    byte-level batches from the same initial weights and lr schedule: ms/step (eigen steps
    included) and the training loss (mean of each tenth of the run) and the held-out loss."""
    import dataclasses

    import torch

    from gptflow.config.settings import KfacConfig, TrainConfig

    cfg = dataclasses.replace(preset_cfg, vocab_size=256)  # bytes
    steps = a.kfac_steps
    train = TrainConfig(
        train_iters=steps, seed=a.seed, seq_length=a.seq_length, micro_batch_size=a.micro_batch,
        global_batch_size=a.micro_batch, lr=a.kfac_lr, min_lr=a.kfac_lr / 10,
        lr_warmup_iters=max(1, steps // 20),
    )  # fmt: skip
    rows, held = byte_rows(a.seq_length, a.seed)
    settings = [("AdamW", None), ("K-FAC 5/50", KfacConfig()),
                ("K-FAC 1/10", KfacConfig(factor_update_steps=1, inv_update_steps=10))]  # fmt: skip
    tenth = max(1, steps // 10)
    print(
        f"\nK-FAC against AdamW: preset {a.preset} with a byte vocabulary ({cfg.num_parameters():,}"
        f" parameters), {steps} steps of {a.micro_batch} x {a.seq_length} bytes of Python stdlib "
        f"source, lr {a.kfac_lr:g} cosine, clip {train.clip_grad:g}; K-FAC a/b = factors every "
        f"a steps, eigendecomposition every b; damping {KfacConfig().damping:g}, decay "
        f"{KfacConfig().factor_decay:g}"
    )
    print(f"  {'setting':<12} {'ms/step':>8}  train loss per tenth of the run{'':<32} held-out")
    for name, kfac in settings:
        r, _ = engine_runner(cfg, train, rows, 1, 0, kfac)
        curve, started = [], time.perf_counter()
        for i in range(steps):
            r.step(i)
            if (i + 1) % tenth == 0:
                curve.append(r.progress.interval.read()[0])
                r.progress.interval.restart()
        ms = 1000 * (time.perf_counter() - started) / steps
        x = torch.from_numpy(held[:, :-1].copy())
        y = torch.from_numpy(held[:, 1:].copy())
        r.model.eval()
        with torch.no_grad():
            val = float(sum(r.model(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8))) / (
                len(x) // 8
            )
        print(f"  {name:<12} {ms:8.1f}  {' '.join(f'{v:.3f}' for v in curve):<62} {val:.4f}")


def muon_loss_table(a, preset_cfg) -> None:
    """AdamW against train.optimizer muon (the trainer's ZeRO-0 step, DeepSpeed's Muon, RMS-
    matched lr, clip 0 as Muon requires, AdamW likewise) and a plain loop of torch.optim.Muon
    (adjust_lr_fn match_rms_adamw, its bf16 Newton-Schulz) + torch AdamW, stepped in turn:
    ms/step and its ratio to AdamW's, training loss per tenth, held-out loss, on the K-FAC
    table's byte-level text and schedule."""
    import dataclasses

    import torch

    from gptflow.config.settings import TrainConfig
    from gptflow.train import engine as ds
    from gptflow.train.model import GPTNeoX

    cfg = dataclasses.replace(preset_cfg, vocab_size=256)  # bytes
    steps, tenth = a.muon_steps, max(1, a.muon_steps // 10)
    train = TrainConfig(
        train_iters=steps, seed=a.seed, seq_length=a.seq_length, micro_batch_size=a.micro_batch,
        global_batch_size=a.micro_batch, lr=a.kfac_lr, min_lr=a.kfac_lr / 10,
        lr_warmup_iters=max(1, steps // 20), clip_grad=0.0,
    )  # fmt: skip
    rows, held = byte_rows(a.seq_length, a.seed)
    x_held = torch.from_numpy(held[:, :-1].copy())
    y_held = torch.from_numpy(held[:, 1:].copy())

    def batch(i: int):
        part = rows[i * a.micro_batch : (i + 1) * a.micro_batch]
        return torch.from_numpy(part[:, :-1].copy()), torch.from_numpy(part[:, 1:].copy())

    def deepspeed(t) -> Runner:
        """build_engine's ZeRO-0 engine (the trainer's), stepped as the loop steps it."""
        torch.manual_seed(t.seed)
        model = GPTNeoX(cfg)
        engine = ds.build_engine(model, ds.optimizer_groups(model, cfg, t), t, 1)
        losses = []

        def step(i: int) -> None:
            loss = engine(*batch(i))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())

        r = Runner(t.optimizer, step, engine.module)
        r.losses = losses
        return r

    def torch_muon() -> Runner:
        torch.manual_seed(train.seed)
        model = GPTNeoX(cfg)
        groups = ds.optimizer_groups(model, cfg, dataclasses.replace(train, optimizer="muon"))
        muon = [p for g in groups if g["use_muon"] for p in g["params"]]
        opts = [
            torch.optim.Muon(
                muon, lr=train.lr, weight_decay=train.weight_decay, adjust_lr_fn="match_rms_adamw"
            ),
            torch.optim.AdamW(
                [
                    {"params": g["params"], "weight_decay": g["weight_decay"]}
                    for g in groups
                    if not g["use_muon"]
                ],
                lr=train.lr,
                betas=(train.adam_beta1, train.adam_beta2),
                eps=train.adam_eps,
            ),
        ]
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: train.lr_at(s) / train.lr)
                  for o in opts]  # fmt: skip
        losses = []

        def step(i: int) -> None:
            loss = model(*batch(i))
            loss.backward()
            for o, sc in zip(opts, scheds, strict=True):
                o.step()
                sc.step()
                o.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        r = Runner("torch.optim.Muon", step, model)
        r.losses = losses
        return r

    print(
        f"\nMuon against AdamW: preset {a.preset} with a byte vocabulary ({cfg.num_parameters():,}"
        f" parameters), {steps} steps of {a.micro_batch} x {a.seq_length} bytes, lr "
        f"{a.kfac_lr:g} cosine (Muon RMS-matched to it), clip 0, weight decay "
        f"{train.weight_decay:g}"
    )
    print(f"  {'setting':<18} {'ms/step':>8} {'x AdamW':>7}  train loss per tenth of the run"
          f"{'':<32} held-out")  # fmt: skip
    # Built first, then stepped in turn (step i of each, the order rotating), so that load
    # from other processes hits all three alike: timed one after another (as until issue 40's
    # second round), the ratio also measured how the machine's load changed (docs/optimizers.md).
    runners = [
        deepspeed(dataclasses.replace(train, optimizer="adamw")),
        deepspeed(dataclasses.replace(train, optimizer="muon")),
        torch_muon(),
    ]
    names = ["AdamW", "Muon (DeepSpeed)", "torch.optim.Muon"]
    spent, curves = [0.0] * len(runners), [[] for _ in runners]
    for i in range(steps):
        for k in (np.arange(len(runners)) + i) % len(runners):
            started = time.perf_counter()
            runners[k].step(i)
            if i:  # untimed: DeepSpeed torch.compiles its Muon update in the first
                spent[k] += time.perf_counter() - started
            if (i + 1) % tenth == 0:
                curves[k].append(float(torch.stack(runners[k].losses).mean()))
                runners[k].losses.clear()
    for name, r, s, curve in zip(names, runners, spent, curves, strict=True):
        ms = 1000 * s / (steps - 1)
        r.model.eval()
        with torch.no_grad():
            val = sum(float(r.model(x_held[i : i + 8], y_held[i : i + 8]))
                      for i in range(0, len(x_held), 8)) / (len(x_held) // 8)  # fmt: skip
        print(
            f"  {name:<18} {ms:8.1f} {s / spent[0]:6.2f}x  "
            f"{' '.join(f'{v:.3f}' for v in curve):<62} {val:.4f}"
        )


def _bench_module(name: str):
    """bench/<name>.py, imported by path (bench/ is not on sys.path; see above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(main())
