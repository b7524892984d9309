"""A finished run as a Hugging Face ``GPTNeoXForCausalLM`` directory, and its evaluation.

The model already uses Hugging Face's parameter names and layouts (gptflow.model), so the
export is the consolidated fp32 weights with ``embed_out`` named ``lm_head`` (transformers 5),
a config.json, and the tokenizer. Weights are read without unpickling anything from outside
the run: a ZeRO-0 checkpoint with ``torch.load(weights_only=True)``; ZeRO 1-3 shards (which
DeepSpeed's zero_to_fp32 unpickles) only from a checkpoint inside the run directory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gptflow.config import ModelConfig, RunConfig
from gptflow.errors import GptflowError
from gptflow.fsutil import fsync_dir, write_json


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def load_checkpoint_weights(checkpoint: str | os.PathLike, run_dir: str | os.PathLike) -> dict:
    """fp32 weights of a checkpoint step directory (``.../checkpoints/{series}/step*``)."""
    ckpt = Path(checkpoint)
    if not (ckpt / "COMPLETE").is_file():
        raise GptflowError(
            f"{ckpt}: not a complete checkpoint (no COMPLETE marker); train the run to the end "
            "or name a finished step directory"
        )
    if any(ckpt.glob("*zero_pp_rank_*optim_states.pt")):
        if not _inside(ckpt, Path(run_dir)):
            raise GptflowError(
                f"{ckpt}: ZeRO shards are unpickled by DeepSpeed's zero_to_fp32, so they are "
                f"read only from inside the run directory {run_dir}; copy the run there"
            )
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    else:
        states = ckpt / "mp_rank_00_model_states.pt"
        if not states.is_file():
            raise GptflowError(f"{ckpt}: no mp_rank_00_model_states.pt; not a DeepSpeed checkpoint")
        weights = torch.load(states, map_location="cpu", weights_only=True)["module"]
    return {k: v.detach().float().contiguous() for k, v in weights.items()}


def hf_config(model: ModelConfig, eod_id: int, seq_length: int) -> dict:
    """config.json of GPTNeoXForCausalLM (transformers 5 names, plus the 4.x rotary keys)."""
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "intermediate_size": model.ffn_size,
        "hidden_act": "gelu",
        "max_position_embeddings": model.max_position_embeddings,
        "layer_norm_eps": model.layer_norm_eps,
        "use_parallel_residual": model.parallel_residual,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(model.rotary_emb_base),
            "partial_rotary_factor": model.rotary_pct,
        },
        "rotary_pct": model.rotary_pct,  # transformers 4.x
        "rotary_emb_base": model.rotary_emb_base,
        "torch_dtype": "float32",
        "gptflow": {"seq_length": seq_length},
    }


def finished_run(config: str | os.PathLike) -> tuple[RunConfig, dict]:
    """The run config and DONE.json of a run that has finished training."""
    cfg = RunConfig.load(config)
    if not cfg.done_path.is_file():
        raise GptflowError(f"{cfg.done_path}: the run has not finished; train it first")
    return cfg, json.loads(cfg.done_path.read_text())


def export_hf(config: str | os.PathLike, out: str | os.PathLike, log=print) -> dict:
    """Write the run's final checkpoint as a Hugging Face directory `out` (published whole)."""
    from safetensors.torch import save_file

    cfg, done = finished_run(config)
    weights = load_checkpoint_weights(done["checkpoint"], cfg.run_dir)
    if "embed_out.weight" not in weights:
        raise GptflowError(f"{done['checkpoint']}: no embed_out.weight; not a gptflow GPT-NeoX")
    weights["lm_head.weight"] = weights.pop("embed_out.weight")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        tok = cfg.tokenizer
        (tmp / "config.json").write_text(
            json.dumps(hf_config(cfg.model, tok.eod_id, cfg.train.seq_length), indent=2) + "\n"
        )
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": tok.eod_id, "eos_token_id": tok.eod_id}, indent=2) + "\n"
        )
        shutil.copyfile(tok.path, tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": tok.eod_token,
                    "eos_token": tok.eod_token,
                    "unk_token": tok.eod_token,
                    "model_max_length": cfg.train.seq_length,
                    "clean_up_tokenization_spaces": False,
                },
                indent=2,
            )
            + "\n"
        )
        for f in tmp.iterdir():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = sum(v.numel() for v in weights.values())
    log(f"{out}: GPTNeoXForCausalLM, {params:,} parameters, step {done['final_step']}")
    return {"dir": str(out), "parameters": params, "step": done["final_step"]}


# --------------------------------------------------------------------------- evaluation


def load_model(cfg: RunConfig, checkpoint: str | os.PathLike):
    from gptflow.model import GPTNeoX

    model = GPTNeoX(cfg.model)
    model.load_state_dict(load_checkpoint_weights(checkpoint, cfg.run_dir))
    return model.eval()


def token_stream(prefixes: list[str], split: str | None = None, part: int = 2):
    """The tokens of shards read as one (gptflow.data.dataset.ShardSet) as one array: all of
    them, or the sequences of one part of `split` (0 train, 1 valid, 2 test). Returns
    (tokens, [begin, end])."""
    from gptflow.data.dataset import ShardSet, split_bounds

    shards = ShardSet(prefixes)
    begin, end = split_bounds(split, len(shards))[part] if split else (0, len(shards))
    chunks = [shards.get(j) for j in range(begin, end)]
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.int64)), [begin, end]


@torch.no_grad()
def perplexity(model, tokens: np.ndarray, seq_length: int, max_windows: int, batch: int = 8):
    """exp(mean NLL) over non-overlapping windows of seq_length + 1 tokens (at most
    `max_windows`), each predicting its last seq_length tokens."""
    n = min((len(tokens) - 1) // seq_length, max_windows)
    if n <= 0:
        return None
    windows = torch.from_numpy(
        np.stack([tokens[i * seq_length : i * seq_length + seq_length + 1] for i in range(n)])
    ).long()
    total, count = 0.0, 0
    for s in range(0, n, batch):
        w = windows[s : s + batch]
        logits = model(w[:, :-1]).float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += w[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "windows": n}


@torch.no_grad()
def greedy(model, ids: list[int], new_tokens: int, eod_id: int, max_length: int) -> list[int]:
    """Greedy continuation of `ids` (stops at EOD), the reference for the HF export's
    ``generate(do_sample=False)``."""
    out = list(ids)
    for _ in range(new_tokens):
        x = torch.tensor([out[-max_length:]])
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
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    cfg, done = finished_run(config)
    torch.manual_seed(0)
    model = load_model(cfg, done["checkpoint"])
    seq = cfg.train.seq_length
    result = {"run": cfg.run, "step": done["final_step"], "checkpoint": done["checkpoint"]}
    test = {}
    for d in cfg.datasets:
        tokens, sequences = token_stream([s.prefix for s in d.shards], cfg.split)
        r = perplexity(model, tokens, seq, max_windows)
        test[d.name] = r or {"note": f"test split '{cfg.split}' has no tokens"}
        test[d.name]["sequences"] = sequences
    result["test"] = test
    result["extra"] = {
        name: perplexity(model, token_stream(prefixes)[0], seq, max_windows) or {"note": "empty"}
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
    log(f"{out}: {len(generations)} generations, {result['seconds']} s")
    return result
