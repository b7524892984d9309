"""Muon inside DeepSpeed (train.optimizer muon), in every layout the planner admits for it:
the update DeepSpeed makes in a step is the one computed here, in float64, by Newton-Schulz
written in this file, from what the step was made of.

One `gptflow train` process per rank count trains each layout in turn (the probe below), on
one rank and on two and four torchrun ranks over gloo; each records, per step and rank, every
parameter's fp32 master weight before it, the learning rate, and the step's raw gradient as
autograd hands it to each parameter (a tensor hook per parameter, summed over the
micro-batches: DeepSpeed's ZeRO 1/2 write the orthogonalized update where its own gradient
accessors read, so they cannot give the raw gradient). Two data-parallel ranks' gradients
are averaged here, as DeepSpeed's reduction does (the peers are the rank's data-parallel group, as
DeepSpeed made it). The model is the tiny GPT-NeoX of the test
config, built by gptflow; what is checked against an independent computation is the
optimizer: Muon (Nesterov momentum, Newton-Schulz, Moonlight's RMS matching, decoupled decay)
on the hidden matrices, torch AdamW on the rest."""

from __future__ import annotations

import os
import re
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
    group = tr.engine.seq_data_parallel_group
    peers = torch.distributed.get_process_group_ranks(group) if group is not None else [0]
    # Muon's momentum as the optimizer keeps it (a ZeRO optimizer wraps the torch one)
    inner = getattr(tr.engine.optimizer, "optimizer", tr.engine.optimizer)
    momenta = sorted({str(s["momentum_buffer"].dtype) for s in inner.state.values()
                      if "momentum_buffer" in s})
    torch.save({"steps": list(steps), "final": master(tr.engine), "muon": current["muon"],
                "ns_dtype": str(ns_compute_dtype("gram")), "data_parallel_peers": peers,
                "momentum_dtypes": momenta},
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
# (precision, ZeRO stage, tensor parallel, pipeline parallel) per rank count: every layout
# the planner admits for Muon with tensor and pipeline parallel up to 2
# (test_every_layout_the_planner_admits_for_muon_is_probed), each once with one data-parallel
# rank and, where it fits on two ranks, with two. In a launch, the layouts of one model split
# come together and tensor parallel last (AutoTP's groups outlive its engine).
LAYOUTS = {
    1: [("fp32", 0, 1, 1), ("fp32", 1, 1, 1), ("fp32", 2, 1, 1), ("fp32", 3, 1, 1),
        ("bf16", 1, 1, 1), ("bf16", 2, 1, 1), ("bf16", 3, 1, 1)],
    2: [("fp32", 0, 1, 1), ("fp32", 1, 1, 1), ("fp32", 2, 1, 1), ("fp32", 3, 1, 1),
        ("bf16", 1, 1, 1), ("bf16", 2, 1, 1), ("bf16", 3, 1, 1), ("fp32", 1, 1, 2),
        ("fp32", 1, 2, 1), ("fp32", 2, 2, 1), ("bf16", 2, 2, 1)],
    4: [("fp32", 1, 2, 2)],
}  # fmt: skip
# the matrices Muon steps, by what they are (the tiny model: 4 a layer, 2 layers), in either
# naming: GPTNeoX's (gpt_neox.layers.{i}.attention.dense.weight) or a pipeline stage's
# ({stage}.layer.attention.dense.weight)
MATRIX = re.compile(r".*\.(attention\.query_key_value|attention\.dense|mlp\.dense_h_to_4h|"
                    r"mlp\.dense_4h_to_h)\.weight")  # fmt: skip


def name(p: str, z: int, tp: int, pp: int, ranks: int) -> str:
    return f"{p}-zero{z}-tp{tp}-pp{pp}-{ranks}"


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
    runs = [make_run(name(p, z, tp, pp, ranks), precision=p, zero_stage=z, tensor_parallel=tp,
                     pipeline_parallel=pp, **SETTINGS)
            for p, z, tp, pp in LAYOUTS[ranks]]  # fmt: skip
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
    # rank 0 logs what each half steps: 8 matrices; 2 LayerNorms (2 each) and 4 biases a
    # layer, embedding, final norm, head (a pipeline's rank 0 holds the first stage only)
    whole = sum(pp == 1 for *_, pp in LAYOUTS[ranks])
    assert out.stderr.count("Muon on 8 matrices, AdamW on 20 tensors") == whole, ranks
    return {
        (r.name, rank): torch.load(f"{prefix}.{r.name}.{rank}.pt", weights_only=True)
        for r in runs
        for rank in range(ranks)
    }


def tolerance(precision: str, ns_dtype: str, half: str) -> float:
    """How far (x lr, per weight) a step may be from the float64 reference, by what the
    reference layouts measured (worst over every layout and step, this CPU, DeepSpeed 0.19.8).

    AdamW's half: 9e-5 in fp32; in bf16 3.7e-3 where DeepSpeed's BF16_Optimizer (ZeRO 1, fp32
    sums) steps it. Muon's half: fp32 Newton-Schulz against the float64 one 2e-3; DeepSpeed's
    Gram Newton-Schulz in fp16 (where the device has fp16) 1.3e-2; under bf16 the
    micro-batches' gradients are bf16 (rounded 2^-8 each) and Newton-Schulz, whose first steps
    stretch small singular values ~3.4x each, spreads that to 3.66e-2 in the bf16 ZeRO 1
    reference (BF16_Optimizer: fp32 momentum and sums). Before gptflow's DeepSpeed patches
    (gptflow.train.deepspeed_patches) bf16 ZeRO 2 measured 1.0 on AdamW's half (biases never
    stepped) and 5.5e-2 on Muon's (momentum in bf16), bf16 ZeRO 3 5.2e-2 on Muon's."""
    if half == "adamw":
        return 5e-3 if precision == "bf16" else 5e-4
    if precision == "bf16":
        return 4e-2
    return 2e-2 if ns_dtype != "torch.float32" else 2e-3


def test_one_muon_step_is_newton_schulz_of_the_momentum_and_adamw_on_the_rest(make_run, tmp_path):
    """In each layout of :data:`LAYOUTS` (every one the planner admits for Muon: ZeRO 0-3,
    fp32 and bf16, tensor and pipeline parallel, one, two and four ranks), every step's change
    of every fp32 master weight is the update computed here from the recorded raw gradients,
    over 3 steps (the momentum carried), to a tolerance per weight of the learning rate that
    the reference layouts justify (:func:`tolerance`). At tensor parallel 2 each rank's block of
    a split matrix is orthogonalized on its own; under a pipeline each stage steps its own
    layers. The check's power: AdamW's first update of a matrix is far from Muon's (over half
    the lr somewhere), a tensor the optimizer leaves alone is 1 lr off, and the Muon half is
    the whole of the hidden matrices, nothing else."""
    recs = {}
    for ranks in LAYOUTS:
        recs.update(run_layouts(make_run, tmp_path, ranks))
    for (run, rank), rec in recs.items():
        t = RunConfig.load(tmp_path / run / "run.yaml").train
        assert set(rec["muon"]) == {p for p in rec["final"] if MATRIX.fullmatch(p)}, run
        assert len(rec["steps"]) == SETTINGS["train_iters"], run
        # the momentum is fp32 state in every layout, as the master weights are
        assert rec["momentum_dtypes"] == ["torch.float32"], (run, rank, rec["momentum_dtypes"])
        # the step's gradient: the mean over the data-parallel peers of each one's
        # micro-batch sum (the peers hold the same parameters, the same slice of each)
        peers = rec["data_parallel_peers"]
        grads = [
            {p: sum(recs[(run, r)]["steps"][k]["grads"][p] for r in peers) / len(peers)
             for p in s["grads"]}
            for k, s in enumerate(rec["steps"])
        ]  # fmt: skip
        want = expected_run(rec, t, grads)
        got = [s["master"] for s in rec["steps"][1:]] + [rec["final"]]
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            for p in w:
                half = "muon" if p in rec["muon"] else "adamw"
                delta = (g[p] - w[p]).abs().max().item() / rec["steps"][k]["lr"]
                assert delta < tolerance(t.precision, rec["ns_dtype"], half), (run, rank, k, p)
        first, lr = rec["steps"][0], rec["steps"][0]["lr"]
        for p in rec["muon"]:
            g = grads[0][p]
            adamw = first["master"][p] * (1 - lr * t.weight_decay) - lr * g / (g.abs() + t.adam_eps)
            assert (want[0][p] - adamw).abs().max() > 0.5 * lr, (run, p)
    # every matrix is Muon's on some rank of each layout
    for ranks, layouts in LAYOUTS.items():
        for layout in layouts:
            run = name(*layout, ranks)
            held = set().union(*(recs[(run, r)]["muon"] for r in range(ranks)))
            assert len(held) == 8, (run, sorted(held))
    # data-parallel peers hold the same weights bit for bit; tensor-parallel ranks differ
    for p, z, tp, pp in LAYOUTS[2]:
        a, b = (recs[(name(p, z, tp, pp, 2), r)]["final"] for r in (0, 1))
        if tp == pp == 1:
            assert all(torch.equal(a[n], b[n]) for n in a), (p, z)
        elif tp == 2:
            qkv = "gpt_neox.layers.0.attention.query_key_value.weight"
            assert not torch.equal(a[qkv], b[qkv])


def test_every_layout_the_planner_admits_for_muon_is_probed(repo, tiny_config):
    """:data:`LAYOUTS` holds every (precision, ZeRO stage, tensor parallel, pipeline parallel)
    with both parallel sizes up to 2 that the planner's config check (what `snakemake -n`
    runs) lets train Muon, and nothing it refuses: a layout the planner starts to admit fails
    here until the probe trains it."""
    from gptflow.errors import GptflowError
    from gptflow.plan.workflow_config import load_workflow_config

    def admitted(precision, zero, tp, pp) -> bool:
        train = dict(SETTINGS, precision=precision, zero_stage=zero, tensor_parallel=tp,
                     pipeline_parallel=pp)  # fmt: skip
        try:
            load_workflow_config(
                {**tiny_config, "train": {**tiny_config["train"], **train}},
                schema_path=repo / "config/schema/config.schema.yaml",
                models_dir=repo / "config/models",
                source="test",
            )
        except GptflowError:
            return False
        return True

    every = {
        (p, z, tp, pp)
        for p in ("fp32", "bf16", "fp16")
        for z in range(4)
        for tp in (1, 2)
        for pp in (1, 2)
        if admitted(p, z, tp, pp)
    }
    probed = {layout for layouts in LAYOUTS.values() for layout in layouts}
    assert probed == every
    # each data-parallel ZeRO layout also with two data-parallel ranks
    assert {x for x in every if x[2:] == (1, 1)} <= set(LAYOUTS[2])
