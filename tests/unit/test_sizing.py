"""The jobs after training sized from the model (gptflow.sizing): the evaluation's precision and
GPUs for the models we ship layouts for, with the same margin as training's fit check, and what
the preflight prints and warns of. Arithmetic only: no GPU exists here, so the plans are checked
against hand-computed figures, not against a GPU's allocator."""

import math
from pathlib import Path

import pytest

from gptflow import preflight, sizing
from gptflow.config import ModelConfig
from gptflow.schema import load_yaml

REPO = Path(__file__).parents[2]
GIB = 2**30


def preset(name: str, vocab: int = 50_304) -> ModelConfig:
    values = load_yaml(REPO / "config" / "models" / f"{name}.yaml")
    values.pop("description", None)
    return ModelConfig(**values, vocab_size=vocab)


@pytest.mark.parametrize(
    ("name", "gpu_gib", "dtype", "gpus"),
    [
        ("pythia-1.4b", 80, "fp32", 1),
        ("pythia-12b", 80, "fp32", 1),
        ("pythia-12b", 40, "bf16", 1),
        ("gpt-neox-20b", 80, "bf16", 1),  # 82 GB of fp32 weights: more than the GPU
        ("gpt-neox-20b", 40, "bf16", 2),
        ("megatron-gpt3-145.6b", 80, "bf16", 5),
        ("megatron-gpt3-310.1b", 80, "bf16", 11),  # more than one 8-GPU node
    ],
)
def test_the_evaluation_fits_its_gpus_with_the_training_margin(name, gpu_gib, dtype, gpus):
    """fp32 on one GPU when weights + logits + the margin (2 GiB + 10 %) fit, else bf16 on the
    fewest GPUs whose consecutive blocks of layers (+ embedding or head) fit; one fewer GPU
    would not."""
    m = preset(name)
    plan = sizing.eval_plan(m, 2048, gpu_gib * GIB)
    assert (plan.dtype, plan.gpus) == (dtype, gpus) and plan.fits
    usable = gpu_gib * GIB - sizing.fit_margin(gpu_gib * GIB)
    logits = 3 * 4 * 8 * 2048 * m.vocab_size
    assert plan.device_bytes <= usable
    if dtype == "fp32":
        assert plan.device_bytes == 4 * m.num_parameters() + logits
        return
    assert 4 * m.num_parameters() + logits > usable
    embedding = 2 * m.vocab_size * m.hidden_size
    per_layer = (2 * m.num_parameters() - 2 * embedding) / m.num_layers
    if gpus > 1:
        fewer = math.ceil(m.num_layers / (gpus - 1)) * per_layer + embedding + logits
        assert fewer > usable
    assert sizing.layer_devices(m.num_layers, gpus)[-1] == gpus - 1


def test_the_fit_check_and_the_evaluation_leave_one_margin():
    """One home: the preflight's margin is gptflow.sizing's."""
    assert preflight.fit_margin is sizing.fit_margin
    assert sizing.fit_margin(80 * GIB) == 2 * GIB + 8 * GIB


def test_the_preflight_prints_the_jobs_after_training_and_warns_past_one_node():
    m = preset("gpt-neox-20b")
    node = preflight.Placement(gres="gpu:8", gpu_mem_mb=40 * 1024)
    eval_cfg = {"max_windows": 256, "prompts": ["a"], "new_tokens": 32}
    lines = preflight.after_training(m, 2048, node, eval_cfg)
    assert lines[0].startswith("  evaluate: bf16 on 2 GPU(s), about 28.4 GiB on the most loaded;")
    assert lines[1].startswith(f"  export_hf: {sizing.export_mb(m):,} MB,")
    assert len(lines) == 2
    big = preflight.after_training(preset("megatron-gpt3-310.1b"), 2048, node, eval_cfg)
    assert (
        big[-1].startswith("  WARNING: evaluating 310,906,486,784 ")
        and "32 GPU(s) of 40 GiB" in big[-1]
    )


def test_the_jobs_time_and_memory_grow_with_the_model():
    small, big = preset("pythia-1.4b"), preset("gpt-neox-20b")
    assert sizing.export_mb(small) < sizing.export_mb(big) < 8 * 1024  # tensors, not the model
    assert sizing.export_runtime_min(big) == math.ceil(
        2 * 2 * 4 * big.num_parameters() / 200e6 / 60
    )
    assert sizing.eval_runtime_min(small, 2048, 256, 3, 32) == sizing.MIN_RUNTIME_MIN
    assert sizing.eval_runtime_min(big, 2048, 256, 3, 32) > sizing.MIN_RUNTIME_MIN
    assert sizing.eval_host_mb(big, 2048, on_gpu=True) < sizing.eval_host_mb(big, 2048, False)
