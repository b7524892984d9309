"""The jobs after training, sized from the model: how evaluation places the model on GPUs, and
the memory and time of the evaluate and export_hf jobs.

One home for these figures: the rules ask for them as the jobs' resources, the preflight checks
them against the profile at ``-n`` and prints them, and ``gptflow evaluate`` places the model by
the same plan on the GPUs it was given. Pure arithmetic on :class:`gptflow.config.ModelConfig`
(planning imports neither torch nor DeepSpeed).

Evaluation keeps only the weights (no gradients, no optimizer state) and one batch of
activations. It runs in fp32 on one GPU when that fits; otherwise in bf16 (the precision the
model trained in on a GPU), its layers placed in order over as many GPUs of one node as the bf16
weights need (layer-wise model parallel: one GPU computes at a time, the activations move
between them; a 175B model fits one 8-GPU node this way). The export never holds the model: it
reads and writes one tensor at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptflow.config import ModelConfig

MIB = 2**20
GIB = 2**30
EVAL_BATCH = 8  # windows per forward pass
# Room the estimate leaves for what it does not see, on top of its terms:
# - CUDA context, cuBLAS/cuDNN workspaces and NCCL's communication buffers: a fixed amount a
#   rank loses before its first tensor (NCCL_BUFFSIZE is 4 MiB a channel and peer; the context
#   is a few hundred MB). Not measured here (no GPU): a round figure, on the safe side.
RUNTIME_OVERHEAD_BYTES = 2 * GIB
# - the caching allocator's fragmentation at the peak: DeepSpeed's activation-offload planner
#   leaves 10 % of device memory to the allocator (MARGIN and MIN_MEASURED_MARGIN in
#   deepspeed/compile/passes/offload_activation.py: "what a margin has to cover is peak-time
#   fragmentation", calibrated there on GPUs).
FRAGMENTATION_SHARE = 0.10


# Host memory of a process besides its tensors: Python, torch, DeepSpeed, tokenizers, the shard
# index and, on a GPU, CUDA's host side. Measured here: 0.40 GB max RSS for a training rank after
# a step on the CPU (torch 2.13, DeepSpeed 0.19.8); a CUDA context adds ~1.7 GB
# (pytorch/pytorch#113326: 2.06 GB max RSS with one CUDA tensor, 0.32 GB without; torch 2.2,
# lazy module loading). Not measured on a GPU here.
HOST_OVERHEAD_BYTES = 2 * GIB
# Sequential read + write of the fp32 weights by the export (a parallel file system gives a
# single stream 200-1000 MB/s; the lower figure, so a time limit is not hit on a busy one)
EXPORT_BYTES_PER_S = 200 * 10**6
# Loading the weights onto the GPUs (read memory-mapped, copied one tensor at a time)
LOAD_BYTES_PER_S = 500 * 10**6
# Evaluation compute: forward FLOPs (2 per parameter per token) at this fraction of a GPU's
# peak (a bf16 A100: 312 TFLOP/s); generations add a few forward passes per new token
EVAL_TFLOPS = 312 * 0.2
MIN_RUNTIME_MIN = 10  # a job's floor: start-up, imports, the shard index


def fit_margin(gpu_bytes: int) -> int:
    """Bytes of a GPU an estimate leaves free: runtime overhead plus fragmentation (training's
    fit check and the evaluation's plan alike)."""
    return RUNTIME_OVERHEAD_BYTES + int(FRAGMENTATION_SHARE * gpu_bytes)


@dataclass(frozen=True)
class EvalPlan:
    """How ``gptflow evaluate`` holds the model: `dtype` over `gpus` devices."""

    dtype: str  # "fp32" or "bf16"
    gpus: int  # devices the layers are placed over (1: the whole model on one)
    device_bytes: int  # the most loaded device's tensors: its weights, the logits
    gpu_bytes: int  # one GPU's memory, planned against (less fit_margin)

    @property
    def fits(self) -> bool:
        return self.device_bytes + fit_margin(self.gpu_bytes) <= self.gpu_bytes


def logits_bytes(model: ModelConfig, seq_length: int, batch: int = EVAL_BATCH) -> int:
    """One batch of fp32 logits three times over (logits, log-softmax, a temporary)."""
    return 3 * 4 * batch * seq_length * model.vocab_size


def eval_plan(
    model: ModelConfig, seq_length: int, gpu_bytes: int, batch: int = EVAL_BATCH
) -> EvalPlan:
    """fp32 on one GPU of `gpu_bytes` when the weights and logits fit with
    :func:`fit_margin` left free; otherwise bf16 on the fewest GPUs whose shares of the
    weights fit (the last holds the logits too)."""
    n = model.num_parameters()
    fixed = logits_bytes(model, seq_length, batch)
    usable = gpu_bytes - fit_margin(gpu_bytes)
    if 4 * n + fixed <= usable:
        return EvalPlan("fp32", 1, 4 * n + fixed, gpu_bytes)
    # layers are whole: a device holds ceil(layers / gpus) of them and the embedding or head
    embedding = 2 * model.vocab_size * model.hidden_size
    per_layer = (2 * n - 2 * embedding) / model.num_layers
    for gpus in range(1, model.num_layers + 1):
        heaviest = (
            2 * n if gpus == 1 else math.ceil(model.num_layers / gpus) * per_layer + embedding
        )
        if heaviest + fixed <= usable or gpus == model.num_layers:
            return EvalPlan("bf16", gpus, int(heaviest + fixed), gpu_bytes)
    raise AssertionError("unreachable: the loop returns at gpus == num_layers")


def layer_devices(num_layers: int, gpus: int) -> list[int]:
    """The device of each layer under an :class:`EvalPlan` of `gpus`: consecutive blocks of
    ceil(layers / gpus), the embedding with the first, the final norm and head with the last."""
    per = math.ceil(num_layers / gpus)
    return [i // per for i in range(num_layers)]


def eval_host_mb(model: ModelConfig, seq_length: int, on_gpu: bool) -> int:
    """Host memory (MB) of the evaluate job. On GPUs: the two largest tensors in flight
    (read, converted) and the overhead; on a CPU the model itself (fp32) and the logits."""
    if on_gpu:
        need = 2 * 4 * model.largest_tensor_numel() + HOST_OVERHEAD_BYTES
    else:
        need = 4 * model.num_parameters() + logits_bytes(model, seq_length) + HOST_OVERHEAD_BYTES
    return math.ceil(need / MIB)


def eval_runtime_min(
    model: ModelConfig, seq_length: int, max_windows: int, prompts: int, new_tokens: int
) -> int:
    """Minutes of the evaluate job: loading the fp32 weights, the windows' forward passes and
    the generations (a forward pass of at most seq_length tokens per new token), doubled for
    a shared, busy cluster."""
    load = 4 * model.num_parameters() / LOAD_BYTES_PER_S
    tokens = (max_windows + prompts * new_tokens) * seq_length
    compute = 2 * model.num_parameters() * tokens / (EVAL_TFLOPS * 1e12)
    return max(MIN_RUNTIME_MIN, math.ceil(2 * (load + compute) / 60))


def export_mb(model: ModelConfig) -> int:
    """Host memory (MB) of the export_hf job: a parameter's pieces, its joined tensor-parallel
    slices and the whole tensor (at most three times the largest tensor in fp32; measured at
    most twice by tests/unit/test_export.py) and the overhead."""
    return math.ceil((3 * 4 * model.largest_tensor_numel() + HOST_OVERHEAD_BYTES) / MIB)


def export_runtime_min(model: ModelConfig) -> int:
    """Minutes of the export_hf job: the fp32 weights read and written once, doubled."""
    seconds = 2 * 4 * model.num_parameters() / EXPORT_BYTES_PER_S
    return max(MIN_RUNTIME_MIN, math.ceil(2 * seconds / 60))
