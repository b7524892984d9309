"""Before any job: the config loaded and validated, its datasets resolved, the plan checked
against the profile (the preflight), and the functions of the Snakefile's onstart, onsuccess
and onerror. A mistake found here stops the workflow while it is planned. The imports here
serve every rule file (Snakemake gives the included files one namespace)."""

import dataclasses
import functools
import json
import os
import re
from pathlib import Path

from snakemake.exceptions import IncompleteCheckpointException, WorkflowError
from snakemake.logging import logger

from gptflow import paths
from gptflow.config.schema import load_yaml
from gptflow.config.settings import TrainConfig
from gptflow.container.image import (
    build_arg_args,
    build_option_args,
    check_planned as check_container,
    recipe_hash,
    registry_login_args,
    squash_options_arg,
)
from gptflow.data import hf as hf_datasets, sources
from gptflow.data.quality import recipe as quality_recipe, selection as quality_selection
from gptflow.data.quality import sizing as quality_sizing
from gptflow.data.readers import FORMATS as READER_FORMATS
from gptflow.environment import put_interpreter_bin_first
from gptflow.errors import GptflowError
from gptflow.hardware import gpu_memory_mib, visible_gpus
from gptflow.plan import gpu_memory, placement, preflight, run_size, submission, why
from gptflow.plan.workflow_config import load_workflow_config, run_configs
from gptflow.results import harness
from gptflow.results.evaluate import extra_args, extra_files, prompt_args
from gptflow.results.evaluate import export_resources as run_export_resources
from gptflow.results.evaluate import harness_resources as run_harness_resources
from gptflow.results.evaluate import run_resources as run_eval_resources
from gptflow.train import init_from
from gptflow.train.distributed import rank_options, train_launcher
from gptflow.train.run_config import data_index_name, data_index_settings


REPO = Path(workflow.basedir)
SCHEMA = REPO / "config" / "schema" / "config.schema.yaml"
CATALOG = REPO / "config" / "datasets.yaml"
put_interpreter_bin_first()  # jobs run the `gptflow` installed beside this Snakemake
CONFIG_SOURCE = " + ".join(str(p) for p in workflow.configfiles) or "--config"

try:
    CFG = load_workflow_config(
        config,
        schema_path=SCHEMA,
        models_dir=REPO / "config" / "models",
        source=CONFIG_SOURCE,
        config_files=[str(p) for p in workflow.configfiles],
    )
except GptflowError as e:
    raise WorkflowError(f"gptflow config: {e}") from None


# `gptflow why`: its dry run asks for the config this plan uses (gptflow.plan.why.DUMP_ENV)
why.dump_config(CFG)

# Every run: one for a config without a study, the study's runs otherwise (each a config of
# its own: its name, model and train; the rest shared). STUDY names the study, else None.
RUNS = run_configs(CFG)
STUDY = CFG["run"] if CFG.get("study") is not None else None
STUDY_PAGE = f"{paths.STUDY_DIR}/study.html"
TOKENIZER = CFG["tokenizer"]["name"]
TOKENIZER_SOURCE = CFG["tokenizer"]["source"]
BLENDED = [item["dataset"] for item in CFG["data"]["blend"]]
DOCUMENTS_PER_SHARD = CFG["tokenize"]["documents_per_shard"]
CONTAINER = CFG["container"]
HARNESS = CFG["eval"]["harness"]  # lm-evaluation-harness on each run's export (rule harness)


def harness_steps():
    """Each run's checkpoints that eval.harness.every evaluates (each kept by its training)."""
    if not HARNESS["tasks"]:
        return dict.fromkeys(RUNS, [])
    try:
        return {
            name: harness.check_steps(
                TrainConfig(**run["train"]), HARNESS["every"], name, CONFIG_SOURCE
            )
            for name, run in RUNS.items()
        }
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {e}") from None


HARNESS_STEPS = harness_steps()


@functools.cache
def harness_work():
    """eval.harness's tasks' work, counted from the task files once
    (gptflow.results.harness.task_work): the harness jobs' size, printed at -n."""
    try:
        return harness.task_work(HARNESS)
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {CONFIG_SOURCE}: {e}") from None


def get_run_settings(wildcards):
    """What run.yaml is rendered from: a change here re-renders it (and so reruns training)."""
    run = RUNS[wildcards.run]
    return {
        "run": run["run"],
        **({"study": STUDY} if STUDY else {}),
        "tokenizer": {"eod_token": CFG["tokenizer"]["eod_token"]},
        "data": run["data"],  # a data ablation's run: its own data.quality
        "model": run["model"],
        "train": run["train"],
    }


def get_train_settings(wildcards):
    """Model and optimisation settings: Snakemake reruns training when one changes."""
    run = RUNS[wildcards.run]
    return {"model": run["model"], "train": run["train"], "data": run["data"]}


APPEND_EOD = ["--append-eod"] if CFG["tokenize"]["append_eod"] else []

# Datasets are resolved once, here (catalog, globs, URL templates), so that a glob matching
# nothing or an unknown catalog entry stops the workflow before any job.
try:
    DATASETS = sources.resolve_datasets(
        CFG,
        sources.needed_datasets(CFG),
        catalog_path=CATALOG,
        schema=load_yaml(SCHEMA),
        source=CONFIG_SOURCE,
    )
except GptflowError as e:
    raise WorkflowError(f"gptflow config: {e}") from None

# Datasets whose shards are imported (type megatron: import_megatron_shard) and those whose
# shards are tokenized here; each of the two rules writing shards takes only its own. Local
# files, one document per file, are collected into JSONL first (collect_local_documents), and
# so are the row ranges of Hugging Face datasets (collect_hf_documents).
IMPORTED = [name for name, d in DATASETS.items() if d.kind == "megatron"]
TOKENIZED = [name for name in DATASETS if name not in IMPORTED]
COLLECTED = [name for name, d in DATASETS.items() if d.kind == "collect"]
HF_COLLECTED = [name for name, d in DATASETS.items() if d.kind == "hf"]
# data.quality (gptflow.data.quality.recipe): each blended dataset's cleaning steps ({} when
# off); a dataset with steps is tokenized from its last step's documents (shard_of). A data
# ablation: a study run's own data.quality (RUN_QUALITY; the base's otherwise) cleans into its
# own steps and shards (RUN_VARIANTS: each dataset's last step, or raw); equal recipes share
# them. Every run's held-out text is the base's shards (gptflow.data.dataset).
try:
    QUALITY = quality_recipe.recipes(CFG, BLENDED, CONFIG_SOURCE, imported=IMPORTED)
    RUN_QUALITY = {
        name: (
            QUALITY
            if run["data"] is CFG["data"]
            else quality_recipe.recipes(
                run, BLENDED, f"{CONFIG_SOURCE} (study run '{name}')", imported=IMPORTED
            )
        )
        for name, run in RUNS.items()
    }
    quality_recipe.check_groups({"the base config": QUALITY, **RUN_QUALITY}, BLENDED, CONFIG_SOURCE)
except GptflowError as e:
    raise WorkflowError(f"gptflow config: {e}") from None
BASE_VARIANTS = quality_recipe.variants(QUALITY, BLENDED)
RUN_VARIANTS = {name: quality_recipe.variants(r, BLENDED) for name, r in RUN_QUALITY.items()}
QUALITY_STEP = {
    (name, step.name): step
    for recipe in (QUALITY, *RUN_QUALITY.values())
    for name, steps in recipe.items()
    for step in steps
}
QUALITY_KEY = {(name, step.key): step for (name, _), step in QUALITY_STEP.items()}
# a filters step's signals (of every recipe: a data ablation's runs' too, as QUALITY_STEP),
# shared by the recipes that differ only in thresholds
SIGNALS_STEP = {
    (name, step.signals_name): step
    for (name, _), step in QUALITY_STEP.items()
    if step.kind == "filters"
}
# a language step's scores (of every recipe, as the signals), shared by the recipes that
# differ only in languages or threshold
SCORES_STEP = {
    (name, step.scores_name): step
    for (name, _), step in QUALITY_STEP.items()
    if step.kind == "language"
}
# every recipe's rules and languages as the filters module takes them, at -n: each recipe's
# own (recipes differing only in thresholds share one SIGNALS_STEP entry), named by its config
try:
    for run, recipe in (("", QUALITY), *RUN_QUALITY.items()):
        source = CONFIG_SOURCE
        if recipe is not QUALITY:
            source = f"{CONFIG_SOURCE} (study run '{run}')"
        for step in (step for steps in recipe.values() for step in steps):
            if step.kind == "filters":
                quality_selection.check_rules(step.settings["rules"], step.where, source)
            elif step.kind == "language":
                quality_selection.check_language(step.settings, step.where, source)
except GptflowError as e:
    raise WorkflowError(f"gptflow config: {e}") from None
# The data index each run reads (gptflow.paths.DATA_INDEX): runs reading the same samples of
# the same shards share one, built once; a run of a data ablation trains on its recipe's shards
INDEX_SETTINGS = {
    name: data_index_settings(run, RUN_VARIANTS[name], BASE_VARIANTS) for name, run in RUNS.items()
}
INDEX_OF = {name: data_index_name(settings) for name, settings in INDEX_SETTINGS.items()}
INDEXES = {INDEX_OF[name]: settings for name, settings in INDEX_SETTINGS.items()}
INDEX_RUN = {index: name for name, index in reversed(INDEX_OF.items())}  # a run reading it
# Where each blended dataset comes from, for the data card
REPORT_DATASETS = {name: CFG["datasets"][name] for name in BLENDED}


def dataset_choice(names):
    """A {dataset} (or {shard}, {run}, {index}) constraint matching exactly `names` ('-'
    matches no name): gptflow.paths.choice_pattern, a study's run names' prefixes once."""
    return paths.choice_pattern(names) or "-"


def imported_shard_choice():
    """The {shard} constraint of import_megatron_shard: the megatron shards' names."""
    return dataset_choice(sorted({s.name for name in IMPORTED for s in DATASETS[name].shards}))


wildcard_constraints:
    dataset=dataset_choice(DATASETS),
    shard=r"\d{5}",
    part=r"\d{4}",
    run=dataset_choice(RUNS),
    index=dataset_choice(INDEXES),
    study=re.escape(STUDY or "-"),
    tokenizer=re.escape(TOKENIZER),
    file=sources.STORED_NAME.pattern + r"(?<!\.sha256)(?<!\.part)(?<!\.lock)",
    hash=r"[0-9a-f]{12}",
    format="sqsh|sif",
    step=quality_recipe.STEP_NAME,
    signals=quality_recipe.SIGNALS_NAME,
    scores=quality_recipe.SCORES_NAME,
    group=dataset_choice([quality_recipe.BLEND_GROUP, *BLENDED]),
    band=r"\d{3}",


# model.init_from's tokenizer against the run's at -n, when the run's exists already
# (tokenizer.path, or made by an earlier run); render_run_config checks it in any case
try:
    for run_cfg in RUNS.values():
        init_from.check_planned_tokenizer(run_cfg, paths.tokenizer_json(TOKENIZER))
except GptflowError as e:
    raise WorkflowError(f"gptflow config ({CONFIG_SOURCE}): {e}") from None


def container_dockerfile():
    path = Path(CONTAINER["dockerfile"])
    return path if path.is_absolute() else REPO / path


@functools.cache
def container_hash():
    """The recipe hash that names the image (read from the files, a few ms); computed only
    when a job needs the image, so a workflow without the container never reads the recipe."""
    try:
        return recipe_hash(
            REPO, container_dockerfile(), CONTAINER["base_image"], CONTAINER["build_args"]
        )
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: container: {e}") from None


@functools.cache
def tokenizer_remote(key):
    """tokenizer.url / .vocab / .merges to download (gptflow.data.sources.RemoteFile)."""
    try:
        return sources.tokenizer_remote_file(key, CFG["tokenizer"][key], CONFIG_SOURCE)
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {e}") from None


def tokenizer_asset(key):
    """Where tokenizer file `key` comes from: downloaded into resources/, or a path on disk."""
    if not CFG["tokenizer"][key].get("url"):
        return CFG["tokenizer"][key]["path"]
    name = tokenizer_remote(key).name
    return paths.TOKENIZER_FILE.format(tokenizer=TOKENIZER, key=key, file=name)


# --------------------------------------------------------------------------- the profile


def profile_value(rule, name):
    """A resource the profile gives `rule` (set-resources, else default-resources) as the
    plugin will read it; None when unset or a function of the job (known when it runs)."""
    settings = workflow.resource_settings
    resource = (settings.overwrite_resources.get(rule) or {}).get(name)
    if resource is not None:
        try:
            return resource.evaluate(
                wildcards=None, input=None, attempt=1, threads=1, rulename=rule, async_run=None
            ).value
        except Exception:  # an expression of the job's wildcards or inputs
            return None
    for arg in getattr(settings.default_resources, "args", None) or []:
        key, _, value = arg.partition("=")
        if key == name:
            value = value.strip("'\"")
            return int(value) if value.isdigit() else value
    return None


def profile_placement():
    """Where the profile puts train_gpt (gptflow.plan.placement.Placement)."""
    threads = (workflow.resource_settings.overwrite_threads or {}).get("train_gpt")

    def number(name):
        value = profile_value("train_gpt", name)
        return value if isinstance(value, int) else None

    settings = [
        ("default-resources slurm_account", profile_value("all", "slurm_account")),
        ("default-resources slurm_partition", profile_value("all", "slurm_partition")),
        ("set-resources train_gpt slurm_partition", profile_value("train_gpt", "slurm_partition")),
        ("set-resources evaluate slurm_partition", profile_value("evaluate", "slurm_partition")),
        # profiles/pbs: its defaults, and the queue and resource line of the GPU rules
        *(
            (f"default-resources {name}", profile_value("all", name))
            for name in ("pbs_account", "pbs_queue", "pbs_select", "pbs_filesystems")
        ),
        *(
            (f"set-resources {rule} {name}", profile_value(rule, name))
            for rule in ("train_gpt", "evaluate")
            for name in ("pbs_queue", "pbs_select")
            if name in (workflow.resource_settings.overwrite_resources.get(rule) or {})
        ),
    ]
    # profiles/pbs: a PBS queue given to training or to every job (a placeholder too)
    pbs = "pbs_queue" in (workflow.resource_settings.overwrite_resources.get("train_gpt") or {})
    pbs = pbs or profile_value("all", "pbs_queue") is not None
    executor = (
        "slurm" if profile_value("train_gpt", "slurm_partition") else "pbs" if pbs else "local"
    )
    mpi = str(profile_value("train_gpt", "mpi") or "")
    # GPUs counted, and their memory read, only where train_gpt runs here without srun
    # (nvidia-smi, not torch); the profile's gpu_mem_mb, where given, over nvidia-smi's
    gpus, gpus_source = visible_gpus() if executor == "local" and not mpi else (None, "")
    gpu_mem_mb, gpu_mem_source = number("gpu_mem_mb"), ""
    if gpus and gpu_mem_mb is None:
        gpu_mem_mb, how = gpu_memory_mib()
        gpu_mem_source = how if gpu_mem_mb else f"assumed: 80 GB GPUs ({how})"
    return placement.Placement(
        executor=executor,
        nodes=number("nodes"),
        tasks_per_node=number("tasks_per_node"),
        tasks=number("tasks"),
        gres=profile_value("train_gpt", "gres"),
        threads=threads.value if threads is not None else None,
        cpus_per_task=number("cpus_per_task"),
        mem_mb=number("mem_mb"),
        partition=profile_value("train_gpt", "slurm_partition"),
        mpi=mpi,
        gpu_mem_mb=gpu_mem_mb,
        gpu_mem_source=gpu_mem_source,
        nproc_per_node=profile_value("train_gpt", "nproc_per_node"),
        gpus=gpus,
        gpus_source=gpus_source,
        settings=tuple((k, str(v)) for k, v in settings if v is not None),
    )


# The preflight, in the main process only (a job's own Snakemake parses this file too): what
# would fail on the cluster is refused here, before any job waits in the queue.
PLACEMENT = profile_placement()
# The GPU jobs on this machine (train_gpt, evaluate, harness, harness_step) each place their
# work from cuda:0 on, sized as if alone on the GPUs: each takes a `gpu` resource of every GPU
# shown here, and the plan offers that many, so they run one at a time (a study's runs
# finishing together too). `--resources gpu=N` given by the user stays. Not on a cluster
# (its scheduler gives each job its own GPUs), nor without a GPU (nothing changes).
LOCAL_GPUS = PLACEMENT.gpus if PLACEMENT.executor == "local" and not PLACEMENT.mpi else 0
if LOCAL_GPUS and "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", LOCAL_GPUS)
if workflow.is_main_process:
    # a study: every run's layout and memory checked, the largest run's preflight in full
    LARGEST = max(RUNS, key=lambda name: run_size.model_config(RUNS[name], 0).num_parameters())
    try:
        PREFLIGHT = preflight.run(
            RUNS[LARGEST],
            PLACEMENT,
            tokenizer_json=Path(paths.tokenizer_json(TOKENIZER)),
            datasets=DATASETS,
            tokenizer=TOKENIZER,
            runtimes={
                "default-resources runtime": profile_value("all", "runtime"),
                "set-resources train_gpt runtime": profile_value("train_gpt", "runtime"),
            },
            config_threads=dict.fromkeys(
                ("tokenize_shard", "tokenize_part"), CFG["tokenize"]["workers"]
            ),
            profile_threads={
                name: threads.value
                for name, threads in (workflow.resource_settings.overwrite_threads or {}).items()
            },
            label=f" (largest run: {LARGEST})" if STUDY else "",
            harness_work=harness_work() if HARNESS["tasks"] else None,
        )
        if STUDY:
            PREFLIGHT.lines += preflight.study(
                RUNS,
                PLACEMENT,
                tokenizer_json=Path(paths.tokenizer_json(TOKENIZER)),
                indexes=len(INDEXES),
                trained={name for name in RUNS if Path(paths.DONE.format(run=name)).is_file()},
            )
    except GptflowError as e:
        raise WorkflowError(f"gptflow preflight ({CONFIG_SOURCE} and the profile): {e}") from None
    for line in PREFLIGHT.lines:
        logger.info(line)
    why.dump_preflight(PREFLIGHT)
    # The container section (when training runs in the image) and eval.extra's files, found
    # here, not in a job's input function (a Snakemake traceback) or as a missing input.
    # (The targets, e.g. `snakemake container`, are not known while this file is parsed.)
    if CONTAINER["enabled"]:
        try:
            check_container(CONTAINER, container_dockerfile(), srun=bool(PLACEMENT.mpi))
        except GptflowError as e:
            raise WorkflowError(f"gptflow config: {CONFIG_SOURCE}: {e}") from None
        container_hash()  # the rest of the recipe, read once: the image's name
    try:
        sources.check_eval_extra(
            CFG["eval"]["extra"], DATASETS, TOKENIZER, bool(DOCUMENTS_PER_SHARD), CONFIG_SOURCE
        )
        harness.check_planned(HARNESS, CONFIG_SOURCE)
        for name, run in RUNS.items() if HARNESS["tasks"] else ():
            seq_length = TrainConfig(**run["train"]).seq_length  # the harness's context
            harness.check_context(harness_work(), seq_length, name, CONFIG_SOURCE)
        for warning in hf_datasets.check_planned(DATASETS, CONFIG_SOURCE):
            logger.warning(f"gptflow: WARNING: {warning}")
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {e}") from None


# --------------------------------------------------------------------------- the hooks


def refuse_placeholders():
    """Snakefile onstart (a real run, never -n): an unedited profile is not submitted."""
    found = placement.placeholders(PLACEMENT)
    cluster = ("slurm", "cluster-generic")  # profiles/slurm, profiles/pbs
    if found and workflow.executor_plugin and workflow.executor_plugin.name in cluster:
        raise WorkflowError(
            "gptflow: not submitted: "
            + placement.placeholder_message(found, PLACEMENT.executor, "the profile")
        )


def record_config():
    """Snakefile onsuccess: the config `gptflow why` compares the next plan against."""
    why.record_config(CFG)


def record_refused_submissions(log):
    """Snakefile onerror: a job Slurm never ran gets the refusal in the log it points at."""
    for path in [log] if isinstance(log, str) else log or []:
        submission.record_refusals(path)
