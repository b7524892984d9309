"""Muon inside DeepSpeed (train.optimizer muon), in the layouts the issue names: the update
DeepSpeed makes in a step is the one computed here, in float64, by Newton-Schulz written in
this file, from what the step was made of.

One `gptflow train` process per rank count trains each layout in turn (the probe below), on
one rank and on two torchrun ranks over gloo; each records, per step and rank, every
parameter's fp32 master weight before it, the learning rate, and the step's raw gradient as
autograd hands it to each parameter (a tensor hook per parameter, summed over the
micro-batches: DeepSpeed's ZeRO 1/2 write the orthogonalized update where its own gradient
accessors read, so they cannot give the raw gradient). Two data-parallel ranks' gradients
are averaged here, as DeepSpeed's reduction does. The model is the tiny GPT-NeoX of the test
config, built by gptflow; what is checked against an independent computation is the
optimizer: Muon (Nesterov momentum, Newton-Schulz, Moonlight's RMS matching, decoupled decay)
on the hidden matrices, torch AdamW on the rest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from gptflow.train.run_config import RunConfig

BIN = Path(sys.executable).parent

PROBE = '''
import os, sys, torch
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype
from gptflow.train import device, loop
from gptflow.train.main import train

rank = os.environ.get("RANK", "0")
steps, current = [], {}


def master(engine):
    return {name: safe_get_full_fp32_param(p).detach().double().clone()
            if safe_get_full_fp32_param(p) is not None else p.detach().double().clone()
            for name, p in engine.module.named_parameters()}


def hooks(engine):
    """Each parameter's raw gradient, summed over the step's micro-batches, in float64."""
    sums = {}
    for name, p in engine.module.named_parameters():
        def add(g, name=name):
            sums[name] = sums.get(name, 0) + g.detach().double()
        p.register_hook(add)
    return sums


def train_step(tr, prog, plain=loop.train_step):
    if current.get("engine") is not tr.engine:
        current["engine"], current["sums"] = tr.engine, hooks(tr.engine)
        current["muon"] = sorted(n for n, p in tr.engine.module.named_parameters()
                                 if getattr(p, "use_muon", False))
    before = master(tr.engine)
    current["sums"].clear()
    plain(tr, prog)
    steps.append({"master": before, "grads": dict(current["sums"]), "lr": prog.lr})


def finish(tr, step, plain=loop.finish):
    torch.save({"steps": list(steps), "final": master(tr.engine), "muon": current["muon"],
                "ns_dtype": str(ns_compute_dtype("gram"))},
               f"{sys.argv[1]}.{current['name']}.{rank}.pt")
    steps.clear()
    plain(tr, step)


def setup(env, timeout, plain=device.setup):
    """One process group for all the runs (DeepSpeed keeps its groups in module globals)."""
    if "dev" not in current:
        current["dev"] = plain(env, timeout)
    return current["dev"]


loop.train_step, loop.finish = train_step, finish
device.setup, device.Device.shutdown = setup, lambda self: None
for path in sys.argv[2:]:
    current["name"] = os.path.basename(os.path.dirname(path))
    code = train(path, threads=1)
    if code:
        break
sys.exit(device.leave(code))  # without the interpreter's teardown (gptflow.train.device.leave)
'''

SETTINGS = dict(train_iters=3, lr=2e-3, min_lr=2e-4, lr_warmup_iters=0, log_interval=1,
                eval_iters=0, save_interval=100, global_batch_size=8, adam_eps=1e-5,
                clip_grad=0.0, optimizer="muon")  # fmt: skip
# (precision, ZeRO stage, tensor parallel) per rank count
LAYOUTS = {
    1: [("fp32", 0, 1), ("fp32", 1, 1), ("fp32", 2, 1), ("bf16", 1, 1)],
    2: [("fp32", 0, 1), ("fp32", 1, 1), ("fp32", 2, 1), ("fp32", 3, 1), ("fp32", 1, 2)],
}
# the tiny model's hidden matrices: 4 a layer, 2 layers
MUON = {f"gpt_neox.layers.{i}.{m}.weight" for i in range(2)
        for m in ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h",
                  "mlp.dense_4h_to_h")}  # fmt: skip


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz (coefficients 3.4445, -4.7750, 2.0315), float64,
    on the wide orientation, after scaling to Frobenius norm 1."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def expected_run(rec: dict, t, grads: list[dict]) -> list[dict[str, torch.Tensor]]:
    """The master weights after each recorded step, each from the recorded weights before it.
    Muon's matrices: momentum m = beta m + (1 - beta) g, Nesterov u = (1 - beta) g + beta m,
    the update lr x 0.2 x sqrt(max(rows, cols)) x NS(u) (Moonlight's RMS matching, lr the
    schedule's train.lr), decay lr x weight_decay. The rest: torch AdamW, decay on matrices."""
    b1, b2, eps, wd, beta = t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.muon.momentum
    m: dict[str, torch.Tensor] = {}
    v: dict[str, torch.Tensor] = {}
    out = []
    for k, (step, g) in enumerate(zip(rec["steps"], grads, strict=True), start=1):
        lr, after = step["lr"], {}
        for name, x in step["master"].items():
            if name in rec["muon"]:
                m[name] = beta * m.get(name, torch.zeros_like(x)) + (1 - beta) * g[name]
                u = (1 - beta) * g[name] + beta * m[name]
                rms_matched = 0.2 * max(x.shape) ** 0.5
                after[name] = x * (1 - lr * wd) - lr * rms_matched * newton_schulz(u)
                continue
            m[name] = b1 * m.get(name, torch.zeros_like(x)) + (1 - b1) * g[name]
            v[name] = b2 * v.get(name, torch.zeros_like(x)) + (1 - b2) * g[name] ** 2
            mhat, vhat = m[name] / (1 - b1**k), v[name] / (1 - b2**k)
            decay = wd if x.dim() == 2 else 0.0
            after[name] = x * (1 - lr * decay) - lr * mhat / (vhat.sqrt() + eps)
        out.append(after)
    return out


def run_layouts(make_run, tmp_path: Path, ranks: int) -> dict:
    runs = [make_run(f"{p}-zero{z}-tp{tp}-{ranks}", precision=p, zero_stage=z,
                     tensor_parallel=tp, **SETTINGS)
            for p, z, tp in LAYOUTS[ranks]]  # fmt: skip
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    prefix = tmp_path / f"rec{ranks}"
    args = [str(prefix), *(str(r / "run.yaml") for r in runs)]
    # DeepSpeed torch.compiles its muon_update: ~17 s of inductor per layout on this CPU;
    # eager here (the same operations; the tolerance covers a fused kernel's rounding)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}
    if ranks == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", str(script),
               *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    for p, z, tp in LAYOUTS[ranks]:  # rank 0 logs what each half steps
        # 8 matrices; 2 LayerNorms (2 each) and 4 biases a layer, embedding, final norm, head
        assert "Muon on 8 matrices, AdamW on 20 tensors" in out.stderr, (p, z, tp)
    return {
        (r.name, rank): torch.load(f"{prefix}.{r.name}.{rank}.pt", weights_only=True)
        for r in runs
        for rank in range(ranks)
    }


def test_one_muon_step_is_newton_schulz_of_the_momentum_and_adamw_on_the_rest(make_run, tmp_path):
    """In each layout (ZeRO 0, 1, 2 on one rank and on two, ZeRO 3 on two; bf16 at ZeRO 1; tensor parallel 2
    at ZeRO 1), every step's change of every fp32 master weight is the update computed here
    from the recorded raw gradients, to 2e-3 of the learning rate per weight (fp32 Newton-
    Schulz, DeepSpeed's Gram form, against the float64 standard one; 2e-2 where DeepSpeed's
    Newton-Schulz runs in fp16, on a CPU with fp16; 6e-2 in bf16), over 3 steps (the
    momentum carried). At tensor
    parallel 2 each rank's block of a split matrix is orthogonalized on its own. The check's
    power: AdamW's first update of a matrix is far from it (over half the lr somewhere), and
    the Muon half is the whole of the hidden matrices, nothing else."""
    recs = {**run_layouts(make_run, tmp_path, 1), **run_layouts(make_run, tmp_path, 2)}
    for (name, rank), rec in recs.items():
        t = RunConfig.load(tmp_path / name / "run.yaml").train
        assert set(rec["muon"]) == MUON, name
        assert len(rec["steps"]) == SETTINGS["train_iters"], name
        ranks = 2 if name.endswith("-2") else 1
        data_parallel = ranks // t.tensor_parallel
        # the step's gradient: the mean over data-parallel ranks of each rank's micro-batch sum
        grads = [
            {p: sum(recs[(name, r)]["steps"][k]["grads"][p] for r in range(data_parallel))
             / data_parallel if data_parallel > 1 else s["grads"][p] for p in s["grads"]}
            for k, s in enumerate(rec["steps"])
        ]  # fmt: skip
        want = expected_run(rec, t, grads)
        got = [s["master"] for s in rec["steps"][1:]] + [rec["final"]]
        # bf16: the micro-batches' gradients are bf16 (rounded 2^-8 each), and Newton-Schulz,
        # whose first steps stretch small singular values ~3.4x each, spreads that to ~3e-2
        # of an update's elements (measured; its direction agrees to a cosine of 0.9999)
        tol = (
            6e-2 if t.precision == "bf16" else 2e-2 if rec["ns_dtype"] != "torch.float32" else 2e-3
        )
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            for p in w:
                delta = (g[p] - w[p]).abs().max().item()
                assert delta < tol * rec["steps"][k]["lr"], (name, rank, k, p, delta)
        first, lr, b1 = rec["steps"][0], rec["steps"][0]["lr"], t.adam_beta1
        for p in MUON:
            g = grads[0][p]
            adamw = first["master"][p] * (1 - lr * t.weight_decay) - lr * g / (g.abs() + t.adam_eps)
            assert (want[0][p] - adamw).abs().max() > 0.5 * lr, (name, p, b1)
    # two data-parallel ranks hold the same weights bit for bit; tensor-parallel ranks differ
    for p, z, tp in LAYOUTS[2]:
        a, b = (recs[(f"{p}-zero{z}-tp{tp}-2", r)]["final"] for r in (0, 1))
        if tp == 1:
            assert all(torch.equal(a[n], b[n]) for n in a), (p, z)
        else:
            qkv = "gpt_neox.layers.0.attention.query_key_value.weight"
            assert not torch.equal(a[qkv], b[qkv])
