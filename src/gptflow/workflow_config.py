"""The workflow config (``config/config.yaml``, merged with ``--configfile``/``--config``):
what to train. :func:`load_workflow_config` validates it against the schema, fills defaults,
resolves the model preset and checks the cross-field rules -- before Snakemake builds any job.
Errors name the key, the value and the fix, in this config's own terms.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from gptflow.config import ModelConfig, TrainConfig, architecture, check_model_parallel, check_wandb
from gptflow.data.tokenizer import BYTE_ALPHABET, check_tokenizer_file, smallest_trained_vocab
from gptflow.errors import GptflowError
from gptflow.schema import check_config_file, fill_defaults, load_yaml, plain, validate


def load_workflow_config(
    config: dict,
    *,
    schema_path: str | os.PathLike,
    models_dir: str | os.PathLike,
    source: str,
    config_files: list[str] | None = None,
) -> dict:
    """Validate the merged workflow config, fill defaults, resolve the model preset.

    `config_files` are the files Snakemake merged into `config` (it keeps the last of a key
    given twice in one file, so they are re-read to refuse that). Returns a new dict of plain
    dicts and lists; ``model`` then holds every architecture key. Raises GptflowError with one
    line naming the key, the value and the file to fix.
    """
    for path in config_files or []:
        check_config_file(path)
    schema = load_yaml(schema_path)
    cfg = plain(config)
    if not isinstance(cfg, dict) or not cfg:
        raise GptflowError(f"{source}: empty config; start from config/config.yaml")
    validate(cfg, schema, source=source)
    fill_defaults(cfg, schema)

    names = set(cfg["datasets"])
    for i, item in enumerate(cfg["data"]["blend"]):
        if item["dataset"] not in names:
            raise GptflowError(
                f"{source}: data.blend[{i}].dataset is '{item['dataset']}', which is not in "
                f"datasets ({', '.join(sorted(names))}). Fix {source}."
            )
    _check_tokenizer(cfg, schema, names, source)

    cfg["model"] = resolve_model(cfg["model"], schema, Path(models_dir), source)
    try:  # the cross-field rules of the dataclasses, named in this file's terms
        train = TrainConfig(**cfg["train"])
        train.check_trainable()
        model = ModelConfig(**architecture(cfg["model"]))
        check_model_parallel(model, train)
        if cfg["model"].get("init_from"):  # its directory, architecture, weights and rows
            from gptflow.init_from import check_planned

            check_planned(cfg["model"]["init_from"], model)
    except GptflowError as e:
        raise GptflowError(f"{source}: {e}. Fix {source}.") from None
    if train.seq_length > cfg["model"]["max_position_embeddings"]:
        raise GptflowError(
            f"{source}: train.seq_length {train.seq_length} exceeds "
            f"model.max_position_embeddings {cfg['model']['max_position_embeddings']}. Fix {source}."
        )
    _check_split(cfg["data"]["split"], train, source)
    check_wandb(train.wandb, source)
    # Not errors: log, eval and save intervals longer than train_iters (the last step logs,
    # evaluates and saves anyway), an eval_interval with eval_iters 0 (nothing to evaluate).
    return cfg


def _check_tokenizer(cfg: dict, schema: dict, names: set[str], source: str) -> None:
    """What each tokenizer source needs: datasets and an eod token among the special tokens
    to train on, a path that exists, a URL, or GPT-2's vocab and merges (defaults filled in)."""
    tok = cfg["tokenizer"]
    if tok["source"] == "train":
        train = tok.setdefault("train", {})
        fill_defaults(train, schema["properties"]["tokenizer"]["properties"]["train"], schema)
        if "datasets" not in train:
            train["datasets"] = [b["dataset"] for b in cfg["data"]["blend"]]
        for name in train["datasets"]:
            if name not in names:
                raise GptflowError(
                    f"{source}: tokenizer.train.datasets names '{name}', which is not in datasets "
                    f"({', '.join(sorted(names))}). Fix {source}."
                )
        used = dict.fromkeys([*train["datasets"], *(b["dataset"] for b in cfg["data"]["blend"])])
        for name in used:
            if cfg["datasets"][name]["type"] == "megatron":
                raise GptflowError(
                    f"{source}: datasets.{name} is a megatron dataset (shards already tokenized), "
                    f"but tokenizer.source is 'train': a tokenizer trained now did not make them. "
                    f"Set tokenizer.source to 'file', 'url' or 'gpt2' with the tokenizer they "
                    f"were made with. Fix {source}."
                )
        if tok["eod_token"] not in tok["special_tokens"]:
            raise GptflowError(
                f"{source}: tokenizer.eod_token '{tok['eod_token']}' is not in "
                f"tokenizer.special_tokens {tok['special_tokens']}. Fix {source}."
            )
        smallest = smallest_trained_vocab(tok["special_tokens"])
        if train["vocab_size"] < smallest:
            raise GptflowError(
                f"{source}: tokenizer.train.vocab_size {train['vocab_size']} is below the "
                f"{len(tok['special_tokens'])} tokenizer.special_tokens + {BYTE_ALPHABET} byte "
                f"tokens a ByteLevel BPE starts with; set it to {smallest} or more. Fix {source}."
            )
    elif tok["source"] == "file":
        if "path" not in tok:
            raise GptflowError(
                f"{source}: tokenizer.source is 'file' but tokenizer.path is not set. Fix {source}."
            )
        _check_path(tok["path"], "tokenizer.path", source)
        try:  # parsed now, not first by the job that reads it
            check_tokenizer_file(tok["path"], tok["eod_token"], "tokenizer.path")
        except GptflowError as e:
            raise GptflowError(
                f"{source}: tokenizer.path: {e}. Fix tokenizer.path in {source}."
            ) from None
    elif tok["source"] == "url":
        if not tok.get("url", {}).get("url"):
            raise GptflowError(
                f"{source}: tokenizer.source is 'url' but tokenizer.url.url is not set. Fix {source}."
            )
    else:  # gpt2
        for key in ("vocab", "merges"):
            spec = tok.get(key)
            if not spec or not (spec.get("url") or spec.get("path")):
                raise GptflowError(
                    f"{source}: tokenizer.source is 'gpt2' but tokenizer.{key} has neither url nor "
                    f"path. Fix {source}."
                )
            if spec.get("path") and not spec.get("url"):
                _check_path(spec["path"], f"tokenizer.{key}.path", source)


def _check_split(split: str, train: TrainConfig, source: str) -> None:
    """data.split gives training a share, and validation one when train.eval_iters asks for it
    (else the data index of the run fails to build, after the whole data stage)."""
    from gptflow.data.dataset import check_split_samples, parse_split

    try:
        train_share, valid_share, _ = parse_split(split)
        check_split_samples(train)
    except GptflowError as e:
        raise GptflowError(f"{source}: {e}. Fix {source}.") from None
    if train_share == 0:
        raise GptflowError(
            f"{source}: data.split '{split}' gives the train split nothing; give its first "
            f"number a share (e.g. '969,30,1'). Fix {source}."
        )
    if valid_share == 0 and train.eval_iters > 0:
        raise GptflowError(
            f"{source}: data.split '{split}' gives the validation split nothing, but "
            f"train.eval_iters is {train.eval_iters}; give its second number a share "
            f"(e.g. '969,30,1') or set train.eval_iters 0. Fix {source}."
        )


def _check_path(path: str, key: str, source: str) -> None:
    if not Path(path).is_file():
        raise GptflowError(
            f"{source}: {key} '{path}' does not exist (relative to {Path.cwd()}). "
            f"Fix {key} in {source}."
        )


def resolve_model(model: dict, schema: dict, models_dir: Path, source: str) -> dict:
    """The preset file with the config's overrides applied (every key present)."""
    preset = model["preset"]
    path = models_dir / f"{preset}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in models_dir.glob("*.yaml"))
        raise GptflowError(
            f"{source}: model.preset is '{preset}', but {path} does not exist (presets: "
            f"{', '.join(have)}). Fix model.preset in {source}."
        )
    data = load_yaml(path) or {}
    validate(data, schema["$defs"]["model_preset"], source=str(path), root=schema)
    defaults = {
        f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name != "vocab_size"
    }
    resolved = {k: v for k, v in defaults.items() if not isinstance(v, type(dataclasses.MISSING))}
    resolved.update(data)
    resolved.update({k: v for k, v in model.items() if k != "preset"})
    resolved["preset"] = preset
    return resolved
