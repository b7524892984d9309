"""Evaluation of a finished run: test-split (and extra shard) perplexity, greedy generations.

The model is built on the meta device and placed where gptflow.results.sizing's plan puts it: on the
CPU in fp32 when there is no GPU; on one GPU in fp32 when it fits; else in bf16, its layers in
order over as many of the job's GPUs as the weights need. The weights are copied in one tensor
at a time from the memory-mapped checkpoint (gptflow.results.export.checkpoint_weights: fp32 weights
only, no optimizer states), so the host holds one tensor beyond the page cache. The job's
memory, GPUs and time are gptflow.results.sizing's, from the model.

Importing this module imports neither torch nor numpy (the workflow sizes the evaluate job
while it plans).
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING

from gptflow.config.settings import ModelConfig
from gptflow.errors import GptflowError
from gptflow.fsutil import write_json
from gptflow.results import sizing
from gptflow.train.run_config import RunConfig

if TYPE_CHECKING:
    import numpy as np

EVAL_BATCH = sizing.EVAL_BATCH  # windows per forward pass


def memory_mb(model: ModelConfig, seq_length: int, on_gpu: bool = False) -> int:
    """Host memory (MB) of the evaluate job (gptflow.results.sizing.eval_host_mb): on a CPU the fp32
    weights, one batch of fp32 logits three times over and 2 GiB for the framework; on GPUs
    two tensors in flight and the framework."""
    return sizing.eval_host_mb(model, seq_length, on_gpu)


def export_resources(config: str | os.PathLike) -> dict:
    """The export_hf job's memory (MB) and minutes for the run config `config` (run.yaml),
    from the model (gptflow.results.sizing)."""
    model = RunConfig.load(config).model
    return {"mem_mb": sizing.export_mb(model), "runtime": sizing.export_runtime_min(model)}


def run_resources(config: str | os.PathLike, gpu_mem_mb: int, on_gpu: bool, eval_cfg: dict) -> dict:
    """The evaluate job's resources for the run config `config` (run.yaml) and the config's
    eval section, from the model (gptflow.results.sizing): host memory, GPUs (``gres``: gpu:N of the
    plan for GPUs of `gpu_mem_mb`) and minutes."""
    cfg = RunConfig.load(config)
    model, seq = cfg.model, cfg.train.seq_length
    plan = sizing.eval_plan(model, seq, gpu_mem_mb * 2**20)
    return {
        "mem_mb": memory_mb(model, seq, on_gpu),
        "gres": f"gpu:{plan.gpus}",
        "runtime": sizing.eval_runtime_min(
            model, seq, eval_cfg["max_windows"], len(eval_cfg["prompts"]), eval_cfg["new_tokens"],
            plan.dtype,
        ),
    }  # fmt: skip


def harness_resources(
    config: str | os.PathLike,
    gpu_mem_mb: int,
    on_gpu: bool,
    harness_cfg: dict,
    work: list[sizing.TaskWork],
) -> dict:
    """A harness job's resources for the run config `config` (run.yaml), from the model and
    the tasks' work (gptflow.results.harness.task_work), at the trained context (train.seq_length)
    with eval.harness.batch_size requests a forward pass: host memory, GPUs (``gres``, the
    plan :func:`eval_placement` follows) and minutes (gptflow.results.sizing)."""
    cfg = RunConfig.load(config)
    model, seq, batch = cfg.model, cfg.train.seq_length, harness_cfg["batch_size"]
    plan = sizing.eval_plan(model, seq, gpu_mem_mb * 2**20, batch)
    fewshot = harness_cfg["num_fewshot"]
    return {
        "mem_mb": sizing.harness_host_mb(model, seq, batch, plan if on_gpu else None),
        "gres": f"gpu:{plan.gpus}",
        "runtime": sizing.harness_runtime_min(model, work, seq, fewshot, plan.dtype),
    }


# `gptflow evaluate` options from the config's eval section, one per param of the evaluate
# rule (argv words)


def prompt_args(prompts: list[str]) -> list[str]:
    """``--prompt=P`` per prompt, one word: a prompt may start with '-'."""
    return [f"--prompt={p}" for p in prompts]


def extra_args(extra: dict[str, list[str]]) -> list[str]:
    """``--extra NAME PREFIX`` per token shard prefix of each extra perplexity."""
    return [
        word for name, prefixes in extra.items() for p in prefixes for word in ("--extra", name, p)
    ]


def extra_files(extra: dict[str, list[str]]) -> list[str]:
    """The .bin and .idx of every extra prefix: what the evaluation reads besides the run."""
    return [
        f"{p}{ext}" for prefixes in extra.values() for p in prefixes for ext in (".bin", ".idx")
    ]


def eval_placement(
    model: ModelConfig, seq_length: int, batch: int = EVAL_BATCH
) -> tuple[list[str], str]:
    """(devices, dtype) of the evaluation: the CPU in fp32 without a GPU; else
    gptflow.results.sizing.eval_plan (`batch` sequences a forward pass) against the smallest of the
    job's GPUs, refused when the job has fewer GPUs than the plan needs."""
    import torch

    if not torch.cuda.is_available():
        return ["cpu"], "fp32"
    count = torch.cuda.device_count()
    gpu_bytes = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
    plan = sizing.eval_plan(model, seq_length, gpu_bytes, batch)
    if not plan.fits or plan.gpus > count:
        raise GptflowError(
            f"evaluating {model.num_parameters():,} parameters needs {plan.gpus} GPU(s) of "
            f"{gpu_bytes / 2**30:.0f} GiB in {plan.dtype} (about {plan.device_bytes / 2**30:.1f} "
            f"GiB on the most loaded), this job has {count}: give the evaluate rule more GPUs "
            f"(set-resources evaluate gres gpu:{plan.gpus}) or larger ones"
        )
    return [f"cuda:{i}" for i in range(plan.gpus)], plan.dtype


def place(model, devices: list[str], dtype: str) -> None:
    """Allocate the meta-device `model` (uninitialised) module by module: the embedding and
    the first block of layers on devices[0], each next block on the next device, the final
    norm and the head on the last, in `dtype` ("fp32" or "bf16"; the rotary frequencies stay
    fp32). With several devices each block moves its inputs to its own device as it runs."""
    import torch

    from gptflow.train.model import reset_buffers

    cast = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    backbone = model.gpt_neox
    where = sizing.layer_devices(len(backbone.layers), len(devices))
    modules = [
        (backbone.embed_in, devices[0]),
        (backbone.rotary, devices[0]),
        *((layer, devices[i]) for layer, i in zip(backbone.layers, where, strict=True)),
        (backbone.final_layer_norm, devices[-1]),
        (model.embed_out, devices[-1]),
    ]
    for module, device in modules:
        module.to_empty(device=device)
        if module is not backbone.rotary:
            module.to(cast)
        if len(devices) > 1 and module is not backbone.rotary:
            module.register_forward_pre_hook(_inputs_to(torch.device(device)))
    reset_buffers(model)


def _inputs_to(device):
    def hook(_module, args):
        return tuple(a.to(device) if hasattr(a, "to") else a for a in args)

    return hook


def load_model(
    cfg: RunConfig, checkpoint: str | os.PathLike, devices=("cpu",), dtype: str = "fp32"
):
    """The run's GPTNeoX in eval mode, placed over `devices` in `dtype` (:func:`place`), with
    the checkpoint's fp32 weights copied in one tensor at a time (nothing initialised first)."""
    import torch

    from gptflow.results.export import checkpoint_weights
    from gptflow.train.model import GPTNeoX

    if isinstance(devices, str):
        devices = [devices]
    with torch.device("meta"):
        model = GPTNeoX(cfg.model)
    place(model, list(devices), dtype)
    params = dict(model.named_parameters())
    weights = checkpoint_weights(checkpoint, cfg.run_dir, cfg.model)
    if weights.keys() != params.keys():
        raise GptflowError(
            f"{checkpoint}: its weights are not the run's model (missing "
            f"{sorted(params.keys() - weights.keys())}, unexpected "
            f"{sorted(weights.keys() - params.keys())})"
        )
    with torch.no_grad():
        for name, w in weights.items():
            if w.shape != tuple(params[name].shape):
                raise GptflowError(
                    f"{checkpoint}: {name} has shape {w.shape}, the run's model "
                    f"{tuple(params[name].shape)}"
                )
            params[name].copy_(w.read())
    return model.eval()


def token_stream(
    prefixes: list[str], split: str | None = None, part: int = 2, max_tokens: int | None = None
):
    """The tokens of shards read as one (gptflow.data.dataset.ShardSet) as one array: all of
    them, or the sequences of one part of `split` (0 train, 1 valid, 2 test); only the first
    sequences holding `max_tokens` tokens when given. Returns (tokens, [begin, end]) with the
    part's sequence range."""
    import numpy as np

    from gptflow.data.dataset import ShardSet, split_bounds

    shards = ShardSet(prefixes)
    begin, end = split_bounds(split, len(shards))[part] if split else (0, len(shards))
    chunks, count = [], 0
    for j in range(begin, end):
        if max_tokens is not None and count >= max_tokens:
            break
        chunks.append(shards.get(j))
        count += len(chunks[-1])
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.int64)), [begin, end]


def perplexity(
    model, tokens: np.ndarray, seq_length: int, max_windows: int, batch: int = EVAL_BATCH
):
    """exp(mean NLL) over non-overlapping windows of seq_length + 1 tokens (at most
    `max_windows`), each predicting its last seq_length tokens, on the model's device (one
    host sync at the end)."""
    import numpy as np
    import torch

    n = min((len(tokens) - 1) // seq_length, max_windows)
    if n <= 0:
        return None
    dev = next(model.parameters()).device
    windows = torch.from_numpy(
        np.stack([tokens[i * seq_length : i * seq_length + seq_length + 1] for i in range(n)])
    ).long()
    total = torch.zeros((), dtype=torch.float64, device=dev)
    count = 0
    with torch.no_grad():
        for s in range(0, n, batch):
            w = windows[s : s + batch].to(dev)
            logits = model(w[:, :-1]).float()  # on the last device the model is placed on
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)),
                w[:, 1:].reshape(-1).to(logits.device),
                reduction="sum",
            )
            total += nll.double().to(dev)
            count += w[:, 1:].numel()
    loss = total.item() / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "windows": n}


def greedy(model, ids: list[int], new_tokens: int, eod_id: int, max_length: int) -> list[int]:
    """Greedy continuation of `ids` (stops at EOD), the reference for the HF export's
    ``generate(do_sample=False)``."""
    import torch

    dev = next(model.parameters()).device
    out = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            x = torch.tensor([out[-max_length:]], device=dev)
            nxt = int(model(x)[0, -1].argmax())
            out.append(nxt)
            if nxt == eod_id:
                break
    return out[len(ids) :]


def evaluate(
    config: str | os.PathLike,
    out: str | os.PathLike,
    *,
    prompts: list[str],
    new_tokens: int = 32,
    extra: dict[str, list[str]] | None = None,
    max_windows: int = 256,
    log=print,
) -> dict:
    """eval.json: perplexity on each dataset's test split (and on `extra` prefixes), and greedy
    generations from `prompts`."""
    import torch
    from tokenizers import Tokenizer

    from gptflow.results.export import finished_run

    t0 = time.perf_counter()
    cfg, done = finished_run(config)
    torch.manual_seed(0)
    devices, dtype = eval_placement(cfg.model, cfg.train.seq_length)
    model = load_model(cfg, done["checkpoint"], devices, dtype)
    seq = cfg.train.seq_length
    needed = max_windows * seq + 1  # tokens the windows read
    result = {
        "run": cfg.run,
        "step": done["final_step"],
        "checkpoint": done["checkpoint"],
        "device": devices[0] if len(devices) == 1 else devices,
        "dtype": dtype,
    }
    test = {}
    for d in cfg.heldout or cfg.datasets:  # a data ablation's run: the base's test split
        tokens, sequences = token_stream([s.prefix for s in d.shards], cfg.split, 2, needed)
        r = perplexity(model, tokens, seq, max_windows)
        test[d.name] = r or {"note": f"test split '{cfg.split}' has no tokens"}
        test[d.name]["sequences"] = sequences
    result["test"] = test
    result["extra"] = {
        name: perplexity(model, token_stream(prefixes, max_tokens=needed)[0], seq, max_windows)
        or {"note": "empty"}
        for name, prefixes in (extra or {}).items()
    }
    tokenizer = Tokenizer.from_file(str(cfg.tokenizer.path))
    generations = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt).ids
        new = greedy(model, ids, new_tokens, cfg.tokenizer.eod_id, seq)
        generations.append(
            {"prompt": prompt, "prompt_ids": ids, "ids": new, "text": tokenizer.decode(new)}
        )
    result["generations"] = generations
    result["seconds"] = round(time.perf_counter() - t0, 2)
    write_json(out, result)
    for name, r in [*test.items(), *result["extra"].items()]:
        if "perplexity" in r:
            log(f"{name}: perplexity {r['perplexity']:.3f} over {r['tokens']} tokens")
        else:
            log(f"{name}: {r['note']}")
    log(
        f"{out}: {len(generations)} generations on {', '.join(devices)} in {dtype}, "
        f"{result['seconds']} s"
    )
    return result
