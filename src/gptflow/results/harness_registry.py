"""lm-evaluation-harness's task registry, read at planning without importing the harness: what a
task *name* in ``eval.harness.tasks`` runs -- a task, a group's member tasks, a tag's tasks --
and each one's output type and generation length, from the task YAML files of the installed
harness (``lm_eval/tasks``) and of ``eval.harness.include``'s directories (later directories
win, as in the harness's ``TaskManager``).

The harness builds its whole index when it runs (~14,000 files, 18 s here): too slow for every
``snakemake`` start. Here each file is only scanned for its top-level ``task:``, ``group:``,
``tag:`` and ``include:`` lines (0.4 s for the installed harness, read once per process), and
only the files a name reaches are parsed, their ``include:`` chains merged as the harness merges
them (the including file's keys win). A group's keys that shape a generation (``output_type``,
``generation_kwargs``) apply to its members, as the harness applies a group's task keys. A name
not found is left to the job (the harness names it there).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gptflow.config.schema import parse_yaml
from gptflow.errors import GptflowError
from gptflow.results.sizing import GENERATED_TOKENS

# a file's top-level key: `task: x`, `"task": "x"`, `tag:` followed by `  - x` lines
TOP_KEY = re.compile(
    r"""^["']?(task|group|tag|include|class)["']?[ \t]*:[ \t]*(.*?)[ \t]*$""", re.M
)
# what the harness applies of a group's keys to its members, of those planning reads
GENERATION_KEYS = ("output_type", "generation_kwargs")
# generation_kwargs' names for the tokens to generate, in the harness's order of precedence
# (lm_eval.models.utils.normalize_gen_kwargs); without one, sizing.GENERATED_TOKENS (HFLM's)
MAX_GEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


class HarnessLoader(yaml.SafeLoader):
    """The harness's own task YAML as it reads it (a key given twice: the last wins), its
    ``!function module.name`` tag read as text (resolved by the harness when it runs)."""


HarnessLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def max_gen_toks(spec: dict) -> tuple[int, str]:
    """(tokens a generate_until task generates at most, the key that says so or the default)."""
    gen = spec.get("generation_kwargs") or {}
    for key in MAX_GEN_KEYS:
        if isinstance(gen, dict) and gen.get(key) is not None:
            return int(gen[key]), f"generation_kwargs.{key}"
    return (
        GENERATED_TOKENS,
        f"no generation_kwargs.max_gen_toks: lm-eval's default {GENERATED_TOKENS}",
    )


def harness_tasks_dir() -> Path | None:
    """The installed harness's task directory (found, not imported), or None."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    tasks = Path(next(iter(spec.submodule_search_locations))) / "tasks"
    return tasks if tasks.is_dir() else None


def registry_path(path: Path) -> str:
    """`path` as a reader finds it: under the installed harness, from ``lm_eval/``."""
    root = harness_tasks_dir()
    if root is not None and path.is_relative_to(root.resolve()):
        return str(Path("lm_eval/tasks") / path.relative_to(root.resolve()))
    return str(path)


@dataclass(frozen=True)
class RegistryTask:
    """One task a config name runs: its name, its YAML file, its settings (includes merged,
    its group's generation keys applied) and the group that brought it in, if any."""

    name: str
    path: Path
    spec: dict = field(compare=False)
    group: str = ""

    @property
    def output_type(self) -> str | None:
        """The task's output type: its YAML's, else the harness's default (generate_until);
        None for a task defined by a Python class, whose own code says."""
        if "class" in self.spec:
            return self.spec.get("output_type")
        return self.spec.get("output_type", "generate_until")


def _value(text: str, rest: str) -> list[str]:
    """A top-level key's value (the text after the colon, `rest`, and for an empty one the
    block list below it in `text`): its items, quotes and comments taken off."""
    if rest and not rest.startswith(("[", "-", "|", ">")):
        return [rest.split(" #")[0].strip().strip("'\"")]
    if rest.startswith("["):
        return [v.strip().strip("'\"") for v in rest.strip("[]").split(",") if v.strip()]
    items = []
    for line in text.splitlines()[1:]:  # the lines after the key's: its list, if any
        item = line.strip()
        if item.startswith("- "):
            items.append(item[2:].split(" #")[0].strip().strip("'\""))
        elif item and not item.startswith("#"):  # the next key, or a mapping: no list
            break
    return [i for i in items if i and ":" not in i]  # `- task: x` dicts are not names


@dataclass
class _Index:
    """Names to files, from each file's top-level lines: tasks, groups, tags (with the tags a
    file inherits through ``include:`` unless it sets its own)."""

    tasks: dict[str, Path] = field(default_factory=dict)
    groups: dict[str, Path] = field(default_factory=dict)
    tags: dict[str, list[str]] = field(default_factory=dict)


def _keys(path: str) -> dict[str, list[str]]:
    """A file's top-level task/group/tag/include values ({} when it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    keys: dict[str, list[str]] = {}
    for match in TOP_KEY.finditer(text):
        keys.setdefault(match[1], _value(text[match.end() : match.end() + 2000], match[2]))
    return keys


def _scan(root: str) -> dict[str, dict[str, list[str]]]:
    """Each ``*.yaml`` file under `root` (the files the harness indexes), by path: its keys."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".ipynb_checkpoints"))
        for name in sorted(filenames):
            if name.endswith(".yaml"):
                path = os.path.join(dirpath, name)
                found[path] = _keys(path)
    return found


def _joined(path: str, include: str) -> str:
    """The file an ``include:`` of `path` names (relative to its directory, or absolute)."""
    return os.path.normpath(os.path.join(os.path.dirname(path), include))


@functools.cache
def _index(roots: tuple[str, ...]) -> _Index:
    index = _Index()
    for root in roots:  # later roots win, as the harness's include_path over its own tasks
        files = _scan(root)

        def tags_of(path: str, seen: frozenset = frozenset()) -> list[str]:
            keys = files[path] if path in files else _keys(path)  # noqa: B023 (this root's)
            if "tag" in keys or path in seen or not keys.get("include"):
                return keys.get("tag", [])
            return tags_of(_joined(path, keys["include"][0]), seen | {path})

        for path, keys in files.items():
            if keys.get("group") and "class" not in keys:  # `class:`: a Python task, as lm-eval
                index.groups[keys["group"][0]] = Path(path)
            elif len(keys.get("task", [])) == 1:
                name = keys["task"][0]
                index.tasks[name] = Path(path)
                for tag in tags_of(path):
                    index.tags.setdefault(tag, []).append(name)
    return index


def load_task_yaml(path: Path, seen: frozenset = frozenset()) -> dict:
    """A task or group YAML with its ``include:`` chain merged (the including file's keys
    win; ``!function`` kept as text): what the harness's loader makes of it."""
    if path in seen:
        raise GptflowError(f"{path}: its include: chain comes back to it")
    cfg = parse_yaml(path.read_text(encoding="utf-8"), path, loader=HarnessLoader)
    if not isinstance(cfg, dict):
        raise GptflowError(f"{path}: a task YAML file holds a mapping")
    includes = cfg.pop("include", None) or []
    merged: dict = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        base = load_task_yaml(Path(_joined(str(path), inc)), seen | {path})
        base.pop("task_list", None)
        merged.update(base)
    return {**merged, **cfg}


def registry_tasks(name: str, include: list[str] | tuple[str, ...] = ()) -> list[RegistryTask]:
    """The tasks harness task name `name` runs ([] when the registry has no such name, or no
    harness is installed): itself, a group's members (nested groups and tags expanded), or a
    tag's tasks."""
    root = harness_tasks_dir()
    dirs = ([root] if root else []) + [Path(d) for d in include if Path(d).is_dir()]
    roots = [str(d.resolve()) for d in dirs]
    if not roots:
        return []
    return _resolve(name, _index(tuple(roots)), {}, "", frozenset())


def _resolve(name: str, index: _Index, overrides: dict, group: str, seen: frozenset) -> list:
    if name in seen:  # a group that contains itself: the harness would loop, the job says so
        return []
    seen |= {name}
    if name in index.groups:
        cfg = load_task_yaml(index.groups[name])
        return _members(cfg, index, overrides, name, seen)
    if name in index.tasks:
        spec = {**load_task_yaml(index.tasks[name]), **overrides}
        return [RegistryTask(name, index.tasks[name], spec, group)]
    return [t for member in index.tags.get(name, []) for t in
            _resolve(member, index, overrides, group, seen)]  # fmt: skip


def _members(cfg: dict, index: _Index, overrides: dict, group: str, seen: frozenset) -> list:
    """A group's member tasks, the group's generation keys under the caller's."""
    keys = {**{k: cfg[k] for k in GENERATION_KEYS if k in cfg}, **overrides}
    members = cfg.get("task") or []
    out = []
    for item in members if isinstance(members, list) else [members]:
        if isinstance(item, str):
            out += _resolve(item, index, keys, group, seen)
        elif isinstance(item, dict) and "group" in item and item["group"] in index.groups:
            inner = {**keys, **{k: item[k] for k in GENERATION_KEYS if k in item}}
            out += _resolve(item["group"], index, inner, group, seen)  # its keys win
        elif isinstance(item, dict) and "group" in item:  # defined inline: the caller's win
            out += _members(item, index, keys, group, seen)
        elif isinstance(item, dict) and isinstance(item.get("task"), str):
            inner = {**keys, **{k: item[k] for k in GENERATION_KEYS if k in item}}
            if item["task"] in index.tasks or item["task"] in index.groups:
                out += _resolve(item["task"], index, inner, group, seen)
            else:  # a task defined inline in the group
                out.append(RegistryTask(item["task"], Path(), {**item, **inner}, group))
    return out
