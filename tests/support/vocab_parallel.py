"""Run under torchrun on 2 ranks (gloo): the vocabulary-parallel loss and model against the
unsplit ones, and write `rank<N>.json` into the directory given as argument 1.

- the loss alone (gptflow.train.model_parallel.vocab_parallel_lm_loss) on fp32 and bf16 logits
  split in two along the vocabulary, against gptflow.train.model.lm_loss on the whole logits: the
  loss and the gradient of this rank's block of the logits;
- the tiny model built as the trainer builds it (gptflow.train.engine.build_model) at tensor parallel
  2 and at 1 in the same process, the same weights: the loss of one batch and the gradients of
  this rank's rows of the embedding and the head (and of a split layer).

Each is written as the largest difference; the test bounds them."""

import json
import sys
from pathlib import Path

import torch

from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train import device, distributed, engine, model_parallel
from gptflow.train.model import lm_loss

env = distributed.resolve()
distributed.export(env)
dev = device.setup(env, timeout_minutes=5)
rank, group = env.rank, torch.distributed.group.WORLD
generator = torch.Generator().manual_seed(0)  # the same tensors on both ranks
V, B, T = 256, 3, 5
record = {}


def biggest(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


for dtype in (torch.float32, torch.bfloat16):
    whole = (4 * torch.randn(B, T, V, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=generator)
    labels[0, :2] = torch.tensor([V // 2 - 1, V // 2])  # either side of the split
    block = whole.detach().chunk(2, dim=-1)[rank].clone().requires_grad_()
    want = lm_loss(whole, labels)
    got = model_parallel.vocab_parallel_lm_loss(block, labels, group, rank * V // 2)
    want.backward()
    got.backward()
    name = str(dtype).removeprefix("torch.")
    record[f"loss {name}"] = abs(want.item() - got.item())
    record[f"grad {name}"] = biggest(whole.grad.chunk(2, dim=-1)[rank], block.grad)
    record[f"grad dtype {name}"] = str(block.grad.dtype)

model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=V)
models = {}
for tp in (2, 1):
    train = TrainConfig(train_iters=1, global_batch_size=4, micro_batch_size=2, zero_stage=1,
                        tensor_parallel=tp)  # fmt: skip
    models[tp] = engine.build_model(model, train, env.world_size, dev.device)
x, y = (torch.randint(0, V, (2, 16), generator=generator) for _ in "xy")
losses = {tp: m(x, y) for tp, m in models.items()}
for loss in losses.values():
    loss.backward()
record["model loss"] = abs(losses[1].item() - losses[2].item())
split, one = dict(models[2].named_parameters()), dict(models[1].named_parameters())
for name in ("gpt_neox.embed_in.weight", "embed_out.weight"):
    record[f"{name} shape"] = list(split[name].shape)
    record[f"{name} weight"] = biggest(one[name].chunk(2)[rank], split[name])
    record[f"{name} grad"] = biggest(one[name].grad.chunk(2)[rank], split[name].grad)
qkv = "gpt_neox.layers.0.attention.query_key_value.weight"
record["qkv grad"] = biggest(one[qkv].grad.chunk(2)[rank], split[qkv].grad)
(Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(record))
dev.shutdown()
device.leave(0)  # without the interpreter's teardown (gptflow.train.device.leave)
