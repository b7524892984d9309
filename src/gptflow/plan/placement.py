"""Where ``train_gpt`` runs, as the profile resolves it (:class:`Placement`), and the checks of
how it is launched: the layout against the ranks the profile gives it (tensor x pipeline
parallel divides them, and the global batch is micro-batches over the data-parallel ranks); one
rank per GPU and task counts the Slurm plugin accepts; the profile's placeholders (account,
partitions), named first at ``-n`` and refused by a real submission.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gptflow.config.settings import TrainConfig
from gptflow.errors import GptflowError
from gptflow.train.distributed import launched_ranks, local_ranks

PLACEHOLDER = re.compile(r"\A<[^<>]*>\Z")  # how the shipped profile marks what to fill in


@dataclass(frozen=True)
class Placement:
    """Where ``train_gpt`` runs, as the profile (and Snakemake's defaults) resolve it."""

    executor: str = "local"  # "slurm" under profiles/slurm, "pbs" under profiles/pbs
    nodes: int | None = None
    tasks_per_node: int | None = None
    tasks: int | None = None
    gres: str | None = None  # per node, e.g. "gpu:8" or "gpu:a100:8"
    threads: int | None = None  # set-threads train_gpt: CPU threads per rank
    cpus_per_task: int | None = None  # set only to override threads
    mem_mb: int | None = None  # per node
    partition: str | None = None
    mpi: str = ""
    gpu_mem_mb: int | None = None  # memory of one GPU, for the fit check
    gpu_mem_source: str = ""  # where gpu_mem_mb comes from, when not the profile (nvidia-smi)
    # one machine without mpi: the ranks to start (as the profile gives it, any type), and the
    # GPUs this machine shows (gptflow.hardware.visible_gpus) and how they were counted
    nproc_per_node: object = None
    gpus: int | None = None
    gpus_source: str = ""
    # every profile value that may be a placeholder: (where, value)
    settings: tuple[tuple[str, str], ...] = field(default=())

    @property
    def on_cluster(self) -> bool:
        """Jobs go to a batch system's GPU nodes (Slurm or PBS), not this machine."""
        return self.executor in ("slurm", "pbs")

    @property
    def trains_on_gpus(self) -> bool:
        """Training runs on GPUs: a batch system's GPU nodes, a gres, or this machine's GPUs."""
        return self.on_cluster or bool(self.gres) or bool(self.gpus)

    @property
    def ranks(self) -> int:
        """The training ranks: srun's counts under ``mpi``, else those started on one machine
        (nproc_per_node, else one per visible GPU, else one)."""
        if self.mpi:
            return launched_ranks(self.nodes, self.tasks_per_node, self.tasks)
        return local_ranks(self.nproc_per_node, self.gpus or 0)

    @property
    def ranks_per_node(self) -> int:
        """Training ranks on the most loaded node: tasks_per_node under ``mpi``; with ``tasks``
        over ``nodes`` (one GPU on each of several nodes), srun's block distribution puts
        ceil(tasks / nodes) on each of the first nodes; every rank where nothing spreads them
        (one machine, or ``tasks`` without ``nodes``: srun may pack them on one node)."""
        if self.mpi and self.tasks_per_node:
            return self.tasks_per_node
        if self.mpi and self.tasks and self.nodes:
            return -(-self.tasks // self.nodes)
        return self.ranks

    @property
    def gpus_per_node(self) -> int | None:
        """The GPU count of ``gres`` (``gpu:8``, ``gpu:a100:8``; ``gpu`` alone is one)."""
        if not self.gres:
            return None
        for item in self.gres.split(","):
            parts = item.strip().split(":")
            if parts[0] == "gpu":
                return int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        return None

    @property
    def gpu_type(self) -> str | None:
        """The GPU type ``gres`` names (``a100`` of ``gpu:a100:8``), if any."""
        for item in (self.gres or "").split(","):
            parts = item.strip().split(":")
            if parts[0] == "gpu" and len(parts) > 1 and not parts[1].isdigit():
                return parts[1]
        return None

    @property
    def cpus(self) -> int | None:
        """CPUs per training task: cpus_per_task when the profile sets it, else the threads."""
        return self.cpus_per_task or self.threads


def placeholders(placement: Placement) -> list[tuple[str, str]]:
    """The profile values still to fill in: ``<...>`` as the shipped profile has them."""
    return [(where, value) for where, value in placement.settings if PLACEHOLDER.match(value)]


# where a profile's values are found, per executor (Placement.executor)
WHERE_VALUES = {
    "slurm": "`sacctmgr show assoc user=$USER format=account` lists your accounts, `sinfo -s` "
    "the partitions",
    "pbs": "your project is your allocation's, `qstat -Q` lists the queues, `pbsnodes -a` the "
    "nodes' resources for the select line",
}


# Torque has no filesystems resource: the edit the README and the profile's comment give
TORQUE_FILESYSTEMS = (
    "on Torque (no filesystems resource), delete ,filesystems={resources.pbs_filesystems} from "
    "cluster-generic-submit-cmd and the pbs_filesystems line of default-resources"
)


def placeholder_message(
    found: list[tuple[str, str]], executor: str, profile: str | None = None
) -> str:
    """The placeholders `found` in `profile` (default: the executor's shipped profile)."""
    profile = profile or {"pbs": "the PBS profile"}.get(executor, "the Slurm profile")
    items = "; ".join(f"{where} is {value}" for where, value in found)
    hint = WHERE_VALUES.get(executor, WHERE_VALUES["slurm"])
    if any(where == "default-resources pbs_filesystems" for where, _ in found):
        hint += f"; {TORQUE_FILESYSTEMS}"
    return f"edit {profile} first: {items} (your cluster's values: {hint})"


# --------------------------------------------------------------------------- layout and launch


def check_layout(train: TrainConfig, ranks: int) -> int:
    """The layout on `ranks`: tensor x pipeline parallel divides them and the global batch is
    whole micro-batches over the data-parallel ranks. Returns the gradient accumulation."""
    return train.grad_accum_steps(ranks)


def check_elastic(train: TrainConfig, ranks_per_node: int, executor: str = "") -> dict[int, int]:
    """{nodes: gradient accumulation} for every node count train.elastic admits (min_nodes to
    max_nodes, in that order or refused), with
    `ranks_per_node` ranks on each: the global batch is the same on each, or the first count
    it does not split on is refused in one line naming train.elastic. Empty when the run is
    not elastic."""
    elastic = train.elastic
    if elastic is None:
        return {}
    if executor == "kubernetes":
        raise GptflowError(
            "train.elastic is not built for profiles/kubernetes: its JobSet has a fixed number "
            "of pods (docs/kubernetes.md); remove train.elastic, or run on profiles/local, "
            "profiles/slurm or profiles/pbs"
        )
    if elastic.min_nodes > elastic.max_nodes:
        raise GptflowError(
            f"train.elastic.min_nodes {elastic.min_nodes} is above train.elastic.max_nodes "
            f"{elastic.max_nodes}; swap them or lower min_nodes"
        )
    out = {}
    for nodes in range(elastic.min_nodes, elastic.max_nodes + 1):
        try:
            out[nodes] = train.grad_accum_steps(nodes * ranks_per_node)
        except GptflowError as e:
            raise GptflowError(
                f"train.elastic (min_nodes {elastic.min_nodes}, max_nodes {elastic.max_nodes}) "
                f"admits {nodes} node(s) x {ranks_per_node} rank(s), where the global batch "
                f"does not split: {e}; or narrow train.elastic to node counts it splits on"
            ) from None
    return out


def check_launch(p: Placement) -> list[str]:
    """How the profile launches training, refused where the Slurm plugin or srun would refuse
    it after the queue; returns warnings (not errors)."""
    warnings: list[str] = []
    if p.executor != "slurm":
        return check_local_launch(p)
    where = "set-resources train_gpt"
    if p.mpi:
        if p.tasks_per_node and p.tasks:
            raise GptflowError(
                f"{where} sets both tasks_per_node {p.tasks_per_node} and tasks {p.tasks}; the "
                "Slurm plugin takes one of them: keep tasks_per_node (ranks per node)"
            )
        if p.tasks_per_node == 1 or (p.tasks == 1 and not p.tasks_per_node):
            raise GptflowError(
                f"{where}: one training task per job step (tasks_per_node 1 or tasks 1) is "
                "refused by the Slurm plugin for srun jobs ('must be greater than 1'). For one "
                "GPU on each of N nodes set `tasks: N` and `nodes: N` instead of "
                "tasks_per_node; for a single GPU remove `mpi`, `tasks_per_node` and `tasks` "
                "(the trainer then runs as one process in the job)"
            )
    gpus, per_node = p.gpus_per_node, p.ranks_per_node
    if gpus is not None and p.mpi and per_node != gpus:
        raise GptflowError(
            f"{where}: {per_node} training ranks per node but gres {p.gres} ({gpus} GPU(s) per "
            "node); gptflow runs one rank per GPU: set tasks_per_node and the gres count to the "
            "GPUs of a node"
        )
    if p.cpus_per_task and p.threads and p.cpus_per_task != p.threads:
        warnings.append(
            f"{where} cpus_per_task {p.cpus_per_task} differs from set-threads train_gpt "
            f"{p.threads}: each rank gets {p.cpus_per_task} CPUs and runs {p.threads} torch "
            "threads; drop cpus_per_task (it follows set-threads)"
        )
    return warnings


def check_local_launch(p: Placement) -> list[str]:
    """One machine without srun: nproc_per_node is a count of ranks, and no more than the GPUs
    this machine shows when it shows any (one rank per GPU; without a GPU the ranks are CPU
    processes, any number). Returns warnings."""
    if p.mpi:
        return []
    n = p.nproc_per_node
    where = "set-resources train_gpt nproc_per_node"
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise GptflowError(
            f"{where} is {n!r}; expected the number of training ranks to start on this machine "
            "(one per GPU), e.g. --set-resources train_gpt:nproc_per_node=2, or leave it unset "
            "for one rank per visible GPU"
        )
    if p.gpus and p.ranks > p.gpus:
        raise GptflowError(
            f"{where} is {p.ranks}, but this machine shows {p.gpus} GPU(s) ({p.gpus_source}); "
            f"gptflow runs one rank per GPU: set nproc_per_node to at most {p.gpus}, or leave "
            "it unset for one rank per visible GPU"
        )
    return []
