"""What would fail on the cluster, found on the login node: `snakemake -n` (rules/common.smk)
and `gptflow why` run these before any job is queued.

- the layout against the ranks the profile gives ``train_gpt``: tensor x pipeline parallel
  divides them, and the global batch is micro-batches over the data-parallel ranks;
- how the profile launches training: one rank per GPU, task counts the Slurm plugin accepts;
- the profile's placeholders (account, partitions), named first at ``-n`` and refused by a
  real submission;
- the profile against the cluster, when ``sinfo`` is on PATH: the partitions exist and their
  nodes have the GPUs, CPUs and memory asked for;
- memory per GPU: weights, gradients and optimizer state (by ZeRO stage, precision and
  layout), activations as the model keeps them (by micro batch, sequence, checkpointing), the
  logits (1/tp of the vocabulary on each tensor-parallel rank), the pipeline's buffers and
  K-FAC's factors (train.kfac; the layouts it is refused with are refused here too), on
  the most loaded pipeline stage, plus a stated margin, against the GPU's memory, the largest
  term named when it does not fit;
- the run's size: parameters and FLOPs (from :class:`gptflow.config.settings.ModelConfig`, the
  trainer's own numbers, with the tokenizer's real vocabulary when it is on disk), tokens,
  GPU-hours at a stated MFU, checkpoint and shard bytes against free disk.

Planning imports neither torch nor DeepSpeed (it runs at every ``snakemake`` start): the counts
are formulas, checked in tests against the real model split over ranks and against
DeepSpeed's own ZeRO estimators.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gptflow import paths
from gptflow.config.settings import (
    ModelConfig,
    TrainConfig,
    check_kfac,
    kfac_floats,
    padded_vocab_size,
)
from gptflow.errors import GptflowError
from gptflow.hardware import background_saves, planned_gpu, training_precision
from gptflow.results import sizing
from gptflow.train.distributed import launched_ranks, local_ranks

GIB = 1024**3
PLACEHOLDER = re.compile(r"\A<[^<>]*>\Z")  # how the shipped profile marks what to fill in
DEFAULT_GPU_MEMORY_MB = 80 * 1024  # A100 80GB / H100 80GB, when the profile does not say
ASSUMED_VOCAB = 50257  # GPT-2's, when no tokenizer is on disk yet and none is to be trained
BYTES_PER_TOKEN_OF_TEXT = sizing.BYTES_PER_TOKEN_OF_TEXT  # text bytes a token (one home)
EXPANSION = {"zst": 3.5, "gz": 3.0, "xz": 4.0, "zip": 3.0, "parquet": 2.5}  # text / file bytes


# --------------------------------------------------------------------------- the placement


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
    gpus = p.gpus_per_node
    per_node = p.tasks_per_node or (p.tasks // p.nodes if p.tasks and p.nodes else p.tasks)
    if gpus is not None and per_node and per_node != gpus:
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


# --------------------------------------------------------------------------- the cluster (sinfo)

SINFO = ["sinfo", "--noheader", "--format=%P|%G|%D|%c|%m|%a|%l"]
ACCOUNTS = ["sacctmgr", "--noheader", "--parsable2", "show", "assoc", "format=user,account"]


@dataclass(frozen=True)
class PartitionNodes:
    """One line of ``sinfo``: a group of alike nodes of a partition."""

    partition: str
    gpus: int  # per node
    nodes: int
    cpus: int  # per node
    mem_mb: int  # per node
    time_limit: int | None = None  # minutes; None: infinite


def minutes(limit: str) -> int | None:
    """A Slurm time limit in minutes (rounded up): "infinite", "M", "M:S", "H:M:S", "D-H",
    "D-H:M", "D-H:M:S" (sbatch's --time forms; sinfo prints D-H:M:S or H:M:S)."""
    limit = limit.strip()
    if limit in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days, dash, clock = limit.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if dash:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (*parts, 0, 0)[:3]
    else:  # M, M:S, H:M:S
        h, m, sec = (0, *parts, 0)[:3] if len(parts) < 3 else parts
    return (int(days or 0) * 24 + h) * 60 + m + (1 if sec else 0)


def parse_sinfo(text: str) -> list[PartitionNodes]:
    """``sinfo --format=%P|%G|%D|%c|%m|%a|%l`` -> node groups of the partitions that are up."""
    groups = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 7 or fields[5].strip() != "up":
            continue
        name, gres, nodes, cpus, mem, _, limit = fields
        gpus = 0
        for item in gres.split(","):
            m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
            if m:
                gpus = max(gpus, int(m[1]))
        groups.append(
            PartitionNodes(
                partition=name.rstrip("*"),
                gpus=gpus,
                nodes=int(nodes),
                cpus=int(re.sub(r"\D.*", "", cpus) or 0),
                mem_mb=int(re.sub(r"\D.*", "", mem) or 0),
                time_limit=minutes(limit),
            )
        )
    return groups


def read_accounts() -> set[str] | None:
    """The accounts this user may charge (``sacctmgr show assoc``), or None where sacctmgr is
    missing or accounting is off (then the account is left to sbatch)."""
    import getpass

    if shutil.which("sacctmgr") is None:
        return None
    try:
        out = subprocess.run(ACCOUNTS, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    user = getpass.getuser()
    found = {
        a for u, _, a in (line.partition("|") for line in out.stdout.splitlines()) if u == user
    }
    return found or None


def read_sinfo() -> list[PartitionNodes] | None:
    """The cluster's partitions from ``sinfo``, or None where there is no sinfo (a laptop, a
    login node without Slurm's commands): then nothing is checked against the cluster."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(SINFO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_sinfo(out.stdout) if out.returncode == 0 else None


def check_cluster(
    p: Placement,
    cpu_partition: str | None,
    groups: list[PartitionNodes],
    accounts: set[str] | None = None,
    runtimes: dict[str, int | None] | None = None,
) -> None:
    """The profile against the cluster: the account is one of the user's (when `accounts`
    is known), the partitions exist, some node group of the training partition has the GPUs,
    CPUs and memory a node is asked for and enough nodes, and each `runtimes` entry
    ({profile key: minutes}) is within its partition's time limit."""
    account = dict(p.settings).get("default-resources slurm_account")
    if accounts and account and not PLACEHOLDER.match(account) and account not in accounts:
        raise GptflowError(
            f"profile default-resources slurm_account is '{account}', which is not one of your "
            f"Slurm accounts ({', '.join(sorted(accounts))}); set one of them"
        )
    names = sorted({g.partition for g in groups})
    for key, name in (
        ("default-resources slurm_partition", cpu_partition),
        ("set-resources train_gpt slurm_partition", p.partition),
    ):
        if name and not PLACEHOLDER.match(name) and name not in names:
            raise GptflowError(
                f"profile {key} is '{name}', which sinfo does not list as up (partitions: "
                f"{', '.join(names) or 'none'}); set one of them"
            )
    if not p.partition or PLACEHOLDER.match(p.partition):
        return
    nodes = [g for g in groups if g.partition == p.partition]
    asks = {
        "gpus": (p.gpus_per_node or 0, "gres GPUs per node", "gres"),
        "cpus": ((p.cpus or 1) * (p.tasks_per_node or 1), "CPUs per node", "set-threads train_gpt"),
        "mem_mb": (p.mem_mb or 0, "MB of memory per node", "mem_mb"),
    }
    for attr, (want, what, key) in asks.items():
        have = max(getattr(g, attr) for g in nodes)
        if want > have:
            how = (
                f"(set-threads train_gpt {p.cpus} x {p.tasks_per_node} ranks per node) "
                if attr == "cpus"
                else ""
            )
            raise GptflowError(
                f"set-resources train_gpt asks for {want} {what} {how}but the nodes of "
                f"partition '{p.partition}' have at most {have}; lower {key}"
            )
    total = sum(g.nodes for g in nodes)
    if (p.nodes or 1) > total:
        raise GptflowError(
            f"set-resources train_gpt nodes {p.nodes}, but partition '{p.partition}' has {total}"
        )
    for key, runtime in (runtimes or {}).items():
        part = cpu_partition if key.startswith("default") else p.partition
        limits = [g.time_limit for g in groups if g.partition == part]
        if runtime and limits and None not in limits and runtime > max(limits):
            raise GptflowError(
                f"profile {key} is {runtime} minutes, beyond partition '{part}''s time limit of "
                f"{max(limits)} minutes (sbatch would refuse the job); lower it -- a training "
                f"job requeues itself before its limit and resumes, so a shorter one only costs "
                f"a restart"
            )


# --------------------------------------------------------------------------- memory per GPU


def vocab_size(cfg: dict, tokenizer_json: Path | None) -> tuple[int, str]:
    """The tokenizer's vocabulary (unpadded) and where the number comes from: the tokenizer
    file when it exists, the size it is to be trained to, or an assumption (said so)."""
    model_vocab = cfg["model"].get("vocab_size")
    if model_vocab:
        return model_vocab, "model.vocab_size"
    if tokenizer_json is not None and tokenizer_json.is_file():
        try:
            tok = json.loads(tokenizer_json.read_text())
            vocab = tok["model"]["vocab"].values()
            ids = set(vocab) | {t["id"] for t in tok.get("added_tokens", [])}
            return max(ids) + 1, str(tokenizer_json)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise GptflowError(
                f"{tokenizer_json}: not a tokenizer.json with a vocabulary ({type(e).__name__}: "
                f"{e}); a job cut short or a disk error? Delete it and it is made again"
            ) from None
    train = cfg.get("tokenizer", {}).get("train") or {}
    if cfg.get("tokenizer", {}).get("source") == "train" and train.get("vocab_size"):
        return train["vocab_size"], "tokenizer.train.vocab_size"
    return ASSUMED_VOCAB, f"assumed {ASSUMED_VOCAB:,} (GPT-2's): the tokenizer is not on disk yet"


def model_config(cfg: dict, vocab: int) -> ModelConfig:
    """The run's model with the vocabulary `vocab` padded; the layouts train.kfac is refused
    with are refused here, where a run's model and train settings first meet."""
    model = {k: v for k, v in cfg["model"].items() if k not in ("preset", "init_from")}
    model["vocab_size"] = padded_vocab_size(vocab, model.get("make_vocab_size_divisible_by", 128))
    m = ModelConfig(**model)
    if cfg["train"].get("kfac") is not None:  # ({} is K-FAC with its defaults; a partial
        # train section without it, as `gptflow why` has, is not built here)
        check_kfac(m, TrainConfig(**cfg["train"]))
    return m


def stage_parameters(
    m: ModelConfig, tensor_parallel: int, pipeline_parallel: int, stage: int
) -> int:
    """Parameters a rank of pipeline stage `stage` holds: its decoder layers (balanced over the
    stages, rounded up), each split matrix 1/tp of it, LayerNorms and the row-parallel biases
    whole; the first stage also the embedding, the last the final LayerNorm and the head,
    and each of those 1/tp of the vocabulary's rows (gptflow.train.engine.VOCAB_PARALLEL)."""
    h, f, v, t = m.hidden_size, m.ffn_size, m.vocab_size, tensor_parallel
    split = (3 * h * h + 3 * h + h * h + h * f + f + f * h) // t  # qkv, dense, mlp (+ biases)
    whole = 2 * h + 4 * h  # the row-parallel biases, two LayerNorms
    layers = -(-m.num_layers // pipeline_parallel) * (split + whole)
    embedding = v * h // t if stage == 0 else 0
    head = v * h // t + 2 * h if stage == pipeline_parallel - 1 else 0
    return layers + embedding + head


# the terms that exist only between a backward pass and the update (not kept across steps)
TRANSIENT = ("gradients", "fp32 gradient partition")


def model_state_bytes(
    params: int, dp: int, zero: int, precision: str, offload: str = "none", largest: int = 0
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
    - ZeRO 3 partitions the weights too; offloaded optimizer state lives in host memory.

    Measured on CPU after a step (tests/unit/test_preflight.py): the kept terms (not
    TRANSIENT) are exactly the tensors DeepSpeed holds, on one rank and on every rank of
    tensor 2 x data 2 (ZeRO 1 and 2) and pipeline 2 x data 2 (ZeRO 1)."""
    half = precision in ("bf16", "fp16")
    width = 2 if half else 4
    shard = dp if zero >= 1 else 1
    parts = {
        "weights": width * params // (dp if zero >= 3 else 1),
        "gradients": width * params // (dp if zero >= 2 and not half else 1),
        "optimizer states": (12 if half or zero >= 1 else 8) * params // shard,
    }
    if half and zero >= 2:
        parts["gradients"] = 2 * params // dp if zero == 2 else 0  # ZeRO 3: straight into fp32
        parts["fp32 gradient partition"] = 4 * params // dp
    if precision == "bf16" and zero == 1:
        parts["fp32 gradient accumulation"] = 4 * params
    if zero >= 3:
        parts["gathered layer"] = (4 if half else 8) * largest
    if offload != "none":
        parts["optimizer states"] = 0
        parts.pop("fp32 gradient partition", None)
        if offload == "optimizer_and_params":
            parts["weights"] = 0
    return parts


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
# Under tensor parallel gptflow.train.engine.VocabParallelCrossEntropy keeps its block's fp32 softmax
# (4) and makes it the gradient in place; its forward holds the logits and that fp32 copy, and its
# backward that and the gradient in the logits' dtype: 4 + the logits' width (2 or 4) either way.
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
    tests/unit/test_preflight.py), in elements a token:

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
    assumed (the reason then says so); on CPUs, the CPU's."""
    if not p.trains_on_gpus:
        return training_precision(t.precision, t.zero_stage, None, None)
    name, capability = planned_gpu(p.gpu_type)
    return training_precision(t.precision, t.zero_stage, name, capability)


# The margin a fit leaves free: gptflow.results.sizing's (one home, shared with the evaluation).
RUNTIME_OVERHEAD_BYTES = sizing.RUNTIME_OVERHEAD_BYTES
FRAGMENTATION_SHARE = sizing.FRAGMENTATION_SHARE
fit_margin = sizing.fit_margin


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
    return {
        **model_state_bytes(params, dp, t.zero_stage, precision, t.offload, largest),
        **activation_bytes(m, t, precision, stage, gas),
        **({"K-FAC factors": 4 * kfac_floats(m)} if t.kfac else {}),  # fp32, every rank
    }


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
    "optimizer states": "raise train.zero_stage (1 partitions them over the data-parallel "
    "ranks), or train.offload optimizer",
    "activations": "set model.activation_checkpointing true, or lower train.micro_batch_size",
    "logits": "lower train.micro_batch_size (or train.seq_length), or raise "
    "train.tensor_parallel: each tensor-parallel rank holds its share of the vocabulary's logits",
    "pipeline buffers": "lower train.micro_batch_size",
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


# --------------------------------------------------------------------------- saves

# What a training rank's process holds in host memory besides its tensors (CUDA context and
# libraries, torch, DeepSpeed, the data loader): sizing's, where its sources are.
PROCESS_HOST_BYTES = sizing.HOST_OVERHEAD_BYTES


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
    beyond its bytes (gptflow.train.snapshot.buffer_bytes: under two pages, 8 KiB, a storage)."""
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

    @property
    def process(self) -> int:
        return self.ranks * PROCESS_HOST_BYTES

    @property
    def need(self) -> int:
        return self.snapshots + self.process + self.state

    @property
    def fits(self) -> bool:
        return self.node_bytes is None or self.need <= self.node_bytes


def snapshot_fit(m: ModelConfig, t: TrainConfig, ranks: int, p: Placement) -> SnapshotFit:
    """The node of `p` whose ranks need the most host memory with background saves (ranks
    are numbered node by node: srun's block distribution, torchrun's node rank)."""
    on_gpus = p.trains_on_gpus
    precision = planned_precision(t, p)[0]
    per_node = p.tasks_per_node if p.mpi and p.tasks_per_node else ranks
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
    parts = (
        f"snapshots {human(fit.snapshots)} ({fit.writers} of {fit.ranks} rank(s) write the model "
        f"file; {human(fit.largest)} on the largest) + {fit.ranks} process(es) x "
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


# --------------------------------------------------------------------------- after training


def after_training(
    m: ModelConfig,
    seq_length: int,
    p: Placement,
    eval_cfg: dict,
    harness_work: list[sizing.TaskWork] | None = None,
) -> list[str]:
    """The evaluate, export_hf and harness jobs as the rules size them (gptflow.results.sizing), and a
    warning when the evaluation needs more GPUs than one node (or this machine) has.
    `harness_work`: eval.harness's tasks (gptflow.results.harness.task_work), when it has any."""
    gpu_mb = p.gpu_mem_mb or DEFAULT_GPU_MEMORY_MB
    plan = sizing.eval_plan(m, seq_length, gpu_mb * 2**20)
    node = p.gpus_per_node if p.on_cluster or p.gres else p.gpus
    where = "a node of train_gpt's partition" if p.on_cluster or p.gres else "this machine"
    lines = []
    if not plan.fits or (node is not None and plan.gpus > node):
        lines.append(
            f"  WARNING: evaluating {m.num_parameters():,} parameters needs {plan.gpus} GPU(s) "
            f"of {gpu_mb / 1024:.0f} GiB in bf16 on one node, {where} has {node}; evaluation "
            "across nodes is not supported, so the evaluate job will not run (Slurm refuses "
            "its GPUs): build the train and export targets (snakemake ... train export) and "
            "evaluate the export on a machine that holds it"
        )
    windows, prompts = eval_cfg.get("max_windows", 256), len(eval_cfg.get("prompts", []))
    minutes = sizing.eval_runtime_min(
        m, seq_length, windows, prompts, eval_cfg.get("new_tokens", 32), plan.dtype
    )
    lines[:0] = [
        f"  evaluate: {plan.dtype} on {plan.gpus} GPU(s), about {human(plan.device_bytes)} on "
        f"the most loaded; {sizing.eval_host_mb(m, seq_length, True):,} MB host memory, "
        f"{minutes} min",
        f"  export_hf: {sizing.export_mb(m):,} MB, {sizing.export_runtime_min(m)} min "
        f"(one tensor at a time: the largest is {human(4 * m.largest_tensor_numel())} in fp32)",
    ]
    if harness_work:
        lines.insert(2, harness_line(m, seq_length, gpu_mb, eval_cfg.get("harness") or {},
                                     harness_work))  # fmt: skip
    return lines


def harness_line(
    m: ModelConfig, seq_length: int, gpu_mb: int, harness_cfg: dict, work: list[sizing.TaskWork]
) -> str:
    """The harness jobs' size at -n: requests and tokens (counted from the task files, or
    assumed: said which), the placement, host memory and minutes (gptflow.results.sizing)."""
    batch, fewshot = harness_cfg.get("batch_size", 8), harness_cfg.get("num_fewshot", 0)
    plan = sizing.eval_plan(m, seq_length, gpu_mb * 2**20, batch)
    requests = sum(w.requests(seq_length) for w in work)
    tokens = sum(w.tokens(seq_length, fewshot) for w in work)
    assumed = [w.name for w in work if not w.counted]
    how = (
        f"estimated from the task files' documents at {sizing.BYTES_PER_TOKEN_OF_TEXT:g} bytes "
        f"a token"
    )
    if assumed:
        how += (
            f"; assumed for {', '.join(assumed)}: {sizing.ASSUMED_DOCUMENTS:,} documents (or "
            f"eval.harness.limit) of {sizing.ASSUMED_CHOICES} requests at the full context"
        )
    minutes = sizing.harness_runtime_min(m, work, seq_length, fewshot, plan.dtype)
    return (
        f"  harness: {len(work)} task(s), about {requests:,} requests, {tokens:,} tokens of at "
        f"most {seq_length} (train.seq_length) ({how}); {plan.dtype} on {plan.gpus} GPU(s), "
        f"{sizing.harness_host_mb(m, seq_length, batch, plan):,} MB host memory, {minutes} min "
        f"a job (harness_step: + the export's {sizing.export_runtime_min(m)} min)"
    )


# --------------------------------------------------------------------------- the run's size

# GPU-hours at -n and in `gptflow why`: an H100's dense bf16 peak at 40 % MFU, unless told
ASSUMED_PEAK_TFLOPS = 989.0
ASSUMED_MFU = 0.4


def size(cfg: dict, m: ModelConfig, shards: int, free: int, peak_tflops: float, mfu: float) -> dict:
    """Parameters, tokens, FLOPs, GPU-hours, checkpoint and shard bytes, free disk."""
    t = cfg["train"]
    n = m.num_parameters()
    tokens = t["train_iters"] * t["global_batch_size"] * t["seq_length"]
    flops = m.flops_per_token(t["seq_length"]) * tokens
    keys = ("train_iters", "save_interval", "keep_last", "keep_every")  # what it depends on
    checkpoints = TrainConfig(**{k: t[k] for k in keys if k in t}).checkpoints_on_disk()
    return {
        "parameters": n,
        "training_tokens": tokens,
        "training_flops": flops,
        "gpu_hours": flops / (peak_tflops * 1e12 * mfu) / 3600,
        "peak_tflops": peak_tflops,
        "mfu": mfu,
        # a checkpoint: fp32 weights + Adam's two moments (+ the half-precision copy, counted
        # as fp32): 16 bytes a parameter, for keep_last steps, the one being written and
        # those kept for good (train.keep_every)
        "checkpoint_bytes": n * 16 * checkpoints,
        "shard_bytes": shards,
        "free_bytes": free,
    }


def study(
    runs: dict[str, dict],
    p: Placement,
    *,
    tokenizer_json: Path | None,
    indexes: int,
    trained: set[str],
    peak_tflops: float = ASSUMED_PEAK_TFLOPS,
    mfu: float = ASSUMED_MFU,
) -> list[str]:
    """A study's plan, one line a run (parameters, tokens, batch split, memory per GPU where
    the run goes to GPUs, GPU-hours, finished or not) under the study's totals. Every run's
    layout and memory are checked as a single run's are (the error names the run)."""
    vocab = vocab_size(next(iter(runs.values())), tokenizer_json)[0]
    rows, total_flops, total_hours = [], 0.0, 0.0
    for name, cfg in runs.items():
        try:
            train = TrainConfig(**cfg["train"])
            m = model_config(cfg, vocab)
            gas = check_layout(train, p.ranks)
            fit = memory_per_gpu(m, train, p.ranks, p) if p.trains_on_gpus else None
            if fit is not None:
                check_memory(fit)
        except GptflowError as e:
            raise GptflowError(f"study run '{name}': {e}") from None
        s = size(cfg, m, 0, 0, peak_tflops, mfu)
        total_flops += s["training_flops"]
        total_hours += s["gpu_hours"]
        memory = f"{human(fit.total)} of {human(fit.gpu_bytes)}" if fit else "-"
        split = f"{train.micro_batch_size} x {gas} x {train.data_parallel_size(p.ranks)}"
        state = "finished" if name in trained else "to train"
        rows.append((name, f"{s['parameters']:,}", f"{s['training_tokens']:,}", split, memory,
                     f"{s['gpu_hours']:.3g}", state))  # fmt: skip
    header = ("run", "parameters", "tokens", "micro x accum x dp", "memory/GPU", "GPU-hours", "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    table = [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    return [
        f"gptflow study: {len(runs)} run(s), {len(trained)} finished (a DONE.json; one whose "
        f"settings changed trains again); {indexes} data index(es) shared by them; {total_flops:.3g} training FLOPs = {total_hours:.3g} GPU-hours at "
        f"{mfu:.0%} MFU of {peak_tflops:g} TFLOP/s",
        *table,
    ]


@dataclass
class Report:
    """What the preflight found, for the plan's output and `gptflow why`."""

    lines: list[str] = field(default_factory=list)  # printed at -n
    warnings: list[str] = field(default_factory=list)
    size: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    placement: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- the plan's preflight


def token_bytes(datasets, vocab: int, tokenizer: str | None = None) -> tuple[int, int]:
    """Bytes the token shards take: the .bin files of shards made already (with `tokenizer`,
    gptflow.paths.SHARD or its PARTs; an imported Megatron shard's), an estimate from the
    inputs on disk for the others: 4 bytes of text a token (a compressed file's bytes times
    its typical expansion), in the token dtype of the vocabulary
    (gptflow.data.indexed's rule). Returns (bytes, inputs not on disk yet, so not counted)."""
    from gptflow.data.indexed import dtype_for_vocab

    total, missing = 0, 0
    for d in datasets.values():
        for s in d.shards:
            made = []
            if tokenizer is not None:
                whole = paths.shard_prefix(tokenizer, d.name, s.name)
                parts = Path().glob(f"{paths.part_prefix(tokenizer, d.name, s.name, '*')}.bin")
                made = [Path(f"{whole}.bin"), *sorted(parts)]
            if s.fmt == "megatron":
                made = [Path(f"{s.input}.bin")]
            if any(f.is_file() for f in made):
                total += sum(f.stat().st_size for f in made if f.is_file())
                continue
            files = [Path(f) for f in s.files] or [Path(s.input)]
            sizes = [(f.name, f.stat().st_size) for f in files if f.is_file()]
            missing += len(files) - len(sizes)
            text = sum(n * EXPANSION.get(name.rsplit(".", 1)[-1].lower(), 1.0) for name, n in sizes)
            total += int(text / BYTES_PER_TOKEN_OF_TEXT) * dtype_for_vocab(vocab).itemsize
    return total, missing


def memory_lines(
    rep: Report,
    m: ModelConfig,
    train: TrainConfig,
    ranks: int,
    p: Placement,
    cfg: dict,
    harness_work: list[sizing.TaskWork] | None = None,
) -> list[str]:
    """The GPU memory fit (where training goes to GPUs), the jobs after training, and the
    host memory of asynchronous saves; each refuses what cannot fit."""
    precision, why = planned_precision(train, p)
    lines = [f"  precision: {precision} ({why})"]
    if p.trains_on_gpus:  # a cluster's, a gres, or this machine's GPUs (nvidia-smi)
        fit = memory_per_gpu(m, train, ranks, p)
        check_memory(fit)
        rep.memory = {"terms": fit.terms, "total": fit.total, "gpu_bytes": fit.gpu_bytes,
                      "gpu_source": fit.gpu_source, "margin": fit.margin,
                      "stage": fit.stage}  # fmt: skip
        terms = ", ".join(f"{k} {human(v)}" for k, v in fit.terms.items() if v)
        where = f" ({fit.stage})" if fit.stage else ""
        lines.append(
            f"  memory per GPU{where}: about {human(fit.total)} + {margin_text(fit)}, of "
            f"{human(fit.gpu_bytes)} ({terms}; {fit.gpu_source})"
        )
        lines += after_training(m, train.seq_length, p, cfg.get("eval") or {}, harness_work)
    in_background = background_saves(train.async_save, p.trains_on_gpus)[0]
    lines.append(check_saves(train, snapshot_fit(m, train, ranks, p) if in_background else None))
    return lines


def run(
    cfg: dict,
    p: Placement,
    *,
    tokenizer_json: Path | None = None,
    datasets: dict | None = None,
    tokenizer: str | None = None,
    config_threads: dict[str, int] | None = None,
    profile_threads: dict[str, int] | None = None,
    runtimes: dict[str, int | None] | None = None,
    harness_work: list[sizing.TaskWork] | None = None,
    sinfo=read_sinfo,
    accounts=read_accounts,
    label: str = "",
) -> Report:
    """Every check above for `cfg` placed by `p`; raises GptflowError at the first failure
    (the key and the fix named), else returns the lines to print at -n."""
    train = TrainConfig(**cfg["train"])
    launch_warnings = check_launch(p)  # how the ranks start, then the layout over them
    ranks = p.ranks
    gas = check_layout(train, ranks)
    rep = Report(placement=asdict(p))
    if found := placeholders(p):
        rep.lines.append("gptflow: " + placeholder_message(found, p.executor))
    rep.warnings += launch_warnings
    if p.executor == "slurm" and (groups := sinfo()) is not None:
        cpu = dict(p.settings).get("default-resources slurm_partition")
        check_cluster(p, cpu, groups, accounts(), runtimes)
    vocab, vocab_source = vocab_size(cfg, tokenizer_json)
    m = model_config(cfg, vocab)
    dp = train.data_parallel_size(ranks)
    split = [f"{n} {kind}" for n, kind in ((train.tensor_parallel, "tensor"),
                                          (train.pipeline_parallel, "pipeline")) if n > 1]  # fmt: skip
    where = (
        f"{p.nodes or 1} node(s) x {p.tasks_per_node} rank(s)"
        if p.mpi and p.tasks_per_node
        else f"{ranks} rank(s)"
    )
    rep.lines.append(
        f"gptflow preflight{label}: train_gpt on {where} = {' x '.join([*split, f'{dp} data'])} "
        f"parallel; micro batch {train.micro_batch_size} x grad accum {gas} x {dp} = global "
        f"batch {train.global_batch_size}; {m.num_parameters():,} parameters (vocabulary "
        f"{vocab:,}: {vocab_source})"
    )
    rep.lines += memory_lines(rep, m, train, ranks, p, cfg, harness_work)
    for rule, n in sorted((profile_threads or {}).items()):
        given = (config_threads or {}).get(rule)
        if given is not None and given != n:
            rep.lines.append(
                f"  {rule} runs {n} thread(s): the profile's set-threads, over the config's "
                f"tokenize.workers {given}"
            )
    if p.threads:
        rep.lines.append(f"  train_gpt: {p.threads} CPU thread(s) per rank (set-threads)")
    if p.executor == "local" and not p.mpi:
        how = "one per visible GPU" if p.gpus else "one: no GPU visible"
        if p.nproc_per_node is not None:
            how = "set-resources train_gpt nproc_per_node"
        rep.lines.append(
            f"  train_gpt: {ranks} rank(s) on this machine ({how}; {p.gpus or 0} GPU(s): "
            f"{p.gpus_source or 'not counted'}), the job's cores shared among them"
        )
    rep.lines += [f"  WARNING: {w}" for w in rep.warnings]
    if datasets is not None:
        made, missing = token_bytes(datasets, vocab, tokenizer)
        rep.size = {"parameters": m.num_parameters(), "vocab": vocab,
                    "vocab_source": vocab_source, "shard_bytes": made,
                    "inputs_not_on_disk": missing}  # fmt: skip
    return rep
