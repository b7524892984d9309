"""Host memory of checkpoint saves in the background (``train.async_save``): each rank's
snapshot of the files DeepSpeed writes, each rank's process and the training state kept in host
memory, on the most loaded node, against the node's memory; and the ``-n`` line on how
checkpoints are saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gptflow.config.settings import ModelConfig, TrainConfig, kfac_floats
from gptflow.errors import GptflowError
from gptflow.hardware import HOST_OVERHEAD_BYTES, background_saves
from gptflow.plan.gpu_memory import (
    human,
    layer_parameters,
    model_state_bytes,
    planned_precision,
    stage_parameters,
)
from gptflow.plan.placement import Placement

# What a training rank's process holds in host memory besides its tensors (CUDA context and
# libraries, torch, DeepSpeed, the data loader): gptflow.hardware's, where its sources are.
PROCESS_HOST_BYTES = HOST_OVERHEAD_BYTES


def writes_model_file(t: TrainConfig, rank: int, ranks: int) -> bool:
    """Whether global rank `rank` writes a save's model file (under a pipeline, its stage's
    layer files): data-parallel rank 0 of each model-parallel group (DeepSpeed's
    save_non_zero_checkpoint; its layer files, pipe/module.py save_state_dict), every rank at
    ZeRO 3 (each its own, of partitioned parameters)."""
    return t.zero_stage == 3 or t.data_parallel_rank(rank, ranks) == 0


def snapshot_bytes(
    m: ModelConfig, t: TrainConfig, ranks: int, precision: str, rank: int = 0
) -> int:
    """Host bytes of global rank `rank`'s checkpoint snapshot (train.async_save): the tensors of
    the files DeepSpeed writes there, as :func:`model_state_bytes` counts them for the rank's
    pipeline stage:

    - the model file, where :func:`writes_model_file`: the weights (at ZeRO 0 also the
      optimizer state, which is not partitioned) and K-FAC's state; at ZeRO 3 its parameters
      are partitioned away (the weights are in the partition);
    - from ZeRO 1 on, the rank's optimizer partition (fp32 weights and Adam's moments), on every
      rank (offloaded or not: the snapshot copies it either way).

    Not counted: the pickles (under 32 KiB a file, measured) and what a host buffer takes
    beyond its bytes (gptflow.train.async_save.buffer_bytes: under two pages, 8 KiB, a storage)."""
    dp = t.data_parallel_size(ranks)
    stage = t.pipeline_stage(rank, ranks)
    params = stage_parameters(m, t.tensor_parallel, t.pipeline_parallel, stage)
    parts = model_state_bytes(params, dp, t.zero_stage, precision)
    partition = parts["optimizer states"] if t.zero_stage >= 1 else 0
    if t.zero_stage == 3 or not writes_model_file(t, rank, ranks):
        return partition
    kfac = 4 * kfac_floats(m) if t.kfac else 0
    model = parts["weights"] + (parts["optimizer states"] if t.zero_stage == 0 else 0)
    return model + kfac + partition


def pipeline_clone_bytes(
    m: ModelConfig, t: TrainConfig, ranks: int, precision: str, rank: int = 0
) -> int:
    """Host bytes global rank `rank` holds for a moment during a save beyond its snapshot: under
    a pipeline, DeepSpeed's ``PipelineModule.save_state_dict`` copies each layer file's tensors
    to the host (``clone_tensors_for_torch_save``) and the snapshot copies them again; one file's
    copy at a time (the next is made after the last is dropped: measured), so the largest of
    the rank's stage -- the embedding, a decoder layer, or the final LayerNorm with the head --
    in the weights' precision, on the ranks that write them (:func:`writes_model_file`).
    Nothing without a pipeline: the model file and the ZeRO partition are copied once, into
    the snapshot."""
    if t.pipeline_parallel == 1 or not writes_model_file(t, rank, ranks):
        return 0
    h, v, tp, pp = m.hidden_size, m.vocab_size, t.tensor_parallel, t.pipeline_parallel
    stage = t.pipeline_stage(rank, ranks)
    files = [layer_parameters(m, tp)]
    if stage == 0:
        files.append(v * h // tp)  # the embedding
    if stage == pp - 1:
        files.append(v * h // tp + 2 * h)  # the final LayerNorm and the head
    return (2 if precision in ("bf16", "fp16") else 4) * max(files)


def host_state_bytes(
    m: ModelConfig, t: TrainConfig, ranks: int, precision: str, rank: int, on_gpus: bool
) -> int:
    """The training state rank `rank` keeps in host memory: on GPUs what train.offload moves
    there (:func:`model_state_bytes` without and with it), on CPUs all of it."""
    dp = t.data_parallel_size(ranks)
    stage = t.pipeline_stage(rank, ranks)
    params = stage_parameters(m, t.tensor_parallel, t.pipeline_parallel, stage)
    whole = sum(model_state_bytes(params, dp, t.zero_stage, precision).values())
    if not on_gpus:
        return whole
    return whole - sum(model_state_bytes(params, dp, t.zero_stage, precision, t.offload).values())


def node_memory() -> int:
    """This machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class SnapshotFit:
    """Host memory of the most loaded node with background saves: its ranks' snapshots, each
    rank's process, and the training state kept in host memory (offloaded optimizer state on
    GPUs; all of it training on CPUs)."""

    snapshots: int  # the node's ranks' snapshots
    largest: int  # the largest of them
    writers: int  # the node's ranks that write a model file
    ranks: int  # of the node
    state: int  # training state in the node's host memory
    node_bytes: int | None  # None: not known (no mem_mb for a cluster's node)
    source: str
    on_cpu: bool
    clones: int = 0  # DeepSpeed's copies of layer files under a pipeline, during a save

    @property
    def process(self) -> int:
        return self.ranks * PROCESS_HOST_BYTES

    @property
    def need(self) -> int:
        return self.snapshots + self.clones + self.process + self.state

    @property
    def fits(self) -> bool:
        return self.node_bytes is None or self.need <= self.node_bytes


def snapshot_fit(m: ModelConfig, t: TrainConfig, ranks: int, p: Placement) -> SnapshotFit:
    """The node of `p` whose ranks need the most host memory with background saves (ranks
    are numbered node by node: srun's block distribution, torchrun's node rank; with
    ``tasks`` over ``nodes``, ceil(tasks / nodes) a node: Placement.ranks_per_node)."""
    on_gpus = p.trains_on_gpus
    precision = planned_precision(t, p)[0]
    per_node = p.ranks_per_node
    if p.mem_mb:
        node, source = p.mem_mb * 2**20, "set-resources train_gpt mem_mb"
    elif not p.on_cluster:
        node, source = node_memory(), "this machine's memory"
    else:
        node, source = None, "not known: set-resources train_gpt mem_mb"
    fits = []
    for first in range(0, ranks, per_node):
        node_ranks = range(first, min(first + per_node, ranks))
        snaps = [snapshot_bytes(m, t, ranks, precision, r) for r in node_ranks]
        fits.append(SnapshotFit(
            snapshots=sum(snaps), largest=max(snaps),
            writers=sum(writes_model_file(t, r, ranks) for r in node_ranks),
            ranks=len(node_ranks),
            state=sum(host_state_bytes(m, t, ranks, precision, r, on_gpus) for r in node_ranks),
            node_bytes=node, source=source, on_cpu=not on_gpus,
            clones=sum(pipeline_clone_bytes(m, t, ranks, precision, r) for r in node_ranks),
        ))  # fmt: skip
    return max(fits, key=lambda f: f.need)


def check_saves(t: TrainConfig, fit: SnapshotFit | None) -> str:
    """The -n line on how checkpoints are saved; refuses a snapshot the node cannot hold."""
    if fit is None:
        why = background_saves(t.async_save, False)[1]
        return f"  checkpoint saves: synchronous ({why}): training waits for each write"
    state = ""
    if fit.state:
        what = "the training state (on CPUs)" if fit.on_cpu else "offloaded optimizer state"
        state = f" + {what} {human(fit.state)}"
    need = f"about {human(fit.need)} of host memory per node"
    clones = (
        f" + {human(fit.clones)} DeepSpeed's copy of a layer file on each writing rank (pipeline)"
        if fit.clones
        else ""
    )
    parts = (
        f"snapshots {human(fit.snapshots)} ({fit.writers} of {fit.ranks} rank(s) write the model "
        f"file; {human(fit.largest)} on the largest){clones} + {fit.ranks} process(es) x "
        f"{human(PROCESS_HOST_BYTES)}{state}"
    )
    node = human(fit.node_bytes) if fit.node_bytes is not None else "?"
    if not fit.fits and fit.on_cpu:  # a GPU run planned on a laptop: say so, plan on
        return (
            f"  WARNING: checkpoint saves in the background (train.async_save) take {need} "
            f"({parts}), more than {node} ({fit.source}): training on this machine's CPUs, set "
            f"train.async_save false"
        )
    if not fit.fits:
        raise GptflowError(
            f"train.async_save: saving in the background takes {need} ({parts}), more than a "
            f"node's {node} ({fit.source}); set train.async_save false (synchronous saves: "
            f"training waits for each write), raise train.zero_stage (it partitions the "
            f"optimizer state), or put fewer ranks on a node"
        )
    return (
        f"  checkpoint saves: in the background (train.async_save): {need}, of {node} "
        f"({fit.source}): {parts}"
    )
