"""What one training submission asks of the cluster (:class:`PodSet`): the config's
``kubernetes`` section resolved for one run, with the counts the plan decided (ranks, CPUs,
memory) -- the one description every renderer of :mod:`gptflow.kubernetes.manifests` reads.
It travels from the plan to the submitting job as JSON (``gptflow kubernetes submit --spec``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field

from gptflow.errors import GptflowError

# JobSet names its pods' hostnames <jobset>-<replicatedJob>-<job index>-<pod index>, a DNS
# label of at most 63 characters: "-node-0-" and a pod index of up to 4 digits leave 51; the
# name is kept well under that.
NAME_MAX = 40
REPLICATED_JOB = "node"  # the JobSet's one replicatedJob: one pod per node
CONTAINER = "trainer"
EXIT_PREEMPTED = 75  # gptflow.train.loop.EXIT_PREEMPTED: saved after a signal; run again
PORT_BASE, PORT_SPAN = 10000, 20000  # as gptflow.train.distributed.job_port: below ephemeral


@dataclass(frozen=True)
class PodSet:
    """One submission: `nodes` pods of `ranks_per_node` ranks each, on the claim at
    `mount_path` (the working directory), running the rule's command."""

    name: str  # the JobSet's (and its headless Service's) name: jobset_name()
    run: str
    namespace: str
    image: str
    volume_claim: str
    mount_path: str
    nodes: int
    gpus_per_node: int  # 0: a CPU pod of one rank
    cpus: int  # per pod
    memory_mb: int  # per pod: request and limit
    shm_mb: int
    done: str  # the job's output (training: DONE.json), relative to the working directory: the
    # truth of success
    manifests_dir: str  # where the submitting job writes the rendered manifests
    gpu_resource: str = "nvidia.com/gpu"
    image_pull_secret: str = ""
    rdma: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    queue: str = ""
    priority_class: str = ""
    max_restarts: int = 3
    grace_seconds: int = 600

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.gpus_per_node)

    @property
    def port(self) -> int:
        """The rendezvous port on node 0: one per JobSet name, so that two JobSets whose pods
        share a host's network (hostNetwork, or the tests' loopback cluster) do not collide."""
        digest = int(hashlib.sha256(self.name.encode()).hexdigest()[:8], 16)
        return PORT_BASE + digest % PORT_SPAN

    @property
    def master(self) -> str:
        """Node 0's name in the JobSet's headless Service (JobSet's pod hostname scheme)."""
        return f"{self.name}-{REPLICATED_JOB}-0-0.{self.name}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PodSet:
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as e:
            raise GptflowError(f"--spec is not a gptflow kubernetes spec ({e})") from None


def jobset_name(run: str, namespace: str, mount_path: str, job: str = "") -> str:
    """A deterministic, RFC 1035 name for run `run` of the working directory at `mount_path` in
    `namespace` (its training; `job`: another of its jobs, e.g. ``evaluate``, named after it):
    the same on every attempt (a second submission finds the first), another for another
    checkout, namespace or job."""
    key = f"{namespace}\0{mount_path}\0{run}" + (f"\0{job}" if job else "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    room = NAME_MAX - len("gptflow--") - 8

    def clean(text: str) -> str:
        return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")

    tail = clean(job)[:room]
    stem = clean(run)[: max(0, room - len(tail) - 1) if tail else room].rstrip("-")
    stem = "-".join(part for part in (stem, tail) if part).rstrip("-")
    return f"gptflow-{stem}-{digest}" if stem else f"gptflow-{digest}"


def check_ready(section: dict, where: str = "kubernetes") -> None:
    """Refuse, naming the key, what a cluster cannot run: no image, no volume claim."""
    if not section.get("image"):
        raise GptflowError(
            f"{where}.image is not set: give the training image pinned by digest "
            "(REPOSITORY@sha256:HEX), built from envs/Dockerfile and pushed to your registry"
        )
    if not section.get("volume_claim"):
        raise GptflowError(
            f"{where}.volume_claim is not set: give the ReadWriteMany PersistentVolumeClaim "
            "that holds the working directory (kubectl get pvc -n NAMESPACE)"
        )
