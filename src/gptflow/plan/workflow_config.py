"""The workflow config (``config/config.yaml``, merged with ``--configfile``/``--config``):
what to train. :func:`load_workflow_config` validates it against the schema, fills defaults,
resolves the model preset and checks the cross-field rules -- before Snakemake builds any job.
Errors name the key, the value and the fix, in this config's own terms.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from pathlib import Path

from gptflow.config.schema import check_config_file, fill_defaults, load_yaml, plain, validate
from gptflow.config.settings import (
    ModelConfig,
    TrainConfig,
    architecture,
    check_context,
    check_kfac,
    check_model_parallel,
    check_wandb,
    steps_for_tokens,
)
from gptflow.data.tokenizer import BYTE_ALPHABET, check_tokenizer_file, smallest_trained_vocab
from gptflow.errors import GptflowError


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

    study = cfg.get("study")
    raw_model = cfg["model"]
    # each preset file read and checked once, not once per study run
    models = _Presets(schema, Path(models_dir))
    cfg["model"] = _check_run(cfg["model"], cfg["train"], cfg, schema, models, source)
    if study is not None:
        _check_grid_keys(study["grid"], schema, source)
        cfg["runs"] = {
            name: _study_run(name, overrides, raw_model, cfg, schema, models, source)
            for name, overrides in study_runs(
                study, source, schema["$defs"]["name"]["pattern"]
            ).items()
        }
    return cfg


def _check_run(model: dict, train: dict, cfg: dict, schema: dict, models, source: str) -> dict:
    """The model resolved (preset + overrides, the presets read through `models`, a
    :class:`_Presets`) and the cross-field rules of a run's model and train keys, named in
    this file's terms."""
    model = resolve_model(model, schema, models.models_dir, source, presets=models)
    try:  # the cross-field rules of the dataclasses, named in this file's terms
        t = TrainConfig(**train)
        t.check_trainable()
        m = ModelConfig(**architecture(model))
        check_context(m, t)
        check_model_parallel(m, t)
        check_kfac(m, t)
        if model.get("init_from"):  # its directory, architecture, weights and rows
            from gptflow.train.init_from import check_planned

            check_planned(model["init_from"], m)
    except GptflowError as e:
        raise GptflowError(f"{source}: {e}. Fix {source}.") from None
    _check_split(cfg["data"]["split"], t, source)
    check_wandb(t.wandb, source)
    # Not errors: log, eval and save intervals longer than train_iters (the last step logs,
    # evaluates and saves anyway), an eval_interval with eval_iters 0 (nothing to evaluate).
    return model


# --------------------------------------------------------------------------- studies


def _label(key: str, value) -> str:
    """A grid value as part of a run name: a string as it is, a number or a boolean after its
    key's last part (lr0.001, tokens1e08), characters a name cannot hold as '_'."""
    if isinstance(value, str):
        text = value
    else:
        shown = str(value).lower() if isinstance(value, bool) else f"{value:g}".replace("+", "")
        text = f"{key.rsplit('.', 1)[-1]}{shown}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def _check_grid_keys(grid: dict, schema: dict, source: str) -> None:
    """Each study.grid key names a key of its section (model.KEY, train.KEY): a misspelt one
    is named here, not as an unknown key of every run it makes."""
    props = schema["properties"]
    known = {
        "model": {*props["model"]["properties"], *schema["$defs"]["model_keys"]["properties"]},
        "train": set(props["train"]["properties"]),
    }
    for key in grid:
        section, _, leaf = key.partition(".")
        if section in known and leaf not in known[section]:
            raise GptflowError(
                f"{source}: unknown key 'study.grid.{key}': {section} has no key '{leaf}' (its "
                f"keys: config/schema/config.schema.yaml). Fix {source}."
            )


def study_runs(study: dict, source: str, name_pattern: str) -> dict[str, dict]:
    """A study's runs by name, each its overrides {model: {...}, train: {...}, tokens: N}:
    the named runs, then every combination of the grid (in the grid's key order); a grid name
    must match `name_pattern` (the schema's $defs/name, the names' one home)."""
    runs = {name: dict(o or {}) for name, o in study["runs"].items()}
    grid = study["grid"]
    for values in itertools.product(*grid.values()) if grid else []:
        name = "-".join(_label(k, v) for k, v in zip(grid, values, strict=True))
        if not re.search(name_pattern, name):
            raise GptflowError(
                f"{source}: study.grid makes the run name '{name}', which does not start with a "
                f"letter or digit; start the grid's first values with one. Fix {source}."
            )
        if name in runs:
            raise GptflowError(
                f"{source}: study run '{name}' is named twice (study.runs and study.grid, or "
                f"two grid values that read alike); rename one. Fix {source}."
            )
        overrides: dict = {}
        for key, value in zip(grid, values, strict=True):
            section, _, leaf = key.partition(".")
            if section == "tokens":
                overrides["tokens"] = value
            else:
                overrides.setdefault(section, {})[leaf] = value
        runs[name] = overrides
    if not runs:
        raise GptflowError(
            f"{source}: study has no runs: give study.runs or study.grid (or remove study for "
            f"one run). Fix {source}."
        )
    return runs


def _study_run(
    name: str, overrides: dict, raw_model: dict, cfg: dict, schema: dict, models, source: str
) -> dict:
    """One study run's {model (resolved), train (defaults filled)}: the base config's model
    and train sections with the run's overrides, checked as a run's are."""
    where = f"{source}: study run '{name}'"
    # the base's own model keys stay over another preset (as they do over the base's preset)
    model = {**raw_model, **overrides.get("model", {})}
    train = {**cfg["train"], **overrides.get("train", {})}
    if "tokens" in overrides and "train_iters" in overrides.get("train", {}):
        raise GptflowError(
            f"{where} sets both tokens and train.train_iters; keep one. Fix {source}."
        )
    props = schema["properties"]
    validate(model, props["model"], source=where, root=schema)
    validate(train, props["train"], source=where, root=schema)
    fill_defaults(train, props["train"], schema)
    if "tokens" in overrides:  # the base's train_iters (validated) gives way to the tokens'
        train["train_iters"] = steps_for_tokens(
            overrides["tokens"], train["global_batch_size"], train["seq_length"]
        )
    run = {"model": _check_run(model, train, cfg, schema, models, where), "train": train}
    if "data" in overrides:
        run["data"] = _run_data(overrides["data"], cfg, schema, where, source)
    return run


def _run_data(data: dict, cfg: dict, schema: dict, where: str, source: str) -> dict:
    """A study run's data section: the base's with the run's own data.quality (a data
    ablation; {} = no cleaning). Every other data key is the study's, shared by its runs."""
    other = sorted(set(data) - {"quality"})
    if other:
        raise GptflowError(
            f"{where} sets data.{other[0]}; a study run may set only data.quality (its "
            f"cleaning recipe): the blend, split and datasets are the study's. Fix {source}."
        )
    if cfg["tokenize"]["documents_per_shard"]:
        raise GptflowError(
            f"{where} sets data.quality, but tokenize.documents_per_shard is "
            f"{cfg['tokenize']['documents_per_shard']}: a run's own recipe is tokenized one "
            f"shard per input only; set tokenize.documents_per_shard 0. Fix {source}."
        )
    quality = data.get("quality")
    if quality is None:
        raise GptflowError(
            f"{where} sets data without data.quality; give data.quality (a recipe, or {{}} "
            f"for none) or remove data. Fix {source}."
        )
    recipe = schema["properties"]["data"]["properties"]["quality"]
    validate(quality, recipe, source=where, root=schema)
    fill_defaults(quality, recipe, schema)
    return {**cfg["data"], "quality": quality}


def run_configs(cfg: dict) -> dict[str, dict]:
    """Every run of a validated config as a config of its own (`run` its name, `model` and
    `train` its own; the other sections shared, not copied): one for a config without a
    study, the study's runs otherwise."""
    if cfg.get("study") is None:
        return {cfg["run"]: cfg}
    return {name: {**cfg, "run": name, **r} for name, r in cfg["runs"].items()}


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


class _Presets:
    """The preset files of `models_dir`, each read and validated once (by preset name)."""

    def __init__(self, schema: dict, models_dir: Path):
        self.schema, self.models_dir, self.read = schema, models_dir, {}

    def get(self, preset: str, source: str) -> dict:
        """Preset `preset`'s keys; a missing file names `source`'s model.preset."""
        if preset not in self.read:
            path = self.models_dir / f"{preset}.yaml"
            if not path.is_file():
                have = sorted(p.stem for p in self.models_dir.glob("*.yaml"))
                raise GptflowError(
                    f"{source}: model.preset is '{preset}', but {path} does not exist "
                    f"(presets: {', '.join(have)}). Fix model.preset in {source}."
                )
            data = load_yaml(path) or {}
            validate(data, self.schema["$defs"]["model_preset"], source=str(path), root=self.schema)
            self.read[preset] = data
        return self.read[preset]


def resolve_model(
    model: dict, schema: dict, models_dir: Path, source: str, presets: _Presets | None = None
) -> dict:
    """The preset file with the config's overrides applied (every key present); `presets`
    keeps the files already read (a study's runs share a few presets)."""
    preset = model["preset"]
    data = (presets or _Presets(schema, models_dir)).get(preset, source)
    defaults = {
        f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name != "vocab_size"
    }
    resolved = {k: v for k, v in defaults.items() if not isinstance(v, type(dataclasses.MISSING))}
    resolved.update(data)
    resolved.update({k: v for k, v in model.items() if k != "preset"})
    resolved["preset"] = preset
    return resolved
