"""The plan's side of Kubernetes: where profiles/kubernetes puts ``train_gpt``
(:func:`placement`: the config's ``kubernetes`` nodes and GPUs as the preflight's placement), and
each run's :class:`~gptflow.kubernetes.spec.PodSet` (:func:`pod_set`; the one-pod jobs after
training: :func:`job_pod_set`), its memory sized by the
same host-memory figures the preflight checks (gptflow.plan.host_memory) and its CPUs by the
profile's set-threads, as srun's --cpus-per-task is on Slurm.
"""

from __future__ import annotations

import dataclasses
import math

from gptflow import paths
from gptflow.hardware import background_saves
from gptflow.kubernetes.spec import PodSet, jobset_name
from gptflow.plan.host_memory import snapshot_fit
from gptflow.plan.placement import Placement
from gptflow.plan.runs import RunPlan

LAUNCHER = "kubernetes"  # profiles/kubernetes: set-resources train_gpt mpi
# The driver's share of a job submitted as a JobSet (the submitter's process): its pod's memory
# and GPUs are the JobSet's, not reserved in the driver's Snakemake.
SUBMITTER_MEM_MB = 1024


def on_kubernetes(p: Placement) -> bool:
    """Whether the profile sends train_gpt to Kubernetes (its ``mpi`` is ``kubernetes``)."""
    return p.mpi == LAUNCHER


def placement(p: Placement, section: dict) -> Placement:
    """`p` (as the profile resolved it) with the JobSet's nodes and ranks: ``nodes`` pods of
    ``gpus_per_node`` ranks (one CPU rank a pod without GPUs), one GPU's memory for the fit
    check, the pod memory the config gives (else none: sized by :func:`pod_memory_mb`)."""
    gpus = section["gpus_per_node"]
    return dataclasses.replace(
        p,
        executor=LAUNCHER,
        nodes=section["nodes"],
        tasks_per_node=max(1, gpus),
        tasks=None,
        gres=f"gpu:{gpus}" if gpus else None,
        gpu_mem_mb=section["gpu_memory_mb"] if gpus else None,
        gpu_mem_source="kubernetes.gpu_memory_mb" if gpus else "",
        mem_mb=section["memory_mb"] or None,
        partition=None,
        threads=section["cpus_per_rank"],
        cpus_per_task=None,
    )


def pod_memory_mb(run: RunPlan, p: Placement, shm_mb: int) -> int:
    """A training pod's memory, MiB: the host memory of its node's ranks as the preflight counts
    it (each rank's process, the training state kept in host memory, and with background saves
    the snapshots and a pipeline's layer copies), plus /dev/shm, whose pages the pod's memory
    cgroup is charged for; rounded up to a GiB."""
    fit = snapshot_fit(run.model, run.train, p.ranks, p)
    need = fit.process + fit.state
    if background_saves(run.train.async_save, p.trains_on_gpus)[0]:
        need += fit.snapshots + fit.clones
    return math.ceil(need / 2**30) * 1024 + shm_mb


def pod_set(run: RunPlan, p: Placement, section: dict) -> PodSet:
    """Run `run`'s submission under placement `p` (:func:`placement`) and the config's
    `section`: CPUs = cpus_per_rank x ranks of a pod."""
    rdma = dict(section["rdma"])
    return _pod_set(
        section,
        run.name,
        name=jobset_name(run.name, section["namespace"], section["mount_path"]),
        nodes=section["nodes"],
        gpus_per_node=section["gpus_per_node"],
        cpus=section["cpus_per_rank"] * max(1, section["gpus_per_node"]),
        memory_mb=section["memory_mb"] or pod_memory_mb(run, p, section["shm_mb"]),
        done=paths.DONE.format(run=run.name),
        manifests_dir=f"{paths.RUN_DIR.format(run=run.name)}/kubernetes",
        rdma=rdma if rdma["enabled"] else {},
    )


def job_gpus(section: dict) -> int:
    """A one-pod job's GPUs (evaluate, harness, harness_step): one when the section's nodes
    have GPUs (these jobs use one, as on Slurm), else none (a CPU pod)."""
    return 1 if section["gpus_per_node"] else 0


def job_pod_set(section: dict, run: str, job: str, done: str, memory_mb: int) -> PodSet:
    """Job `job` of run `run` after training (``evaluate``, ``harness``, ``harness-step-N``)
    as its own JobSet of one pod: :func:`job_gpus` GPUs, cpus_per_rank CPUs, `memory_mb` (the
    rule's host memory, as it asks of Slurm) plus /dev/shm, no RDMA (nothing leaves the pod);
    success is `done` (the rule's output) written. Its name is its own per run and job, its
    manifests in the run's kubernetes/`job`/."""
    return _pod_set(
        section,
        run,
        name=jobset_name(run, section["namespace"], section["mount_path"], job),
        nodes=1,
        gpus_per_node=job_gpus(section),
        cpus=section["cpus_per_rank"],
        memory_mb=memory_mb + section["shm_mb"],
        done=done,
        manifests_dir=f"{paths.RUN_DIR.format(run=run)}/kubernetes/{job}",
        rdma={},
    )


def _pod_set(section: dict, run: str, **counts) -> PodSet:
    """A PodSet of the config's `section` (image, claim, scheduling, restarts) with `counts`
    (name, pods, GPUs, CPUs, memory, done, manifests_dir, rdma) of the submission."""
    return PodSet(
        run=run,
        namespace=section["namespace"],
        image=section["image"],
        image_pull_secret=section["image_pull_secret"],
        volume_claim=section["volume_claim"],
        mount_path=section["mount_path"],
        gpu_resource=section["gpu_resource"],
        shm_mb=section["shm_mb"],
        env=dict(section["env"]),
        node_selector=dict(section["node_selector"]),
        tolerations=[dict(t) for t in section["tolerations"]],
        queue=section["queue"],
        priority_class=section["priority_class"],
        max_restarts=section["max_restarts"],
        grace_seconds=section["termination_grace_seconds"],
        **counts,
    )


def plan_pod_set(plan, run: str) -> PodSet:
    """Run `run`'s submission as the plan (gptflow.plan.build.Plan) has it."""
    return pod_set(plan.every_run[run], plan.placement, plan.config["kubernetes"])


def rank_options(p: Placement) -> list[str]:
    """Argv words after ``gptflow train --config RUN.yaml`` in each pod: its ranks, the node
    count (the ranks meet at node 0: gptflow.train.pods), its threads per rank."""
    return ["--nproc-per-node", str(p.tasks_per_node), "--nnodes", str(p.nodes),
            "--threads", str(p.threads)]  # fmt: skip


def submit_launcher(p: PodSet) -> list[str]:
    """Argv words before ``gptflow train`` in the train_gpt rule (and ``gptflow evaluate`` /
    ``harness`` in those rules, :func:`job_pod_set`): the submitter, which runs the command
    after ``--`` in every pod of the JobSet of `p` and watches it to the end."""
    return ["gptflow", "kubernetes", "submit", "--spec", p.to_json(), "--"]
