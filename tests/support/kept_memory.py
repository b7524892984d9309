"""Run under torchrun on 4 ranks: for `tensor_parallel` and `pipeline_parallel` (arguments 1 and
2) and each "zero:precision" of argument 4 (e.g. "1:bf16,2:bf16,1:fp32"), build this rank's model
and engine as the trainer does (gptflow.train.engine), train one step on the tiny model and write
`rank<N>-<zero>-<precision>.json` into the directory given third: the rank's pipeline stage, the
bytes DeepSpeed keeps after the step (tests.support.memory.kept_bytes), the peak of what
autograd kept for backward during it (saved_peak), and what an asynchronous save takes on the
rank: the files DeepSpeed writes, taken as the trainer takes them (gptflow.train.checkpoint's
_snapshots into a gptflow.train.async_save.BufferPool), their tensors' bytes and buffers, and the
bytes the pool then holds, and the most bytes DeepSpeed's own host copies of a pipeline's layer
files (``clone_tensors_for_torch_save`` in ``PipelineModule.save_state_dict``) held at once
during it. One file per rank and setting: lines four ranks print to one pipe can interleave."""

import json
import sys
import weakref
from functools import partial
from pathlib import Path

import deepspeed.runtime.pipe.module as pipe_module
import torch

from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train import device, distributed, engine
from gptflow.train.async_save import BufferPool
from gptflow.train.checkpoint import _snapshots
from gptflow.train.model import decay_groups
from tests.support.memory import kept_bytes, saved_peak


def step(eng, x: torch.Tensor, y: torch.Tensor, pp: int) -> None:
    """One optimizer step: a pipeline's `pp` micro-batches through its schedule, or one."""
    if pp > 1:
        eng.train_batch(data_iter=iter([(x, y)] * pp))
    else:
        eng.backward(eng(x, y))
        eng.step()


class CloneCount:
    """DeepSpeed's copies of a pipeline's layer files alive at once: each copy's tensors
    counted from when ``clone_tensors_for_torch_save`` returns them until they are freed."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.clone = pipe_module.clone_tensors_for_torch_save
        pipe_module.clone_tensors_for_torch_save = self

    def __call__(self, item, *args, **kwargs):
        copy = self.clone(item, *args, **kwargs)
        for tensor in copy.values():  # a layer's state dict: flat
            nbytes = tensor.untyped_storage().nbytes()
            self.live += nbytes
            weakref.finalize(tensor, self.freed, nbytes)
        self.peak = max(self.peak, self.live)
        return copy

    def freed(self, nbytes: int) -> None:
        self.live -= nbytes


CLONES = CloneCount()
MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
MICRO, SEQ = 2, 16

env = distributed.resolve()
distributed.export(env)
dev = device.setup(env, timeout_minutes=5)
tp, pp = int(sys.argv[1]), int(sys.argv[2])
dp = env.world_size // (tp * pp)
gas = pp  # a pipeline's first stage then holds pp micro-batches in flight (1F1B)
for setting in sys.argv[4].split(","):
    zero, precision = setting.split(":")
    train = TrainConfig(
        train_iters=2, global_batch_size=MICRO * dp * gas, micro_batch_size=MICRO,
        seq_length=SEQ, zero_stage=int(zero), precision=precision, tensor_parallel=tp,
        pipeline_parallel=pp,
    )  # fmt: skip
    model = engine.build_model(MODEL, train, env.world_size, dev.device)
    eng = engine.build_engine(model, decay_groups(model, 0.1), train, env.world_size)
    generator = torch.Generator().manual_seed(0)  # the same batch on every rank
    x, y = (torch.randint(0, MODEL.vocab_size, (MICRO, SEQ), generator=generator) for _ in "xy")

    peak = saved_peak(partial(step, eng, x, y, pp), eng.module.parameters())
    stage = eng.stage_id if pp > 1 else 0
    record = {"rank": env.rank, "stage": stage, "kept": kept_bytes(eng), "saved_peak": peak}
    pool = BufferPool()  # a save's snapshot, as Saves.save takes it (nothing written)
    CLONES.peak = 0
    taken = _snapshots(eng, str(Path(sys.argv[3]) / "checkpoints"), f"z{zero}{precision}", {}, pool)
    record["files"] = sorted(Path(snap.path).name for snap in taken)
    record["snapshot"] = sum(b.nbytes for snap in taken for _, b in snap.storages)
    record["buffers"] = sum(len(snap.storages) for snap in taken)
    record["held"] = pool.held_bytes()
    record["clones"] = CLONES.peak
    out = Path(sys.argv[3]) / f"rank{env.rank}-{zero}-{precision}.json"
    out.write_text(json.dumps(record))
dev.shutdown()
device.leave(0)  # without the interpreter's teardown (gptflow.train.device.leave)
