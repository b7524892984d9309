"""Tensor and pipeline parallel: how the model is split over ranks, before DeepSpeed's engine
is made around it (:mod:`gptflow.train.engine`).

Tensor parallel is Megatron's scheme through DeepSpeed AutoTP's layers
(:data:`TENSOR_PARALLEL_PLAN`), the vocabulary split too (:data:`VOCAB_PARALLEL`;
:class:`VocabParallelCrossEntropy`: the loss without gathering the logits); pipeline parallel
is DeepSpeed's ``PipelineModule`` (:func:`pipeline_model`), as GPT-NeoX does. Both cut the
model on the meta device, so that a rank allocates only its own stage and slices. The dropout
of a split region draws from an RNG of its own per tensor-parallel rank
(:func:`split_region_rng`). The export merges the slices back by the same plan
(:func:`tensor_parallel_dim`, gptflow.results.export).
"""

from __future__ import annotations

import contextlib
import re
from functools import partial

import torch

from gptflow.config.settings import TrainConfig
from gptflow.errors import GptflowError

# How tensor parallelism splits each layer (Megatron's scheme; DeepSpeed AutoTP's layer
# specs, matched against gptflow.train.model's parameter names). Column-parallel: the output rows
# are split, so each rank computes whole heads (query_key_value's rows are grouped per head as
# [q_h; k_h; v_h], so a contiguous block is whole heads) and 1/tp of the MLP's columns.
# Row-parallel: the input columns are split and the outputs summed over the group (their
# biases replicated, added once). LayerNorms are replicated. The vocabulary is split too
# (VOCAB_PARALLEL, Megatron's VocabParallelEmbedding and vocab-parallel output layer): each rank
# holds a contiguous block of the embedding's and the head's rows.
TENSOR_PARALLEL_PLAN = [
    {
        "patterns": [
            r".*\.attention\.query_key_value\.(weight|bias)$",
            r".*\.mlp\.dense_h_to_4h\.(weight|bias)$",
        ],
        "partition_type": "column",
    },
    {
        "patterns": [r".*\.attention\.dense\.weight$", r".*\.mlp\.dense_4h_to_h\.weight$"],
        "partition_type": "row",
    },
]


# The embedding and the output head, split along the vocabulary (rows [r V/tp, (r+1) V/tp) on
# tensor-parallel rank r) by split_tensor_parallel with DeepSpeed's own vocab-parallel layers:
# not AutoTP layer specs, whose column split would gather the logits and whose embedding
# split is along the hidden size.
VOCAB_PARALLEL = [r"gpt_neox\.embed_in\.weight", r"embed_out\.weight"]


def model_name(name: str, pipeline_parallel: int, num_layers: int) -> str:
    """The :class:`~gptflow.train.model.GPTNeoX` name of an engine module's parameter."""
    from gptflow.train.model import hf_name

    return hf_name(name, num_layers) if pipeline_parallel > 1 else name


def tensor_parallel_rank(tensor_parallel: int) -> int:
    if tensor_parallel == 1:
        return 0
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_rank()


def tensor_parallel_slice(name: str, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The part of parameter `name` that tensor-parallel rank `rank` of `size` holds, by
    :data:`TENSOR_PARALLEL_PLAN`: rows of a column-parallel matrix (and its bias), columns of
    a row-parallel one, the whole of anything else."""
    dim = tensor_parallel_dim(name)
    if size == 1 or dim is None:
        return whole
    return whole.chunk(size, dim=dim)[rank]


def tensor_parallel_dim(name: str) -> int | None:
    """The dimension along which tensor parallel splits parameter `name` (of
    :class:`~gptflow.train.model.GPTNeoX`): 0 for a column-parallel matrix and its bias and for the
    vocabulary-parallel embedding and head (:data:`VOCAB_PARALLEL`), 1 for a row-parallel
    matrix (:data:`TENSOR_PARALLEL_PLAN`), None for a replicated parameter."""
    if any(re.fullmatch(pattern, name) for pattern in VOCAB_PARALLEL):
        return 0
    for spec in TENSOR_PARALLEL_PLAN:
        if any(re.fullmatch(pattern, name) for pattern in spec["patterns"]):
            return 0 if spec["partition_type"] == "column" else 1
    return None


def pipeline_model(model, stages: int, tensor_parallel: int, world_size: int):
    """`model` (on the meta device) split into `stages` consecutive pipeline stages
    (DeepSpeed's PipelineModule, as GPT-NeoX does): the decoder layers balanced over the
    stages, the embedding on the first and the head on the last; each rank keeps its stage's
    layers. The ranks form DeepSpeed's pipe x data x model grid: with tensor parallel, a
    tensor-parallel group is `tensor_parallel` neighbouring ranks of one stage."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from gptflow.train.model import lm_loss, pipeline_stages

    class MetaPipeline(PipelineModule):
        """PipelineModule's constructor moves the stage to the rank's device; here its layers
        stay on the meta device until they are split, and are allocated after."""

        def to(self, *args, **kwargs):
            if any(p.is_meta for p in self.parameters()):
                return self
            return super().to(*args, **kwargs)

    topology = PipeModelDataParallelTopology(
        num_pp=stages, num_mp=tensor_parallel, num_dp=world_size // (stages * tensor_parallel)
    )
    return MetaPipeline(
        layers=pipeline_stages(model),
        topology=topology,
        loss_fn=lm_loss,
        partition_method="type:LayerStage",
    )


def split_tensor_parallel(module, group) -> None:
    """AutoTP's split of `module` (on the meta device) by :data:`TENSOR_PARALLEL_PLAN` over
    `group`, before ``deepspeed.initialize``: so that it is split before it is allocated, and
    because the engine would make its tensor-parallel groups over all ranks as data x tensor,
    which a pipeline's stages are not. AutoTP's training layers take their group from
    DeepSpeed's `groups`, which is pointed at `group` first."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.module_inject.layers import (
        collect_autotp_universal_checkpoint_info,
        set_autotp_mode,
    )
    from deepspeed.utils import groups

    if groups._TENSOR_MODEL_PARALLEL_GROUP is None:  # a pipeline's: the grid's slice
        groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = group
        groups._DATA_PARALLEL_GROUP = module.mpu().get_data_parallel_group()
    set_autotp_mode(training=True)
    config = AutoTPConfig.from_dict(
        {"use_default_specs": False, "layer_specs": TENSOR_PARALLEL_PLAN}
    )
    config.tp_size = torch.distributed.get_world_size(group)
    autotp = AutoTP(
        module=module,
        all_reduce_linears=(),
        prefix="",
        state_dict=None,
        linear_layer_setting=(torch.nn.Linear, torch.nn.Embedding),
        orig_layer_impl=None,
        partition_config=config,
        training_mode=True,
    )
    autotp.set_tensor_parallel_config(config.tp_size, group)
    autotp.update_linear_policies()
    autotp._replace_module(module)
    split_vocabulary(module, group)
    # how ds_to_universal merges each parameter's slices: rank 0's record is the one saved, so
    # under a pipeline it must name every stage's parameters, not only the first stage's
    records = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, collect_autotp_universal_checkpoint_info(module))
    setattr(module, UNIVERSAL_CHECKPOINT_INFO, merge_records(records))
    module.ds_autotp_parsed = True  # deepspeed.initialize splits nothing again


def split_vocabulary(module, group) -> None:
    """The embedding and the output head of `module` (a GPTNeoX or a pipeline's stages, on the
    meta device) split along the vocabulary over `group` (:data:`VOCAB_PARALLEL`), as Megatron
    and GPT-NeoX split them, with DeepSpeed's layers (which carry AutoTP's universal-checkpoint
    marks, so ds_to_universal merges their rows): the embedding looks up the ids in its rows
    and sums over the group; the head keeps its block of the logits (no gather), and the loss
    (``loss_fn``, of the model or of the pipeline's last stage) is
    :func:`vocab_parallel_lm_loss`."""
    from deepspeed.module_inject.layers import VocabParallelEmbedding, VocabParallelLinear

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name == "embed_in" and isinstance(child, torch.nn.Embedding):
                setattr(parent, name, VocabParallelEmbedding(child, group, name=name))
            elif name == "embed_out" and isinstance(child, torch.nn.Linear):
                head = VocabParallelLinear(child, group, name=name)
                if len(set(head._partition_sizes)) != 1:
                    raise GptflowError(
                        f"the vocabulary of {head.vocab_size} rows does not split evenly over "
                        f"{len(head._partition_sizes)} tensor-parallel ranks"
                    )
                setattr(parent, name, head)
                module.loss_fn = partial(
                    vocab_parallel_lm_loss, group=group, start=head.vocab_start_index
                )


def vocab_parallel_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, group, start: int
) -> torch.Tensor:
    """:func:`gptflow.train.model.lm_loss` of logits split along the vocabulary over `group`
    (this rank's columns ``start`` to ``start + logits.size(-1)``): the mean next-token
    cross-entropy, in fp32."""
    return VocabParallelCrossEntropy.apply(logits, labels, group, start).mean()


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's ``vocab_parallel_cross_entropy``: each token's loss from logits split along
    the vocabulary, (B, T, V/tp) -> (B, T) fp32, without gathering them. The maximum is
    all-reduced over the group, then the target's logit (taken by the rank whose block holds
    it, 0 elsewhere) and the sum of exponentials in one all-reduce. It keeps the softmax of its
    block (fp32) for the backward, which turns it into the gradient in place (softmax minus the
    target's one-hot, times the incoming gradient): 4 bytes a logit kept, no other copy."""

    @staticmethod
    def forward(ctx, logits, labels, group, start):
        dist = torch.distributed
        shifted = logits.to(torch.float32, copy=True)  # (B, T, V/tp)
        top = shifted.amax(dim=-1)  # (B, T)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted.sub_(top.unsqueeze(-1))
        local, owned = _local_labels(labels, start, shifted.size(-1))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)  # (B, T)
        probs = shifted.exp_()
        sums = torch.stack((torch.where(owned, picked, 0.0), probs.sum(dim=-1)))  # (2, B, T)
        dist.all_reduce(sums, group=group)
        probs.div_(sums[1].unsqueeze(-1))
        ctx.save_for_backward(probs, labels)
        ctx.start, ctx.dtype = start, logits.dtype
        return sums[1].log() - sums[0]

    @staticmethod
    def backward(ctx, grad):
        probs, labels = ctx.saved_tensors
        local, owned = _local_labels(labels, ctx.start, probs.size(-1))
        grad_logits = probs  # (B, T, V/tp): the softmax, made the gradient in place
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -owned.unsqueeze(-1).to(probs.dtype))
        grad_logits.mul_(grad.unsqueeze(-1))
        return grad_logits.to(ctx.dtype), None, None, None


def _local_labels(labels: torch.Tensor, start: int, width: int):
    """The labels as columns of a rank's block (0 where another rank's block holds them),
    and which ones it holds."""
    local = labels - start
    owned = (local >= 0) & (local < width)
    return local.masked_fill(~owned, 0), owned


def merge_records(records: list):
    """Nested records of several ranks as one: dicts merged key by key, lists of names joined
    without repeats (in first-seen order), anything else equal on every rank that has it."""
    first = records[0]
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for r in records for k in r))
        return {k: merge_records([r[k] for r in records if k in r]) for k in keys}
    if isinstance(first, list) and all(isinstance(x, str) for r in records for x in r):
        return list(dict.fromkeys(x for r in records for x in r))
    if any(r != first for r in records):
        raise GptflowError(f"ranks disagree on a tensor-parallel record: {records}")
    return first


# ----------------------------------------------------------------------------- dropout RNG
#
# Megatron's model-parallel RNG, with less machinery. Under tensor parallel the dropout masks of
# a replicated region (the embedding's; the hidden dropouts, whose inputs are the row-parallel
# sums) must agree on the ranks of a tensor-parallel group, or their copies of the replicated
# weights drift apart; those of a split region (the attention probabilities: each rank holds
# other heads) must differ, or head h of every rank gets the same mask. The default RNG stream
# is the replicated one: the trainer seeds it per micro-batch from the data-parallel rank,
# never the tensor-parallel one (gptflow.train.loop.reseed). The attention's dropout runs in a
# fork of it reseeded for the tensor-parallel rank (:func:`split_region_rng`).


def use_split_region_rng(module: torch.nn.Module, train: TrainConfig, device: torch.device) -> None:
    """Under tensor parallel, give every attention of `module` (this rank's model, or its
    pipeline stage) the split-region RNG of its tensor-parallel rank: the model's hook
    ``Attention.split_rng``, a null context by default."""
    if train.tensor_parallel == 1:
        return
    rank = tensor_parallel_rank(train.tensor_parallel)
    devices = []  # the GPU whose generator the attention draws from, besides the CPU's
    if device.type == "cuda":
        devices = [torch.cuda.current_device() if device.index is None else device.index]
    for m in module.modules():
        if hasattr(m, "split_rng"):
            m.split_rng = lambda: split_region_rng(rank, train.tensor_parallel, devices)


@contextlib.contextmanager
def split_region_rng(rank: int, size: int, devices: list[int]):
    """The default generators (the CPU's, and those of the GPUs `devices`) reseeded for a split
    region of tensor-parallel rank `rank` of `size`, and restored after it.

    The seed is a draw from the default CPU stream, the same on every rank of the group,
    times `size` plus `rank`: distinct per rank, and a function of the replicated stream, so
    of (seed, step, micro-batch, data-parallel rank) -- repeated by a resume, and by activation
    checkpointing's recomputation, which restores the default RNG states before it reruns a
    layer (Megatron's tracker, a stream of its own, needs its own checkpoint function for that).
    The draw advances the replicated stream alike on every rank. No host sync: the draw is a
    CPU tensor, and a GPU generator's state (seed, Philox offset) lives on the host (ATen's
    ``CUDAGeneratorState``; get/set_state copy it to and from a CPU byte tensor)."""
    draw = int(torch.randint(2**62 // size, (), device="cpu"))  # a CPU tensor: no device sync
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.default_generator.manual_seed(draw * size + rank)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(draw * size + rank)
        yield
