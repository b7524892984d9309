"""EleutherAI's lm-evaluation-harness on a run's Hugging Face export (rule harness).

The harness runs through its own public API (``lm_eval.simple_evaluate`` with its ``hf``
model and a ``TaskManager``): no wrapper of ours around its internals, so upgrading it is a
version bump. It is an optional extra (``pip install 'gptflow[eval]'``); planning checks that
it is installed and that the task files the config names exist and parse, without importing it
(its task registry takes seconds to index). Tasks are harness task names or task YAML files
the user brings (e.g. over local JSONL); the CLI runs it offline (HF_DATASETS_OFFLINE=1).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from gptflow.config.schema import UniqueKeyLoader, parse_yaml
from gptflow.config.settings import TrainConfig
from gptflow.errors import GptflowError
from gptflow.fsutil import write_json
from gptflow.results import sizing
from gptflow.results.harness_registry import (
    load_task_yaml,
    max_gen_toks,
    registry_path,
    registry_tasks,
)

INSTALL = "pip install 'gptflow[eval]'"


class TaskLoader(UniqueKeyLoader):
    """The harness's task YAML: our safe loader, plus its ``!function module.name`` tag (read
    as text here; the harness resolves it when it runs)."""


TaskLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def is_task_file(task: str) -> bool:
    """A task given as a file (a .yaml/.yml name or a path), not a harness task name."""
    return task.endswith((".yaml", ".yml")) or "/" in task or os.sep in task


def read_task_file(path: str | os.PathLike, key: str) -> dict:
    """A task YAML file (its mapping); a missing or unparsable file, or one without a
    ``task:`` name, is one line naming the file and the config key `key`."""
    path = Path(path)
    if not path.is_file():
        raise GptflowError(
            f"{key}: {path}: no such task file (a task is a harness task name, or the path of "
            f"a task YAML file)"
        )
    try:
        task = parse_yaml(path.read_text(encoding="utf-8"), path, loader=TaskLoader)
    except GptflowError as e:
        raise GptflowError(f"{key}: {e}") from None
    if not isinstance(task, dict) or not isinstance(task.get("task"), str):
        raise GptflowError(
            f"{key}: {path}: a task YAML file needs a `task: NAME` key (the name the harness "
            f"knows it by)"
        )
    return task


def task_name(task: str, key: str) -> str:
    """The harness's name of config task `task` (a name, or a file's ``task:``)."""
    return read_task_file(task, key)["task"] if is_task_file(task) else task


def include_dirs(tasks: list[str], include: list[str]) -> list[str]:
    """The harness's include_path: the directories of the task files, then `include`."""
    dirs = [str(Path(t).resolve().parent) for t in tasks if is_task_file(t)]
    dirs += [str(Path(d).resolve()) for d in include]
    return list(dict.fromkeys(dirs))


def _data_files(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [f for v in value for f in _data_files(v)]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _data_files(v)]
    return []


def input_files(harness_cfg: dict) -> list[str]:
    """What the harness job reads besides the export: each task file, and the local data files
    it names (``dataset_kwargs.data_files`` that exist), so a changed one reruns the job."""
    files = []
    for i, task in enumerate(harness_cfg["tasks"]):
        if not is_task_file(task):
            continue
        files.append(task)
        kwargs = read_task_file(task, f"eval.harness.tasks[{i}]").get("dataset_kwargs") or {}
        if isinstance(kwargs, dict):
            files += [f for f in _data_files(kwargs.get("data_files")) if Path(f).is_file()]
    return list(dict.fromkeys(files))


def _split_files(task: dict) -> list[Path]:
    """The local data files of the split a task evaluates (its test_split, else its
    validation_split: the harness's order), from ``dataset_kwargs.data_files``."""
    kwargs = task.get("dataset_kwargs") or {}
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if isinstance(files, dict):
        split = task.get("test_split") or task.get("validation_split")
        files = files.get(split) if split in files else list(files.values())
    return [Path(f) for f in _data_files(files)]


def _documents(path: Path) -> list[bytes] | None:
    """A data file's documents as stored (a JSON Lines row, a JSON array's item, a CSV row),
    or None for a format not read here."""
    data = path.read_bytes()
    if path.suffix in (".json", ".jsonl") and data.lstrip().startswith(b"["):
        try:
            return [json.dumps(d).encode() for d in json.loads(data)]
        except ValueError:
            return None
    if path.suffix in (".json", ".jsonl"):
        return [line for line in data.splitlines() if line.strip()]
    if path.suffix == ".csv":
        return [line for line in data.splitlines()[1:] if line.strip()]
    return None


def _choices(task: dict, documents: list[bytes]) -> float | None:
    """Choices per question: a `doc_to_choice` list, or the mean length of the documents'
    list field it names; None where it is a template or a function (not evaluated here)."""
    choice = task.get("doc_to_choice")
    if isinstance(choice, list):
        return float(len(choice))
    if not isinstance(choice, str) or not choice.isidentifier():
        return None
    counts = []
    for doc in documents:
        try:
            value = json.loads(doc).get(choice)
        except (ValueError, AttributeError):
            return None
        if not isinstance(value, list):
            return None
        counts.append(len(value))
    return sum(counts) / len(counts) if counts else None


def task_work(harness_cfg: dict) -> list[sizing.TaskWork]:
    """Each task's work (gptflow.results.sizing.TaskWork), estimated at planning without lm-eval: a
    task file over local data files is counted (documents, their mean size, the choices of a
    multiple-choice question, a generation's max_gen_toks); data the job downloads is
    sizing.ASSUMED_DOCUMENTS documents at the full context. A harness task name is read from
    lm-eval's registry (gptflow.results.harness_registry: its tasks' output type and the
    longest generation among them; its documents assumed). At most eval.harness.limit
    documents a task."""
    limit = harness_cfg["limit"]
    dirs = include_dirs(harness_cfg["tasks"], harness_cfg["include"])  # as the job's
    work = []
    for i, task in enumerate(harness_cfg["tasks"]):
        if not is_task_file(task):
            work.append(named_work(task, dirs, limit))
            continue
        spec = read_task_file(task, f"eval.harness.tasks[{i}]")
        if spec.get("include"):  # the generation may be set in the file it includes
            spec = load_task_yaml(Path(task))
        kind = spec.get("output_type", "generate_until")
        generated = max_gen_toks(spec)[0] if kind == "generate_until" else 0
        files = _split_files(spec)
        docs = [_documents(f) for f in files if f.is_file()]
        if not files or len(docs) < len(files) or None in docs:  # not counted here
            documents = sizing.ASSUMED_DOCUMENTS if limit is None else limit
            choices = sizing.ASSUMED_CHOICES if kind == "multiple_choice" else 1
            work.append(sizing.TaskWork(spec.get("task", task), kind, documents, 0.0, choices,
                                        generated, counted=False))  # fmt: skip
            continue
        rows = [d for found in docs for d in found][:limit]
        choices = _choices(spec, rows) if kind == "multiple_choice" else 1.0
        mean = sum(map(len, rows)) / len(rows) if rows else 0.0
        work.append(sizing.TaskWork(spec["task"], kind, len(rows), mean,
                                    sizing.ASSUMED_CHOICES if choices is None else choices,
                                    generated))  # fmt: skip
    return work


def named_work(task: str, include: list[str], limit: int | None) -> sizing.TaskWork:
    """The work of harness task name `task` (a task, a group, a tag of lm-eval's registry, or
    of eval.harness.include's files): its documents assumed (downloaded by the job), its
    output type its tasks' (generate_until when one generates), the longest generation among
    them and which one that is; a name the registry does not have is assumed multiple-choice
    (the job names it)."""
    members = registry_tasks(task, include)
    kinds = [m.output_type for m in members if m.output_type]
    generating = [m for m in members if m.output_type == "generate_until"]
    kind = "generate_until" if generating else (kinds[0] if kinds else "multiple_choice")
    generated, by = 0, ""
    if generating:
        longest = max(generating, key=lambda m: max_gen_toks(m.spec)[0])
        generated, key = max_gen_toks(longest.spec)
        of = f"its task {longest.name}, " if longest.name != task else ""
        by = f"{of}lm-eval's {registry_path(longest.path)}: {key}"
    documents = sizing.ASSUMED_DOCUMENTS if limit is None else limit
    choices = sizing.ASSUMED_CHOICES if kind == "multiple_choice" else 1
    return sizing.TaskWork(task, kind, documents, 0.0, choices, generated, counted=False,
                           generated_by=by)  # fmt: skip


def check_context(work: list[sizing.TaskWork], seq_length: int, run: str, source: str) -> None:
    """A generation must fit the harness's context (the run's train.seq_length): lm-eval
    asserts max_gen_toks < max_length when the job runs. A task file says its own; a task name
    its registry's (:func:`named_work`: the longest generation among its tasks)."""
    for w in work:
        if w.output_type != "generate_until" or w.generated_tokens < seq_length:
            continue
        at = (
            f"task '{w.name}' generates up to {w.generated_tokens} tokens "
            + (f"({w.generated_by})" if w.generated_by else
               f"(generation_kwargs.max_gen_toks; lm-eval's default {sizing.GENERATED_TOKENS})")
            + f", but the harness's context is run {run}'s train.seq_length {seq_length} and "
            "lm-eval needs fewer; "
        )  # fmt: skip
        fix = (
            f"raise train.seq_length above {w.generated_tokens}, or give eval.harness.tasks a "
            f"copy of that task's YAML file with generation_kwargs.max_gen_toks below "
            f"{seq_length}, or drop the task"
            if w.generated_by
            else f"set generation_kwargs.max_gen_toks below {seq_length} in the task file"
        )
        raise GptflowError(f"{source}: eval.harness.tasks: {at}{fix}")


def _import_problem() -> str | None:
    """Why the harness cannot run its hf model here, or None. `import lm_eval` is cheap (it
    imports its evaluator lazily); accelerate (of lm-eval[hf]) is looked up, not imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        return str(e)
    if importlib.util.find_spec("accelerate") is None:
        return "accelerate is missing: lm-eval was installed without its [hf] extra"
    return None


def check_planned(harness_cfg: dict, source: str) -> None:
    """At plan time, when eval.harness.tasks is set: the harness imports, each task file exists and parses, each include directory exists. Task names are
    not checked here (the harness's registry takes seconds to build): the job names them."""
    if not harness_cfg["tasks"]:
        return
    problem = _import_problem()
    if problem:
        raise GptflowError(
            f"{source}: eval.harness.tasks is set, but lm-evaluation-harness cannot be imported "
            f"in {sys.prefix} ({problem}); install it with {INSTALL} (or set "
            f"eval.harness.tasks: [])"
        )
    for i, task in enumerate(harness_cfg["tasks"]):
        if is_task_file(task):
            read_task_file(task, f"{source}: eval.harness.tasks[{i}]")
    for i, d in enumerate(harness_cfg["include"]):
        if not Path(d).is_dir():
            raise GptflowError(
                f"{source}: eval.harness.include[{i}]: {d}: no such directory (of task YAML files)"
            )


def checkpoint_steps(train: TrainConfig, every: int | None) -> list[int]:
    """The intermediate checkpoints eval.harness.every evaluates (rule harness_step): its
    multiples below train_iters. The final step is the export's (rule harness)."""
    return list(range(every, train.train_iters, every)) if every else []


def check_steps(train: TrainConfig, every: int | None, run: str, source: str) -> list[int]:
    """checkpoint_steps of run `run`, each a step its training saves and keeps (else one line
    saying which steps and what to set, at -n: a pruned checkpoint cannot be evaluated)."""
    steps = checkpoint_steps(train, every)
    key = f"{source}: eval.harness.every {every} (run {run})"
    unsaved = [s for s in steps if s % train.save_interval]
    if unsaved:
        raise GptflowError(
            f"{key}: training saves no checkpoint at step {unsaved[0]} (train.save_interval "
            f"{train.save_interval}); use a multiple of train.save_interval"
        )
    kept = set(train.kept_steps())
    pruned = [s for s in steps if s not in kept]
    if pruned:
        shown = ", ".join(map(str, pruned[:4])) + (", ..." if len(pruned) > 4 else "")
        raise GptflowError(
            f"{key}: training deletes the checkpoints of steps {shown} (train.keep_last "
            f"{train.keep_last}, train.keep_every {train.keep_every}); set train.keep_every: "
            f"{every} (before training: a deleted checkpoint is gone)"
        )
    return steps


def _metrics(result: dict) -> dict:
    """A task's results from the harness ({"acc,none": 0.5, "acc_stderr,none": 0.2, "alias":
    ...}) as {"acc": 0.5, "acc_stderr": 0.2}: the "none" filter's name dropped, another kept
    ("exact_match,flexible-extract"), and a metric's stderr always the metric's name and
    "_stderr" ("exact_match,flexible-extract_stderr", from the harness's
    "exact_match_stderr,flexible-extract"), as the reports look it up; "N/A" (no stderr for
    this metric) as null."""
    metrics = {}
    for key, value in result.items():
        if "," not in key:
            continue
        metric, _, filt = key.partition(",")
        base = metric.removesuffix("_stderr")
        name = (base if filt == "none" else f"{base},{filt}") + metric[len(base) :]
        metrics[name] = None if value == "N/A" else value
    return metrics


def hf_model_settings(
    hf_dir: str | os.PathLike, devices: list[str], dtype: str, max_length: int
) -> dict:
    """The harness's ``hf`` model arguments for the evaluate job's placement (devices, dtype:
    gptflow.results.evaluate.eval_placement): fp32 on the CPU or one GPU; on several GPUs (a model
    too large for one) bf16 with the harness's own ``parallelize`` (accelerate spreads the
    layers over the job's GPUs). The context is `max_length`, the length the model was
    trained at (train.seq_length): left to itself the harness takes the export's
    max_position_embeddings (2048), scoring positions the model never saw. Log-softmax runs in
    fp32 in either dtype (the harness's ``softmax_dtype``; left to itself, the model's dtype)."""
    args = {
        "pretrained": str(hf_dir),
        "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
        "max_length": max_length,
        "softmax_dtype": "float32",
    }
    if len(devices) > 1:
        return {**args, "parallelize": True}
    return {**args, "device": devices[0]}


def run_harness(
    hf_dir: str | os.PathLike,
    tasks: list[str],
    *,
    include: list[str],
    num_fewshot: int,
    batch_size: int,
    limit: int | None,
    out: str | os.PathLike,
    devices: list[str],
    dtype: str,
    max_length: int,
    step: int | None = None,
    checkpoint: str | None = None,
) -> dict:
    """Run the harness on the Hugging Face model directory `hf_dir` (the export of training
    step `step`) on `devices` in `dtype`, at most `max_length` tokens a forward pass
    (:func:`hf_model_settings`), and write `out`
    (harness.json, atomically): the harness version, each task's version, few-shot count and
    every metric with its stderr, and the settings. An export made on the fly from
    `checkpoint` (:func:`exported_step`) is recorded as that checkpoint, not as its
    temporary directory."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise GptflowError(
            f"the harness cannot be imported ({e}); install it with {INSTALL}"
        ) from None

    names = [task_name(t, f"--task {t}") for t in tasks]
    args = hf_model_settings(hf_dir, devices, dtype, max_length)
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=args,
        tasks=names,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        limit=limit,
        # the harness's own tasks indexed only when one is named (its ~15,000 YAMLs: ~9 s)
        task_manager=TaskManager(
            include_path=include_dirs(tasks, include) or None,
            include_defaults=not all(is_task_file(t) for t in tasks),
        ),
    )
    record = {
        "harness_version": importlib.metadata.version("lm_eval"),
        "tasks": {
            name: {
                "version": results["versions"].get(name),
                "num_fewshot": results["n-shot"].get(name),
                "samples": results.get("n-samples", {}).get(name),
                "metrics": _metrics(results["results"][name]),
            }
            for name in names
        },
        "config": {
            "tasks": list(tasks),
            "include": list(include),
            "num_fewshot": num_fewshot,
            "batch_size": batch_size,
            "limit": limit,
            "dtype": args["dtype"],
            "softmax_dtype": args["softmax_dtype"],
            "max_length": max_length,
            "devices": devices,
        },
        "hf": None if checkpoint else str(hf_dir),
        "checkpoint": checkpoint,
        "step": step,
    }
    write_json(out, record)
    return record


# `gptflow harness` options from the config's eval.harness, one per param of the harness rule
# (argv words)


def task_args(harness_cfg: dict) -> list[str]:
    return [w for t in harness_cfg["tasks"] for w in ("--task", t)]


def include_args(harness_cfg: dict) -> list[str]:
    return [w for d in harness_cfg["include"] for w in ("--include", d)]


def limit_args(harness_cfg: dict) -> list[str]:
    return [] if harness_cfg["limit"] is None else ["--limit", str(harness_cfg["limit"])]
