"""The config tree: validated against the JSON schema, defaults filled, cross-field rules checked.

Two documents:

* the **workflow config** (``config/config.yaml``, merged with ``--configfile``/``--config``):
  what to train. :func:`load_workflow_config` validates it before Snakemake builds any job.
* the **run config** (``results/runs/{run}/run.yaml``): the resolved, self-contained input of
  ``gptflow train`` -- model with the preset applied, tokenizer facts, shard prefixes with their
  checksums, hyperparameters. :class:`RunConfig` reads it back and derives the numbers training
  needs (gradient accumulation, tokens per step, ...), checked once.

Errors name the key, the value and the fix, in this config's own terms.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gptflow.errors import GptflowError

# ----------------------------------------------------------------------------- YAML + schema


_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class DuplicateKeyError(Exception):
    """A mapping gives one key twice (YAML and JSON parsers silently keep the last)."""

    def __init__(self, key: str, line: int | None, first_line: int | None = None) -> None:
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line

    def describe(self, path: str | os.PathLike) -> str:
        where = f"{path}:{self.line}" if self.line else str(path)
        also = f" (first on line {self.first_line})" if self.first_line else ""
        return (
            f"{where}: key '{self.key}' is given twice{also}; only the last would count. "
            f"Remove one of them from {path}."
        )


class UniqueKeyLoader(_BaseLoader):
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last).

    Keys merged in with ``<<`` may be overridden, as YAML intends."""

    def construct_document(self, node):
        self._root_node = node
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                    key_node, yaml.ScalarNode
                ):
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    parent = _node_path(getattr(self, "_root_node", node), node)
                    raise DuplicateKeyError(_dotted([*parent, key]), line, seen[key])
                seen[key] = line
        return super().construct_mapping(node, deep)


def _node_path(root, target) -> list:
    """Keys and indices from the document's root node to `target` (a composed YAML node)."""
    stack, visited = [(root, [])], set()
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append((v, [*path, k.value if isinstance(k, yaml.ScalarNode) else "?"]))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, [*path, i]) for i, v in enumerate(node.value))
    return []


def parse_yaml(text: str, where: str | os.PathLike) -> Any:
    """Parse YAML text; a syntax error or a key given twice names `where` and the line."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKeyError as e:
        raise GptflowError(e.describe(where)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark else str(where)
        raise GptflowError(f"{at}: invalid YAML ({getattr(e, 'problem', e)})") from None


def load_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file; a syntax error or a key given twice names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise GptflowError(f"{path}: no such file")
    return parse_yaml(path.read_text(encoding="utf-8"), path)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key, None)
        out[key] = value
    return out


def check_config_file(path: str | os.PathLike) -> None:
    """Re-read a config file Snakemake merged: a key given twice is an error naming the file,
    the line and the key (Snakemake keeps the last). Read as Snakemake reads it: JSON first,
    else YAML."""
    path = Path(path)
    if not path.is_file():
        raise GptflowError(f"{path}: config file not found")
    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text, object_pairs_hook=_unique_pairs)
    except DuplicateKeyError as e:
        try:  # JSON is YAML: the YAML parser names the line and the full key
            yaml.load(text, Loader=UniqueKeyLoader)
        except DuplicateKeyError as full:
            raise GptflowError(full.describe(path)) from None
        except yaml.YAMLError:
            pass
        lines = [i + 1 for i, line in enumerate(text.splitlines()) if f'"{e.key}"' in line]
        raise GptflowError(
            DuplicateKeyError(e.key, lines[-1] if lines else None).describe(path)
        ) from None
    except ValueError:  # not JSON: YAML, as Snakemake falls back to
        parse_yaml(text, path)


def plain(value: Any) -> Any:
    """`value` with every mapping a dict and every sequence a list (Snakemake reads JSON config
    files into OrderedDicts, which yaml.safe_dump refuses)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def non_finite_numbers(value: Any, path: tuple = ()) -> list[tuple[str, float]]:
    """(dotted key, value) of every NaN or infinity in a config tree."""
    if isinstance(value, float) and not math.isfinite(value):
        return [(_dotted(path), value)]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in non_finite_numbers(v, (*path, k))]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in non_finite_numbers(v, (*path, i))]
    return []


def _resolve(schema: dict, root: dict) -> dict:
    """Follow a local ``$ref`` ("#/$defs/x"), merging the referring schema's own keys over it."""
    ref = schema.get("$ref")
    if not ref:
        return schema
    target: Any = root
    for part in ref.lstrip("#/").split("/"):
        target = target[part]
    merged = dict(_resolve(target, root))
    merged.update({k: v for k, v in schema.items() if k != "$ref"})
    merged["properties"] = {**target.get("properties", {}), **schema.get("properties", {})}
    return merged


def fill_defaults(instance: Any, schema: dict, root: dict | None = None) -> Any:
    """Insert schema ``default`` values for absent keys (recursively, only under present parents)."""
    root = root or schema
    schema = _resolve(schema, root)
    if isinstance(instance, dict):
        for branch in schema.get("allOf", []):  # if/then on a discriminating const
            cond = branch.get("if", {}).get("properties", {})
            if cond and all(instance.get(k) == v.get("const") for k, v in cond.items()):
                fill_defaults(instance, branch["then"], root)
        props = schema.get("properties", {})
        for key, sub in props.items():
            sub = _resolve(sub, root)
            if key not in instance and "default" in sub:
                instance[key] = copy.deepcopy(sub["default"])
            if key in instance:
                fill_defaults(instance[key], sub, root)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in instance:
                if key not in props:
                    fill_defaults(instance[key], extra, root)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for item in instance:
            fill_defaults(item, schema["items"], root)
    return instance


def _dotted(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


_JSON_TYPE_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true/false",
    "object": "a mapping",
    "array": "a list",
    "null": "null",
}


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "null" if value is None else type(value).__name__


def _choices(schema: dict, root: dict) -> list | None:
    """The values an enum/const schema (or an anyOf of them) allows, else None."""
    schema = _resolve(schema, root)
    if "enum" in schema:
        return list(schema["enum"])
    if "const" in schema:
        return [schema["const"]]
    if "anyOf" in schema:
        out: list = []
        for sub in schema["anyOf"]:
            more = _choices(sub, root)
            if more is None:
                return None
            out += more
        return out
    return None


def _describe_error(err, root: dict, what: str) -> str:
    """One line for a jsonschema ValidationError: the key, its value and what is expected."""
    path = list(err.absolute_path)
    key = _dotted(path)
    v = err.validator
    expected = err.schema.get("x-expected") if isinstance(err.schema, dict) else None
    if "propertyNames" in err.absolute_schema_path:  # the key itself is the bad value
        want = expected or f"a key matching {err.validator_value!r}"
        return f"'{key}' has a key {err.instance!r}; expected {want}"
    if v in ("additionalProperties", "unevaluatedProperties"):
        allowed = set(_resolve(err.schema, root).get("properties", {}))
        unknown = sorted(k for k in err.instance if k not in allowed)
        parts = []
        for k in unknown:
            full = _dotted([*path, k])
            close = difflib.get_close_matches(str(k), sorted(allowed), n=1)
            hint = f" (did you mean '{_dotted([*path, close[0]])}'?)" if close else ""
            parts.append(f"unknown key '{full}'{hint}")
        known = ", ".join(sorted(allowed)) or "none"
        return f"{'; '.join(parts)}; keys allowed there: {known}"
    if v == "required":
        missing = re.findall(r"'([^']+)' is a required property", err.message)
        name = _dotted([*path, missing[0]]) if missing else key
        return f"missing required key '{name}'"
    if v == "type":
        expected = err.validator_value
        expected = expected if isinstance(expected, list) else [expected]
        names = " or ".join(_JSON_TYPE_NAMES.get(t, t) for t in expected)
        return f"'{key}' is {err.instance!r} ({_type_name(err.instance)}); expected {names}"
    if v == "control":
        return (
            f"'{key}' is {err.instance!r}, which holds a control character (newline, tab, ...); "
            f"remove it"
        )
    if v in ("enum", "const"):
        choices = err.validator_value if v == "enum" else [err.validator_value]
        return f"'{key}' is {err.instance!r}; expected one of {choices}"
    if v in ("anyOf", "oneOf") and _choices(err.schema, root) is not None:
        return f"'{key}' is {err.instance!r}; expected one of {_choices(err.schema, root)}"
    if v == "pattern":
        want = expected or f"a string matching {err.validator_value!r}"
        return f"'{key}' is {err.instance!r}; expected {want}"
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        op = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}[v]
        return f"'{key}' is {err.instance!r}; it must be {op} {err.validator_value}"
    if v in ("minItems", "minProperties", "minLength"):
        return f"'{key}' must not be empty"
    if v == "uniqueItems":
        return f"'{key}' is {err.instance!r}; give each item once"
    if v == "maxItems":
        return f"'{key}' is {err.instance!r}; it takes at most {err.validator_value} items"
    return f"'{key}': {err.message}"


_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def _to_end(pattern: str) -> str:
    r"""`pattern` with a final ``$`` made ``\Z``: in Python's re (which jsonschema's ``pattern``
    uses) ``$`` also matches before a trailing newline, so ``^[a-z]+$`` would accept "abc\n"."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + r"\Z"
    return pattern


@functools.cache
def _validator_class():
    """Draft 2020-12, stricter where a config value can become a path or a command word:
    ``pattern`` matches to the end of the string (see :func:`_to_end`), and a string holds no
    control character unless its schema says ``x-text: true`` (free text, e.g. a prompt)."""
    from jsonschema import Draft202012Validator, ValidationError, validators

    draft_type = Draft202012Validator.VALIDATORS["type"]

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not re.search(_to_end(patrn), instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def type_(validator, types, instance, schema):
        yield from draft_type(validator, types, instance, schema)
        if (
            isinstance(instance, str)
            and not schema.get("x-text")
            and _CONTROL_CHARACTER.search(instance)
        ):
            yield ValidationError(f"{instance!r} holds a control character", validator="control")

    return validators.extend(Draft202012Validator, {"pattern": pattern, "type": type_})


def validate(instance: Any, schema: dict, *, source: str, root: dict | None = None) -> None:
    """Raise one GptflowError listing every violation (one clause each), naming `source`:
    the schema's, and any NaN or infinity (refused everywhere, with its key)."""
    root = root or schema
    if root is not schema:
        schema = {**schema, "$defs": root.get("$defs", {})}
    non_finite = non_finite_numbers(instance)
    lines = {
        f"'{key}' is {value!r}; numbers must be finite (no .nan/.inf in YAML, NaN/Infinity in JSON)"
        for key, value in non_finite
    }
    reported = {key for key, _ in non_finite}
    for err in _validator_class()(schema).iter_errors(instance):
        if _dotted(err.absolute_path) not in reported:  # a NaN is also out of range, ...
            lines.add(_describe_error(err, root, source))
    if lines:
        raise GptflowError(f"{source}: {'; '.join(sorted(lines))}. Fix {source}.")


# ----------------------------------------------------------------------------- model and train


@dataclass(frozen=True)
class ModelConfig:
    """GPT-NeoX architecture. Field names follow Hugging Face ``GPTNeoXConfig`` where one exists."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 0  # padded embedding rows; set from the tokenizer by the run config
    intermediate_size: int | None = None  # None = 4 x hidden_size
    rotary_pct: float = 0.25
    rotary_emb_base: float = 10000.0
    parallel_residual: bool = True
    layer_norm_eps: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    max_position_embeddings: int = 2048
    make_vocab_size_divisible_by: int = 128
    init_std: float | None = None  # None = sqrt(2 / (5 x hidden_size))
    activation_checkpointing: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise GptflowError(
                f"model.hidden_size {self.hidden_size} is not a multiple of "
                f"model.num_attention_heads {self.num_attention_heads}; change one of them"
            )
        if self.rotary_ndims % 2:
            raise GptflowError(
                f"model.rotary_pct {self.rotary_pct} gives {self.rotary_ndims} rotary dimensions per "
                f"head (head size {self.head_dim}); it must be even - adjust model.rotary_pct"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_ndims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def num_parameters(self) -> int:
        """Parameter count (embedding and untied output head included).

        The one home of this number: the trainer's start-up line, the preflight and the report
        call it, so it is right under ZeRO-3 (where live parameters are partitions) and for
        models never built."""
        d, f, v, n = self.hidden_size, self.ffn_size, self.vocab_size, self.num_layers
        per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return v * d + n * per_layer + 2 * d + v * d

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward), Megatron-LM's formula.

        Per layer: the QKV and output projections (4 h^2) and the MLP (2 h f) as matrix
        multiplies (2 FLOPs per multiply-add), plus attention's scores and weighted values
        (2 s h, causal masking not discounted, as Megatron counts it); once per token the
        logits (h V). Biases, LayerNorms, rotary and the softmax are left out. With f = 4h this
        is Megatron's 72 L h^2 (1 + s/(6h) + V/(12 L h)) per token (Narayanan et al. 2021).
        """
        h, f, v, n = self.hidden_size, self.ffn_size, self.vocab_size, self.num_layers
        forward = n * (2 * (4 * h * h + 2 * h * f) + 4 * seq_length * h) + 2 * h * v
        return 3.0 * forward


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging (keys of ``train.wandb:``); see the schema."""

    enabled: bool = False
    mode: str = "offline"  # offline | online
    project: str = "gptflow"
    entity: str | None = None
    name: str | None = None  # None = RUN-SERIES


def check_wandb(wandb: WandbConfig, source: str) -> None:
    """An enabled train.wandb can run here: the wandb package is importable (looked up, not
    imported: wandb takes a second to import) and, online, $WANDB_API_KEY is set. Called when
    the workflow is planned and when training starts."""
    import importlib.util
    import sys

    if not wandb.enabled:
        return
    if importlib.util.find_spec("wandb") is None:
        raise GptflowError(
            f"{source}: train.wandb.enabled is true, but the wandb package is not installed in "
            f"{sys.prefix}; install it with pip install 'gptflow[wandb]' (or set "
            f"train.wandb.enabled: false)"
        )
    if wandb.mode == "online" and not os.environ.get("WANDB_API_KEY"):
        raise GptflowError(
            f"{source}: train.wandb.mode is 'online', but $WANDB_API_KEY is not set; export it "
            f"(the key is read from the environment only, never from a config file), or set "
            f"train.wandb.mode: offline and upload later with `wandb sync`"
        )


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and schedule (keys of ``train:``); see the schema for units."""

    train_iters: int
    seed: int = 1234
    seq_length: int = 256
    micro_batch_size: int = 8
    global_batch_size: int = 16
    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "fp32"
    zero_stage: int = 0
    tensor_parallel: int = 1  # ranks that share each layer's matrices (Megatron's split)
    pipeline_parallel: int = 1  # stages the layers are split into (DeepSpeed's PipelineModule)
    offload: str = "none"
    compile: bool = False  # torch.compile through DeepSpeed's engine.compile
    peak_tflops: float | None = None  # per device, for MFU; None = from the GPU's name
    distributed_timeout_minutes: float = 30.0
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    save_interval: int = 100
    keep_last: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.wandb, dict):  # from the config or run.yaml
            object.__setattr__(self, "wandb", WandbConfig(**self.wandb))
        if self.global_batch_size % self.micro_batch_size:
            raise GptflowError(
                f"train.global_batch_size {self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size {self.micro_batch_size}; change one of them"
            )
        if self.offload != "none" and self.zero_stage == 0:
            raise GptflowError(
                f"train.offload {self.offload} needs ZeRO: set train.zero_stage to 1, 2 or 3"
            )
        if self.offload == "optimizer_and_params" and self.zero_stage != 3:
            raise GptflowError(
                f"train.offload optimizer_and_params offloads parameters, which only ZeRO stage 3 "
                f"partitions: set train.zero_stage 3 (it is {self.zero_stage}) or offload: optimizer"
            )
        if self.min_lr > self.lr:
            raise GptflowError(f"train.min_lr {self.min_lr} is above train.lr {self.lr}; lower it")
        if self.lr_warmup_iters >= self.decay_iters and self.lr_decay_style != "constant":
            raise GptflowError(
                f"train.lr_warmup_iters {self.lr_warmup_iters} must be below the decay length "
                f"{self.decay_iters} (train.lr_decay_iters, or train.train_iters when unset)"
            )

    def check_trainable(self) -> None:
        """What DeepSpeed cannot train right, refused when a run is planned or started (not
        when an existing run is read, e.g. to export it)."""
        if self.precision == "bf16" and self.zero_stage == 0:
            raise GptflowError(
                "train.precision bf16 needs train.zero_stage 1 or more: at stage 0 DeepSpeed "
                "trains bf16 through its FP16_UnfusedOptimizer, whose dummy first step leaves "
                "Adam's step count one ahead (the first update ~0.73x its size), and it cannot "
                "sum gradients in fp32. Set train.zero_stage 1 (DeepSpeed's BF16_Optimizer: fp32 "
                "master weights and gradient accumulation; on one rank it partitions nothing)"
            )
        if self.tensor_parallel > 1 and self.zero_stage == 0:
            raise GptflowError(
                f"train.tensor_parallel {self.tensor_parallel} needs train.zero_stage 1 or 2: a "
                "tensor-parallel checkpoint is exported and moved to other layouts through "
                "DeepSpeed's universal checkpoint, which reads ZeRO 1/2 optimizer partitions. "
                "Set train.zero_stage 1 (Megatron's distributed optimizer)"
            )
        if self.pipeline_parallel > 1 and self.zero_stage != 1:
            raise GptflowError(
                f"train.pipeline_parallel {self.pipeline_parallel} needs train.zero_stage 1 (it "
                f"is {self.zero_stage}): DeepSpeed's pipeline engine refuses ZeRO 2 and 3 (each "
                "stage would partition gradients it accumulates over micro-batches), and "
                "gptflow exports pipeline checkpoints from ZeRO 1's fp32 partitions"
            )
        if self.tensor_parallel > 1 and self.zero_stage == 3:
            raise GptflowError(
                f"train.tensor_parallel {self.tensor_parallel} with train.zero_stage 3 is not "
                "supported: DeepSpeed's AutoTP splits a model built whole on every rank, which "
                "is what ZeRO-3's partitioned construction exists to avoid, and the two together "
                "have not been verified here. Use train.zero_stage 1 or 2 with tensor parallel "
                "(stage 1 is Megatron's distributed optimizer)"
            )

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.train_iters

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model between them: tensor x pipeline parallel."""
        return self.tensor_parallel * self.pipeline_parallel

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks: the ranks / (tensor_parallel x pipeline_parallel)."""
        if world_size % self.model_parallel:
            parts = [
                f"train.{key} {n}"
                for key, n in (
                    ("tensor_parallel", self.tensor_parallel),
                    ("pipeline_parallel", self.pipeline_parallel),
                )
                if n > 1
            ]
            keys = " x ".join(parts)
            if len(parts) > 1:
                keys += f" = {self.model_parallel}"
            raise GptflowError(
                f"{keys} does not divide the {world_size} training ranks; give the training rule "
                f"a multiple of {self.model_parallel} ranks (the profile's nodes x tasks per "
                f"node) or change {' or '.join(p.split()[0] for p in parts)}"
            )
        return world_size // self.model_parallel

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        """The data-parallel rank of global rank `rank`, as DeepSpeed lays the ranks out:
        rank = (stage x dp + data rank) x tp + tensor rank (its pipe x data x model grid).

        A tensor-parallel group is `tp` neighbouring ranks (so it stays inside a node) and
        reads the samples of its data-parallel rank; each pipeline stage is a contiguous block
        of ranks, and a pipeline spans the blocks."""
        return (rank // self.tensor_parallel) % self.data_parallel_size(world_size)

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank: global / (micro x data-parallel ranks)."""
        dp = self.data_parallel_size(world_size)
        per_pass = self.micro_batch_size * dp
        if self.global_batch_size % per_pass:
            ranks = f"{dp} ranks"
            if self.model_parallel > 1:
                ranks = (
                    f"{dp} data-parallel ranks ({world_size} ranks / {self.model_parallel} "
                    f"per model copy)"
                )
            fixes = [f"train.global_batch_size a multiple of {per_pass}"]
            if self.global_batch_size % dp == 0:
                per_rank = self.global_batch_size // dp
                fits = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
                fixes.append(f"train.micro_batch_size one of {fits[-6:]}")
            fixes.append("fewer ranks (the profile's nodes x tasks_per_node)")
            raise GptflowError(
                f"train.global_batch_size {self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size {self.micro_batch_size} x {ranks} = {per_pass}: a "
                f"step is whole micro-batches on every data-parallel rank; set "
                f"{', or '.join(fixes)}"
            )
        return self.global_batch_size // per_pass

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
        if self.lr_warmup_iters and step < self.lr_warmup_iters:
            return self.lr * (step + 1) / self.lr_warmup_iters
        if self.lr_decay_style == "constant":
            return self.lr
        progress = (step - self.lr_warmup_iters) / max(1, self.decay_iters - self.lr_warmup_iters)
        progress = min(1.0, max(0.0, progress))
        if self.lr_decay_style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coeff * (self.lr - self.min_lr)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_length


def check_model_parallel(model: ModelConfig, train: TrainConfig) -> None:
    """Megatron's split needs whole heads and whole MLP columns on every rank, and as many
    layers on every pipeline stage (a stage with one layer more than the others sets the
    pace of the whole pipeline)."""
    pp = train.pipeline_parallel
    if pp > model.num_layers:
        raise GptflowError(
            f"train.pipeline_parallel {pp} exceeds model.num_layers {model.num_layers}: every "
            f"stage holds at least one layer; lower train.pipeline_parallel"
        )
    if model.num_layers % pp:
        fits = [n for n in range(2, model.num_layers + 1) if model.num_layers % n == 0]
        raise GptflowError(
            f"train.pipeline_parallel {pp} does not divide model.num_layers {model.num_layers}: "
            f"every stage holds as many layers (Megatron's rule); use one of {fits[:8]}"
        )
    tp = train.tensor_parallel
    if tp == 1:
        return
    for key, value in (
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.intermediate_size (default 4 x hidden_size)", model.ffn_size),
    ):
        if value % tp:
            raise GptflowError(
                f"train.tensor_parallel {tp} does not divide {key} {value}: each rank holds "
                f"1/{tp} of the attention heads and of the MLP; pick a tensor_parallel that "
                f"divides both ({model.num_attention_heads} heads, {model.ffn_size} MLP columns)"
            )


# ----------------------------------------------------------------------------- run config


@dataclass(frozen=True)
class TokenizerInfo:
    """What a shard or a run needs to know about the tokenizer it was made with."""

    path: str
    sha256: str
    vocab_size: int
    eod_id: int
    eod_token: str


@dataclass(frozen=True)
class ShardInfo:
    prefix: str
    idx_sha256: str
    bin_sha256: str
    documents: int
    tokens: int


@dataclass(frozen=True)
class DatasetBlend:
    name: str
    weight: float
    shards: tuple[ShardInfo, ...]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


@dataclass(frozen=True)
class InitFromInfo:
    """``model.init_from`` as run.yaml records it: the Hugging Face checkpoint directory the
    run starts from (gptflow.init_from), the identity of its weights (sha256 over its
    safetensors files' sha256s; the series fingerprint holds it) and each file as hashed
    ({name: {bytes, mtime_ns, sha256}}: the trainer checks the files are still those)."""

    path: str
    sha256: str
    files: dict


# keys of the workflow config's `model:` that choose the model rather than describe it
MODEL_CHOICES = ("preset", "init_from")


def architecture(model: dict) -> dict:
    """The ModelConfig keys of a workflow config's resolved `model:` section."""
    return {k: v for k, v in model.items() if k not in MODEL_CHOICES}


@dataclass(frozen=True)
class RunConfig:
    """The resolved input of ``gptflow train`` (``results/runs/{run}/run.yaml``)."""

    run: str
    run_dir: str
    tokenizer: TokenizerInfo
    datasets: tuple[DatasetBlend, ...]
    split: str
    model: ModelConfig
    train: TrainConfig
    init_from: InitFromInfo | None = None  # model.init_from: the weights of step 0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.train.seq_length > self.model.max_position_embeddings:
            raise GptflowError(
                f"train.seq_length {self.train.seq_length} exceeds model.max_position_embeddings "
                f"{self.model.max_position_embeddings}; raise the latter or shorten the sequences"
            )
        if self.model.vocab_size < self.tokenizer.vocab_size:
            raise GptflowError(
                f"model vocab {self.model.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size} ids; re-render the run config"
            )

    # paths inside the run directory -------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return Path(self.run_dir) / "checkpoints"

    @property
    def checkpoint_dir(self) -> Path:
        """Checkpoints of this configuration: one series per trajectory fingerprint."""
        return self.checkpoint_root / self.series

    @property
    def metrics_path(self) -> Path:
        return Path(self.run_dir) / "metrics.jsonl"

    @property
    def done_path(self) -> Path:
        return Path(self.run_dir) / "DONE.json"

    @property
    def lock_path(self) -> Path:
        return Path(self.run_dir) / "train.lock"

    @property
    def index_cache_dir(self) -> Path:
        return Path(self.run_dir) / "data-index"

    @property
    def wandb_dir(self) -> Path:
        """W&B's own files (wandb.init's dir is the run directory) and each series' W&B run id."""
        return Path(self.run_dir) / "wandb"

    # identity -------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """Everything that determines the training trajectory, and nothing that does not.

        Two configs with the same fingerprint produce the same sequence of parameters step
        by step, so their checkpoints are interchangeable: one resumes the other. Logging,
        evaluation and checkpoint intervals, ``train_iters`` (when the decay length is fixed
        by ``lr_decay_iters``) and the micro-batch size are not part of it.
        """
        t = self.train
        model = dataclasses.asdict(self.model)
        for k in ("description", "activation_checkpointing", "max_position_embeddings"):
            model.pop(k)
        # the starting weights by content (not by path); absent for a random start, so the
        # series of runs from before model.init_from existed keep their names
        init = {"init_from": self.init_from.sha256} if self.init_from else {}
        return {
            **init,
            "model": model,
            "tokenizer_sha256": self.tokenizer.sha256,
            "eod_id": self.tokenizer.eod_id,
            "data": [
                {"name": d.name, "weight": d.weight, "shards": [s.bin_sha256 for s in d.shards]}
                for d in self.datasets
            ],
            "split": self.split,
            "seed": t.seed,
            "seq_length": t.seq_length,
            "global_batch_size": t.global_batch_size,
            "optimizer": {
                "lr": t.lr,
                "min_lr": t.min_lr,
                "warmup": t.lr_warmup_iters,
                "decay_iters": t.decay_iters,
                "decay_style": t.lr_decay_style,
                "weight_decay": t.weight_decay,
                "betas": [t.adam_beta1, t.adam_beta2],
                "eps": t.adam_eps,
                "clip_grad": t.clip_grad,
                "precision": t.precision,
            },
        }

    @property
    def series(self) -> str:
        blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    # (de)serialisation ----------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "run": self.run,
            "run_dir": self.run_dir,
            "tokenizer": dataclasses.asdict(self.tokenizer),
            "data": {
                "split": self.split,
                "datasets": [
                    {
                        "name": d.name,
                        "weight": d.weight,
                        "shards": [dataclasses.asdict(s) for s in d.shards],
                    }
                    for d in self.datasets
                ],
            },
            "model": dataclasses.asdict(self.model),
            **({"init_from": dataclasses.asdict(self.init_from)} if self.init_from else {}),
            "train": dataclasses.asdict(self.train),
            **({"derived": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "run.yaml") -> RunConfig:
        try:
            return cls(
                run=d["run"],
                run_dir=d["run_dir"],
                tokenizer=TokenizerInfo(**d["tokenizer"]),
                datasets=tuple(
                    DatasetBlend(
                        name=b["name"],
                        weight=float(b["weight"]),
                        shards=tuple(ShardInfo(**s) for s in b["shards"]),
                    )
                    for b in d["data"]["datasets"]
                ),
                split=d["data"]["split"],
                model=ModelConfig(**d["model"]),
                train=TrainConfig(**d["train"]),
                init_from=InitFromInfo(**d["init_from"]) if d.get("init_from") else None,
                extra=d.get("derived", {}),
            )
        except (KeyError, TypeError) as e:
            raise GptflowError(
                f"{source}: not a gptflow run config ({e}); re-create it with the workflow "
                f"(rule render_run_config)"
            ) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        data = load_yaml(path)
        if not isinstance(data, dict):
            raise GptflowError(f"{path}: not a gptflow run config (expected a mapping)")
        return cls.from_dict(data, source=str(path))


# ----------------------------------------------------------------------------- workflow config


def expand_root(root: str) -> Path:
    """Expand ``{python_stdlib}``, ``~`` and ``$VARS`` in a dataset root."""
    root = root.replace("{python_stdlib}", sysconfig.get_paths()["stdlib"])
    return Path(os.path.expandvars(os.path.expanduser(root)))


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
    elif tok["source"] == "file":
        if "path" not in tok:
            raise GptflowError(
                f"{source}: tokenizer.source is 'file' but tokenizer.path is not set. Fix {source}."
            )
        _check_path(tok["path"], "tokenizer.path", source)
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
    from gptflow.data.dataset import parse_split

    try:
        train_share, valid_share, _ = parse_split(split)
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


def render_run_config(
    cfg: dict, *, tokenizer_path: str, shards: dict[str, list[str]], run_dir: str
) -> RunConfig:
    """The run config of a validated workflow config: model resolved, tokenizer and shards checked.

    `shards` maps each blended dataset to its shard prefixes. Shards tokenized with another
    tokenizer than the run's are refused (their manifests record the tokenizer's sha256).
    """
    from gptflow.data.tokenize import read_manifest
    from gptflow.data.tokenizer import tokenizer_info

    tok = tokenizer_info(tokenizer_path, cfg["tokenizer"]["eod_token"])
    blends = []
    for item in cfg["data"]["blend"]:
        name = item["dataset"]
        infos = []
        for prefix in shards[name]:
            m = read_manifest(prefix)
            if m["tokenizer"]["sha256"] != tok.sha256:
                raise GptflowError(
                    f"{prefix}.json: shard was tokenized with tokenizer {m['tokenizer']['path']} "
                    f"(sha256 {m['tokenizer']['sha256'][:12]}), but the run uses {tokenizer_path} "
                    f"(sha256 {tok.sha256[:12]}); delete the shard so the workflow re-tokenizes it"
                )
            infos.append(
                ShardInfo(
                    prefix=prefix,
                    idx_sha256=m["idx_sha256"],
                    bin_sha256=m["bin_sha256"],
                    documents=m["documents"],
                    tokens=m["tokens"],
                )
            )
        blends.append(DatasetBlend(name=name, weight=float(item["weight"]), shards=tuple(infos)))
    model_keys = architecture(cfg["model"])
    model_keys["vocab_size"] = padded_vocab_size(
        tok.vocab_size, model_keys["make_vocab_size_divisible_by"]
    )
    model = ModelConfig(**model_keys)
    train = TrainConfig(**cfg["train"])
    init_from = None
    if cfg["model"].get("init_from"):
        from gptflow.init_from import resolve

        init_from = resolve(cfg["model"]["init_from"], model, tokenizer_path, run_dir)
    data_tokens = sum(b.tokens for b in blends)
    total = train.train_iters * train.tokens_per_step
    derived = {
        "preset": cfg["model"]["preset"],
        "parameters": model.num_parameters(),
        "tokens_per_step": train.tokens_per_step,
        "total_tokens": total,
        "data_tokens": data_tokens,
        "epochs": round(total / data_tokens, 4) if data_tokens else None,
        "training_flops_6nd": 6 * model.num_parameters() * total,
        "token_dtype": "uint16" if tok.vocab_size < 65500 else "int32",
    }
    return RunConfig(
        run=cfg["run"],
        run_dir=run_dir,
        tokenizer=tok,
        datasets=tuple(blends),
        split=cfg["data"]["split"],
        model=model,
        train=train,
        init_from=init_from,
        extra=derived,
    )


def write_run_config(run: RunConfig, path: str | os.PathLike) -> None:
    from gptflow.fsutil import atomic_write

    with atomic_write(path) as f:
        f.write(f"# Resolved run config of '{run.run}' (written by the workflow; do not edit).\n")
        yaml.safe_dump(run.to_dict(), f, sort_keys=False, default_flow_style=False)
