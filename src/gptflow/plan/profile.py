"""The profile as planning reads it (:class:`Profile`): the resources and threads Snakemake's
profile and command line give each rule, as plain values, so that where ``train_gpt`` runs
(:func:`placement`) is decided here, in the package, and tested without Snakemake.
rules/setup.smk reads them off Snakemake's workflow (its one adapter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gptflow.plan.placement import Placement


@dataclass(frozen=True)
class Profile:
    """`resources`: each rule's set-resources, by name (None: a function of the job, known
    when it runs); `defaults`: default-resources; `threads`: set-threads per rule."""

    resources: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    defaults: Mapping[str, object] = field(default_factory=dict)
    threads: Mapping[str, int] = field(default_factory=dict)

    def value(self, rule: str, name: str) -> object:
        """A resource `rule` gets, as the executor plugin reads it: its set-resources (None
        where a function of the job), else default-resources; None when unset."""
        given = self.resources.get(rule) or {}
        if name in given:
            return given[name]
        return self.defaults.get(name)

    def sets(self, rule: str, name: str) -> bool:
        """Whether set-resources gives `rule` a `name` (a placeholder or a job's function too)."""
        return name in (self.resources.get(rule) or {})


def default_resources(args: list[str]) -> dict[str, object]:
    """Snakemake's default-resources as given (``NAME=VALUE`` words, a value maybe quoted)
    as plain values: a whole number an int (as the executor plugins read mem_mb, runtime),
    anything else the string without its quotes."""
    defaults: dict[str, object] = {}
    for arg in args:
        key, _, value = arg.partition("=")
        value = value.strip().strip("'\"")
        defaults[key.strip()] = int(value) if value.isdigit() else value
    return defaults


# The profile values that may be placeholders, where the message names them
_SETTINGS = [
    ("default-resources slurm_account", "all", "slurm_account"),
    ("default-resources slurm_partition", "all", "slurm_partition"),
    ("set-resources train_gpt slurm_partition", "train_gpt", "slurm_partition"),
    ("set-resources evaluate slurm_partition", "evaluate", "slurm_partition"),
    # profiles/pbs: its defaults, and the queue and resource line of the GPU rules
    *((f"default-resources {name}", "all", name)
      for name in ("pbs_account", "pbs_queue", "pbs_select", "pbs_filesystems")),
]  # fmt: skip


def placement(
    profile: Profile,
    visible_gpus: Callable[[], tuple[int | None, str]],
    gpu_memory_mib: Callable[[], tuple[int | None, str]],
) -> Placement:
    """Where the profile puts train_gpt. The executor: Slurm where train_gpt has a Slurm
    partition, PBS where a PBS queue is given (to it or to every job), else this machine;
    here, without srun, the GPUs are counted and their memory read (`visible_gpus`,
    `gpu_memory_mib`: gptflow.hardware's, nvidia-smi), the profile's gpu_mem_mb over it."""

    def number(name):
        value = profile.value("train_gpt", name)
        return value if isinstance(value, int) else None

    settings = [(where, profile.value(rule, name)) for where, rule, name in _SETTINGS]
    settings += [
        (f"set-resources {rule} {name}", profile.value(rule, name))
        for rule in ("train_gpt", "evaluate")
        for name in ("pbs_queue", "pbs_select")
        if profile.sets(rule, name)
    ]
    pbs = profile.sets("train_gpt", "pbs_queue") or profile.value("all", "pbs_queue") is not None
    executor = (
        "slurm" if profile.value("train_gpt", "slurm_partition") else "pbs" if pbs else "local"
    )
    mpi = str(profile.value("train_gpt", "mpi") or "")
    gpus, gpus_source = visible_gpus() if executor == "local" and not mpi else (None, "")
    # A node's memory: what train_gpt's job is given. Slurm's plugin passes mem_mb (the rule's
    # or default-resources') as --mem; the PBS profile's submit line and this machine pass none,
    # so there only train_gpt's own set-resources mem_mb states it (default-resources' mem_mb
    # is the CPU jobs' scheduling figure)
    mem_mb = (
        number("mem_mb") if executor == "slurm" or profile.sets("train_gpt", "mem_mb") else None
    )
    gpu_mem_mb, gpu_mem_source = number("gpu_mem_mb"), ""
    if gpus and gpu_mem_mb is None:
        gpu_mem_mb, how = gpu_memory_mib()
        gpu_mem_source = how if gpu_mem_mb else f"assumed: 80 GB GPUs ({how})"
    return Placement(
        executor=executor,
        nodes=number("nodes"),
        tasks_per_node=number("tasks_per_node"),
        tasks=number("tasks"),
        gres=profile.value("train_gpt", "gres"),
        threads=profile.threads.get("train_gpt"),
        cpus_per_task=number("cpus_per_task"),
        mem_mb=mem_mb,
        partition=profile.value("train_gpt", "slurm_partition"),
        mpi=mpi,
        gpu_mem_mb=gpu_mem_mb,
        gpu_mem_source=gpu_mem_source,
        nproc_per_node=profile.value("train_gpt", "nproc_per_node"),
        gpus=gpus,
        gpus_source=gpus_source,
        settings=tuple((k, str(v)) for k, v in settings if v is not None),
    )
