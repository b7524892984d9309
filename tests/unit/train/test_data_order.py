"""Data order and dropout seeds are functions of the step, not of the layout (gptflow.train.loop):
a global batch of samples read the same way, each sample under the same dropout seed, on one
rank accumulating micro-batches or on several ranks -- Megatron's pretraining sampler. The
training tests (two ranks match one) check the losses; these name the arithmetic."""

from __future__ import annotations

import pytest
import torch

from gptflow.config.settings import TrainConfig
from gptflow.train.loop import micro_batch_start, reseed


def reads(t: TrainConfig, step: int, world: int) -> dict[int, int]:
    """Sample -> the dropout seed it is read under, over the ranks and micro-batches of `step`."""
    gas = t.grad_accum_steps(world)
    out = {}
    for rank in range(world):
        for micro in range(gas):
            start = micro_batch_start(t, step, micro, rank, world)
            reseed(t.seed, step, micro, rank, world, gas)
            for i in range(start, start + t.micro_batch_size):
                assert i not in out, f"sample {i} read twice (world {world})"
                out[i] = torch.initial_seed()
    return out


@pytest.mark.parametrize("step", [0, 3])
def test_a_step_reads_its_global_batch_once_whatever_the_ranks(step):
    t = TrainConfig(train_iters=10, micro_batch_size=2, global_batch_size=8)
    one = reads(t, step, world=1)
    assert sorted(one) == list(range(step * 8, (step + 1) * 8))
    for world in (2, 4):  # 2 micro-batches on 2 ranks, 1 on 4: each sample, its seed
        assert reads(t, step, world) == one
    # rank r's micro-batch m is the (m * ranks + r)-th slice (Megatron's sampler)
    assert [micro_batch_start(t, step, m, r, 2) for m in (0, 1) for r in (0, 1)] == [
        step * 8 + k for k in (0, 2, 4, 6)
    ]
