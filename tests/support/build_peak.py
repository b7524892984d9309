"""Run under torchrun: build this rank's model as the trainer does (gptflow.train.engine.build_model)
for `tensor_parallel` and `pipeline_parallel` given as arguments, and write `rank<N>.json` into
the directory given third: the peak tensor memory of the build, the bytes of the parameters the
rank then holds, and the whole model's bytes and its largest tensor's. (One file per rank: lines
that four ranks print to one pipe can interleave.)"""

import json
import sys
from pathlib import Path

import torch

from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train import device, distributed, engine
from gptflow.train.model import GPTNeoX
from tests.support.memory import peak_allocated

env = distributed.resolve()
distributed.export(env)
dev = device.setup(env, timeout_minutes=5)
model = ModelConfig(num_layers=8, hidden_size=128, num_attention_heads=4, vocab_size=128)
train = TrainConfig(
    train_iters=1, global_batch_size=8, micro_batch_size=2, zero_stage=1,
    tensor_parallel=int(sys.argv[1]), pipeline_parallel=int(sys.argv[2]),
)  # fmt: skip
built = []
peak = peak_allocated(
    lambda: built.append(engine.build_model(model, train, env.world_size, dev.device))
)
with torch.device("meta"):
    whole = list(GPTNeoX(model).parameters())
record = json.dumps({
    "rank": env.rank,
    "peak": peak,
    "held": sum(p.numel() * p.element_size() for p in built[0].parameters()),
    "whole": sum(p.numel() * 4 for p in whole),
    "largest": max(p.numel() * 4 for p in whole),
})  # fmt: skip
(Path(sys.argv[3]) / f"rank{env.rank}.json").write_text(record)
dev.shutdown()
device.leave(0)  # without the interpreter's teardown (gptflow.train.device.leave)
