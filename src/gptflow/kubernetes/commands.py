"""``gptflow kubernetes driver | render | submit``: the subcommands of profiles/kubernetes.

- ``render --configfile CONFIG...``: each run's manifests (the JobSet gptflow would submit, or
  every renderer's with ``--kind all``) as multi-document YAML on standard output, from the same
  config files as the workflow (merged over config/config.yaml as Snakemake merges them), with
  no cluster: for review and for checks.
- ``driver --configfile CONFIG... [--target T] [--apply]``: the driver's ServiceAccount, Role,
  RoleBinding and Job (``snakemake --profile profiles/kubernetes T`` on the claim), printed, or
  created in the cluster.
- ``submit --spec JSON -- COMMAND...``: what the train_gpt rule runs (gptflow.kubernetes.submit).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

from gptflow import paths
from gptflow.errors import GptflowError
from gptflow.kubernetes import manifests, sizing
from gptflow.kubernetes.spec import PodSet, check_ready, jobset_name
from gptflow.plan.profile import Profile

KINDS = [*manifests.RENDERERS, "all"]
WORKFLOW_CONFIG = "config/config.yaml"  # the Snakefile's configfile


def add_arguments(s: argparse.ArgumentParser) -> None:
    sub = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    helps = {}
    r = sub.add_parser("render", help="each run's manifests as YAML, without a cluster")
    add_config_arguments(r)
    r.add_argument("--run", action="append", default=None, metavar="RUN",
                   help="only this run (repeatable; default: every run of the config)")  # fmt: skip
    r.add_argument("--kind", choices=KINDS, default="jobset",
                   help="which renderer: the JobSet gptflow submits (default), Kubeflow's "
                   "PyTorchJob (v1) or TrainJob (Trainer v2), T9k's DeepSpeedJob "
                   "(unvalidated), or all")  # fmt: skip
    helps["render"] = r
    d = sub.add_parser("driver", help="the driver Job running Snakemake in the cluster")
    add_config_arguments(d)
    d.add_argument("--target", default="all", help="the Snakemake target (default: all)")
    d.add_argument("--apply", action="store_true",
                   help="create the objects in the cluster (kubeconfig) instead of printing them")  # fmt: skip
    helps["driver"] = d
    m = sub.add_parser("submit", help="(the train_gpt rule's launcher) run COMMAND as a JobSet")
    m.add_argument("--spec", required=True, help="the submission as JSON (the rule's)")
    m.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND: what every pod runs")
    helps["submit"] = m
    # `gptflow kubernetes --help` shows every action's flags
    s.epilog = "\n".join(p.format_usage().strip() for p in helps.values())
    s.formatter_class = argparse.RawDescriptionHelpFormatter


def add_config_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--configfile", nargs="+", required=True, metavar="CONFIG",
                   help="the workflow's config files, as given to snakemake --configfile")  # fmt: skip
    s.add_argument("--replace-workflow-config", action="store_true",
                   help="do not merge them over config/config.yaml (as snakemake's flag)")  # fmt: skip
    s.add_argument("--directory", default=".",
                   help="the workflow directory (the repository; default: here)")  # fmt: skip


def run(a: argparse.Namespace) -> int:
    return {"render": cmd_render, "driver": cmd_driver, "submit": cmd_submit}[a.action](a)


def merged_config(repo: Path, files: list[str], replace: bool) -> dict:
    """The config Snakemake would see: config/config.yaml, then each file merged over it."""
    config: dict = {}
    for path in ([] if replace else [repo / WORKFLOW_CONFIG]) + [Path(f) for f in files]:
        try:
            text = path.read_text()
        except OSError as e:
            raise GptflowError(f"--configfile {path}: {e.strerror}") from None
        merge(config, yaml.safe_load(text) or {})
    return config


def merge(base: dict, over: dict) -> None:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def plan_of(a: argparse.Namespace):
    from gptflow.plan.build import build_plan

    repo = Path(a.directory)
    config = merged_config(repo, a.configfile, a.replace_workflow_config)
    profile = Profile(resources={"train_gpt": {"mpi": sizing.LAUNCHER}})
    return build_plan(config, repo=repo, profile=profile, config_files=a.configfile,
                      main_process=False)  # fmt: skip


def pod_command(plan, run: str) -> list[str]:
    """What each pod runs: the train_gpt rule's command after its launcher (rules/train.smk)."""
    return ["gptflow", "train", "--config", paths.RUN_YAML.format(run=run),
            *sizing.rank_options(plan.placement), "--wait-for-lock"]  # fmt: skip


def cmd_render(a: argparse.Namespace) -> int:
    plan = plan_of(a)
    check_ready(plan.config["kubernetes"])
    runs = a.run or list(plan.runs)
    unknown = [r for r in runs if r not in plan.runs]
    if unknown:
        raise GptflowError(f"--run {unknown[0]}: not a run of the config ({', '.join(plan.runs)})")
    kinds = list(manifests.RENDERERS) if a.kind == "all" else [a.kind]
    objects = []
    for run in runs:
        p = sizing.plan_pod_set(plan, run)
        objects += [manifests.RENDERERS[k](p, pod_command(plan, run)) for k in kinds]
    sys.stdout.write(manifests.dump_all(objects))
    return 0


def cmd_driver(a: argparse.Namespace) -> int:
    from gptflow.plan.workflow_config import load_workflow_config

    repo = Path(a.directory)
    absolute = [f for f in a.configfile if Path(f).is_absolute()]
    if absolute:
        raise GptflowError(
            f"--configfile {absolute[0]}: give the config files relative to the working "
            "directory (the driver reads them from the volume claim, at kubernetes.mount_path)"
        )
    cfg = load_workflow_config(
        merged_config(repo, a.configfile, a.replace_workflow_config),
        schema_path=repo / "config" / "schema" / "config.schema.yaml",
        models_dir=repo / "config" / "models", source=" + ".join(a.configfile),
    )  # fmt: skip
    k = cfg["kubernetes"]
    check_ready(k)
    p = PodSet(
        name=jobset_name(cfg["run"], k["namespace"], k["mount_path"]), run=cfg["run"],
        namespace=k["namespace"], image=k["image"], volume_claim=k["volume_claim"],
        mount_path=k["mount_path"], nodes=1, gpus_per_node=0, cpus=k["driver"]["cpus"],
        memory_mb=k["driver"]["memory_mb"], shm_mb=64, done="", manifests_dir="",
        image_pull_secret=k["image_pull_secret"], grace_seconds=k["termination_grace_seconds"],
    )  # fmt: skip
    objects = manifests.driver(p, a.configfile, a.target, k["driver"]["cpus"],
                               k["driver"]["memory_mb"], k["service_account"],
                               replace=a.replace_workflow_config)  # fmt: skip
    if not a.apply:
        sys.stdout.write(manifests.dump_all(objects))
        return 0
    from kubernetes import utils

    from gptflow.kubernetes.submit import load_client

    client = load_client()
    api = client.ApiClient()
    for obj in objects:
        utils.create_from_dict(api, obj, namespace=p.namespace)
        print(f"created {obj['kind']} {p.namespace}/{obj['metadata']['name']}")
    return 0


def cmd_submit(a: argparse.Namespace) -> int:
    from gptflow.kubernetes.submit import submit

    p = PodSet.from_json(a.spec)
    check_ready({"image": p.image, "volume_claim": p.volume_claim})
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    return submit(p, command)
