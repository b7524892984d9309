"""Generated config mutants: every leaf key of config/schema/config.schema.yaml, broken one way
at a time, must be refused with one line that names the key (its dotted path).

A "kitchen sink" config sets every key the schema has (a test below proves it, so a new schema
key without a place here fails). Each leaf gets: a wrong type, each bound/enum/pattern/length
overstepped, NaN, +inf, the key written twice (as YAML text, re-read as Snakemake's config file),
an unknown neighbour key, and, for strings, the value with a newline appended. The few mutants
that are legitimately valid are in ALLOWED, each with its reason.
"""

from __future__ import annotations

import copy
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gptflow.errors import GptflowError
from gptflow.plan.workflow_config import load_workflow_config

REPO = Path(__file__).resolve().parents[3]
SCHEMA_PATH = REPO / "config" / "schema" / "config.schema.yaml"
SCHEMA = yaml.safe_load(SCHEMA_PATH.read_text())
SOURCE = "my.yaml"


def remote_file(stem: str) -> dict:
    return {
        "url": f"https://example.org/{stem}",
        "mirrors": [f"https://mirror.example.org/{stem}"],
        "sha256": "0" * 64,
        "name": stem,
        "path": f"files/{stem}",
    }


def kitchen_sink() -> dict:
    """The tests' tiny config with every key of the schema set to a valid value."""
    cfg = yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())
    cfg["download"] = {"localrule": False, "attempts": 8}
    cfg["datasets"] = {
        "stdlib": {
            **cfg["datasets"]["stdlib"],
            "exclude": ["json/tool.py"],
            "format": "document_per_file",
            "json_key": "text",
            "member": "*",
            "member_format": "jsonl",
        },
        "web": {
            "type": "url",
            "format": "jsonl",
            "member": "*",
            "member_format": "jsonl",
            "json_key": "text",
            "files": [remote_file("a.jsonl")],
            "url_template": "https://example.org/{lang}/{part:02d}.jsonl",
            "mirror_templates": ["https://mirror.example.org/{lang}/{part:02d}.jsonl"],
            "parts": [0, 1],
            "vars": {"lang": "de"},
            "auth": {
                "token_env": "WEB_TOKEN",
                "origins": ["https://example.org"],
                "hosts": ["mirror.example.org"],
                "allow_http": False,
            },
        },
        "cat": {
            "type": "catalog",
            "name": "pile_subset",
            "parts": [0, 0],
            "vars": {"lang": "de"},
            "shards": 2,
        },
        "hub": {
            "type": "hf",
            "path": "wikitext",
            "name": "wikitext-2-raw-v1",
            "split": "train",
            "revision": "main",
            "text_key": "text",
            "streaming": False,
            "shards": 2,
        },
        # not in the blend (the kitchen sink trains its tokenizer); the files are checked
        # when the workflow resolves the datasets, not by the schema
        "tok": {
            "type": "megatron",
            "prefixes": ["/data/pile/pile_00_text_document", "shards/pile_01_text_document"],
        },
    }
    cfg["tokenizer"].update(
        path="files/tokenizer.json",
        url=remote_file("tokenizer.json"),
        vocab=remote_file("vocab.json"),
        merges=remote_file("merges.txt"),
    )
    cfg["tokenize"].update(
        engine="auto", on_bad_document="error", max_rss_mb=1024, documents_per_shard=0, merge=False
    )
    steps = [
        {"step": "exact", "scope": "dataset"},
        {"step": "minhash", "ngram": 5, "bands": 14, "rows": 8, "seed": 1, "tokenizer": "regex",
         "scope": "blend"},
        {"step": "filters", "tokenizer": "regex", "rules": {"gopher_quality": {"min_words": 50}}},
        {"step": "language", "model": "files/lid.176.bin", "sha256": "0" * 64,
         "languages": ["en"], "threshold": 0.65},
    ]  # fmt: skip
    cfg["data"]["quality"] = {"steps": steps, "datasets": {"stdlib": copy.deepcopy(steps)}}
    cfg["model"] = {
        "preset": "tiny",
        "description": "the tiny preset, every key spelled out",
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 256,
        "rotary_pct": 0.25,
        "rotary_emb_base": 10000,
        "parallel_residual": True,
        "layer_norm_eps": 1.0e-5,
        "hidden_dropout": 0.1,
        "attention_dropout": 0.1,
        "max_position_embeddings": 2048,
        "make_vocab_size_divisible_by": 128,
        "init_std": 0.02,
        "activation_checkpointing": False,
    }
    cfg["train"].update(
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1.0e-8,
        lr_decay_iters=40,
        offload="none",
        compile=False,
        peak_tflops=1.0,
        distributed_timeout_minutes=30,
        tensorboard=False,
        wandb={
            "enabled": False,  # on, planning would need the package (tested in test_wandb.py)
            "mode": "offline",
            "project": "gptflow",
            "entity": "my-team",
            "name": "a display name",
        },
        tensor_parallel=1,
        pipeline_parallel=1,
        keep_every=20,
        async_save=False,
        kfac={"factor_update_steps": 5, "inv_update_steps": 50, "damping": 0.003,
              "factor_decay": 0.95},
        optimizer="adamw",  # muon with kfac is refused; its keys are read only with muon
        muon={"lr": 0.02, "momentum": 0.95, "ns_method": "gram", "weight_decay": 0.1},
        elastic={"min_nodes": 1, "max_nodes": 2, "max_restarts": 2, "join_timeout_s": 300,
                 "last_call_s": 10, "keep_alive_s": 5},
        log_samples=True,
    )  # fmt: skip
    cfg["eval"] = {
        "prompts": ["def ", "The "],
        "new_tokens": 8,
        "max_windows": 4,
        "extra": {"wiki": ["results/tokens/tiny-bpe/wiki/00000"]},
        "harness": {
            "tasks": ["lambada_openai", "tasks/my_task.yaml"],
            "num_fewshot": 5,
            "batch_size": 16,
            "limit": 100,
            "include": ["tasks"],
            "every": 20,
        },
    }
    cfg["study"] = {
        "runs": {
            "big": {"model": {"preset": "small"}, "train": {"lr": 1.0e-3}, "tokens": 1.0e5},
            "exact": {"data": {"quality": {"steps": [{"step": "exact"}]}}},  # a data ablation
        },
        "grid": {"train.lr": [1.0e-3, 2.0e-3]},
        "budgets": [1.0e21],
    }
    # with study, refused when the plan is built (gptflow.plan.build), not by the schema
    cfg["autotune"] = {
        "micro_batch_sizes": [1, 2, 4],
        "zero_stages": [0, 1],
        "activation_checkpointing": [False, True],
        "steps": 8,
        "warmup_steps": 2,
        "memory_limit_mb": 4000,
    }
    cfg["train"]["autotune_trial"] = False  # what autotune sets on its trials' configs
    cfg["container"] = {
        "enabled": False,
        "format": "sqsh",
        "builder": "auto",
        "dockerfile": "envs/Dockerfile",
        "base_image": "python:3.11-slim",
        "build_args": {"GPTFLOW_PIP_ARGS": "--no-cache-dir"},
        "build_options": ["--pull"],
        "registry_login": [
            {"server": "nvcr.io", "username": "$oauthtoken", "password_env": "NGC_API_KEY"}
        ],
        "squash": "auto",
        "squash_options": ["-comp", "lzo"],
        "mounts": ["/scratch:/scratch"],
    }
    cfg["kubernetes"] = {
        "image": "registry.example.org/gptflow@sha256:" + "ab" * 32,
        "image_pull_secret": "registry-login",
        "namespace": "llm",
        "service_account": "gptflow",
        "volume_claim": "gptflow-work",
        "mount_path": "/workspace",
        "nodes": 2,
        "gpus_per_node": 8,
        "gpu_resource": "nvidia.com/gpu",
        "cpus_per_rank": 12,
        "gpu_memory_mb": 81920,
        "memory_mb": 0,
        "shm_mb": 16384,
        "rdma": {"enabled": True, "resource": "rdma/rdma_shared_device_a", "count": 1,
                 "hca": "mlx5"},
        "env": {"NCCL_P2P_DISABLE": "1"},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present",
                         "effect": "NoSchedule"}],
        "queue": "team-a",
        "priority_class": "high",
        "max_restarts": 3,
        "termination_grace_seconds": 600,
        "driver": {"cpus": 8, "memory_mb": 32000},
    }  # fmt: skip
    return cfg


def load(cfg: dict, config_files: list[str] | None = None) -> dict:
    return load_workflow_config(
        cfg,
        schema_path=SCHEMA_PATH,
        models_dir=REPO / "config" / "models",
        source=SOURCE,
        config_files=config_files,
    )


# --------------------------------------------------------------------------- the schema walk


def resolve(schema: dict, instance=None) -> dict:
    """`schema` with its $ref merged in, and the allOf if/then branches the instance selects
    (all of them when `instance` is None: the schema-only walk)."""
    ref = schema.get("$ref")
    if ref:
        target = SCHEMA
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        base = resolve(target, instance)
        merged = {**base, **{k: v for k, v in schema.items() if k != "$ref"}}
        merged["properties"] = {**base.get("properties", {}), **schema.get("properties", {})}
        schema = merged
    for branch in schema.get("allOf", []):
        cond = branch["if"]["properties"]
        if instance is None or all(instance.get(k) == v["const"] for k, v in cond.items()):
            then = resolve(branch["then"], instance)
            schema = {
                **schema,
                "properties": {**schema.get("properties", {}), **then["properties"]},
            }
    return schema


def is_node(schema: dict) -> bool:
    """An object with keys (walked into; a map's entries are leaves of their own), not a leaf."""
    return bool(schema.get("properties")) or isinstance(schema.get("additionalProperties"), dict)


def branch_label(schema: dict, instance: dict | None) -> list[str]:
    """Map entries whose schema branches on a const (datasets by type): one label per branch."""
    branches = [b["if"]["properties"] for b in resolve(schema).get("allOf", [])]
    if not branches:
        return ["*"]
    if instance is not None:
        return [f"*<{instance['type']}>"]
    return [f"*<{c['type']['const']}>" for c in branches]


def schema_leaves(schema: dict, path: tuple = ()) -> set[tuple]:
    """Generalized leaf paths of the schema alone ('*' a map key, '[]' a list item)."""
    out: set[tuple] = set()
    schema = resolve(schema)
    for key, sub in schema.get("properties", {}).items():
        out |= _schema_child(sub, (*path, key))
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        for label in branch_label(extra, None):
            out |= _schema_child(extra, (*path, label), label)
    return out


def _schema_child(sub: dict, path: tuple, label: str = "*") -> set[tuple]:
    if label != "*":  # one branch of a const-discriminated entry
        const = label[2:-1]
        return schema_leaves(resolve(sub, {"type": const}) | {"allOf": []}, path)
    r = resolve(sub)
    if is_node(r):
        return schema_leaves(r, path)
    items = r.get("items")
    if r.get("type") == "array" and isinstance(items, dict) and is_node(resolve(items)):
        return schema_leaves(resolve(items), (*path, "[]"))
    return {path}


@dataclass
class Leaf:
    path: tuple  # concrete: ("datasets", "web", "files", 0, "url")
    general: tuple  # ("datasets", "*<url>", "files", "[]", "url")
    schema: dict  # resolved
    parent_open: bool  # the parent is a map (any key allowed)


def config_leaves(schema: dict, inst: dict, path=(), general=()) -> list[Leaf]:
    """The leaves of the kitchen sink, with their schema (the walk guided by the instance)."""
    out: list[Leaf] = []
    schema = resolve(schema, inst)
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    for key, value in inst.items():
        if key in props:
            sub, g, open_ = props[key], key, False
        else:
            assert isinstance(extra, dict), f"kitchen sink key {(*path, key)} not in the schema"
            sub, open_ = extra, True
            g = branch_label(extra, value if isinstance(value, dict) else None)[0]
        r = resolve(sub, value if isinstance(value, dict) else None)
        if isinstance(value, dict) and is_node(r):
            out += config_leaves(r, value, (*path, key), (*general, g))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            # every item: items of one list may take different branches (data.quality's steps)
            for i, item in enumerate(value):
                out += config_leaves(
                    resolve(r["items"], item), item, (*path, key, i), (*general, g, "[]")
                )
        else:
            out.append(Leaf((*path, key), (*general, g), r, open_))
    return out


def dotted(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def general_name(general: tuple) -> str:
    return ".".join(general).replace(".[]", "[]")


# --------------------------------------------------------------------------- the mutants

WRONG_TYPE_CANDIDATES = ["x", 7, ["x"], {"k": 1}]
PATTERN_CANDIDATES = ["a/b", "-x", "..", "x y", ""]
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array"}


def allowed_types(s: dict) -> set[str]:
    if "type" in s:
        t = s["type"]
        return set(t if isinstance(t, list) else [t])
    values = s.get("enum") or ([s["const"]] if "const" in s else None)
    if values is None and "anyOf" in s:
        values = [
            v for sub in s["anyOf"] for v in resolve(sub).get("enum", [resolve(sub).get("const")])
        ]
    return {JSON_TYPES[type(v)] for v in values or []}


def type_of(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, dict):
        return "object"
    return JSON_TYPES[type(value)]


def wrong_type(s: dict):
    types = allowed_types(s)
    if "number" in types:
        types.add("integer")
    return next(v for v in WRONG_TYPE_CANDIDATES if type_of(v) not in types)


def out_of_range(s: dict) -> list[tuple[str, object]]:
    """(what, value) for each bound, enum, pattern or length the leaf schema sets."""
    out = []
    integer = "integer" in allowed_types(s) and "number" not in allowed_types(s)
    step = 1 if integer else 0.5
    if "minimum" in s:
        out.append(("minimum", s["minimum"] - step))
    if "exclusiveMinimum" in s:
        out.append(("exclusiveMinimum", s["exclusiveMinimum"]))
    if "maximum" in s:
        out.append(("maximum", s["maximum"] + step))
    if "exclusiveMaximum" in s:
        out.append(("exclusiveMaximum", s["exclusiveMaximum"]))
    if "enum" in s or "const" in s or "anyOf" in s:
        choices = s.get("enum") or ([s["const"]] if "const" in s else ["anyOf"])
        out.append(("enum", 99 if all(isinstance(c, int) for c in choices) else "zz-none-of-them"))
    if "pattern" in s:
        pattern = (
            s["pattern"].removesuffix("$") + r"\Z" if s["pattern"].endswith("$") else s["pattern"]
        )
        out.append(("pattern", next(v for v in PATTERN_CANDIDATES if not re.search(pattern, v))))
    if "minLength" in s:
        out.append(("minLength", ""))
    return out


@dataclass
class Case:
    kind: str
    leaf: Leaf
    target: tuple  # the path the mutant breaks (the leaf, or its first item)
    value: object = None
    what: str = ""

    @property
    def id(self) -> str:
        extra = f"({self.what})" if self.what else ""
        return f"{self.kind}{extra}:{dotted(self.target)}"

    @property
    def general(self) -> str:
        return general_name(self.leaf.general)


def cases_of(leaf: Leaf, value) -> list[Case]:
    s = leaf.schema
    out = [Case("duplicate", leaf, leaf.path), Case("neighbour", leaf, leaf.path)]
    targets = [(leaf.path, s)]
    if isinstance(value, list):  # a list of scalars: the list itself, and its first item
        out.append(Case("wrong_type", leaf, leaf.path, {"k": 1}))
        if "minItems" in s:
            out.append(Case("out_of_range", leaf, leaf.path, [], "minItems"))
        if s.get("uniqueItems"):
            out.append(Case("out_of_range", leaf, leaf.path, value + value[:1], "uniqueItems"))
        if "maxItems" in s:
            out.append(Case("out_of_range", leaf, leaf.path, value * s["maxItems"], "maxItems"))
        targets = [((*leaf.path, 0), resolve(s["items"]))]
    for path, ts in targets:
        out.append(Case("wrong_type", leaf, path, wrong_type(ts)))
        out += [Case("out_of_range", leaf, path, v, what) for what, v in out_of_range(ts)]
        out.append(Case("nan", leaf, path, math.nan))
        out.append(Case("inf", leaf, path, math.inf))
        current = get(KITCHEN, path)
        if "string" in allowed_types(ts) and isinstance(current, str):
            out.append(Case("newline", leaf, path, current + "\n"))
    return out


def get(cfg, path):
    for p in path:
        cfg = cfg[p]
    return cfg


def put(cfg, path, value) -> dict:
    cfg = copy.deepcopy(cfg)
    node = cfg
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return cfg


# Mutants that are valid on purpose: (kind, generalized leaf) -> why.
ALLOWED = {
    ("newline", "eval.prompts"): "a prompt is free text; a newline in it is meant",
    ("newline", "model.description"): "free text, ignored by training",
    ("neighbour", "container.build_args.*"): "build_args is a map: any build-arg name is a key",
    ("neighbour", "datasets.*<url>.vars.*"): "vars is a map of template variables",
    ("neighbour", "datasets.*<catalog>.vars.*"): "vars is a map of template variables",
    ("neighbour", "eval.extra.*"): "eval.extra is a map: any (strict) name is a key",
    ("neighbour", "data.quality.steps[].rules.*.*"): "a rule's thresholds are a map of its keys",
    ("neighbour", "data.quality.datasets.*[].rules.*.*"): "a rule's thresholds are a map",
    ("neighbour", "kubernetes.env.*"): "kubernetes.env is a map: any variable name is a key",
    ("neighbour", "kubernetes.node_selector.*"): "a node selector is a map of labels",
}

KITCHEN = kitchen_sink()
LEAVES = config_leaves(SCHEMA, KITCHEN)
CASES = [c for leaf in LEAVES for c in cases_of(leaf, get(KITCHEN, leaf.path))]


# --------------------------------------------------------------------------- the tests


# Keys whose valid value is an artifact the mutants would have to match: model.init_from names
# a Hugging Face checkpoint whose config.json must equal the model key by key, so every
# architecture mutant would fail on it instead of on its own rule. Its schema refusals are
# below; tests/unit/train/test_init_from.py covers the directory, the weights and the tokenizer.
NOT_IN_THE_SINK = {"model.init_from"}


def test_the_kitchen_sink_sets_every_schema_key_and_loads():
    have = {leaf.general for leaf in LEAVES}
    want = {g for g in schema_leaves(SCHEMA) if general_name(g) not in NOT_IN_THE_SINK}
    assert {general_name(g) for g in want - have} == set(), "schema keys the kitchen sink lacks"
    assert have == want
    assert len(CASES) == len({c.id for c in CASES})  # every case is one of its own
    assert all((k, g) in {(c.kind, c.general) for c in CASES} for k, g in ALLOWED)
    open_maps = {("neighbour", general_name(leaf.general)) for leaf in LEAVES if leaf.parent_open}
    # study.grid is a map whose keys name model and train keys: a neighbour is refused by name
    assert open_maps - {("neighbour", "study.grid.*")} == {
        k for k in ALLOWED if k[0] == "neighbour"
    }
    cfg = load(KITCHEN)
    assert cfg["container"]["mounts"] == ["/scratch:/scratch"]


def test_case_counts():
    counts = Counter(c.kind for c in CASES)
    print("\nconfig mutants:", dict(sorted(counts.items())), "total", len(CASES))
    assert len(LEAVES) >= 100
    for kind in ("duplicate", "neighbour", "nan", "inf"):
        assert counts[kind] >= len(LEAVES)
    assert counts["newline"] >= 50 and counts["out_of_range"] >= 60 and counts["wrong_type"] >= 100


def names_key(message: str, key: str) -> bool:
    """`key` (a dotted path) appears in `message` as a whole path, not as a prefix of another."""
    return re.search(rf"(?<![\w.\[]){re.escape(key)}(?![\w\[]|\.\w)", message) is not None


def refused(cfg: dict, config_files=None) -> str:
    with pytest.raises(GptflowError) as e:
        load(cfg, config_files)
    message = str(e.value)
    assert "\n" not in message
    return message


class DupMap(list):
    """A mapping written as YAML with its pairs as given (a key may repeat)."""


yaml.SafeDumper.add_representer(
    DupMap, lambda d, data: d.represent_mapping("tag:yaml.org,2002:map", list(data))
)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_mutant(case: Case, tmp_path_factory):
    key = dotted(case.target)
    allowed = ALLOWED.get((case.kind, case.general))
    parent, name = case.leaf.path[:-1], case.leaf.path[-1]
    if case.kind == "duplicate":
        cfg = copy.deepcopy(KITCHEN)
        node = get(cfg, parent)
        pairs = DupMap([*node.items(), (name, node[name])])
        text = yaml.safe_dump(put(cfg, parent, pairs) if parent else pairs, sort_keys=False)
        path = tmp_path_factory.mktemp("dup") / "config.yaml"
        path.write_text(text)
        message = refused(yaml.safe_load(text), [str(path)])
        lines = text.splitlines()
        assert re.fullmatch(
            rf"{re.escape(str(path))}:(\d+): key '{re.escape(key)}' is given twice \(first on "
            rf"line (\d+)\); only the last would count\. Remove one of them from "
            rf"{re.escape(str(path))}\.",
            message,
        ), message
        line = int(re.match(rf"{re.escape(str(path))}:(\d+)", message)[1])
        assert lines[line - 1].lstrip(" -").startswith(f"{name}:")
        return
    if case.kind == "neighbour":
        extra = f"{name}_x"
        cfg = put(KITCHEN, (*parent, extra), get(KITCHEN, case.leaf.path))
        if allowed:
            assert load(cfg) is not None, allowed
            return
        message = refused(cfg)
        assert f"unknown key '{dotted((*parent, extra))}'" in message, message
        return
    cfg = put(KITCHEN, case.target, case.value)
    if allowed:
        loaded = load(cfg)
        assert get(loaded, case.target) == case.value, allowed
        return
    message = refused(cfg)
    assert message.startswith(f"{SOURCE}: ") and message.endswith(f"Fix {SOURCE}."), message
    assert names_key(message, key), message
    if case.kind in ("nan", "inf"):
        assert f"'{key}' is {case.value!r}; numbers must be finite" in message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (7, r"'model.init_from' is 7 \(an integer\); expected a string"),
        ("hf\n", r"model.init_from"),
        ("", r"model.init_from"),
    ],
)  # fmt: skip
def test_init_from_values_the_schema_refuses(value, message):
    cfg = copy.deepcopy(KITCHEN)
    cfg["model"]["init_from"] = value
    with pytest.raises(GptflowError, match=message):
        load(cfg)


@pytest.mark.parametrize("value", [7, 0, [7]])
def test_url_template_not_a_string_is_one_line(value, tmp_path):
    """url_template as an integer (or a list) in the config's url dataset and in a catalog
    entry a config names: one line naming the key and its value (no empty clause: a catalog
    entry's failed url branch leaves url_template "unevaluated", which is not an unknown key),
    never a TypeError where the template is filled."""
    cfg = copy.deepcopy(KITCHEN)
    cfg["datasets"]["web"]["url_template"] = value
    message = refused(cfg)
    assert f"'datasets.web.url_template' is {value!r} (" in message, message

    from gptflow.data.sources import resolve_datasets

    catalog = yaml.safe_load((REPO / "config" / "datasets.yaml").read_text())
    catalog["pile"]["url_template"] = value
    path = tmp_path / "datasets.yaml"
    path.write_text(yaml.safe_dump(catalog))
    with pytest.raises(GptflowError) as e:
        resolve_datasets({"datasets": {"p": {"type": "catalog", "name": "pile", "parts": [0, 0]}}},
                         ["p"], catalog_path=path, schema=SCHEMA, source=SOURCE)  # fmt: skip
    message = str(e.value)
    assert message == (
        f"{path} (entry pile): 'url_template' is {value!r} ({'a list' if value == [7] else 'an integer'}); "
        f"expected a string. Fix {path} (entry pile)."
    ), message
