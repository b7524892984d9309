"""Run under torchrun: build this rank's tiny model (dropout 0.5) as the trainer does at
tensor parallel 2 with activation checkpointing, seed the micro-batch's RNG as the trainer does,
run one forward and backward, and save ``rank<N>.pt`` into the directory given as argument: the
masks of the replicated dropouts (forward hooks on the embedding's and the layers' nn.Dropout)
and, for each attention call (forward, then backward's recomputation), the mask its dropout's
stream draws: drawn from the RNG state SDPA is called with, in a fork, so the call itself is
the real one."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train import device, distributed, engine, model_parallel
from gptflow.train.loop import reseed

env = distributed.resolve()
distributed.export(env)
dev = device.setup(env, timeout_minutes=5)
P = 0.5
model_cfg = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
    hidden_dropout=P, attention_dropout=P, activation_checkpointing=True,
)  # fmt: skip
train = TrainConfig(
    train_iters=1, global_batch_size=2, micro_batch_size=2, zero_stage=1, tensor_parallel=2
)
model = engine.build_model(model_cfg, train, env.world_size, dev.device)
model_parallel.use_split_region_rng(model, train, dev.device)
model.train()

hidden, attention = [], []
for m in model.modules():
    if isinstance(m, torch.nn.Dropout):
        m.register_forward_hook(lambda m, args, out: hidden.append(out == 0))
sdpa = F.scaled_dot_product_attention


def recording_sdpa(q, k, v, **kwargs):
    B, H, T, _ = q.shape
    with torch.random.fork_rng(devices=[]):
        attention.append(torch.rand(B, H, T, T) < P)
    return sdpa(q, k, v, **kwargs)


F.scaled_dot_product_attention = recording_sdpa
torch.manual_seed(0)
ids = torch.randint(128, (2, 16))  # the same on both ranks
reseed(train.seed, 3, 0, 0, 1, 1)  # step 3, micro-batch 0 of the only data-parallel rank
model(ids, ids).backward()
out = Path(sys.argv[1]) / f"rank{env.rank}.pt"
torch.save({"hidden": hidden, "attention": attention}, out)
dev.shutdown()
device.leave(0)  # without the interpreter's teardown (gptflow.train.device.leave)
