"""What ``gptflow kubernetes render`` and ``driver`` print, from the workflow's config files:

- :func:`run_objects`: each run's manifests (the JobSet gptflow would submit, or every
  renderer's), from the same config files as the workflow (merged over config/config.yaml as
  Snakemake merges them), with no cluster: for review and for checks.
- :func:`driver_objects`: the driver's ServiceAccount, Role, RoleBinding and Job
  (``snakemake --profile profiles/kubernetes TARGET`` on the claim).

The flags are gptflow.cli.kubernetes's; the submitter (what the train_gpt rule runs) is
gptflow.kubernetes.submit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from gptflow import paths
from gptflow.errors import GptflowError
from gptflow.kubernetes import manifests, sizing
from gptflow.kubernetes.spec import PodSet, check_ready, jobset_name
from gptflow.plan.profile import Profile

WORKFLOW_CONFIG = "config/config.yaml"  # the Snakefile's configfile


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


def plan_of(repo: Path, files: list[str], replace: bool):
    """The workflow's plan under profiles/kubernetes (its train_gpt launcher), without Snakemake."""
    from gptflow.plan.build import build_plan

    config = merged_config(repo, files, replace)
    profile = Profile(resources={"train_gpt": {"mpi": sizing.LAUNCHER}})
    return build_plan(config, repo=repo, profile=profile, config_files=files,
                      main_process=False)  # fmt: skip


def pod_command(plan, run: str) -> list[str]:
    """What each pod runs: the train_gpt rule's command after its launcher (rules/train.smk)."""
    return ["gptflow", "train", "--config", paths.RUN_YAML.format(run=run),
            *sizing.rank_options(plan.placement), "--wait-for-lock"]  # fmt: skip


def run_objects(
    repo: Path, files: list[str], *, replace: bool, runs: list[str] | None, kind: str
) -> list[dict]:
    """Each run's manifests (`kind`: a renderer of manifests.RENDERERS, or "all")."""
    plan = plan_of(repo, files, replace)
    check_ready(plan.config["kubernetes"])
    runs = runs or list(plan.runs)
    unknown = [r for r in runs if r not in plan.runs]
    if unknown:
        raise GptflowError(f"--run {unknown[0]}: not a run of the config ({', '.join(plan.runs)})")
    kinds = list(manifests.RENDERERS) if kind == "all" else [kind]
    objects = []
    for run in runs:
        p = sizing.plan_pod_set(plan, run)
        objects += [manifests.RENDERERS[k](p, pod_command(plan, run)) for k in kinds]
    return objects


def driver_objects(
    repo: Path, files: list[str], *, replace: bool, target: str
) -> tuple[str, list[dict]]:
    """The driver's namespace and objects: ServiceAccount, Role, RoleBinding, Job."""
    from gptflow.plan.workflow_config import load_workflow_config

    absolute = [f for f in files if Path(f).is_absolute()]
    if absolute:
        raise GptflowError(
            f"--configfile {absolute[0]}: give the config files relative to the working "
            "directory (the driver reads them from the volume claim, at kubernetes.mount_path)"
        )
    cfg = load_workflow_config(
        merged_config(repo, files, replace),
        schema_path=repo / "config" / "schema" / "config.schema.yaml",
        models_dir=repo / "config" / "models", source=" + ".join(files),
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
    objects = manifests.driver(p, files, target, k["driver"]["cpus"], k["driver"]["memory_mb"],
                               k["service_account"], replace=replace)  # fmt: skip
    return p.namespace, objects


def apply(namespace: str, objects: list[dict]) -> list[str]:
    """Create `objects` in the cluster of the kubeconfig (or the pod's service account)."""
    from kubernetes import utils

    from gptflow.kubernetes.submit import load_client

    api = load_client().ApiClient()
    done = []
    for obj in objects:
        utils.create_from_dict(api, obj, namespace=namespace)
        done.append(f"created {obj['kind']} {namespace}/{obj['metadata']['name']}")
    return done
