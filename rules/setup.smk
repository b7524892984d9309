"""Before any job: the plan (gptflow.plan.build.build_plan: the config loaded and validated,
its datasets resolved, every run's settings, the preflight against the profile) built once
as PLAN, which every input function reads; the functions of the Snakefile's onstart,
onsuccess and onerror. A mistake found here stops the workflow while it is planned. This file
is Snakemake's adapter: it reads the profile off Snakemake's workflow, turns a refused plan
into one WorkflowError line, and declares what only Snakemake can (the `gpu` resource, the
wildcard constraints). The imports here serve every rule file (Snakemake gives the included
files one namespace)."""

import dataclasses
import functools
import json
import os
import re
from pathlib import Path

from snakemake.exceptions import IncompleteCheckpointException, WorkflowError
from snakemake.logging import logger

from gptflow import paths
from gptflow.container.image import (
    build_arg_args,
    build_option_args,
    registry_login_args,
    squash_options_arg,
)
from gptflow.data import hf as hf_datasets, remote_files, sources
from gptflow.data.quality import recipe as quality_recipe
from gptflow.data.quality import sizing as quality_sizing
from gptflow.data.readers import FORMATS as READER_FORMATS
from gptflow.environment import put_interpreter_bin_first
from gptflow.errors import GptflowError
from gptflow.kubernetes import sizing as kube_sizing
from gptflow.plan import gpu_memory, placement, records, submission
from gptflow.plan.build import PlanError, build_plan
from gptflow.plan.profile import Profile, default_resources
from gptflow.results import harness
from gptflow.results.evaluate import extra_args, extra_files, prompt_args
from gptflow.results.evaluate import export_resources as run_export_resources
from gptflow.results.evaluate import harness_resources as run_harness_resources
from gptflow.results.evaluate import run_resources as run_eval_resources
from gptflow.train import init_from
from gptflow.train.distributed import rank_options, train_launcher
from gptflow.train.trial import trial_command

REPO = Path(workflow.basedir)
put_interpreter_bin_first()  # jobs run the `gptflow` installed beside this Snakemake


def read_profile():
    """The profile's resources and threads as plain values (gptflow.plan.profile.Profile): a
    rule's set-resources evaluated as the executor plugin will (None where it is a function
    of the job, known when it runs), default-resources, set-threads."""
    settings = workflow.resource_settings

    def evaluated(resource, rule_name):
        try:
            return resource.evaluate(
                wildcards=None, input=None, attempt=1, threads=1, rulename=rule_name, async_run=None
            ).value
        except Exception:  # an expression of the job's wildcards or inputs
            return None

    resources = {
        rule_name: {name: evaluated(r, rule_name) for name, r in given.items() if r is not None}
        for rule_name, given in (settings.overwrite_resources or {}).items()
    }
    defaults = default_resources(getattr(settings.default_resources, "args", None) or [])
    threads = {name: t.value for name, t in (settings.overwrite_threads or {}).items()}
    return Profile(resources=resources, defaults=defaults, threads=threads)


def planned(value, *args):
    """`value(*args)` (a part of the plan read when a job needs it), a refusal as one line."""
    try:
        return value(*args)
    except GptflowError as e:
        raise WorkflowError(str(e)) from None


try:
    PLAN = build_plan(
        config,
        repo=REPO,
        profile=read_profile(),
        config_files=[str(p) for p in workflow.configfiles],
        main_process=workflow.is_main_process,
    )
except PlanError as e:
    for line in e.preflight.lines if e.preflight else []:
        logger.info(line)  # what the preflight found before the refusal
    raise WorkflowError(str(e)) from None
if PLAN.preflight is not None:
    for line in PLAN.preflight.lines:
        logger.info(line)
    records.dump_preflight(PLAN.preflight)
    for warning in PLAN.warnings:
        logger.warning(f"gptflow: WARNING: {warning}")
# The GPU jobs on this machine (train_gpt, evaluate, harness, harness_step) each place their
# work from cuda:0 on, sized as if alone on the GPUs: each takes a `gpu` resource of every GPU
# shown here, and the plan offers that many, so they run one at a time (a study's runs
# finishing together too). `--resources gpu=N` given by the user stays. Not on a cluster
# (its scheduler gives each job its own GPUs), nor without a GPU (nothing changes).
if PLAN.local_gpus and "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", PLAN.local_gpus)

STUDY_PAGE = f"{paths.STUDY_DIR}/study.html"
APPEND_EOD = ["--append-eod"] if PLAN.config["tokenize"]["append_eod"] else []


def get_run_settings(wildcards):
    """What run.yaml is rendered from: a change here re-renders it (and so reruns training)."""
    run = PLAN.every_run[wildcards.run].config
    return {
        "run": run["run"],
        **({"study": PLAN.study} if PLAN.study else {}),
        "tokenizer": {"eod_token": PLAN.config["tokenizer"]["eod_token"]},
        "data": run["data"],  # a data ablation's run: its own data.quality
        "model": run["model"],
        "train": run["train"],
    }


def get_train_settings(wildcards):
    """Model and optimisation settings: Snakemake reruns training when one changes."""
    run = PLAN.every_run[wildcards.run].config
    return {"model": run["model"], "train": run["train"], "data": run["data"]}


def harness_work():
    """eval.harness's tasks' work, counted from the task files once (the harness jobs' size)."""
    return planned(lambda: PLAN.harness_work)


def container_dockerfile():
    return PLAN.dockerfile


def container_hash():
    """The recipe hash that names the image, read when a job needs the image."""
    return planned(lambda: PLAN.container_hash)


def tokenizer_remote(key):
    """tokenizer.url / .vocab / .merges to download (gptflow.data.remote_files.RemoteFile)."""
    return planned(PLAN.tokenizer_remote, key)


def tokenizer_asset(key):
    """Where tokenizer file `key` comes from: downloaded into resources/, or a path on disk."""
    if not PLAN.config["tokenizer"][key].get("url"):
        return PLAN.config["tokenizer"][key]["path"]
    name = tokenizer_remote(key).name
    return paths.TOKENIZER_FILE.format(tokenizer=PLAN.tokenizer, key=key, file=name)


def profile_value(rule, name):
    """A resource the profile gives `rule` (set-resources, else default-resources)."""
    return PLAN.profile.value(rule, name)


def dataset_choice(names):
    """A {dataset} (or {shard}, {run}, {index}) constraint matching exactly `names` ('-'
    matches no name): gptflow.paths.choice_pattern, a study's run names' prefixes once."""
    return paths.choice_pattern(names) or "-"


def imported_shard_choice():
    """The {shard} constraint of import_megatron_shard: the megatron shards' names."""
    names = {s.name for name in PLAN.imported for s in PLAN.datasets[name].shards}
    return dataset_choice(sorted(names))


wildcard_constraints:
    dataset=dataset_choice(PLAN.datasets),
    shard=r"\d{5}",
    part=r"\d{4}",
    run=dataset_choice(PLAN.every_run),
    index=dataset_choice(PLAN.indexes),
    study=re.escape(PLAN.study or "-"),
    tokenizer=re.escape(PLAN.tokenizer),
    file=remote_files.STORED_NAME.pattern + r"(?<!\.sha256)(?<!\.part)(?<!\.lock)",
    hash=r"[0-9a-f]{12}",
    format="sqsh|sif",
    step=quality_recipe.STEP_NAME,
    signals=quality_recipe.SIGNALS_NAME,
    scores=quality_recipe.SCORES_NAME,
    group=dataset_choice([quality_recipe.BLEND_GROUP, *PLAN.blended]),
    band=r"\d{3}",


# --------------------------------------------------------------------------- the hooks


def refuse_placeholders():
    """Snakefile onstart (a real run, never -n): an unedited profile is not submitted."""
    found = placement.placeholders(PLAN.placement)
    cluster = ("slurm", "cluster-generic")  # profiles/slurm, profiles/pbs
    if found and workflow.executor_plugin and workflow.executor_plugin.name in cluster:
        raise WorkflowError(
            "gptflow: not submitted: "
            + placement.placeholder_message(found, PLAN.placement.executor, "the profile")
        )


def record_config():
    """Snakefile onsuccess: the config `gptflow why` compares the next plan against."""
    records.record_config(PLAN.config)


def record_refused_submissions(log):
    """Snakefile onerror: a job Slurm never ran gets the refusal in the log it points at."""
    for path in [log] if isinstance(log, str) else log or []:
        submission.record_refusals(path)
