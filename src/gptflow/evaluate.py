"""Evaluation of a finished run: test-split (and extra shard) perplexity, greedy generations.

The model is built on the evaluation device (CUDA when there is one, else the CPU) and its
weights are copied in one tensor at a time from the memory-mapped checkpoint
(gptflow.export.checkpoint_weights: fp32 weights only, no optimizer states), so the host holds
one tensor beyond the page cache. :func:`memory_mb` is the job's memory, from the model.

Importing this module imports neither torch nor numpy (the workflow sizes the evaluate job
with :func:`memory_mb` while it plans).
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING

from gptflow.config import ModelConfig
from gptflow.errors import GptflowError
from gptflow.fsutil import write_json
from gptflow.run_config import RunConfig

if TYPE_CHECKING:
    import numpy as np

EVAL_BATCH = 8  # windows per forward pass


def memory_mb(model: ModelConfig, seq_length: int, batch: int = EVAL_BATCH) -> int:
    """Memory (MB) the evaluation needs where the model runs: the fp32 weights (4 bytes a
    parameter; no optimizer states are read), one batch of fp32 logits three times over
    (logits, log-softmax, and a temporary), and 2 GiB for the framework (CUDA context,
    tokenizer, tokens). On a GPU this is its memory, and ample host memory; on a CPU, host
    memory."""
    weights = 4 * model.num_parameters()
    logits = 3 * 4 * batch * seq_length * model.vocab_size
    return math.ceil((weights + logits + 2 * 2**30) / 2**20)


def run_memory_mb(config: str | os.PathLike) -> int:
    """:func:`memory_mb` of the run config `config` (run.yaml): the evaluate job's memory."""
    cfg = RunConfig.load(config)
    return memory_mb(cfg.model, cfg.train.seq_length)


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


def eval_device() -> str:
    """The evaluation device: ``cuda`` (the job's first GPU) when there is one, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(cfg: RunConfig, checkpoint: str | os.PathLike, device: str = "cpu"):
    """The run's GPTNeoX on `device` in eval mode, with the checkpoint's fp32 weights copied in
    one tensor at a time."""
    import torch

    from gptflow.export import checkpoint_weights
    from gptflow.model import GPTNeoX

    with torch.device(device):
        model = GPTNeoX(cfg.model)
    params = model.state_dict()
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
            logits = model(w[:, :-1]).float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum"
            )
            total += nll.double()
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

    from gptflow.export import finished_run

    t0 = time.perf_counter()
    cfg, done = finished_run(config)
    torch.manual_seed(0)
    dev = eval_device()
    model = load_model(cfg, done["checkpoint"], dev)
    seq = cfg.train.seq_length
    needed = max_windows * seq + 1  # tokens the windows read
    result = {
        "run": cfg.run,
        "step": done["final_step"],
        "checkpoint": done["checkpoint"],
        "device": dev,
    }
    test = {}
    for d in cfg.datasets:
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
    log(f"{out}: {len(generations)} generations on {dev}, {result['seconds']} s")
    return result
