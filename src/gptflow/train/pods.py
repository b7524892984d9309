"""Where a pod's ranks meet: torchrun's own ``PET_*`` variables as Kubernetes sets them.

gptflow's JobSet (gptflow.kubernetes.manifests) sets ``PET_NNODES``, ``PET_NODE_RANK`` (the Job
completion index, through the downward API), ``PET_MASTER_ADDR`` (node 0's name in the JobSet's
headless Service) and ``PET_MASTER_PORT``; Kubeflow Trainer v2's torch runtime sets the same
four itself. Each pod runs one ``gptflow train --nproc-per-node G --nnodes N``, whose elastic
launcher meets the others' at node 0 with a static rendezvous: node rank = completion index,
as a Slurm task's rank is ``SLURM_PROCID``.
"""

from __future__ import annotations

from gptflow.errors import GptflowError


def _int(env: dict, key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise GptflowError(f"environment variable {key}={env[key]!r} is not an integer") from None


def pod_rendezvous(nnodes: int, env: dict) -> list[str]:
    """torchrun's rendezvous options for this pod, one of `nnodes` (``--nnodes``, the
    manifest's node count), from the ``PET_*`` variables; node rank from ``PET_NODE_RANK``,
    else ``JOB_COMPLETION_INDEX``. One node needs no rendezvous host (``--standalone``)."""
    if "PET_NNODES" in env and env["PET_NNODES"] != str(nnodes):
        raise GptflowError(
            f"--nnodes {nnodes}, but this pod is one of PET_NNODES={env['PET_NNODES']}: the "
            "manifest and the command disagree; render the manifest again (gptflow kubernetes "
            "render)"
        )
    if nnodes == 1:
        return ["--standalone"]
    key = "PET_NODE_RANK" if env.get("PET_NODE_RANK", "") != "" else "JOB_COMPLETION_INDEX"
    if key not in env:
        raise GptflowError(
            "no PET_NODE_RANK or JOB_COMPLETION_INDEX in this pod's environment: a pod of "
            f"{nnodes} nodes learns its node rank from its Indexed Job (JobSet) or its runtime"
        )
    rank = _int(env, key)
    if not 0 <= rank < nnodes:
        raise GptflowError(f"{key}={rank} is not a node rank of --nnodes {nnodes}")
    port = _int(env, "PET_MASTER_PORT") if "PET_MASTER_PORT" in env else 29500
    return [
        f"--nnodes={nnodes}", f"--node-rank={rank}", "--rdzv-backend=static",
        f"--master-addr={env['PET_MASTER_ADDR']}", f"--master-port={port}",
    ]  # fmt: skip
