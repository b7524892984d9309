"""Run under torchrun: build this rank's model as the trainer does (gptflow.train.engine.build_model)
from a run's model.init_from (gptflow.train.init_from.HFWeights), at the layout given as arguments
(RUN_YAML TENSOR_PARALLEL PIPELINE_PARALLEL ZERO_STAGE OUT_DIR), and compare every parameter the rank
holds with the checkpoint's tensor as the safetensors library reads it, cut here by Megatron's
split (rows of query_key_value and dense_h_to_4h and the vocabulary's rows of the embedding and
the head, columns of attention.dense and dense_4h_to_h; apart from
gptflow.train.model_parallel.tensor_parallel_slice). Under ZeRO-3 each parameter
is gathered first. Writes OUT_DIR/rank{N}.json (one file per rank: their stdout would
interleave): rank, parameters compared, those equal (torch.equal), and the shape of each
parameter the rank holds."""

import dataclasses
import json
import re
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from gptflow.train import device, distributed, engine, model_parallel
from gptflow.train.init_from import HFWeights
from gptflow.train.model import checkpoint_names
from gptflow.train.run_config import RunConfig

env = distributed.resolve()
distributed.export(env)
dev = device.setup(env, timeout_minutes=5)
cfg = RunConfig.load(sys.argv[1])
tp, pp, zero = map(int, sys.argv[2:5])
train = dataclasses.replace(cfg.train, tensor_parallel=tp, pipeline_parallel=pp, zero_stage=zero)
with HFWeights(cfg.init_from) as init:
    module = engine.build_model(cfg.model, train, env.world_size, dev.device, init)

stored = {}
for f in Path(cfg.init_from.path).glob("*.safetensors"):
    with safe_open(f, framework="pt") as st:
        stored |= {name: st.get_tensor(name) for name in st.keys()}  # noqa: SIM118
tp_rank = env.rank % tp


def expected(name: str) -> torch.Tensor:
    whole = next(stored[n] for n in checkpoint_names(name) if n in stored).float()
    if re.search(r"(query_key_value|dense_h_to_4h)\.(weight|bias)$|embed_(in|out)\.", name):
        rows = whole.shape[0] // tp
        return whole[tp_rank * rows : (tp_rank + 1) * rows]
    if re.search(r"(attention\.dense|dense_4h_to_h)\.weight$", name):
        cols = whole.shape[1] // tp
        return whole[:, tp_rank * cols : (tp_rank + 1) * cols]
    return whole


compared, equal, shapes = 0, 0, {}
for name, p in module.named_parameters():
    full = model_parallel.model_name(name, pp, cfg.model.num_layers)
    if zero == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            held = p.detach().clone()
    else:
        held = p.detach()
    compared += 1
    equal += int(torch.equal(held, expected(full)))
    shapes[full] = list(held.shape)
result = {"rank": env.rank, "compared": compared, "equal": equal, "shapes": shapes}
(Path(sys.argv[5]) / f"rank{env.rank}.json").write_text(json.dumps(result))
del module  # ZeRO-3's partitioned parameters before the process group they were made over
dev.barrier()
dev.shutdown()
device.leave(0)  # without the interpreter's teardown (gptflow.train.device.leave)
