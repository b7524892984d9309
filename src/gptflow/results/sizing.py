"""The jobs after training, sized from the model: how evaluation places the model on GPUs, and
the memory and time of the evaluate and export_hf jobs.

One home for these figures: the rules ask for them as the jobs' resources, the preflight checks
them against the profile at ``-n`` and prints them, and ``gptflow evaluate`` places the model by
the same plan on the GPUs it was given. Pure arithmetic on
:class:`gptflow.config.settings.ModelConfig` (planning imports neither torch nor DeepSpeed). The
margins an estimate leaves free, which training's fit check shares, are gptflow.hardware's
(:func:`gptflow.hardware.fit_margin`); the bytes of text a token, gptflow.data.tokenizer's.

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

from gptflow.config.settings import ModelConfig
from gptflow.data.tokenizer import BYTES_PER_TOKEN_OF_TEXT
from gptflow.hardware import HOST_OVERHEAD_BYTES, fit_margin

MIB = 2**20
GIB = 2**30
EVAL_BATCH = 8  # windows per forward pass


# Sequential read + write of the fp32 weights by the export (a parallel file system gives a
# single stream 200-1000 MB/s; the lower figure, so a time limit is not hit on a busy one)
EXPORT_BYTES_PER_S = 200 * 10**6
# Loading the weights onto the GPUs (read memory-mapped, copied one tensor at a time)
LOAD_BYTES_PER_S = 500 * 10**6
# Evaluation compute: forward FLOPs (2 per parameter per token) at EVAL_UTILISATION of an A100's
# peak in the placement's dtype: 312 TFLOP/s in bf16 (tensor cores); 19.5 in fp32 (PyTorch
# leaves TF32 off for matmuls: torch.backends.cuda.matmul.allow_tf32 is False by default).
# Generations add a few forward passes per new token.
PEAK_TFLOPS = {"bf16": 312.0, "fp32": 19.5}
EVAL_UTILISATION = 0.2
MIN_RUNTIME_MIN = 10  # a job's floor: start-up, imports, the shard index


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


def forward_minutes(model: ModelConfig, tokens: int, dtype: str) -> int:
    """Minutes of a job that loads the fp32 weights and runs forward passes over `tokens`
    tokens in `dtype` (PEAK_TFLOPS x EVAL_UTILISATION), doubled for a shared, busy cluster;
    at least MIN_RUNTIME_MIN. The evaluate and harness jobs alike."""
    load = 4 * model.num_parameters() / LOAD_BYTES_PER_S
    flops_per_s = PEAK_TFLOPS[dtype] * EVAL_UTILISATION * 1e12
    compute = 2 * model.num_parameters() * tokens / flops_per_s
    return max(MIN_RUNTIME_MIN, math.ceil(2 * (load + compute) / 60))


def eval_runtime_min(
    model: ModelConfig,
    seq_length: int,
    max_windows: int,
    prompts: int,
    new_tokens: int,
    dtype: str = "bf16",
) -> int:
    """Minutes of the evaluate job (:func:`forward_minutes`): the windows' forward passes and
    the generations (a forward pass of at most seq_length tokens per new token), in the
    placement's `dtype` (:func:`eval_plan`)."""
    tokens = (max_windows + prompts * new_tokens) * seq_length
    return forward_minutes(model, tokens, dtype)


# --------------------------------------------------------------------------- the harness

ASSUMED_DOCUMENTS = 10_000  # a harness task whose documents are not counted (HellaSwag: 10,042)
ASSUMED_CHOICES = 4  # a multiple-choice task whose choices are not counted (ARC, HellaSwag)
GENERATED_TOKENS = 256  # generate_until's max_gen_toks when a task does not set it (lm-eval's)


@dataclass(frozen=True)
class TaskWork:
    """What one lm-evaluation-harness task asks of the model, estimated at planning without
    lm-eval (gptflow.results.harness.task_work reads the task file and its local data): documents
    and their mean length, requests per document (a multiple-choice question is one request a
    choice), the tokens a generation adds. `counted` says whether the documents were counted
    from local files; else ASSUMED_DOCUMENTS (or eval.harness.limit) at the full context."""

    name: str
    output_type: str  # the task's: multiple_choice, loglikelihood, loglikelihood_rolling, ...
    documents: int
    document_bytes: float  # mean UTF-8 bytes of one document as stored (0: not known)
    choices: float = 1.0  # requests per document (multiple_choice: its choices)
    generated_tokens: int = 0  # per request (generate_until)
    counted: bool = True
    # for a task lm-eval's registry names: which of its tasks generates the most, where it is
    # set ("" for a task file: its own generation_kwargs)
    generated_by: str = ""

    def document_tokens(self, max_length: int) -> float:
        """A document's tokens: its bytes / BYTES_PER_TOKEN_OF_TEXT; the full context when its
        length is unknown."""
        if not self.counted or not self.document_bytes:
            return float(max_length)
        return max(1.0, self.document_bytes / BYTES_PER_TOKEN_OF_TEXT)

    def requests(self, max_length: int) -> int:
        """The harness's requests: one per choice of each document; a rolling-loglikelihood
        document is one request per window of max_length tokens."""
        if self.output_type == "loglikelihood_rolling":
            return self.documents * math.ceil(self.document_tokens(max_length) / max_length)
        return math.ceil(self.documents * self.choices)

    def tokens(self, max_length: int, num_fewshot: int) -> int:
        """Tokens the model's forward passes take: each request's context (its document and
        `num_fewshot` examples like it, at most max_length) and generated tokens; a rolling
        document's windows (the last one is a whole max_length window)."""
        doc = self.document_tokens(max_length)
        if self.output_type == "loglikelihood_rolling":
            return self.requests(max_length) * math.ceil(min(doc, max_length))
        per_request = min(doc * (1 + num_fewshot), max_length) + self.generated_tokens
        return math.ceil(self.requests(max_length) * per_request)


def harness_runtime_min(
    model: ModelConfig, work: list[TaskWork], max_length: int, num_fewshot: int, dtype: str
) -> int:
    """Minutes of a harness job: every task's tokens (TaskWork.tokens) through
    :func:`forward_minutes` in the placement's `dtype`."""
    tokens = sum(w.tokens(max_length, num_fewshot) for w in work)
    return forward_minutes(model, tokens, dtype)


def harness_host_mb(model: ModelConfig, max_length: int, batch: int, plan: EvalPlan | None) -> int:
    """Host memory (MB) of a harness job: transformers may build the model in host memory
    before moving it to the GPUs (the weights in the plan's dtype, `plan`); on a CPU (`plan`
    None) the fp32 model and one batch of logits (:func:`logits_bytes`); the overhead."""
    if plan is not None:
        need = (2 if plan.dtype == "bf16" else 4) * model.num_parameters()
    else:
        need = 4 * model.num_parameters() + logits_bytes(model, max_length, batch)
    return math.ceil((need + HOST_OVERHEAD_BYTES) / MIB)


def export_mb(model: ModelConfig) -> int:
    """Host memory (MB) of the export_hf job: a parameter's pieces, its joined tensor-parallel
    slices and the whole tensor (at most three times the largest tensor in fp32; measured at
    most twice by tests/unit/results/test_export.py) and the overhead."""
    return math.ceil((3 * 4 * model.largest_tensor_numel() + HOST_OVERHEAD_BYTES) / MIB)


def export_runtime_min(model: ModelConfig) -> int:
    """Minutes of the export_hf job: the fp32 weights read and written once, doubled."""
    seconds = 2 * 4 * model.num_parameters() / EXPORT_BYTES_PER_S
    return max(MIN_RUNTIME_MIN, math.ceil(2 * seconds / 60))
