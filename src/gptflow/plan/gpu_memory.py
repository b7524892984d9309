"""Memory per GPU: weights, gradients and optimizer state (by ZeRO stage, precision and
layout), activations as the model keeps them (by micro batch, sequence, checkpointing), the
logits (1/tp of the vocabulary on each tensor-parallel rank), the pipeline's buffers and K-FAC's
factors, on the most loaded pipeline stage, plus a stated margin, against the GPU's memory; the
largest term named when it does not fit.

Formulas only (planning imports neither torch nor DeepSpeed), checked in tests against the real
model split over ranks and against DeepSpeed's own ZeRO estimators.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gptflow.config.settings import (
    DEEPSPEED_REDUCE_BUCKET_SIZE,
    ModelConfig,
    TrainConfig,
    kfac_floats,
    muon_state_floats,
)
from gptflow.errors import GptflowError
from gptflow.hardware import (
    FRAGMENTATION_SHARE,
    RUNTIME_OVERHEAD_BYTES,
    fit_margin,
    planned_gpu,
    training_precision,
)
from gptflow.plan.muon import muon_memory
from gptflow.plan.placement import Placement

GIB = 1024**3
DEFAULT_GPU_MEMORY_MB = 80 * 1024  # A100 80GB / H100 80GB, when the profile does not say


def layer_parameters(m: ModelConfig, tensor_parallel: int) -> int:
    """Parameters of one decoder layer on a rank: each split matrix 1/tp of it, LayerNorms and
    the row-parallel biases whole."""
    h, f, t = m.hidden_size, m.ffn_size, tensor_parallel
    split = (3 * h * h + 3 * h + h * h + h * f + f + f * h) // t  # qkv, dense, mlp (+ biases)
    whole = 2 * h + 4 * h  # the row-parallel biases, two LayerNorms
    return split + whole


def stage_parameters(
    m: ModelConfig, tensor_parallel: int, pipeline_parallel: int, stage: int
) -> int:
    """Parameters a rank of pipeline stage `stage` holds: its decoder layers (balanced over the
    stages, rounded up; :func:`layer_parameters` each); the first stage also the embedding, the
    last the final LayerNorm and the head, and each of those 1/tp of the vocabulary's rows
    (gptflow.train.model_parallel.VOCAB_PARALLEL)."""
    h, v, t = m.hidden_size, m.vocab_size, tensor_parallel
    layers = -(-m.num_layers // pipeline_parallel) * layer_parameters(m, t)
    embedding = v * h // t if stage == 0 else 0
    head = v * h // t + 2 * h if stage == pipeline_parallel - 1 else 0
    return layers + embedding + head


# the terms that exist only between a backward pass and the update (not kept across steps)
TRANSIENT = (
    "gradients",
    "fp32 gradient partition",
    "gradient bucket",
    "Newton-Schulz",
    "Muon update",
)


def model_state_bytes(
    params: int,
    dp: int,
    zero: int,
    precision: str,
    offload: str = "none",
    largest: int = 0,
    muon: int = 0,
) -> dict[str, int]:
    """GPU bytes of a rank's weights, gradients and optimizer state (Adam) for the `params`
    parameters it holds, over `dp` data-parallel ranks, as DeepSpeed allocates them:

    - fp32: 4-byte weights and gradients; Adam's two moments (8 bytes), and from ZeRO 1 on
      DeepSpeed's fp32 copy of the rank's partition (4 more), partitioned by ZeRO 1-3;
    - bf16/fp16: 2-byte weights and gradients; fp32 masters and moments (12 bytes),
      partitioned by ZeRO 1-3; bf16 at ZeRO 1 also sums gradients in an fp32 buffer
      (grad_accum_dtype fp32, 4 bytes); ZeRO 2-3 reduce into an fp32 gradient partition
      (4/N), ZeRO 2 also partitions the 16-bit gradients -- DeepSpeed's own
      estimate_zero2_model_states_mem_needs (2 + 18/N bytes a parameter) and estimate_zero3_...
      (18/N, plus the largest layer gathered: `largest` parameters, 4 bytes each, 8 in fp32);
    - ZeRO 3 partitions the weights too; offloaded optimizer state lives in host memory;
    - ZeRO 1/2's gradient bucket, the same size whatever the model (:func:`gradient_bucket_bytes`);
    - `muon` of the parameters stepped by Muon (train.optimizer muon) keep no Adam moments
      (8 bytes less each, partitioned alike); what Muon holds instead is
      :func:`gptflow.plan.muon.muon_memory`'s.

    Measured on CPU after a step (tests/unit/plan/test_preflight.py): the kept terms (not
    TRANSIENT) are exactly the tensors DeepSpeed holds, on one rank and on every rank of
    tensor 2 x data 2 (ZeRO 1 and 2) and pipeline 2 x data 2 (ZeRO 1)."""
    half = precision in ("bf16", "fp16")
    width = 2 if half else 4
    shard = dp if zero >= 1 else 1
    parts = {
        "weights": width * params // (dp if zero >= 3 else 1),
        "gradients": width * params // (dp if zero >= 2 and not half else 1),
        "optimizer states": ((12 if half or zero >= 1 else 8) * params - 8 * muon) // shard,
    }
    if half and zero >= 2:
        parts["gradients"] = 2 * params // dp if zero == 2 else 0  # ZeRO 3: straight into fp32
        parts["fp32 gradient partition"] = 4 * params // dp
    if precision == "bf16" and zero == 1:
        parts["fp32 gradient accumulation"] = 4 * params
    if zero >= 3:
        parts["gathered layer"] = (4 if half else 8) * largest
    if bucket := gradient_bucket_bytes(zero, precision):
        parts["gradient bucket"] = bucket
    if offload != "none":
        parts["optimizer states"] = 0
        parts.pop("fp32 gradient partition", None)
        if offload == "optimizer_and_params":
            parts["weights"] = 0
    return parts


def gradient_bucket_bytes(zero: int, precision: str) -> int:
    """ZeRO 1 and 2's gradient bucket: DeepSpeed 0.19.8 (stage_1_and_2.py, setup_buckets)
    allocates it whole at each backward, reduce_bucket_size elements (5e8 by default: 2 GB in
    fp32) whatever the model's size, in the dtype it reduces in: fp32 for fp32 runs and for
    fp16 at ZeRO 1 (whose gradients accumulate in fp32 beside the fp16 ones), the 16-bit dtype
    at ZeRO 2; bf16 at ZeRO 1 runs BF16_Optimizer, which has none. Freed after the update (a
    TRANSIENT term). Found by an autotune trial running out of memory on the CPU (2,000,000,000
    bytes asked for a 165k-parameter model at ZeRO 1)."""
    if zero not in (1, 2) or (precision == "bf16" and zero == 1):
        return 0
    width = 4 if precision == "fp32" or zero == 1 else 2
    return width * DEEPSPEED_REDUCE_BUCKET_SIZE


LAYER_NORM_STATS = 2 * 4  # a LayerNorm keeps each token's mean and 1/std in fp32 (on CUDA also
# for 16-bit input; CPU's bf16 LayerNorm keeps them in bf16, 4 bytes less)
TOKEN_ID = 8  # int64: the ids the embedding keeps, the labels the loss keeps
# The logits' peak, bytes a logit (b x s x V on the last stage, V/tp on each tensor-parallel
# rank), in the loss's backward. On one rank gptflow.train.model.lm_loss: F.cross_entropy keeps
# log_softmax's fp32 output (4); its backward holds that, the fp32 gradient nll_loss hands it (4)
# and the gradient it makes (4). The 16-bit logits and their fp32 copy (2 + 4) are freed after the
# forward -- except under a pipeline, whose engine keeps each micro-batch's stage output (here the
# logits) in its buffers until the buffer is reused (deepspeed/runtime/pipe/engine.py; the last
# stage runs two buffers), counted apart.
LOGITS_PEAK = 12
# Under tensor parallel gptflow.train.model_parallel.VocabParallelCrossEntropy keeps its block's
# fp32 softmax (4) and makes it the gradient in place; its forward holds the logits and that fp32
# copy, and its backward that and the gradient in the logits' dtype: 4 + the logits' width (2 or 4)
# either way.
VOCAB_PARALLEL_LOGITS_PEAK = 4


def logits_bytes(tokens: int, vocab: int, tensor_parallel: int, width: int) -> int:
    """The loss's peak over the logits of `tokens` tokens on a rank of `tensor_parallel` (its
    1/tp of the `vocab` columns), logits `width` bytes each (LOGITS_PEAK)."""
    if tensor_parallel == 1:
        return LOGITS_PEAK * tokens * vocab
    return (VOCAB_PARALLEL_LOGITS_PEAK + width) * tokens * (vocab // tensor_parallel)


def layer_activation_bytes(m: ModelConfig, tensor_parallel: int, tokens: int, width: int) -> int:
    """Bytes one decoder layer (gptflow.train.model.Layer) keeps for its backward, for `tokens`
    tokens of a micro-batch on a rank of `tensor_parallel`, elements `width` bytes (2 in
    bf16/fp16, 4 in fp32), as autograd saves them (measured on CPU in
    tests/unit/plan/test_preflight.py), in elements a token:

    - the layer's input (kept by both LayerNorms, one tensor) and the two LayerNorms' outputs
      (kept by query_key_value and dense_h_to_4h): 3h; each LayerNorm's mean and 1/std;
    - query_key_value's output whole (3h/tp): q, k and v are views of it and attention keeps
      v, so the projection stays alive; the rotated q and k (2h/tp, new tensors); attention's
      output (h/tp) and its log-sum-exp (fp32, one a head); the copy of that output in (T, C)
      order that ``dense`` keeps (h/tp: transpose + flatten copies);
    - the MLP's GELU input and output (2f/tp);
    - with hidden dropout, two 1-byte masks (h each). scaled_dot_product_attention keeps no
      s x s matrix (flash / memory-efficient kernels; their dropout keeps no mask either)."""
    h, f, heads, t = m.hidden_size, m.ffn_size, m.num_attention_heads, tensor_parallel
    per_token = width * (3 * h + (7 * h + 2 * f) // t) + 2 * LAYER_NORM_STATS + 4 * heads // t
    if m.hidden_dropout:
        per_token += 2 * h
    return tokens * per_token


def activation_bytes(
    m: ModelConfig, t: TrainConfig, precision: str, stage: int = 0, gas: int = 1
) -> dict[str, int]:
    """What a rank of pipeline stage `stage` keeps for its backward passes at its peak (the
    start of a backward), by what holds it:

    - activations: each layer's (:func:`layer_activation_bytes`), or with activation
      checkpointing only each layer's input plus one layer's whole set while it is recomputed,
      for each micro-batch in flight: under 1F1B stage k holds min(pp - k, gas) (DeepSpeed's
      TrainSchedule); the first stage also the token ids, the last the final LayerNorm's input
      and output, its mean and 1/std, and the labels;
    - logits: on the last stage only, b x s x V/tp on each tensor-parallel rank (the head is
      split along the vocabulary), :func:`logits_bytes`;
    - pipeline buffers: DeepSpeed's pipeline engine keeps each buffer's received input (and one
      receive buffer), each in-flight micro-batch's output (b x s x h) until its backward, and on
      the last stage the logits of up to two micro-batches (its two buffers)."""
    s, b, h, v = t.seq_length, t.micro_batch_size, m.hidden_size, m.vocab_size
    tp, pp = t.tensor_parallel, t.pipeline_parallel
    width = 2 if precision in ("bf16", "fp16") else 4
    tokens = s * b
    first, last = stage == 0, stage == pp - 1
    layers = -(-m.num_layers // pp)
    one_layer = layer_activation_bytes(m, tp, tokens, width)
    in_flight = min(pp - stage, gas)
    # with checkpointing a layer keeps only its input
    kept = layers * (tokens * width * h if m.activation_checkpointing else one_layer)
    if first:  # the ids; split along the vocabulary, the embedding keeps its rank's (as many)
        # and the mask of those other ranks hold (1 byte each)
        kept += tokens * (TOKEN_ID + (1 if tp > 1 else 0) + (h if m.hidden_dropout else 0))
    kept *= in_flight
    if m.activation_checkpointing:
        kept += one_layer
    terms = {"activations": kept, "logits": 0}
    if last:
        terms["activations"] += tokens * (2 * width * h + LAYER_NORM_STATS + TOKEN_ID)
        terms["logits"] = logits_bytes(tokens, v, tp, width)
    if pp > 1:
        buffers = max(2, in_flight)  # DeepSpeed's TrainSchedule.num_pipe_buffers
        held = 0 if first else (buffers + 1) * tokens * width * h
        held += 0 if last else in_flight * tokens * width * h
        terms["pipeline buffers"] = held + (min(2, gas) * tokens * width * v // tp if last else 0)
    return terms


def planned_precision(t: TrainConfig, p: Placement) -> tuple[str, str]:
    """(the precision training runs in on `p`, why): the trainer's own decision
    (gptflow.hardware.training_precision) for the GPUs the profile's gres names, or for those
    assumed (the reason then says so); on CPUs, the CPU's. ``auto`` on a GPU type the table
    does not know is refused: the trainer decides by the GPU's compute capability, which
    planning cannot know, and a plan in the wrong precision is the wrong memory estimate."""
    if t.precision != "auto" or not p.trains_on_gpus:
        return training_precision(t.precision, t.zero_stage, None, None)
    name, capability = planned_gpu(p.gpu_type)
    if capability is None:
        raise GptflowError(
            f"train.precision is auto, which the trainer decides by the GPU's compute "
            f"capability (bf16 on 8.0 and later at train.zero_stage 1+, else fp32), and the "
            f"profile's gres {p.gres} names {p.gpu_type!r}, a GPU type gptflow.hardware does "
            f"not know: set train.precision bf16 (Ampere or later) or fp32 (older GPUs)"
        )
    return training_precision(t.precision, t.zero_stage, name, capability)


def planned_train(t: TrainConfig, p: Placement) -> TrainConfig:
    """`t` with train.precision as the trainer will decide it on `p` (:func:`planned_precision`),
    refused where the trainer would refuse it (TrainConfig.check_trainable, which the config's
    load checked before ``auto`` was decided: Muon's refusal of bf16 at ZeRO 1 under a
    model-parallel grid, say)."""
    precision, why = planned_precision(t, p)
    planned = dataclasses.replace(t, precision=precision)
    if t.precision == "auto":
        try:
            planned.check_trainable()
        except GptflowError as e:
            raise GptflowError(f"train.precision auto is {precision} here ({why}): {e}") from None
    return planned


@dataclass(frozen=True)
class MemoryFit:
    terms: dict[str, int]  # bytes per GPU by what holds them, on the most loaded rank
    total: int  # the terms' sum
    gpu_bytes: int
    gpu_source: str
    margin: int = 0  # bytes left free for what the terms do not see (fit_margin)
    stage: str = ""  # which pipeline stage is the most loaded ("" without a pipeline)

    @property
    def fits(self) -> bool:
        return self.total + self.margin <= self.gpu_bytes

    @property
    def largest(self) -> str:
        return max(self.terms, key=self.terms.get)


def stage_memory(
    m: ModelConfig, t: TrainConfig, dp: int, gas: int, precision: str, stage: int
) -> dict[str, int]:
    """The terms of a rank of pipeline stage `stage`: its model state and activations."""
    h, f = m.hidden_size, m.ffn_size
    largest = max(m.vocab_size * h, 4 * h * h + 2 * h * f)  # the embedding, or a layer
    params = stage_parameters(m, t.tensor_parallel, t.pipeline_parallel, stage)
    muon, newton_schulz = muon_floats(m, t)
    return {
        **model_state_bytes(params, dp, t.zero_stage, precision, t.offload, largest, muon),
        **activation_bytes(m, t, precision, stage, gas),
        **({"K-FAC factors": 4 * kfac_floats(m)} if t.kfac else {}),  # fp32, every rank
        **muon_memory(m, t, dp, precision),
        **({"Newton-Schulz": 4 * newton_schulz} if newton_schulz else {}),
    }


def muon_floats(m: ModelConfig, t: TrainConfig) -> tuple[int, int]:
    """(parameters Muon steps on a rank of the most loaded pipeline stage, fp32 numbers of its
    largest Newton-Schulz working set), (0, 0) for AdamW (gptflow.config.settings.muon_state_floats
    for the whole model's, per layer here)."""
    if t.optimizer != "muon":
        return 0, 0
    moment, work = muon_state_floats(m, t.tensor_parallel)
    layers = -(-m.num_layers // t.pipeline_parallel)
    return moment // m.num_layers * layers, work


def memory_per_gpu(m: ModelConfig, t: TrainConfig, ranks: int, p: Placement) -> MemoryFit:
    """The most loaded rank's memory (of the first and the last pipeline stage, the larger)
    against its GPU (the profile's gpu_mem_mb, else 80 GB), less fit_margin."""
    precision = planned_precision(t, p)[0]
    dp, gas, pp = t.data_parallel_size(ranks), t.grad_accum_steps(ranks), t.pipeline_parallel
    stages = {s: stage_memory(m, t, dp, gas, precision, s) for s in sorted({0, pp - 1})}
    worst = max(stages, key=lambda s: sum(stages[s].values()))
    name = "" if pp == 1 else ("first pipeline stage" if worst == 0 else "last pipeline stage")
    gpu_mb = p.gpu_mem_mb or DEFAULT_GPU_MEMORY_MB
    source = p.gpu_mem_source or (
        "set-resources train_gpt gpu_mem_mb" if p.gpu_mem_mb else "assumed: 80 GB GPUs"
    )
    gpu = gpu_mb * 1024**2
    terms = stages[worst]
    return MemoryFit(terms, sum(terms.values()), gpu, source, fit_margin(gpu), name)


FIXES = {
    "weights": "raise train.tensor_parallel or train.pipeline_parallel, or train.zero_stage 3",
    "gradients": "raise train.zero_stage to 2, or train.tensor_parallel",
    "fp32 gradient partition": "use more data-parallel ranks, or raise train.tensor_parallel",
    "fp32 gradient accumulation": "raise train.zero_stage to 2, or train.tensor_parallel",
    "gathered layer": "raise train.tensor_parallel",
    "gradient bucket": "use train.zero_stage 0 or 3, or GPUs with more memory: DeepSpeed's ZeRO "
    "1/2 reduce gradients through a bucket of 5e8 elements allocated whole, whatever the model",
    "optimizer states": "raise train.zero_stage (1 partitions them over the data-parallel "
    "ranks), or train.offload optimizer",
    "activations": "set model.activation_checkpointing true, or lower train.micro_batch_size",
    "logits": "lower train.micro_batch_size (or train.seq_length), or raise "
    "train.tensor_parallel: each tensor-parallel rank holds its share of the vocabulary's logits",
    "pipeline buffers": "lower train.micro_batch_size",
    "Newton-Schulz": "raise train.tensor_parallel: each rank orthogonalizes its block of the "
    "largest matrix",
    "Muon momentum": "raise train.zero_stage (1 partitions it over the data-parallel ranks)",
    "Muon staged momentum": "raise train.tensor_parallel (smaller matrices) or use more "
    "data-parallel ranks: ZeRO 1/2 holds the Muon matrices a partition touches whole, twice "
    "(committed and staged)",
    "Muon gather cache": "use train.zero_stage 1 or 2: ZeRO 3's Muon update keeps its gather "
    "buffers up to 256 MiB",
    "Muon update": "use train.zero_stage 1 or 2, or fewer data-parallel ranks: ZeRO 3's Muon "
    "update gathers each bucket's gradients and momenta and pads each round's to data-parallel "
    "ranks x its largest matrix",
    "K-FAC factors": "set train.kfac null: its factors grow with the square of each layer's "
    "width (model.intermediate_size above all) and are not partitioned",
}


def human(n: int) -> str:
    """Bytes as GiB, or MiB below a tenth of one."""
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def margin_text(fit: MemoryFit) -> str:
    return (
        f"margin {human(fit.margin)}: {human(RUNTIME_OVERHEAD_BYTES)} CUDA context and NCCL "
        f"buffers + {FRAGMENTATION_SHARE:.0%} of the GPU for allocator fragmentation"
    )


def check_memory(fit: MemoryFit) -> None:
    if fit.fits:
        return
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in fit.terms.items())
    where = f" on the {fit.stage}" if fit.stage else ""
    raise GptflowError(
        f"the model does not fit in a GPU: about {fit.total / GIB:.1f} GiB per GPU{where} "
        f"({parts} GiB) + {margin_text(fit)}, against {fit.gpu_bytes / GIB:.0f} GiB "
        f"({fit.gpu_source}); the largest is {fit.largest}: {FIXES[fit.largest]}"
    )
