"""Throughput of the model-parallel layouts against data parallel on the same ranks.

Two tables, each run with `torchrun` and gloo on this machine's CPUs, fp32, ZeRO 1, the same
model (a preset from config/models), the same global batch, micro-batch size, sequence length
and random token ids (numpy seed: the compute of a dense model does not depend on which ids it
sees): on 2 ranks, data parallel 2 (the baseline), tensor parallel 2, pipeline parallel 2; on 4
ranks, data parallel 4 (the baseline), tensor 2 x data 2, pipeline 2 x data 2, tensor 2 x
pipeline 2. Each rank does the trainer's own step (gptflow.train.loop.train_step on
build_engine's engine): --warmup untimed steps, then --steps timed ones. Rank 0 reports the
median ms/step; printed per layout: ms/step, tokens/s, and the ratio to its table's baseline,
run in the same command.

On CPUs tensor parallel trades compute for two all-reduces per layer in each direction over gloo,
and a pipeline of 2 stages idles each stage for part of every step (the 1F1B bubble) and sends
activations between them, so expect both to lose here: the figures say what the split costs
where there is no NVLink and no memory pressure, not what it gains on GPUs (not measurable on
this machine). On a 2-core machine the 4-rank table runs two ranks per core: it shows that
the layouts run and what they cost relative to each other, not their speed.

Usage: python bench/parallel.py [--preset small] [--seq-length 256] [--global-batch 8]
       [--micro-batch 2] [--steps 10] [--warmup 2] [--threads 1] [--ranks 2,4] [--first K]
       [--smoke]
(--first K: the first K layouts of each table, its baseline first. --smoke: the tiny preset,
one timed step, the 2-rank table's baseline and tensor parallel 2: seconds rather than minutes,
the test suite's run (tests/unit/test_bench.py), whose figures mean nothing. A layout that
fails prints one line and makes the exit status 1.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# --smoke: the smallest run that still prints a ratio (explicit options still win)
SMOKE = dict(preset="tiny", vocab=512, seq_length=32, global_batch=4, micro_batch=1, steps=1,
             warmup=1, ranks="2", first=2)  # fmt: skip


def worker(a) -> None:
    """One rank of a layout (under torchrun): time the trainer's step, rank 0 prints JSON."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from gptflow.config.schema import load_yaml
    from gptflow.config.settings import ModelConfig, TrainConfig, padded_vocab_size
    from gptflow.train import device, distributed
    from gptflow.train import engine as ds
    from gptflow.train.loop import Progress, Trainer, train_step
    from gptflow.train.metrics import Interval
    from gptflow.train.model import decay_groups

    torch.set_num_threads(a.threads)
    env = distributed.resolve()
    distributed.export(env)
    dev = device.setup(env, timeout_minutes=30)
    preset = load_yaml(REPO / "config/models" / f"{a.preset}.yaml") or {}
    vocab = padded_vocab_size(a.vocab, preset.get("make_vocab_size_divisible_by", 128))
    cfg = ModelConfig(**{**preset, "vocab_size": vocab, "hidden_dropout": 0.0,
                         "attention_dropout": 0.0})  # fmt: skip
    total = a.warmup + a.steps
    t = TrainConfig(
        train_iters=total, seq_length=a.seq_length, micro_batch_size=a.micro_batch,
        global_batch_size=a.global_batch, zero_stage=1, tensor_parallel=a.tp,
        pipeline_parallel=a.pp,
    )  # fmt: skip
    rows = np.random.default_rng(1234).integers(
        0, a.vocab, size=(total * a.global_batch, a.seq_length + 1), dtype=np.int64
    )
    torch.manual_seed(t.seed)
    model = ds.build_model(cfg, t, env.world_size, dev.device)
    engine = ds.build_engine(model, decay_groups(model, t.weight_decay), t, env.world_size)
    trainer = Trainer(
        cfg=SimpleNamespace(train=t), dev=dev, rank=env.rank, launcher="torchrun",
        engine=engine, series=None, train_data=rows, valid_data=None,
        gas=t.grad_accum_steps(env.world_size), flops_per_token=0.0, peak_tflops=None,
        exit_interval=None, resume_from=None, resume_mode="native",
        saves=None,  # the bench never saves: train_step does not touch them
    )  # fmt: skip
    prog = Progress(step=0, interval=Interval(dev))
    times = []
    for i in range(total):
        dev.barrier()
        started = time.perf_counter()
        prog.step = i
        train_step(trainer, prog)
        dev.barrier()
        if i >= a.warmup:
            times.append(time.perf_counter() - started)
    if env.rank == 0:
        print(json.dumps({"ms_per_step": 1000 * statistics.median(times),
                          "parameters": cfg.num_parameters()}))  # fmt: skip


LAYOUTS = {  # ranks -> (tensor, pipeline, name); the first is the table's baseline
    2: [(1, 1, "data parallel 2 (baseline)"), (2, 1, "tensor parallel 2"),
        (1, 2, "pipeline parallel 2")],
    4: [(1, 1, "data parallel 4 (baseline)"), (2, 1, "tensor 2 x data 2"),
        (1, 2, "pipeline 2 x data 2"), (2, 2, "tensor 2 x pipeline 2")],
}  # fmt: skip


def layout_tables(a, ranks: list[int], first: int | None = None) -> bool:
    """Run and print the table of each number of ranks in `ranks` (options as main's), the
    first `first` layouts of each (all: None); False when a layout failed."""
    tokens = a.global_batch * a.seq_length
    ok = True
    for n in ranks:
        print(
            f"layouts on {n} ranks (torchrun, gloo, CPU, {a.threads} thread(s) each): preset "
            f"{a.preset}, global batch {a.global_batch} (micro {a.micro_batch}) x "
            f"{a.seq_length} = {tokens} tokens/step, fp32, ZeRO 1; {a.warmup} warm-up + "
            f"{a.steps} timed steps, median"
        )
        base = None
        for tp, pp, name in LAYOUTS[n][:first]:
            cmd = [
                str(Path(sys.executable).parent / "torchrun"), "--standalone",
                f"--nproc_per_node={n}", __file__, "--tp", str(tp), "--pp", str(pp),
                "--preset", a.preset, "--vocab", str(a.vocab), "--micro-batch",
                str(a.micro_batch), "--seq-length", str(a.seq_length), "--global-batch",
                str(a.global_batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
                "--threads", str(a.threads),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONWARNINGS": "ignore"}
            for attempt in (1, 2):  # a second try, said, where the first fails (a busy machine)
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                if out.returncode == 0 and lines:
                    break
                why = [line for line in out.stderr.splitlines() if "Error" in line] or [
                    out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "no output"
                ]  # one line: the worker's last error line
                what = "cannot run here" if attempt == 2 else "failed once, run again"
                print(f"  {name:28s} {what} (exit {out.returncode}): {why[-1].strip()}")
            if out.returncode != 0 or not lines:
                ok = False
                continue
            ms = json.loads(lines[-1])["ms_per_step"]
            base = base or ms
            print(
                f"  {name:28s} {ms:9.1f} ms/step {tokens / ms * 1000:10.0f} tokens/s  "
                f"{base / ms:5.2f}x the baseline's tokens/s"
            )
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="config/models/<preset>.yaml (default small)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--ranks", default="2,4", help="the tables to run: 2 and/or 4 ranks")
    p.add_argument("--first", type=int, help="the first K layouts of each table (default all)")
    p.add_argument("--smoke", action="store_true", help=f"seconds, not minutes: {SMOKE}")
    p.add_argument("--tp", type=int, default=0, help=argparse.SUPPRESS)  # worker mode
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        p.set_defaults(**SMOKE)
        a = p.parse_args()
    if a.tp:
        worker(a)
        return 0

    return 0 if layout_tables(a, [int(n) for n in a.ranks.split(",")], a.first) else 1


if __name__ == "__main__":
    sys.exit(main())
