"""What a run trains: the model's architecture (:class:`ModelConfig`) and the training
settings (:class:`TrainConfig`), frozen dataclasses whose checks run when they are made.

Derived numbers are computed here, once: parameters and FLOPs per token (the trainer, the
preflight and the report call the same methods), gradient accumulation, the data-parallel size
and rank of a layout. The workflow config is read and validated by
:mod:`gptflow.plan.workflow_config`; the resolved input of ``gptflow train`` is
:mod:`gptflow.train.run_config`.

Over 500 lines: the two dataclasses, their cross-field checks and every number derived from
them (FLOPs per token with K-FAC's and Muon's, the optimizers' states, Muon's buckets), read by
the trainer, the preflight and the report; split, one would have two homes or an import circle.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from gptflow.errors import GptflowError


@dataclass(frozen=True)
class ModelConfig:
    """GPT-NeoX architecture. Field names follow Hugging Face ``GPTNeoXConfig`` where one exists."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 0  # padded embedding rows; set from the tokenizer by the run config
    intermediate_size: int | None = None  # None = 4 x hidden_size
    rotary_pct: float = 0.25
    rotary_emb_base: float = 10000.0
    parallel_residual: bool = True
    layer_norm_eps: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    max_position_embeddings: int = 2048
    make_vocab_size_divisible_by: int = 128
    init_std: float | None = None  # None = sqrt(2 / (5 x hidden_size))
    activation_checkpointing: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise GptflowError(
                f"model.hidden_size {self.hidden_size} is not a multiple of "
                f"model.num_attention_heads {self.num_attention_heads}; change one of them"
            )
        if self.rotary_ndims % 2:
            raise GptflowError(
                f"model.rotary_pct {self.rotary_pct} gives {self.rotary_ndims} rotary dimensions per "
                f"head (head size {self.head_dim}); it must be even - adjust model.rotary_pct"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_ndims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def num_parameters(self) -> int:
        """Parameter count (embedding and untied output head included).

        The one home of this number: the trainer's start-up line, the preflight and the report
        call it, so it is right under ZeRO-3 (where live parameters are partitions) and for
        models never built."""
        d, f, v, n = self.hidden_size, self.ffn_size, self.vocab_size, self.num_layers
        per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return v * d + n * per_layer + 2 * d + v * d

    def largest_tensor_numel(self) -> int:
        """Elements of the model's largest tensor: an embedding (vocabulary x hidden), the
        fused query/key/value projection, or an MLP matrix."""
        h = self.hidden_size
        return max(self.vocab_size * h, 3 * h * h, h * self.ffn_size)

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward), Megatron-LM's formula.

        Per layer: the QKV and output projections (4 h^2) and the MLP (2 h f) as matrix
        multiplies (2 FLOPs per multiply-add), plus attention's scores and weighted values
        (2 s h, causal masking not discounted, as Megatron counts it); once per token the
        logits (h V). Biases, LayerNorms, rotary and the softmax are left out. With f = 4h this
        is Megatron's 72 L h^2 (1 + s/(6h) + V/(12 L h)) per token (Narayanan et al. 2021).
        """
        h, f, v, n = self.hidden_size, self.ffn_size, self.vocab_size, self.num_layers
        forward = n * (2 * (4 * h * h + 2 * h * f) + 4 * seq_length * h) + 2 * h * v
        return 3.0 * forward


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging (keys of ``train.wandb:``); see the schema."""

    enabled: bool = False
    mode: str = "offline"  # offline | online
    project: str = "gptflow"
    entity: str | None = None
    name: str | None = None  # None = RUN-SERIES


def check_wandb(wandb: WandbConfig, source: str) -> None:
    """An enabled train.wandb can run here: the wandb package is importable (looked up, not
    imported: wandb takes a second to import) and, online, $WANDB_API_KEY is set. Called when
    the workflow is planned and when training starts."""
    import importlib.util
    import sys

    if not wandb.enabled:
        return
    if importlib.util.find_spec("wandb") is None:
        raise GptflowError(
            f"{source}: train.wandb.enabled is true, but the wandb package is not installed in "
            f"{sys.prefix}; install it with pip install 'gptflow[wandb]' (or set "
            f"train.wandb.enabled: false)"
        )
    if wandb.mode == "online" and not os.environ.get("WANDB_API_KEY"):
        raise GptflowError(
            f"{source}: train.wandb.mode is 'online', but $WANDB_API_KEY is not set; export it "
            f"(the key is read from the environment only, never from a config file), or set "
            f"train.wandb.mode: offline and upload later with `wandb sync`"
        )


@dataclass(frozen=True)
class KfacConfig:
    """K-FAC preconditioning (keys of ``train.kfac:``; kfac-pytorch's names, as llm-pytorch's
    ``--kfac-*`` flags); see the schema and :mod:`gptflow.train.kfac`."""

    factor_update_steps: int = 5  # steps between factor updates
    inv_update_steps: int = 50  # steps between eigendecompositions
    damping: float = 0.003  # added to each eigenvalue product
    factor_decay: float = 0.95  # running average: decay x old + (1 - decay) x new


@dataclass(frozen=True)
class MuonConfig:
    """Muon's settings (keys of ``train.muon:``, read when ``train.optimizer`` is muon); see the
    schema and :func:`gptflow.train.engine.build_engine`."""

    lr: float | None = None  # None: RMS-matched to AdamW's train.lr (muon_lr_scale)
    momentum: float = 0.95  # Nesterov momentum of the orthogonalized matrices
    ns_method: str = "gram"  # DeepSpeed's Newton-Schulz: gram | standard
    weight_decay: float | None = None  # decoupled, on Muon's matrices; None: train.weight_decay


@dataclass(frozen=True)
class ElasticConfig:
    """Keys of ``train.elastic:`` (torchrun's ``--nnodes=MIN:MAX``); see the schema."""

    min_nodes: int
    max_nodes: int  # at least min_nodes (gptflow.plan.placement.check_elastic)
    max_restarts: int = 3  # after failed ranks; a membership change uses none
    join_timeout_s: int = 600  # torchrun's join_timeout
    last_call_s: int = 30  # torchrun's last_call_timeout
    keep_alive_s: int = 5  # c10d's keep_alive_interval: a node silent 3 of them is lost


# Newton-Schulz iterations per Muon update: DeepSpeed 0.19.8 calls its muon_update without
# ns_steps wherever it runs it (ZeRO 0-3), so its default, 5, is what every layout computes.
MUON_NS_STEPS = 5
# Moonlight's RMS matching ("Muon is Scalable for LLM Training", 2025): an update of RMS
# 0.2 x lr, AdamW's typical update RMS, so AdamW's learning rate and schedule carry over.
MUON_MATCHED_RMS = 0.2
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and schedule (keys of ``train:``); see the schema for units."""

    train_iters: int
    seed: int = 1234
    seq_length: int = 256
    micro_batch_size: int = 8
    global_batch_size: int = 16
    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "fp32"
    zero_stage: int = 0
    tensor_parallel: int = 1  # ranks that share each layer's matrices (Megatron's split)
    pipeline_parallel: int = 1  # stages the layers are split into (DeepSpeed's PipelineModule)
    offload: str = "none"
    compile: bool = False  # torch.compile through DeepSpeed's engine.compile
    peak_tflops: float | None = None  # per device, for MFU; None = from the GPU's name
    distributed_timeout_minutes: float = 30.0
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    save_interval: int = 100
    keep_last: int = 2
    keep_every: int | None = None  # checkpoints at multiples of it are never pruned
    # snapshot to host memory, write in the background (gptflow.train.async_save); auto: with GPUs
    async_save: bool | str = "auto"
    kfac: KfacConfig | None = None  # K-FAC preconditioning; None = off
    optimizer: str = "adamw"  # adamw | muon (Muon on the hidden matrices, AdamW on the rest)
    muon: MuonConfig = field(default_factory=MuonConfig)
    elastic: ElasticConfig | None = None  # torchrun --nnodes=MIN:MAX; None = fixed ranks
    log_samples: bool = False  # each rank's sample indices per step to samples.jsonl
    autotune_trial: bool = False  # set by autotune: timed steps, no evaluation, no checkpoint

    def __post_init__(self) -> None:
        if isinstance(self.elastic, dict):
            object.__setattr__(self, "elastic", ElasticConfig(**self.elastic))
        if isinstance(self.wandb, dict):  # from the config or run.yaml
            object.__setattr__(self, "wandb", WandbConfig(**self.wandb))
        if isinstance(self.kfac, dict):
            object.__setattr__(self, "kfac", KfacConfig(**self.kfac))
        if isinstance(self.muon, dict):
            object.__setattr__(self, "muon", MuonConfig(**self.muon))
        if self.global_batch_size % self.micro_batch_size:
            raise GptflowError(
                f"train.global_batch_size {self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size {self.micro_batch_size}; change one of them"
            )
        if self.offload != "none" and self.zero_stage == 0:
            raise GptflowError(
                f"train.offload {self.offload} needs ZeRO: set train.zero_stage to 1, 2 or 3"
            )
        if self.offload == "optimizer_and_params" and self.zero_stage != 3:
            raise GptflowError(
                f"train.offload optimizer_and_params offloads parameters, which only ZeRO stage 3 "
                f"partitions: set train.zero_stage 3 (it is {self.zero_stage}) or offload: optimizer"
            )
        if self.keep_every is not None and self.keep_every % self.save_interval:
            raise GptflowError(
                f"train.keep_every {self.keep_every} is not a multiple of train.save_interval "
                f"{self.save_interval}: only saved steps can be kept; use a multiple of it"
            )
        if self.min_lr > self.lr:
            raise GptflowError(f"train.min_lr {self.min_lr} is above train.lr {self.lr}; lower it")
        if self.lr_warmup_iters >= self.decay_iters and self.lr_decay_style != "constant":
            raise GptflowError(
                f"train.lr_warmup_iters {self.lr_warmup_iters} must be below the decay length "
                f"{self.decay_iters} (train.lr_decay_iters, or train.train_iters when unset)"
            )

    def check_trainable(self) -> None:
        """What DeepSpeed cannot train right, refused when a run is planned or started (not
        when an existing run is read, e.g. to export it)."""
        if self.precision == "bf16" and self.zero_stage == 0:
            raise GptflowError(
                "train.precision bf16 needs train.zero_stage 1 or more: at stage 0 DeepSpeed "
                "trains bf16 through its FP16_UnfusedOptimizer, whose dummy first step leaves "
                "Adam's step count one ahead (the first update ~0.73x its size), and it cannot "
                "sum gradients in fp32. Set train.zero_stage 1 (DeepSpeed's BF16_Optimizer: fp32 "
                "master weights and gradient accumulation; on one rank it partitions nothing)"
            )
        if self.precision == "fp16" and self.zero_stage == 0:
            # measured (DeepSpeed 0.19.8, one rank): the held gradient's norm is the true one
            # (1.14), not 2^16 times it, and the first update is 0.73 lr, not ~1 lr
            raise GptflowError(
                "train.precision fp16 needs train.zero_stage 1 or more: at stage 0 DeepSpeed "
                "trains fp16 through its FP16_UnfusedOptimizer, whose engine.backward never "
                "scales the loss while its step divides the gradients by the loss scale (2^16 "
                "at the start: small gradients underflow fp16, updates shrink where Adam's eps "
                "matters), and whose dummy first step leaves Adam's step count one ahead. Set "
                "train.zero_stage 1 (fp32 master weights and gradient sums, the loss scaled; on "
                "one rank it partitions nothing)"
            )
        if self.tensor_parallel > 1 and self.zero_stage == 0:
            raise GptflowError(
                f"train.tensor_parallel {self.tensor_parallel} needs train.zero_stage 1 or 2: a "
                "tensor-parallel checkpoint is exported and moved to other layouts through "
                "DeepSpeed's universal checkpoint, which reads ZeRO 1/2 optimizer partitions. "
                "Set train.zero_stage 1 (Megatron's distributed optimizer)"
            )
        if self.pipeline_parallel > 1 and self.zero_stage != 1:
            raise GptflowError(
                f"train.pipeline_parallel {self.pipeline_parallel} needs train.zero_stage 1 (it "
                f"is {self.zero_stage}): DeepSpeed's pipeline engine refuses ZeRO 2 and 3 (each "
                "stage would partition gradients it accumulates over micro-batches), and "
                "gptflow exports pipeline checkpoints from ZeRO 1's fp32 partitions"
            )
        self.check_muon()
        if self.tensor_parallel > 1 and self.zero_stage == 3:
            raise GptflowError(
                f"train.tensor_parallel {self.tensor_parallel} with train.zero_stage 3 is not "
                "supported: DeepSpeed's AutoTP splits a model built whole on every rank, which "
                "is what ZeRO-3's partitioned construction exists to avoid, and the two together "
                "have not been verified here. Use train.zero_stage 1 or 2 with tensor parallel "
                "(stage 1 is Megatron's distributed optimizer)"
            )

    def check_muon(self) -> None:
        """The combinations train.optimizer muon is refused with, one line each (part of
        :meth:`check_trainable`: at ``snakemake -n`` and when training starts)."""
        if self.optimizer != "muon":
            return
        refused = [
            (self.kfac is not None, "train.kfac",
             "K-FAC preconditions the gradients AdamW steps on, and Muon orthogonalizes them "
             "again, undoing it; set train.kfac null or train.optimizer adamw"),
            (self.offload != "none", f"train.offload {self.offload}",
             "DeepSpeed orthogonalizes offloaded Muon gradients on a path of its own that has "
             "not been verified here; set train.offload none"),
            (self.clip_grad > 0, f"train.clip_grad {self.clip_grad}",
             "at ZeRO 1-3 DeepSpeed 0.19.8 clips by the norm of the orthogonalized Muon updates "
             "and AdamW's gradients together (every update shrinks by ~that norm, ~sqrt of the "
             "matrices' summed widths), at ZeRO 0 by the raw gradients' -- another trajectory "
             "per stage; set train.clip_grad 0"),
            (self.precision == "bf16" and self.zero_stage == 1 and self.model_parallel > 1,
             f"train.precision bf16 at train.zero_stage 1 with {self.model_parallel}-way "
             "tensor x pipeline parallel",
             "DeepSpeed's BF16_Optimizer (bf16 at ZeRO 1) refuses Muon under a model-parallel "
             "grid (\"BF16 Muon currently requires FP32 accumulation, dense DP\"); use "
             "train.zero_stage 2 (tensor parallel) or train.precision fp32"),
            (self.precision == "fp16", "train.precision fp16",
             "DeepSpeed's fp16 Muon (its loss-scale handling of the orthogonalized updates, "
             "Newton-Schulz in fp16 on GPUs) has not been verified here (no fp16 on this "
             "project's CPUs); use train.precision bf16 or fp32"),
        ]  # fmt: skip
        for bad, what, why in refused:
            if bad:
                raise GptflowError(f"train.optimizer muon is not supported with {what}: {why}")

    def kept_for_good(self, step: int) -> bool:
        """Whether checkpoint `step` outlives keep_last (a multiple of train.keep_every): the
        steps a learning curve over checkpoints reads (eval.harness.every)."""
        return self.keep_every is not None and step % self.keep_every == 0

    def saved_steps(self) -> list[int]:
        """The steps a run that is not stopped saves: every save_interval, and the last."""
        return sorted({*range(self.save_interval, self.train_iters + 1, self.save_interval),
                       self.train_iters})  # fmt: skip

    def kept_steps(self) -> list[int]:
        """The checkpoints on disk after the run: the last keep_last saved, and those kept
        for good (:meth:`kept_for_good`), as :meth:`gptflow.train.checkpoint.CheckpointSeries.prune`
        leaves them."""
        saved = self.saved_steps()
        last = set(saved[-self.keep_last :])
        return [s for s in saved if s in last or self.kept_for_good(s)]

    def checkpoints_on_disk(self) -> int:
        """The most checkpoints on disk at once: keep_last, the one being written, and those
        kept for good before the last keep_last (the disk the preflight counts)."""
        saved = self.saved_steps()
        early = [s for s in saved[: -self.keep_last] if self.kept_for_good(s)]
        return self.keep_last + 1 + len(early)

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.train_iters

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model between them: tensor x pipeline parallel."""
        return self.tensor_parallel * self.pipeline_parallel

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks: the ranks / (tensor_parallel x pipeline_parallel)."""
        if world_size % self.model_parallel:
            parts = [
                f"train.{key} {n}"
                for key, n in (
                    ("tensor_parallel", self.tensor_parallel),
                    ("pipeline_parallel", self.pipeline_parallel),
                )
                if n > 1
            ]
            keys = " x ".join(parts)
            if len(parts) > 1:
                keys += f" = {self.model_parallel}"
            raise GptflowError(
                f"{keys} does not divide the {world_size} training ranks; give the training rule "
                f"a multiple of {self.model_parallel} ranks (the profile's nodes x "
                f"tasks_per_node, or nproc_per_node on one machine) or change "
                f"{' or '.join(p.split()[0] for p in parts)}"
            )
        return world_size // self.model_parallel

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        """The data-parallel rank of global rank `rank`, as DeepSpeed lays the ranks out:
        rank = (stage x dp + data rank) x tp + tensor rank (its pipe x data x model grid).

        A tensor-parallel group is `tp` neighbouring ranks (so it stays inside a node) and
        reads the samples of its data-parallel rank; each pipeline stage is a contiguous block
        of ranks, and a pipeline spans the blocks."""
        return (rank // self.tensor_parallel) % self.data_parallel_size(world_size)

    def pipeline_stage(self, rank: int, world_size: int) -> int:
        """The pipeline stage of global rank `rank`, in the same grid (:meth:`data_parallel_rank`)."""
        return rank // (self.tensor_parallel * self.data_parallel_size(world_size))

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank: global / (micro x data-parallel ranks)."""
        dp = self.data_parallel_size(world_size)
        per_pass = self.micro_batch_size * dp
        if self.global_batch_size % per_pass:
            ranks = f"{dp} ranks"
            if self.model_parallel > 1:
                ranks = (
                    f"{dp} data-parallel ranks ({world_size} ranks / {self.model_parallel} "
                    f"per model copy)"
                )
            fixes = [f"train.global_batch_size a multiple of {per_pass}"]
            if self.global_batch_size % dp == 0:
                per_rank = self.global_batch_size // dp
                fits = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
                fixes.append(f"train.micro_batch_size one of {fits[-6:]}")
            fixes.append(
                "fewer ranks (the profile's nodes x tasks_per_node, or nproc_per_node on one "
                "machine)"
            )
            raise GptflowError(
                f"train.global_batch_size {self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size {self.micro_batch_size} x {ranks} = {per_pass}: a "
                f"step is whole micro-batches on every data-parallel rank; set "
                f"{', or '.join(fixes)}"
            )
        return self.global_batch_size // per_pass

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
        if self.lr_warmup_iters and step < self.lr_warmup_iters:
            return self.lr * (step + 1) / self.lr_warmup_iters
        if self.lr_decay_style == "constant":
            return self.lr
        progress = (step - self.lr_warmup_iters) / max(1, self.decay_iters - self.lr_warmup_iters)
        progress = min(1.0, max(0.0, progress))
        if self.lr_decay_style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coeff * (self.lr - self.min_lr)

    @property
    def tokens_per_step(self) -> int:
        return tokens_per_step(self.global_batch_size, self.seq_length)


def check_kfac(model: ModelConfig, train: TrainConfig) -> None:
    """The layouts train.kfac is refused with, one line each: its factors are of whole,
    replicated nn.Linear layers, on the steps of a plain forward and backward."""
    if train.kfac is None:
        return
    refused = [
        (train.tensor_parallel > 1, f"train.tensor_parallel {train.tensor_parallel}",
         "a tensor-parallel rank holds a slice of each layer, and its factors would need the "
         "whole layer's activations; set train.tensor_parallel 1"),
        (train.pipeline_parallel > 1, f"train.pipeline_parallel {train.pipeline_parallel}",
         "DeepSpeed's pipeline schedule runs forward and backward itself, where the step's "
         "last gradient is not in reach; set train.pipeline_parallel 1"),
        (train.zero_stage == 3, "train.zero_stage 3",
         "ZeRO 3 partitions the weights the factors are of; use train.zero_stage 0, 1 or 2"),
        (train.offload != "none", f"train.offload {train.offload}",
         "the offloaded gradients have not been verified with it; set train.offload none"),
        (train.compile, "train.compile true",
         "its hooks (a Python count per layer call) have not been verified under "
         "torch.compile; set train.compile false"),
        (model.activation_checkpointing, "model.activation_checkpointing true",
         "the recomputed forward would count each layer's inputs twice; set it false"),
    ]  # fmt: skip
    for bad, what, why in refused:
        if bad:
            raise GptflowError(
                f"train.kfac is not supported with {what}: {why}, or train.kfac null"
            )


def kfac_layer_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """(rows of the input factor A, rows of the output-gradient factor G) of each nn.Linear
    that K-FAC preconditions: per transformer layer the fused query/key/value and attention
    output projections and the two MLP matrices, all with biases (an input row of ones, so
    A is (inputs + 1) square)."""
    d, f = model.hidden_size, model.ffn_size
    per_layer = [(d + 1, 3 * d), (d + 1, d), (d + 1, f), (f + 1, d)]
    return per_layer * model.num_layers


def kfac_floats(model: ModelConfig) -> int:
    """fp32 numbers K-FAC holds on every rank (:class:`gptflow.train.kfac.Kfac`, which checks
    it holds exactly these): each layer's factors A and G, their eigenbases, the step's
    statistics being gathered (each as large as the factors), and the eigenvalues. The one
    home of this count: the preflight's memory check and the trainer's start-up line."""
    return sum(3 * (a * a + g * g) + a + g for a, g in kfac_layer_shapes(model))


MUON_LAYER = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h",
              "mlp.dense_4h_to_h")  # fmt: skip


def muon_matrix_shapes(model: ModelConfig, tensor_parallel: int = 1) -> list[tuple[int, int]]:
    """(rows, columns) of each matrix Muon orthogonalizes, as a tensor-parallel rank holds it
    (gptflow.train.model_parallel.TENSOR_PARALLEL_PLAN: query_key_value and dense_h_to_4h split by
    rows, dense and dense_4h_to_h by columns): per layer the weights of :data:`MUON_LAYER`.
    DeepSpeed runs Newton-Schulz on the matrix a rank holds, so at tensor_parallel > 1 each
    rank's block is orthogonalized on its own (Megatron-Core's ``blockwise`` Muon)."""
    return list(muon_layer_shapes(model, tensor_parallel).values()) * model.num_layers


def muon_layer_shapes(model: ModelConfig, tensor_parallel: int = 1) -> dict[str, tuple[int, int]]:
    """(rows, columns) of one layer's Muon matrices by :data:`MUON_LAYER` name, as a
    tensor-parallel rank holds them (:func:`muon_matrix_shapes`)."""
    h, f, t = model.hidden_size, model.ffn_size, tensor_parallel
    shapes = [(3 * h // t, h), (h, h // t), (f // t, h), (h, f // t)]
    return dict(zip(MUON_LAYER, shapes, strict=True))


def muon_lr_scale(rows: int, cols: int) -> float:
    """What train.lr is multiplied by to give the lr DeepSpeed's Muon applies to a (rows x cols)
    matrix under RMS matching: Moonlight's update is lr x 0.2 x sqrt(max(rows, cols)) x the
    orthogonalized matrix, DeepSpeed's lr x sqrt(max(1, rows / cols)) x the same; the ratio is
    0.2 x sqrt(cols) (either way round)."""
    return MUON_MATCHED_RMS * math.sqrt(max(rows, cols)) / math.sqrt(max(1.0, rows / cols))


def muon_lr(train: TrainConfig, rows: int, cols: int) -> float:
    """The peak lr of a (rows x cols) Muon matrix (as the rank holds it): train.muon.lr, or
    under RMS matching train.lr x :func:`muon_lr_scale`. The engine groups Muon's matrices by
    it (gptflow.train.engine.optimizer_groups), the preflight counts those groups
    (gptflow.plan.muon.muon_groups)."""
    if train.muon.lr is not None:
        return train.muon.lr
    return train.lr * muon_lr_scale(rows, cols)


def newton_schulz_flops(rows: int, cols: int, method: str, steps: int = MUON_NS_STEPS) -> float:
    """Matrix-multiply FLOPs (2 per multiply-add) of DeepSpeed's Newton-Schulz on one (rows x
    cols) matrix, n = min, m = max of the two. ``standard`` (zeropower_via_newtonschulz5): per
    step X Xᵀ (2n²m), A² (2n³), B X (2n²m). ``gram`` (zeropower_via_gram_newtonschulz) on a
    non-square matrix iterates on the n x n Gram matrix, step by step as its loop does: R = X Xᵀ
    first; per step Z = b R + c R² (2n³) and Q = a Q + Z Q (2n³, not where Q starts: the
    first step and the restart); R's update (two products) but after the last step and before
    the restart at step 2; the restart's Q X and X Xᵀ and the final Q X (2n²m each). Square
    matrices run the standard iteration."""
    n, m = min(rows, cols), max(rows, cols)
    if method == "standard" or n == m:
        return steps * (4.0 * n * n * m + 2.0 * n**3)
    restart = 2  # DeepSpeed's restart_at
    wide, square, fresh_q = 2, 0, True  # X Xᵀ and the final Q X
    for i in range(steps):
        if i == restart:
            wide, fresh_q = wide + 2, True
        square += 1 if fresh_q else 2
        fresh_q = False
        if i < steps - 1 and i + 1 != restart:
            square += 2
    return wide * 2.0 * n * n * m + square * 2.0 * n**3


def optimizer_flops_per_step(model: ModelConfig, train: TrainConfig) -> float:
    """FLOPs of an optimizer step beyond elementwise work: 0 for AdamW; for Muon, Newton-
    Schulz on every matrix (:func:`muon_matrix_shapes`: each rank's blocks at tensor
    parallel), counted once per step as a model replica's work (ranks that repeat it, data-
    parallel ranks at ZeRO 0, add time, not useful FLOPs)."""
    if train.optimizer != "muon":
        return 0.0
    t = train.tensor_parallel
    return t * sum(
        newton_schulz_flops(r, c, train.muon.ns_method) for r, c in muon_matrix_shapes(model, t)
    )


def training_flops_per_token(model: ModelConfig, train: TrainConfig) -> float:
    """The FLOPs per trained token that MFU and the run's compute count: the model's forward
    and backward (:meth:`ModelConfig.flops_per_token`) and the optimizer's step spread over the
    step's tokens (:func:`optimizer_flops_per_step`). The one home for the trainer's log line,
    the preflight's GPU-hours and the run's derived numbers."""
    extra = optimizer_flops_per_step(model, train) / train.tokens_per_step
    return model.flops_per_token(train.seq_length) + extra


def muon_state_floats(model: ModelConfig, tensor_parallel: int = 1) -> tuple[int, int]:
    """(fp32 numbers of Muon's momentum, of its largest Newton-Schulz working set) on a rank
    before ZeRO partitioning: one moment per matrix element where AdamW keeps two; the
    working set of one matrix (n = min, m = max side) the fp32 gradient view (nm), the
    normalized copy (nm), and the n x n Gram terms the iteration keeps at once (R, Z, Q and
    R Z or A, A², B: 4n²) -- an estimate from the code's tensors, not measured."""
    shapes = muon_matrix_shapes(model, tensor_parallel)
    moment = sum(r * c for r, c in shapes)
    work = max(2 * r * c + 4 * min(r, c) ** 2 for r, c in shapes)
    return moment, work


DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000  # zero_optimization.reduce_bucket_size's default


def muon_reduce_bucket_size(train: TrainConfig, dp: int, largest: int) -> int | None:
    """The zero_optimization.reduce_bucket_size (elements) a Muon run at ZeRO 3 gives DeepSpeed
    on `dp` data-parallel ranks, its largest Muon matrix `largest` elements; None elsewhere
    (DeepSpeed's default, 5e8). The engine's config and the preflight's count both call it.

    DeepSpeed's ZeRO-3 Muon update gathers the gradients and momenta of a bucket's matrices at
    once (about 3 x the bucket: gptflow.plan.muon.zero3_update) and hands them out in rounds of
    one matrix per rank; a round with fewer matrices than ranks still sends every rank dp x its
    largest matrix, mostly zeros. dp x the largest matrix is the smallest bucket that fills a
    round (no rank sits a round out for want of matrices but at a bucket's end), and its
    gathers (about 3 dp x the largest matrix) stay below what a round takes on GPUs anyway
    ((4 dp + 2) x the largest matrix: DeepSpeed's padded buffers and NCCL's flat copies). At
    Pythia-1.4B bf16 on 8 ranks (on paper) it lowers the update's peak from 6.7 to 4.0 GB for
    12 % more of its traffic (15.0 -> 16.7 GB, against the step's 317 GB). DeepSpeed's default
    caps it: where dp x the largest matrix is more (Pythia-6.9B from 8 ranks), a smaller
    bucket pads more rounds and a larger one gathers more, so the default stays and the
    preflight weighs the update's memory and traffic (gptflow.plan.muon.check_traffic). It
    also sizes ZeRO 3's gradient-reduction bucket, a buffer kept between steps: at 1B
    parameters and up >= 2 x 16.8M elements, large enough for NCCL's bandwidth.
    """
    if train.optimizer != "muon" or train.zero_stage != 3:
        return None
    return min(DEEPSPEED_REDUCE_BUCKET_SIZE, dp * largest)


def tokens_per_step(global_batch_size: int, seq_length: int) -> int:
    """The tokens one optimizer step trains on (TrainConfig.tokens_per_step)."""
    return global_batch_size * seq_length


def steps_for_tokens(tokens: int, global_batch_size: int, seq_length: int) -> int:
    """The steps that train on at least `tokens` tokens (a study's `tokens`), 1 or more; from
    the train keys, before a run's settings are a TrainConfig (its checks read train_iters)."""
    return max(1, math.ceil(tokens / tokens_per_step(global_batch_size, seq_length)))


def check_context(model: ModelConfig, train: TrainConfig) -> None:
    """A sequence fits the model's positions (checked when a run is planned, and when its
    run.yaml is read)."""
    if train.seq_length > model.max_position_embeddings:
        raise GptflowError(
            f"train.seq_length {train.seq_length} exceeds model.max_position_embeddings "
            f"{model.max_position_embeddings}; raise the latter or shorten the sequences"
        )


def check_model_parallel(model: ModelConfig, train: TrainConfig) -> None:
    """Megatron's split needs whole heads and whole MLP columns on every rank, and as many
    layers on every pipeline stage (a stage with one layer more than the others sets the
    pace of the whole pipeline)."""
    pp = train.pipeline_parallel
    if pp > model.num_layers:
        raise GptflowError(
            f"train.pipeline_parallel {pp} exceeds model.num_layers {model.num_layers}: every "
            f"stage holds at least one layer; lower train.pipeline_parallel"
        )
    if model.num_layers % pp:
        fits = [n for n in range(2, model.num_layers + 1) if model.num_layers % n == 0]
        raise GptflowError(
            f"train.pipeline_parallel {pp} does not divide model.num_layers {model.num_layers}: "
            f"every stage holds as many layers (Megatron's rule); use one of {fits[:8]}"
        )
    tp = train.tensor_parallel
    if tp == 1:
        return
    for key, value in (
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.intermediate_size (default 4 x hidden_size)", model.ffn_size),
    ):
        if value % tp:
            raise GptflowError(
                f"train.tensor_parallel {tp} does not divide {key} {value}: each rank holds "
                f"1/{tp} of the attention heads and of the MLP; pick a tensor_parallel that "
                f"divides both ({model.num_attention_heads} heads, {model.ffn_size} MLP columns)"
            )
    # The vocabulary is split too (each rank holds 1/tp of the embedding's and the head's rows).
    # Its padding does not follow tensor_parallel (Megatron pads to the multiple x tp): the
    # checkpoint's shape must not change when a run moves to another tensor_parallel.
    multiple = model.make_vocab_size_divisible_by
    if multiple % tp or model.vocab_size % tp:
        key, value = ("model.make_vocab_size_divisible_by", multiple)
        if model.vocab_size % tp:
            key, value = ("model.vocab_size", model.vocab_size)
        raise GptflowError(
            f"train.tensor_parallel {tp} does not divide {key} {value}: each rank holds 1/{tp} of the "
            f"vocabulary (the embedding's and the output head's rows, padded to a multiple of "
            f"model.make_vocab_size_divisible_by); set model.make_vocab_size_divisible_by to "
            f"a multiple of {tp} (e.g. {math.lcm(multiple, tp)}) when the run starts -- "
            f"the padding fixes the checkpoint's shape -- or pick a tensor_parallel that "
            f"divides {multiple}"
        )


MODEL_CHOICES = ("preset", "init_from")


def architecture(model: dict) -> dict:
    """The ModelConfig keys of a workflow config's resolved `model:` section."""
    return {k: v for k, v in model.items() if k not in MODEL_CHOICES}
