"""The numbers behind TFLOP/s and MFU: parameters and FLOPs per token from the model config
(one home: ModelConfig), checked against hand calculations and against a model built on CPU;
and what gptflow.hardware decides from a device (its peak, `train.precision: auto`)."""

from __future__ import annotations

import pytest
import yaml

from gptflow.config.settings import ModelConfig
from gptflow.hardware import mfu, peak_tflops, training_precision
from gptflow.train.model import GPTNeoX


def preset(repo, name: str, vocab: int) -> ModelConfig:
    keys = yaml.safe_load((repo / "config" / "models" / f"{name}.yaml").read_text())
    return ModelConfig(**keys, vocab_size=vocab)


def test_pythia_410m_by_hand(repo):
    """Pythia-410M (24 layers, hidden 1024, ffn 4096, vocabulary padded to 50,304) at 2,048.

    Parameters: 2 x 50,304 x 1,024 (embedding and head) + 24 x 12,596,224 (per layer: two
    LayerNorms 4,096; QKV 3,145,728 + 3,072; dense 1,048,576 + 1,024; MLP 4,194,304 + 4,096
    and 4,194,304 + 1,024) + 2,048 (final LayerNorm) = 405,334,016, the published count.

    FLOPs per token, Megatron: 3 x [24 x (2 x (4h^2 + 2hf) + 4sh) + 2hV]
      = 3 x [24 x (25,165,824 + 8,388,608) + 103,022,592] = 3 x 908,328,960 = 2,724,986,880,
    which is 72 L h^2 (1 + s/6h + V/12Lh) = 1,811,939,328 x 1.50390625.
    """
    cfg = preset(repo, "pythia-410m", 50_304)
    assert cfg.num_parameters() == 405_334_016
    assert cfg.flops_per_token(2048) == 2_724_986_880
    L, h, s, V = 24, 1024, 2048, 50_304
    assert cfg.flops_per_token(2048) == 72 * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))


@pytest.mark.parametrize(
    "keys",
    [
        {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512},
        {"num_layers": 3, "hidden_size": 96, "num_attention_heads": 6, "vocab_size": 1024,
         "intermediate_size": 200},
    ],
)  # fmt: skip
def test_parameter_count_equals_the_built_model(keys):
    cfg = ModelConfig(**keys)
    assert cfg.num_parameters() == sum(p.numel() for p in GPTNeoX(cfg).parameters())


def test_flops_terms_by_hand_for_a_non_square_mlp():
    """h 96, 3 layers, vocabulary 1,024, ffn 200, sequence 128:
    per layer 2 x (4 x 9,216 + 2 x 96 x 200) + 4 x 128 x 96 = 150,528 + 49,152 = 199,680;
    3 layers 599,040; logits 2 x 96 x 1,024 = 196,608; x 3 = 2,386,944."""
    cfg = ModelConfig(
        num_layers=3, hidden_size=96, num_attention_heads=6, vocab_size=1024, intermediate_size=200
    )
    assert cfg.flops_per_token(128) == 3 * (3 * 199_680 + 196_608) == 2_386_944
    # doubling the sequence adds only attention's scores and values: 3 x L x 4 x s x h
    assert cfg.flops_per_token(256) - cfg.flops_per_token(128) == 3 * 3 * 4 * 128 * 96


def test_peak_table_and_mfu():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == (
        989.0,
        "NVIDIA H100 80GB HBM3 (dense bf16 peak)",
    )
    assert peak_tflops("NVIDIA H100 PCIe")[0] == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB")[0] == 312.0
    assert peak_tflops("NVIDIA B200")[0] == 2250.0
    assert peak_tflops("NVIDIA H200")[0] == 989.0
    assert peak_tflops("NVIDIA H100", configured=500.0) == (500.0, "train.peak_tflops")
    value, why = peak_tflops(None)
    assert value is None and "set train.peak_tflops" in why
    value, why = peak_tflops("Tesla V100-SXM2-16GB")
    assert value is None and "is not in gptflow.hardware's table" in why
    assert mfu(494.5, 989.0) == 0.5
    assert mfu(1.0, None) is None


@pytest.mark.parametrize(
    ("configured", "zero", "device", "capability", "want", "why"),
    [
        ("auto", 1, "NVIDIA H100 80GB HBM3", (9, 0), "bf16", "bf16 tensor cores, ZeRO stage 1"),
        ("auto", 3, "NVIDIA A100-SXM4-80GB", (8, 0), "bf16", "ZeRO stage 3"),
        ("auto", 0, "NVIDIA H100 80GB HBM3", (9, 0), "fp32", "set train.zero_stage 1 for bf16"),
        ("auto", 1, "Tesla V100-SXM2-16GB", (7, 0), "fp32", "set train.precision fp16"),
        ("auto", 1, None, None, "fp32", "auto on a CPU"),
        ("fp32", 1, "NVIDIA H100 80GB HBM3", (9, 0), "fp32", "train.precision"),
        ("bf16", 2, None, None, "bf16", "train.precision"),
        ("fp16", 1, "Tesla V100-SXM2-16GB", (7, 0), "fp16", "train.precision"),
    ],
)
def test_auto_precision_is_bf16_only_where_a_gpu_and_zero_can_train_it(
    configured, zero, device, capability, want, why
):
    """GPUs are described by name and compute capability (no GPU exists here; the decision
    is a pure function of those two values, which is what the trainer passes)."""
    precision, reason = training_precision(configured, zero, device, capability)
    assert precision == want
    assert why in reason


def assert_mfu_is_per_device(log: str, records: list[dict], peak: float) -> None:
    """A run's MFU is per device: the model FLOPs of the tokens all ranks trained (FLOPs per
    token from the run's start line, tokens per second of the whole global batch) over every
    rank's peak -- not the data-parallel ranks', whichever way tensor and pipeline parallel
    split the model (each rank then does 1/(tp x pp) of a copy's FLOPs)."""
    import re

    flops_per_token = float(re.search(r"; ([\d,]+) FLOPs per token", log)[1].replace(",", ""))
    tokens_per_step = int(re.search(r"(\d+) tokens/step", log)[1])
    timed = [r for r in records if r["timed_steps"]]  # an interval of only untimed steps: n/a
    assert timed
    for r in records:
        if not r["timed_steps"]:
            assert r["ms_per_step"] is r["tokens_per_s"] is r["mfu"] is None
    for r in timed:
        tokens_per_s = tokens_per_step / (r["ms_per_step"] / 1000)
        assert r["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-9)
        per_device = flops_per_token * tokens_per_s / r["world_size"] / 1e12
        assert r["tflops_per_device"] == pytest.approx(per_device, rel=1e-9)
        assert r["mfu"] == pytest.approx(per_device / peak, rel=1e-9)
