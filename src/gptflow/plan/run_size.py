"""The run's size, as the plan and ``gptflow why`` print it: the vocabulary and the model
(:class:`gptflow.config.settings.ModelConfig`, the trainer's own numbers, with the tokenizer's
real vocabulary when it is on disk), parameters, tokens, FLOPs, GPU-hours at a stated MFU,
checkpoint and shard bytes against free disk.
"""

from __future__ import annotations

import json
from pathlib import Path

from gptflow import paths
from gptflow.config.settings import (
    ModelConfig,
    TrainConfig,
    check_kfac,
    muon_state_floats,
    padded_vocab_size,
    training_flops_per_token,
)
from gptflow.data.tokenizer import BYTES_PER_TOKEN_OF_TEXT
from gptflow.errors import GptflowError

ASSUMED_VOCAB = 50257  # GPT-2's, when no tokenizer is on disk yet and none is to be trained
EXPANSION = {"zst": 3.5, "gz": 3.0, "xz": 4.0, "zip": 3.0, "parquet": 2.5}  # text / file bytes


def vocab_size(cfg: dict, tokenizer_json: Path | None) -> tuple[int, str]:
    """The tokenizer's vocabulary (unpadded) and where the number comes from: the tokenizer
    file when it exists, the size it is to be trained to, or an assumption (said so)."""
    model_vocab = cfg["model"].get("vocab_size")
    if model_vocab:
        return model_vocab, "model.vocab_size"
    if tokenizer_json is not None and tokenizer_json.is_file():
        try:
            tok = json.loads(tokenizer_json.read_text())
            vocab = tok["model"]["vocab"].values()
            ids = set(vocab) | {t["id"] for t in tok.get("added_tokens", [])}
            return max(ids) + 1, str(tokenizer_json)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise GptflowError(
                f"{tokenizer_json}: not a tokenizer.json with a vocabulary ({type(e).__name__}: "
                f"{e}); a job cut short or a disk error? Delete it and it is made again"
            ) from None
    train = cfg.get("tokenizer", {}).get("train") or {}
    if cfg.get("tokenizer", {}).get("source") == "train" and train.get("vocab_size"):
        return train["vocab_size"], "tokenizer.train.vocab_size"
    return ASSUMED_VOCAB, f"assumed {ASSUMED_VOCAB:,} (GPT-2's): the tokenizer is not on disk yet"


def model_config(cfg: dict, vocab: int) -> ModelConfig:
    """The run's model with the vocabulary `vocab` padded; the layouts train.kfac is refused
    with are refused here, where a run's model and train settings first meet."""
    model = {k: v for k, v in cfg["model"].items() if k not in ("preset", "init_from")}
    model["vocab_size"] = padded_vocab_size(vocab, model.get("make_vocab_size_divisible_by", 128))
    m = ModelConfig(**model)
    if cfg["train"].get("kfac") is not None:  # ({} is K-FAC with its defaults; a partial
        # train section without it, as `gptflow why` has, is not built here)
        check_kfac(m, TrainConfig(**cfg["train"]))
    return m


# GPU-hours at -n and in `gptflow why`: an H100's dense bf16 peak at 40 % MFU, unless told
ASSUMED_PEAK_TFLOPS = 989.0
ASSUMED_MFU = 0.4


def size(m: ModelConfig, t: TrainConfig, shards: int, free: int, peak_tflops: float,
         mfu: float) -> dict:  # fmt: skip
    """Parameters, tokens, FLOPs, GPU-hours, checkpoint and shard bytes, free disk."""
    n = m.num_parameters()
    tokens = t.train_iters * t.tokens_per_step
    flops = training_flops_per_token(m, t) * tokens
    # Muon's matrices keep one moment, not Adam's two (4 bytes a parameter less)
    muon = muon_state_floats(m)[0] if t.optimizer == "muon" else 0
    return {
        "parameters": n,
        "training_tokens": tokens,
        "training_flops": flops,
        "gpu_hours": flops / (peak_tflops * 1e12 * mfu) / 3600,
        "peak_tflops": peak_tflops,
        "mfu": mfu,
        # a checkpoint: fp32 weights + Adam's two moments (+ the half-precision copy, counted
        # as fp32): 16 bytes a parameter, for keep_last steps, the one being written and
        # those kept for good (train.keep_every)
        "checkpoint_bytes": (n * 16 - 4 * muon) * t.checkpoints_on_disk(),
        "shard_bytes": shards,
        "free_bytes": free,
    }


def made_bins(tokenizer: str, dataset) -> dict[str, list[Path]]:
    """The .bin files made already of each shard of `dataset` with `tokenizer`, by shard name:
    the whole shard's (gptflow.paths.SHARD) and its parts' (PART, in order). One listing of the
    dataset's token directory, not a glob per shard: a plan of 10,000 shards (each with a
    .bin, .idx and .json there) would list the directory 10,000 times."""
    directory = Path(paths.shard_prefix(tokenizer, dataset.name, "-")).parent
    names = {s.name for s in dataset.shards}
    made: dict[str, list[Path]] = {}
    for path in sorted(directory.glob("*.bin")) if directory.is_dir() else ():
        stem = path.name[: -len(".bin")]
        whole, dash, part = stem.rpartition("-")
        if stem in names:
            made.setdefault(stem, []).insert(0, path)  # the whole shard first
        elif dash and whole in names and part.isdigit():  # {shard}-{part}
            made.setdefault(whole, []).append(path)
    return made


def token_bytes(datasets, vocab: int, tokenizer: str | None = None) -> tuple[int, int]:
    """Bytes the token shards take: the .bin files of shards made already (with `tokenizer`,
    gptflow.paths.SHARD or its PARTs; an imported Megatron shard's), an estimate from the
    inputs on disk for the others: 4 bytes of text a token (a compressed file's bytes times
    its typical expansion), in the token dtype of the vocabulary
    (gptflow.data.indexed's rule). Returns (bytes, inputs not on disk yet, so not counted)."""
    from gptflow.data.indexed import dtype_for_vocab

    total, missing = 0, 0
    for d in datasets.values():
        made_of = made_bins(tokenizer, d) if tokenizer is not None else {}
        for s in d.shards:
            made = made_of.get(s.name, [])
            if s.fmt == "megatron":
                made = [Path(f"{s.input}.bin")]
            if any(f.is_file() for f in made):
                total += sum(f.stat().st_size for f in made if f.is_file())
                continue
            files = [Path(f) for f in s.files] or [Path(s.input)]
            sizes = [(f.name, f.stat().st_size) for f in files if f.is_file()]
            missing += len(files) - len(sizes)
            text = sum(n * EXPANSION.get(name.rsplit(".", 1)[-1].lower(), 1.0) for name, n in sizes)
            total += int(text / BYTES_PER_TOKEN_OF_TEXT) * dtype_for_vocab(vocab).itemsize
    return total, missing
