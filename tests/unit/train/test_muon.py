"""train.optimizer muon without training: which parameters Muon steps, its learning-rate rule,
the FLOPs and memory the preflight and the trainer count, the refusals at planning and the
run's identity. The update itself is checked in tests/unit/train/test_muon_layouts.py."""

from __future__ import annotations

import pytest
import torch
import yaml

from gptflow.config.settings import (
    ModelConfig,
    TrainConfig,
    muon_layer_shapes,
    muon_lr_scale,
    muon_matrix_shapes,
    newton_schulz_flops,
    optimizer_flops_per_step,
    training_flops_per_token,
)
from gptflow.errors import GptflowError

MUON = {"optimizer": "muon", "clip_grad": 0.0}


def tiny(repo) -> ModelConfig:
    return ModelConfig(
        **yaml.safe_load((repo / "config/models/tiny.yaml").read_text()), vocab_size=512
    )


def test_muon_steps_the_hidden_matrices_and_adamw_the_rest(repo):
    """gptflow.train.engine.optimizer_groups on the GPTNeoX: Muon's groups hold exactly every
    layer's query_key_value, dense and MLP weights (tagged use_muon, as DeepSpeed's ZeRO reads
    it), AdamW's the embedding, embed_out, norms and biases, train.lr first; the matrices'
    shapes are muon_matrix_shapes' (what the FLOPs and memory count), and with AdamW the groups
    are decay_groups' unchanged."""
    from gptflow.train import engine
    from gptflow.train.model import GPTNeoX, decay_groups

    m = tiny(repo)
    with torch.device("meta"):
        net = GPTNeoX(m)
    names = {id(p): n for n, p in net.named_parameters()}
    t = TrainConfig(train_iters=10, lr=1e-3, **MUON)
    groups = engine.optimizer_groups(net, m, t)
    muon = [names[id(p)] for g in groups if g["use_muon"] for p in g["params"]]
    adamw = [names[id(p)] for g in groups if not g["use_muon"] for p in g["params"]]
    assert sorted(muon) == sorted(
        f"gpt_neox.layers.{i}.{kind}.weight" for i in range(m.num_layers)
        for kind in ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h",
                     "mlp.dense_4h_to_h")
    )  # fmt: skip
    assert sorted(muon + adamw) == sorted(names.values())
    assert {"gpt_neox.embed_in.weight", "embed_out.weight"} <= set(adamw)
    assert groups[0]["lr"] == t.lr and not groups[0]["use_muon"]
    assert all(p.use_muon == (names[id(p)] in muon) for p in net.parameters())
    shapes = sorted(tuple(p.shape) for p in net.parameters() if p.use_muon)
    assert shapes == sorted(muon_matrix_shapes(m))
    # RMS matching: each group's lr x DeepSpeed's own scale is train.lr x 0.2 sqrt(max side)
    for g in (g for g in groups if g["use_muon"]):
        for p in g["params"]:
            r, c = p.shape
            assert g["lr"] * max(1, r / c) ** 0.5 == pytest.approx(t.lr * 0.2 * max(r, c) ** 0.5)
            assert g["lr"] * g["weight_decay"] == pytest.approx(t.lr * t.weight_decay)
    plain = TrainConfig(train_iters=10)
    assert [len(g["params"]) for g in engine.optimizer_groups(net, m, plain)] == [
        len(g["params"]) for g in decay_groups(net, plain.weight_decay)
    ]


def test_the_rms_rule_and_the_tensor_parallel_blocks(repo):
    m = tiny(repo)
    for r, c in [(192, 64), (64, 256), (64, 64)]:
        assert muon_lr_scale(r, c) * max(1, r / c) ** 0.5 == pytest.approx(0.2 * max(r, c) ** 0.5)
    # tensor parallel 2: column-parallel matrices lose half their rows, row-parallel ones
    # half their columns, as gptflow.train.model_parallel.tensor_parallel_dim splits them
    from gptflow.train.model_parallel import tensor_parallel_dim

    whole, half = muon_layer_shapes(m), muon_layer_shapes(m, 2)
    for kind, (r, c) in whole.items():
        dim = tensor_parallel_dim(f"gpt_neox.layers.0.{kind}.weight")
        assert half[kind] == ((r // 2, c) if dim == 0 else (r, c // 2)), kind


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(48, 16), (16, 40), (24, 24)])
def test_newton_schulz_flops_are_deepspeeds_counted(method, shape):
    """The formula equals torch's FLOP counter over DeepSpeed's own Newton-Schulz (eager)."""
    from deepspeed.runtime.zero.muon import original_muon as om
    from torch.utils.flop_counter import FlopCounterMode

    fn = om.zeropower_via_gram_newtonschulz if method == "gram" else om.zeropower_via_newtonschulz5
    with FlopCounterMode(display=False) as counter:
        torch.compiler.disable(fn)(torch.randn(*shape), steps=5)
    assert counter.get_total_flops() == newton_schulz_flops(*shape, method)


def test_training_flops_count_newton_schulz_once_per_step(repo):
    m = tiny(repo)
    adamw = TrainConfig(train_iters=10)
    assert training_flops_per_token(m, adamw) == m.flops_per_token(adamw.seq_length)
    muon = TrainConfig(train_iters=10, **MUON)
    ns = sum(newton_schulz_flops(r, c, "gram") for r, c in muon_matrix_shapes(m))
    assert optimizer_flops_per_step(m, muon) == ns
    assert training_flops_per_token(m, muon) == pytest.approx(
        m.flops_per_token(muon.seq_length) + ns / muon.tokens_per_step
    )
    blocks = TrainConfig(train_iters=10, tensor_parallel=2, zero_stage=1, **MUON)
    # every rank's blocks: the n^3 terms of a block whose short side did not shrink repeat
    assert optimizer_flops_per_step(m, blocks) == 2 * sum(
        newton_schulz_flops(r, c, "gram") for r, c in muon_matrix_shapes(m, 2)
    )


def test_muon_keeps_its_momentum_for_adams_two_moments_and_counts_newton_schulz(repo):
    """The preflight's optimizer state: Muon's matrices keep no Adam moments (8 bytes a
    parameter, partitioned by ZeRO alike) but a momentum, counted by gptflow.plan.muon (at ZeRO
    0 one fp32 moment each; at ZeRO 1/2 on 2 ranks each rank's momentum of the matrices its
    partition touches, whole, and the staged copy as large: tests/unit/plan/test_muon_memory.py
    measures them); a Newton-Schulz working set; the checkpoint bytes."""
    from gptflow.plan import gpu_memory, muon

    m = tiny(repo)
    matrices = sum(r * c for r, c in muon_matrix_shapes(m))
    for zero in (0, 1, 2):
        kw = dict(train_iters=10, zero_stage=zero)
        with_muon = TrainConfig(**kw, **MUON)
        a = gpu_memory.stage_memory(m, TrainConfig(**kw), 2, 1, "fp32", 0)
        b = gpu_memory.stage_memory(m, with_muon, 2, 1, "fp32", 0)
        shard = 2 if zero else 1
        assert a["optimizer states"] - b["optimizer states"] == 8 * matrices // shard
        if zero == 0:
            assert b["Muon momentum"] == 4 * matrices and "Muon staged momentum" not in b
        else:
            assert b["Muon momentum"] == b["Muon staged momentum"] >= 4 * matrices // 2
        assert not {"Muon momentum", "Muon staged momentum"} & set(gpu_memory.TRANSIENT)
        assert b.keys() - a.keys() == {"Newton-Schulz", *muon.muon_memory(m, with_muon, 2, "fp32")}
        assert "Newton-Schulz" not in a and b["Newton-Schulz"] > 0
        assert "Newton-Schulz" in gpu_memory.TRANSIENT


@pytest.mark.parametrize(
    "train, refused",
    [({"clip_grad": 1.0}, "train.clip_grad 1.0"),
     ({"kfac": {}}, "train.kfac"),
     ({"zero_stage": 1, "offload": "optimizer"}, "train.offload optimizer"),
     ({"zero_stage": 1, "precision": "fp16"}, "train.precision fp16"),
     ({"zero_stage": 1, "precision": "bf16", "tensor_parallel": 2},
      "train.precision bf16 at train.zero_stage 1 with 2-way tensor x pipeline parallel")],
)  # fmt: skip
def test_what_cannot_be_right_is_refused_at_planning(repo, tiny_config, train, refused):
    """The workflow config's check (what snakemake -n runs, schema included) refuses each in
    one line naming the key and the way on; Muon with clip_grad 0 is accepted."""
    from gptflow.plan.workflow_config import load_workflow_config

    def load(train: dict) -> dict:
        return load_workflow_config(
            {**tiny_config, "train": {**tiny_config["train"], **MUON, **train}},
            schema_path=repo / "config/schema/config.schema.yaml",
            models_dir=repo / "config/models", source="my.yaml",
        )  # fmt: skip

    with pytest.raises(GptflowError) as err:
        load(train)
    message = str(err.value)
    assert f"train.optimizer muon is not supported with {refused}: " in message
    assert "\n" not in message and message.endswith("Fix my.yaml.")
    assert load({})["train"]["muon"] == {"lr": None, "momentum": 0.95, "ns_method": "gram",
                                         "weight_decay": None}  # fmt: skip


def test_the_optimizer_is_in_the_series_and_adamw_series_keep_their_names(
    repo, tiny_config, tokenizer_json, shards
):
    """Muon and its settings are part of the trajectory's fingerprint; an AdamW run's
    fingerprint has no trace of them (its series name is the one it had before Muon)."""
    from gptflow.plan.workflow_config import load_workflow_config
    from gptflow.train.run_config import render_run_config

    base = load_workflow_config(
        tiny_config, schema_path=repo / "config/schema/config.schema.yaml",
        models_dir=repo / "config/models", source="my.yaml",
    )  # fmt: skip

    def run(**train):
        cfg = {**base, "train": {**base["train"], **train}}
        return render_run_config(
            cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards}, run_dir="r"
        )

    adamw, muon = run(), run(**MUON)
    assert "muon" not in adamw.fingerprint() and "muon" in muon.fingerprint()
    clipped = run(clip_grad=0.0)
    series = {clipped.series, muon.series, run(**MUON, muon={"lr": 0.02}).series,
              run(**MUON, muon={"momentum": 0.9}).series}  # fmt: skip
    assert len(series) == 4
    assert muon.extra["training_flops"] > clipped.extra["training_flops"]  # Newton-Schulz's
