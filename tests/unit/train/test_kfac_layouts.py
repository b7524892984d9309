"""K-FAC inside DeepSpeed, in every layout `train.kfac` accepts: the update DeepSpeed makes
after a step is the preconditioned AdamW update computed here, in float64, from what the step
was made of (issue 36: under bf16 at ZeRO 1, DeepSpeed's BF16_Optimizer, the preconditioned
gradient was written where the optimizer never reads and the update was plain AdamW's).

One `gptflow train` process per rank count trains each layout in turn (the probe below), on
one rank and on two torchrun ranks over gloo; each records, per step and rank, the fp32
master weights before it, every parameter's whole gradient before K-FAC (DeepSpeed's own
``safe_get_full_grad``, not gptflow's accessor), the factors K-FAC holds and the learning
rate. fp16 runs where DeepSpeed refuses it on this CPU (no oneDNN fp16) with that gate lifted,
on PyTorch's reference fp16 kernels (tests/support/hardware.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptflow.train.run_config import RunConfig
from tests.support.hardware import fp16_env

BIN = Path(sys.executable).parent

PROBE = '''
import os, sys, torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
from gptflow.train import engine as ds
from gptflow.train import device, loop
from gptflow.train.main import train
from gptflow.train.kfac import Kfac

rank = os.environ.get("RANK", "0")
steps, current = [], {}


def master(engine):
    """Every parameter's fp32 master copy: ZeRO 1/2's reassembled from the partitions, fp16's
    at ZeRO 0 from DeepSpeed's FP16_UnfusedOptimizer, fp32's at ZeRO 0 the parameter."""
    opt = engine.optimizer
    fp32_of = {id(lp): hp for lows, highs in zip(getattr(opt, "fp16_groups", []),
                                                  getattr(opt, "fp32_groups", []))
               for lp, hp in zip(lows, highs)}
    out = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        full = fp32_of.get(id(p), p) if full is None else full
        out[name] = full.detach().double().clone()
    return out


def train_step(tr, prog, plain=loop.train_step):
    current["tr"] = tr
    plain(tr, prog)


def precondition(self, plain=Kfac.precondition):
    engine = current["tr"].engine
    grads = {n: safe_get_full_grad(p).detach().double().clone()
             for n, p in engine.module.named_parameters()}
    steps.append({"master": master(engine), "grads": grads, "lr": engine.get_lr()[0],
                  "scale": ds.loss_scale(engine), "skipped": ds.skipped_steps(engine),
                  "A": [ly.A.double().clone() for ly in self.layers],
                  "G": [ly.G.double().clone() for ly in self.layers]})
    plain(self)


def finish(tr, step, plain=loop.finish):
    modules = {id(m): n for n, m in tr.engine.module.named_modules()}
    torch.save({"steps": list(steps), "final": master(tr.engine),
                "layers": [modules[id(ly.module)] for ly in tr.kfac.layers],
                "skipped": ds.skipped_steps(tr.engine)},
               f"{sys.argv[1]}.{current['name']}.{rank}.pt")
    steps.clear()
    plain(tr, step)


def deepspeed_config(*args, plain=ds.deepspeed_config, **kwargs):
    """A run named ...-power<P> starts fp16's dynamic loss scale at 2^P, not at 2^16."""
    cfg = plain(*args, **kwargs)
    power = current["name"].partition("-power")[2]
    if power:
        cfg["fp16"]["initial_scale_power"] = int(power)
    return cfg


def setup(env, timeout, plain=device.setup):
    """One process group for all the runs (DeepSpeed keeps its groups in module globals)."""
    if "dev" not in current:
        current["dev"] = plain(env, timeout)
    return current["dev"]


loop.train_step, Kfac.precondition, loop.finish = train_step, precondition, finish
ds.deepspeed_config = deepspeed_config
device.setup, device.Device.shutdown = setup, lambda self: None
for path in sys.argv[2:]:
    current["name"] = os.path.basename(os.path.dirname(path))
    code = train(path, threads=1)
    if code:
        break
sys.exit(device.leave(code))  # without the interpreter's teardown (gptflow.train.device.leave)
'''

KFAC = {"factor_update_steps": 1, "inv_update_steps": 1, "damping": 1e-3, "factor_decay": 0.5}
# adam_eps 1e-5: an element that is 0 in float64 is ~1e-9 in fp32 arithmetic, which Adam's
# first step would turn into ~0.1 of the learning rate against an eps of 1e-8
SETTINGS = dict(train_iters=3, lr_warmup_iters=0, log_interval=1, eval_iters=0, save_interval=100,
                global_batch_size=8, adam_eps=1e-5, kfac=KFAC)  # fmt: skip
# what train.kfac accepts (config.check_kfac; bf16 and fp16 need ZeRO 1+: check_trainable)
LAYOUTS = {
    "fp32-bf16": [("fp32", 0), ("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)],
    "fp16": [("fp16", 1), ("fp16", 2)],
}
# run on one rank besides: (precision, ZeRO stage, fp16's initial loss scale power, 16 by default)
RESCALED = {"fp16": [("fp16", 1, 8)]}


def preconditioned(m: torch.Tensor, A: torch.Tensor, G: torch.Tensor, damping: float):
    """(G ⊗ A + damping I)⁻¹ vec(M) in float64, through the factors' eigenbases."""
    dA, QA = torch.linalg.eigh(A)
    dG, QG = torch.linalg.eigh(G)
    v = QG.T @ m @ QA / (torch.outer(dG.clamp(min=0), dA.clamp(min=0)) + damping)
    return QG @ v @ QA.T


def expected_run(rec: dict, t) -> list[dict[str, torch.Tensor]]:
    """The master weights after each recorded step, each from the recorded weights before it:
    K-FAC's preconditioning of the recorded gradients, DeepSpeed's clipping to t.clip_grad
    by the global norm, then torch AdamW (decoupled decay on matrices only, bias-corrected
    moments carried over the steps). fp16: the gradients are unscaled first, and a step
    DeepSpeed skipped (an overflow: its skip count grew) leaves the weights and moments."""
    b1, b2, eps, wd = t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay
    m: dict[str, torch.Tensor] = {}
    v: dict[str, torch.Tensor] = {}
    out, k = [], 0
    skips = [s["skipped"] for s in rec["steps"][1:]] + [rec["skipped"]]
    for step, skipped_after in zip(rec["steps"], skips, strict=True):
        if skipped_after > step["skipped"]:
            out.append(step["master"])
            continue
        k += 1
        g = {name: x / step["scale"] for name, x in step["grads"].items()}
        for i, layer in enumerate(rec["layers"]):
            w, b = f"{layer}.weight", f"{layer}.bias"
            both = torch.cat([g[w], g[b][:, None]], dim=1)
            p = preconditioned(both, step["A"][i], step["G"][i], KFAC["damping"])
            g[w], g[b] = p[:, :-1], p[:, -1]
        norm = torch.sqrt(sum((x * x).sum() for x in g.values()))
        coef = min(1.0, t.clip_grad / (float(norm) + 1e-6))
        after = {}
        for name, x in step["master"].items():
            grad = g[name] * coef
            m[name] = b1 * m.get(name, torch.zeros_like(x)) + (1 - b1) * grad
            v[name] = b2 * v.get(name, torch.zeros_like(x)) + (1 - b2) * grad * grad
            mhat, vhat = m[name] / (1 - b1**k), v[name] / (1 - b2**k)
            decay = wd if x.dim() == 2 else 0.0  # matrices; not biases or LayerNorms
            after[name] = x * (1 - step["lr"] * decay) - step["lr"] * mhat / (vhat.sqrt() + eps)
        out.append(after)
    return out


def run_layouts(make_run, tmp_path: Path, layouts, ranks: int) -> dict:
    runs = [make_run(f"{p}-zero{z}-{ranks}" + "".join(f"-power{s}" for s in power),
                     precision=p, zero_stage=z, **SETTINGS)
            for p, z, *power in layouts]  # fmt: skip
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    prefix = tmp_path / f"rec{ranks}"
    args = [str(prefix), *(str(r / "run.yaml") for r in runs)]
    fp16 = any(p == "fp16" for p, *_ in layouts)
    env = {**(fp16_env() if fp16 else os.environ), "OMP_NUM_THREADS": "1"}
    if ranks == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", str(script),
               *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stderr.count("K-FAC on 8 nn.Linear layers") == len(layouts)  # rank 0 logs it
    return {
        (r.name, rank): torch.load(f"{prefix}.{r.name}.{rank}.pt", weights_only=True)
        for r in runs
        for rank in range(ranks)
    }


@pytest.mark.parametrize("precisions", LAYOUTS)
def test_the_update_is_the_preconditioned_adamw_update_in_every_layout(
    make_run, tmp_path, precisions
):
    """In each layout, on one rank and on two: each step's change of the fp32 master weights
    is AdamW's on the K-FAC-preconditioned, clipped gradient, to 5e-3 of the learning rate
    per weight (fp32 eigendecompositions against float64), and is not plain AdamW's (off by
    more than half the learning rate somewhere). Two ranks hold the same weights and factors
    bit for bit, and in fp32 the one-rank run's to reduction noise. Eigenvectors are not
    compared: they are defined up to sign and order within equal eigenvalues. fp16: the
    factors are the unscaled loss's, the same at DeepSpeed's loss scale 2^16 and 2^8 (issue
    36: the loop hands K-FAC the scale; with the update checked here, the scaled step is the
    unscaled one)."""
    layouts = LAYOUTS[precisions]
    recs = {**run_layouts(make_run, tmp_path, layouts + RESCALED.get(precisions, []), 1),
            **run_layouts(make_run, tmp_path, layouts, 2)}  # fmt: skip
    for (name, rank), rec in recs.items():
        t = RunConfig.load(tmp_path / name / "run.yaml").train
        assert len(rec["steps"]) == SETTINGS["train_iters"], name
        assert len(rec["layers"]) == 8  # 4 nn.Linear per layer of the tiny model, head left out
        want = expected_run(rec, t)
        got = [s["master"] for s in rec["steps"][1:]] + [rec["final"]]
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            for p in w:
                delta = (g[p] - w[p]).abs().max().item()
                assert delta < 5e-3 * rec["steps"][k]["lr"], (name, rank, k, p, delta)
        # the check's power: AdamW's first update on the raw gradient is far from it
        k, first = next((k, s) for k, s in enumerate(rec["steps"]) if want[k] is not s["master"])
        lr, w = first["lr"], f"{rec['layers'][-1]}.weight"
        g = first["grads"][w] / first["scale"]
        plain = first["master"][w] * (1 - lr * t.weight_decay) - lr * g / (g.abs() + t.adam_eps)
        assert (want[k][w] - plain).abs().max() > 0.5 * lr, name
    # measured: 1e-7 of the factor at the first step, 2e-4 after (the weights part by fp16's
    # underflow at the lower scale); scaled statistics would be S^2 = 2^32 / 2^16 apart
    for p, z, power in RESCALED.get(precisions, []):
        one, other = recs[(f"{p}-zero{z}-1", 0)], recs[(f"{p}-zero{z}-1-power{power}", 0)]
        assert [s["scale"] for s in other["steps"]] == [2.0**power] * SETTINGS["train_iters"]
        for k, (x, y) in enumerate(zip(one["steps"], other["steps"], strict=True)):
            for i, (f, g) in enumerate(zip(x["A"] + x["G"], y["A"] + y["G"], strict=True)):
                assert (f - g).norm() < 1e-2 * f.norm(), (p, z, power, k, i)
    # one rank sums 2 micro-batches, two ranks 1 each: in fp32 the same to reduction noise;
    # in bf16 each computed in bf16, whose rounding Adam turns into ~0.5 lr over 3 steps
    for p, z in layouts:
        one, *two = (recs[(f"{p}-zero{z}-{n}", r)] for n, r in ((1, 0), (2, 0), (2, 1)))
        for x, y in zip(
            two[0]["steps"][-1]["A"] + two[0]["steps"][-1]["G"],
            two[1]["steps"][-1]["A"] + two[1]["steps"][-1]["G"],
            strict=True,
        ):
            assert torch.equal(x, y), (p, z)
        for name, x in two[0]["final"].items():
            assert torch.equal(x, two[1]["final"][name]), (p, z, name)
            if p == "fp32":
                assert (x - one["final"][name]).abs().max() < 1e-4, (z, name)
