"""The DeepSpeed config is rendered from ours: batch arithmetic, explicit clipping, precision."""

import pytest

from gptflow.config import TrainConfig
from gptflow.engine import deepspeed_config
from gptflow.errors import GptflowError


def test_batch_arithmetic_for_world_sizes():
    t = TrainConfig(
        train_iters=10, micro_batch_size=4, global_batch_size=64, clip_grad=0.5, zero_stage=2
    )
    for world, gas in [(1, 16), (2, 8), (4, 4), (16, 1)]:
        cfg = deepspeed_config(t, world)
        assert cfg["train_batch_size"] == 64
        assert cfg["train_micro_batch_size_per_gpu"] == 4
        assert cfg["gradient_accumulation_steps"] == gas
        assert cfg["train_batch_size"] == 4 * gas * world
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"] == {"stage": 2}
    assert "bf16" not in cfg and "fp16" not in cfg


def test_clipping_is_always_explicit():
    """DeepSpeed silently clips at 1.0 when the key is absent; ours is always written."""
    cfg = deepspeed_config(TrainConfig(train_iters=1, clip_grad=0.0), 1)
    assert cfg["gradient_clipping"] == 0.0


def test_precision_sections():
    bf16 = deepspeed_config(TrainConfig(train_iters=1, precision="bf16"), 1)
    assert bf16["bf16"] == {"enabled": True} and "fp16" not in bf16
    fp16 = deepspeed_config(TrainConfig(train_iters=1, precision="fp16"), 1)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling


def test_indivisible_batch_names_the_numbers():
    t = TrainConfig(train_iters=1, micro_batch_size=4, global_batch_size=16)
    with pytest.raises(
        GptflowError, match=r"global_batch_size 16 is not a multiple of .* 4 x 3 ranks = 12"
    ):
        deepspeed_config(t, 3)


def test_offload_sections_and_their_zero_requirements():
    opt = deepspeed_config(TrainConfig(train_iters=1, zero_stage=2, offload="optimizer"), 1)
    assert opt["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in opt["zero_optimization"]
    assert opt["zero_force_ds_cpu_optimizer"] is False  # torch AdamW, no C++ build
    both = TrainConfig(train_iters=1, zero_stage=3, offload="optimizer_and_params")
    assert deepspeed_config(both, 1)["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert (
        "offload_optimizer"
        not in deepspeed_config(TrainConfig(train_iters=1), 1)["zero_optimization"]
    )
    with pytest.raises(GptflowError, match=r"train\.offload optimizer needs ZeRO"):
        TrainConfig(train_iters=1, offload="optimizer")
    with pytest.raises(GptflowError, match="only ZeRO stage 3 partitions"):
        TrainConfig(train_iters=1, zero_stage=2, offload="optimizer_and_params")
