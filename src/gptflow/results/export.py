"""A finished run as a Hugging Face ``GPTNeoXForCausalLM`` directory, streamed tensor by tensor.

The model already uses Hugging Face's parameter names and layouts (gptflow.train.model), so the
export is the fp32 weights with ``embed_out`` named ``lm_head`` (transformers 5), a
config.json, and the tokenizer.

Reading. :func:`checkpoint_weights` describes a checkpoint's fp32 weights by name (shape and
dtype) and reads each one only when asked, so nothing holds the whole model:

- ZeRO 0: ``mp_rank_00_model_states.pt`` memory-mapped (``torch.load(mmap=True,
  weights_only=True)``); the Adam states beside the weights are never read. With fp16/bf16 the
  weights are DeepSpeed's fp32 master weights (``optimizer.fp32_groups`` of its
  FP16_UnfusedOptimizer), not the half-precision module.
- ZeRO 1/2, any precision (DeepSpeed's BF16_Optimizer of ZeRO 1 in bf16 included), with or
  without tensor and pipeline parallel: every rank's flat fp32 partitions (the master
  weights) memory-mapped, each parameter cut out of them where DeepSpeed's
  ``param_slice_mappings`` says, its tensor-parallel slices joined; nothing converted.
- ZeRO 3: the partitions through DeepSpeed's own zero_to_fp32 loader (its ``GatheredTensor``).

  The Adam states beside the weights are dropped unread. Optimizer files hold pickled
  DeepSpeed objects: ZeRO 1/2's are read by torch's weights-only unpickler with the four
  DeepSpeed classes they hold allowed by name; ZeRO 3's by zero_to_fp32, so they are read only
  from a checkpoint inside the run directory.

Writing. safetensors shards of at most ``max_shard_size`` bytes, planned as Hugging Face plans
them (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``; a single
``model.safetensors`` when the model fits in one shard), each written one tensor at a time.
Peak memory is a small multiple of the largest tensor, not of the model (measured by
tests/unit/results/test_export.py). The directory is published whole (temporary directory, rename).

DeepSpeed is imported only to read ZeRO 1-3 checkpoints.

Over 500 lines: reading every checkpoint layout DeepSpeed writes (ZeRO 0-3, tensor and
pipeline slices; evaluation reads weights through it too) and writing safetensors shards.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from gptflow import paths
from gptflow.config.settings import ModelConfig
from gptflow.errors import GptflowError
from gptflow.fsutil import publish, temp_dir
from gptflow.train.checkpoint import tag_for
from gptflow.train.model import checkpoint_name
from gptflow.train.run_config import RunConfig

MAX_SHARD_SIZE = 5 * 10**9  # bytes per safetensors shard: Hugging Face's default ("5GB")

SAFETENSORS_DTYPES = {  # torch dtype -> safetensors' name for it
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Weight:
    """One tensor of a checkpoint: shape and dtype known now, values read by `read()` (a CPU
    tensor, contiguous, possibly a view of a memory-mapped file: do not write to it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# --------------------------------------------------------------------------- reading


def checkpoint_weights(
    checkpoint: str | os.PathLike, run_dir: str | os.PathLike, model: ModelConfig | None = None
) -> dict[str, Weight]:
    """The fp32 weights of a checkpoint step directory (``.../checkpoints/{series}/step*``) by
    name, in the model's order, each read on demand.

    `model` (default: the run directory's run.yaml) gives the model's names, order and shapes
    (the merged tensor-parallel slices are checked against them) and names the fp32 master
    weights of a ZeRO-0 fp16/bf16 checkpoint, which DeepSpeed saves per optimizer group."""
    ckpt = Path(checkpoint)
    if not (ckpt / "COMPLETE").is_file():
        raise GptflowError(
            f"{ckpt}: not a complete checkpoint (no COMPLETE marker); train the run to the end "
            "or name a finished step directory"
        )

    def config() -> ModelConfig:
        return model or RunConfig.load(paths.in_run_dir(paths.RUN_YAML, run_dir)).model

    files = optimizer_files(ckpt)
    if not files:
        return _zero0_weights(ckpt, config)
    if not _inside(ckpt, Path(run_dir)):
        raise GptflowError(
            f"{ckpt}: DeepSpeed's optimizer files hold pickled objects, so they are read only "
            f"from inside the run directory {run_dir}; copy the run there"
        )
    if _sliced(files[min(files)]):
        return _sliced_weights(ckpt, files, config())
    return _zero3_partitioned_weights(ckpt)


def load_checkpoint_weights(checkpoint: str | os.PathLike, run_dir: str | os.PathLike) -> dict:
    """fp32 weights of a checkpoint step directory, all read (see :func:`checkpoint_weights`)."""
    return {name: w.read() for name, w in checkpoint_weights(checkpoint, run_dir).items()}


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return (t.float() if t.is_floating_point() else t).contiguous()


def _stored(t: torch.Tensor) -> Weight:
    """A tensor stored whole in the checkpoint, exported as fp32 (other dtypes as they are)."""
    dtype = torch.float32 if t.is_floating_point() else t.dtype
    return Weight(tuple(t.shape), dtype, partial(_fp32, t))


def _zero0_weights(ckpt: Path, model: Callable[[], ModelConfig]) -> dict[str, Weight]:
    path = ckpt / "mp_rank_00_model_states.pt"
    if not path.is_file():
        raise GptflowError(f"{ckpt}: no mp_rank_00_model_states.pt; not a DeepSpeed checkpoint")
    states = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    module = states["module"]
    if not any(t.dtype in (torch.float16, torch.bfloat16) for t in module.values()):
        return {name: _stored(t) for name, t in module.items()}
    masters = _zero0_masters(path, states, model())
    return {
        name: Weight(
            tuple(t.shape), torch.float32, partial(_checked_master, name, masters[name], t)
        )
        for name, t in module.items()
    }


def _zero0_masters(path: Path, states: dict, model: ModelConfig) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a ZeRO-0 fp16/bf16 checkpoint, by name.

    DeepSpeed's FP16_UnfusedOptimizer saves them as ``optimizer.fp32_groups``: one list per
    optimizer parameter group, in the group's order, without names. The groups are
    gptflow.train.model.decay_groups's, so the names come from that function applied to the model
    (built on the meta device: no memory)."""
    from gptflow.train.model import GPTNeoX, decay_groups

    module = states["module"]
    groups = (states.get("optimizer") or {}).get("fp32_groups")
    if groups is None:
        raise GptflowError(
            f"{path}: half-precision weights without DeepSpeed's fp32 master weights (no "
            "optimizer.fp32_groups); exporting them would write rounded weights as fp32. "
            "Export a checkpoint saved by gptflow train"
        )
    with torch.device("meta"):
        net = GPTNeoX(model)
    names = {id(p): name for name, p in net.named_parameters()}
    order = [[names[id(p)] for p in g["params"]] for g in decay_groups(net, 0.0)]
    if [len(g) for g in order] != [len(g) for g in groups]:
        raise GptflowError(
            f"{path}: fp32 master weights in groups of {[len(g) for g in groups]}, but "
            f"gptflow.train.model.decay_groups makes groups of {[len(g) for g in order]} of the "
            "model's parameters; not a checkpoint of this model"
        )
    masters = {}
    for group_names, tensors in zip(order, groups, strict=True):
        for name, t in zip(group_names, tensors, strict=True):
            if name not in module or tuple(t.shape) != tuple(module[name].shape):
                raise GptflowError(
                    f"{path}: the fp32 master weight for {name} has shape {tuple(t.shape)}, "
                    "which the checkpoint's module lacks or has in another shape; not a "
                    "checkpoint of this model"
                )
            masters[name] = t
    return masters


def _checked_master(name: str, master: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """`master`, checked to round to the stored half-precision weight (DeepSpeed copies the
    masters into the module after every step), which proves the group-to-name mapping."""
    if not torch.equal(master.to(stored.dtype), stored):
        raise GptflowError(
            f"{name}: the fp32 master weight does not round to the checkpoint's {stored.dtype} "
            "weight; the optimizer groups are not gptflow.train.model.decay_groups's"
        )
    return master.contiguous()


def _zero3_partitioned_weights(ckpt: Path) -> dict[str, Weight]:
    """ZeRO 3: one :class:`Weight` per parameter over every rank's fp32 partitions, read by
    DeepSpeed's zero_to_fp32 loader."""
    from deepspeed.checkpoint.constants import BUFFER_NAMES, FROZEN_PARAM_SHAPES, PARAM_SHAPES
    from deepspeed.utils import zero_to_fp32

    # memory-mapped; checks the stage and that every rank's file is there
    stage, world, flat_groups, _ = zero_to_fp32.parse_optim_states(
        zero_to_fp32.get_optim_files(str(ckpt)), str(ckpt)
    )
    # rank 0's model states: parameter names and shapes
    states = torch.load(
        zero_to_fp32.get_model_state_file(str(ckpt), stage),
        map_location="cpu",
        mmap=True,
        weights_only=True,
    )
    if states.get(FROZEN_PARAM_SHAPES):
        raise GptflowError(f"{ckpt}: frozen parameters are not supported by the export")
    buffers = set(states[BUFFER_NAMES])
    weights = {name: _stored(t) for name, t in states["module"].items() if name in buffers}
    weights |= _zero3_weights(ckpt, states[PARAM_SHAPES], flat_groups, world)
    for alias, name in (states.get("shared_params") or {}).items():
        if name in weights:
            weights[alias] = weights[name]
    # the module's order (DeepSpeed's is by optimizer group), as at ZeRO 0
    order = [name for name in states["module"] if name in weights]
    order += [name for name in weights if name not in states["module"]]
    return {name: weights[name] for name in order}


# DeepSpeed's optimizer files: ``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``
# (the ``bf16_`` ones are its BF16_Optimizer's: ZeRO 1 in bf16, the default on a GPU)
OPTIMIZER_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def optimizer_files(ckpt: Path) -> dict[tuple[int, int], Path]:
    """{(model-parallel rank, data-parallel rank): file} of a ZeRO checkpoint, every one of the
    grid there (empty at ZeRO 0)."""
    files = {}
    for path in ckpt.glob("*_optim_states.pt"):
        if m := OPTIMIZER_FILE.fullmatch(path.name):
            files[int(m[2]), int(m[1])] = path
    if files:
        mps, dps = (1 + max(k[i] for k in files) for i in (0, 1))
        missing = [(mp, dp) for mp in range(mps) for dp in range(dps) if (mp, dp) not in files]
        if missing:
            mp, dp = missing[0]
            raise GptflowError(
                f"{ckpt}: the optimizer file of data-parallel rank {dp}, model-parallel rank "
                f"{mp} is missing ({len(files)} of {mps * dps}); the save was cut short or "
                "files were removed: use an earlier complete step"
            )
    return files


def _optimizer_state(path: Path) -> dict:
    """The DeepSpeed optimizer state of one rank, memory-mapped, without the Adam moments
    (dropped unread: only the fp32 master weights are wanted)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    # the only objects a ZeRO 1/2 optimizer file holds besides tensors and containers, allowed
    # by name: torch's weights-only unpickler refuses anything else
    allowed = [fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler]
    with torch.serialization.safe_globals(allowed):
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    optim = state["optimizer_state_dict"]
    optim.pop("base_optimizer_state", None)
    return optim


def _sliced(path: Path) -> bool:
    """ZeRO 1/2 (any precision; BF16_Optimizer included): fp32 partitions with DeepSpeed's
    map of which parameter each holds (``param_slice_mappings``). ZeRO 3 has none."""
    optim = _optimizer_state(path)
    return "param_slice_mappings" in optim and "single_partition_of_fp32_groups" in optim


def _sliced_weights(
    ckpt: Path, files: dict[tuple[int, int], Path], model: ModelConfig
) -> dict[str, Weight]:
    """ZeRO 1/2, with or without tensor and pipeline parallel, read where the ranks wrote it.

    Each model-parallel rank (``mp = pipeline stage x tp + tensor-parallel rank``) has its
    parameters' shapes in ``mp_rank_{mp}_model_states.pt``; each of its data-parallel ranks
    holds one consecutive piece of every parameter group's flat fp32 vector, and
    ``param_slice_mappings`` says which part of which parameter (start, numel) that piece
    holds. A parameter is its pieces in data-parallel order; under tensor parallel, its
    slices in tensor-parallel order, joined along the dimension
    :data:`gptflow.train.model_parallel.TENSOR_PARALLEL_PLAN` splits (replicated ones read from
    the first rank). Nothing is converted or written: the universal conversion (which loads every file
    whole, twice) is left to a resume in another layout."""
    from gptflow.train.model import GPTNeoX, hf_name
    from gptflow.train.model_parallel import tensor_parallel_dim

    mps, dps = (1 + max(k[i] for k in files) for i in (0, 1))
    slices: dict[str, list[Weight]] = {}  # model name -> its slices in model-parallel order
    for mp in range(mps):
        shapes = _param_shapes(ckpt / f"mp_rank_{mp:02d}_model_states.pt")
        states = [_optimizer_state(files[mp, dp]) for dp in range(dps)]
        for g, group in enumerate(shapes):
            for name, shape in group.items():
                pieces = [
                    (state["single_partition_of_fp32_groups"][g], *where)
                    for state in states
                    if (where := _fragment(state, g, name)) is not None
                ]
                if sum(numel for _, _, numel in pieces) != math.prod(shape):
                    raise GptflowError(
                        f"{files[mp, 0]}: the data-parallel ranks hold "
                        f"{sum(n for _, _, n in pieces)} of the {math.prod(shape)} elements of "
                        f"{name}; the optimizer files do not match the model states"
                    )
                # a pipeline's names are its stages' ("3.layer.mlp..."): the model's instead
                key = hf_name(name, model.num_layers) if name[:1].isdigit() else name
                read = partial(_joined_pieces, pieces, tuple(shape))
                slices.setdefault(key, []).append(Weight(tuple(shape), torch.float32, read))
    with torch.device("meta"):  # the model's names, order and shapes, at no memory cost
        want = {name: tuple(p.shape) for name, p in GPTNeoX(model).named_parameters()}
    if sorted(want) != sorted(slices):
        raise GptflowError(
            f"{ckpt}: holds parameters {sorted(slices.keys() ^ want.keys())[:4]} that the run's "
            f"model lacks or misses them ({len(slices)} against {len(want)}); was the run "
            "config changed?"
        )
    weights = {}
    for name, shape in want.items():
        weights[name] = _merged(name, slices[name], tensor_parallel_dim(name))
        if weights[name].shape != shape:
            raise GptflowError(
                f"{ckpt}: {name} merges to {weights[name].shape}, the run's model has {shape}"
            )
    return weights


def _param_shapes(path: Path) -> list[dict]:
    if not path.is_file():
        raise GptflowError(f"{path.parent}: no {path.name}; not a complete DeepSpeed checkpoint")
    states = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if states.get("frozen_param_shapes"):
        raise GptflowError(f"{path}: frozen parameters are not supported by the export")
    return states["param_shapes"]


def _fragment(state: dict, group: int, name: str) -> tuple[int, int] | None:
    """(start, numel) of parameter `name` in this rank's piece of `group`, if it holds any."""
    where = state["param_slice_mappings"][group].get(name)
    return None if where is None else (where.start, where.numel)


def _joined_pieces(pieces: list[tuple[torch.Tensor, int, int]], shape: tuple) -> torch.Tensor:
    parts = [flat[start : start + numel] for flat, start, numel in pieces]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)


def _merged(name: str, slices: list[Weight], dim: int | None) -> Weight:
    """One parameter from its tensor-parallel slices (one slice: itself)."""
    if len(slices) == 1 or dim is None:
        return slices[0]
    shape = list(slices[0].shape)
    shape[dim] = sum(w.shape[dim] for w in slices)
    return Weight(tuple(shape), torch.float32, partial(_concatenated, slices, dim))


def _concatenated(slices: list[Weight], dim: int) -> torch.Tensor:
    return torch.cat([w.read() for w in slices], dim)


def _zero3_weights(ckpt, param_shapes, flat_groups, world) -> dict[str, Weight]:
    """ZeRO 3: every parameter is split over the ranks (padded to a multiple of `world`); the
    lazy ``GatheredTensor`` of zero_to_fp32 gathers one parameter from every rank."""
    from deepspeed.utils.zero_to_fp32 import GatheredTensor, zero3_partitioned_param_info

    shapes = {name: shape for group in param_shapes for name, shape in group.items()}
    group_offsets = [0, *itertools.accumulate(t.numel() for t in flat_groups[0])]
    weights, offset = {}, 0
    for name, shape in shapes.items():
        part_numel, _ = zero3_partitioned_param_info(math.prod(shape), world)
        lazy = GatheredTensor(flat_groups, group_offsets, offset, part_numel, shape)
        weights[name] = Weight(tuple(shape), torch.float32, lazy.contiguous)
        offset += part_numel
    if offset != group_offsets[-1]:
        raise GptflowError(
            f"{ckpt}: the parameters take {offset} of each rank's {group_offsets[-1]} elements; "
            "the ZeRO-3 partitions do not match the parameter shapes"
        )
    return weights


# --------------------------------------------------------------------------- writing


def plan_shards(weights: dict[str, Weight], max_shard_size: int) -> dict[str, list[str]]:
    """{file name: tensor names}, as huggingface_hub's split_torch_state_dict_into_shards
    plans them: in order, a new shard when the next tensor would overflow this one, a tensor
    above `max_shard_size` alone in its shard; ``model.safetensors`` when there is one."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, w in weights.items():
        if w.nbytes > max_shard_size:
            shards.append([name])
            continue
        if size + w.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += w.nbytes
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return {"model.safetensors": shards[0] if shards else []}
    n = len(shards)
    return {f"model-{i:05d}-of-{n:05d}.safetensors": s for i, s in enumerate(shards, 1)}


def write_safetensors(path: str | os.PathLike, weights: dict[str, Weight]) -> None:
    """A safetensors file written one tensor at a time (nothing but the tensor being written
    in memory), fsynced.

    The format: an 8-byte little-endian header length N; N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded
    with spaces to a multiple of 8; then the tensors' little-endian bytes back to back, at
    their data_offsets (relative to the end of the header)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, w in weights.items():
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[w.dtype],
            "shape": list(w.shape),
            "data_offsets": [offset, offset + w.nbytes],
        }
        offset += w.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, w in weights.items():
            t = w.read()
            if tuple(t.shape) != w.shape or t.dtype != w.dtype:
                raise GptflowError(
                    f"{name}: read {tuple(t.shape)} {t.dtype}, expected {w.shape} {w.dtype}"
                )
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
            del t
        f.flush()
        os.fsync(f.fileno())


def write_hf_weights(
    out_dir: Path, weights: dict[str, Weight], max_shard_size: int = MAX_SHARD_SIZE
) -> dict[str, list[str]]:
    """The weights as safetensors shards in `out_dir` (+ the index when more than one);
    returns the shard plan."""
    plan = plan_shards(weights, max_shard_size)
    for filename, names in plan.items():
        write_safetensors(out_dir / filename, {n: weights[n] for n in names})
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(w.nbytes for w in weights.values())},
            "weight_map": {n: filename for filename, names in plan.items() for n in names},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return plan


def hf_config(model: ModelConfig, eod_id: int, seq_length: int) -> dict:
    """config.json of GPTNeoXForCausalLM (transformers 5 names, plus the 4.x rotary keys)."""
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "intermediate_size": model.ffn_size,
        "hidden_act": "gelu",
        "max_position_embeddings": model.max_position_embeddings,
        "layer_norm_eps": model.layer_norm_eps,
        "use_parallel_residual": model.parallel_residual,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(model.rotary_emb_base),
            "partial_rotary_factor": model.rotary_pct,
        },
        "rotary_pct": model.rotary_pct,  # transformers 4.x
        "rotary_emb_base": model.rotary_emb_base,
        "torch_dtype": "float32",
        "gptflow": {"seq_length": seq_length},
    }


def finished_run(config: str | os.PathLike) -> tuple[RunConfig, dict]:
    """The run config and DONE.json of a run that has finished training."""
    cfg = RunConfig.load(config)
    if not cfg.done_path.is_file():
        raise GptflowError(f"{cfg.done_path}: the run has not finished; train it first")
    return cfg, json.loads(cfg.done_path.read_text())


def step_checkpoint(cfg: RunConfig, step: int) -> Path:
    """The complete checkpoint of step `step` of the run (finished or still training), or one
    error saying why it is not on disk and how to keep it next time."""
    path = cfg.checkpoint_dir / tag_for(step)
    if not (path / "COMPLETE").is_file():
        t = cfg.train
        kept = f"train.keep_last {t.keep_last}, train.keep_every {t.keep_every}"
        raise GptflowError(
            f"{path}: run {Path(cfg.run_dir).name} has no complete checkpoint of step {step} "
            f"(not saved yet, or deleted: its training keeps steps "
            f"{', '.join(map(str, t.kept_steps()))}; {kept}); set train.keep_every to a "
            f"divisor of {step} that is a multiple of train.save_interval before training, or "
            f"evaluate a kept step"
        )
    return path


def export_hf(
    config: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    max_shard_size: int = MAX_SHARD_SIZE,
    log=print,
) -> dict:
    """Write the run's final checkpoint (or that of step `step`, kept by train.keep_every,
    also while the run still trains) as a Hugging Face directory `out` (published whole),
    streamed into safetensors shards of at most `max_shard_size` bytes. Reading a checkpoint
    changes nothing in the run."""
    if step is None:
        cfg, done = finished_run(config)
        checkpoint, step = done["checkpoint"], done["final_step"]
    else:
        cfg = RunConfig.load(config)
        checkpoint = step_checkpoint(cfg, step)
    weights = checkpoint_weights(checkpoint, cfg.run_dir, cfg.model)
    if "embed_out.weight" not in weights:
        raise GptflowError(f"{checkpoint}: no embed_out.weight; not a gptflow GPT-NeoX")
    weights = {checkpoint_name(k): w for k, w in weights.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out)
    try:
        plan = write_hf_weights(tmp, weights, max_shard_size)
        tok = cfg.tokenizer
        (tmp / "config.json").write_text(
            json.dumps(hf_config(cfg.model, tok.eod_id, cfg.train.seq_length), indent=2) + "\n"
        )
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": tok.eod_id, "eos_token_id": tok.eod_id}, indent=2) + "\n"
        )
        shutil.copyfile(tok.path, tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": tok.eod_token,
                    "eos_token": tok.eod_token,
                    "unk_token": tok.eod_token,
                    "model_max_length": cfg.train.seq_length,
                    "clean_up_tokenization_spaces": False,
                },
                indent=2,
            )
            + "\n"
        )
        for f in tmp.iterdir():
            if f.name not in plan:  # the shards are fsynced as they are written
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = sum(math.prod(w.shape) for k, w in weights.items())
    log(
        f"{out}: GPTNeoXForCausalLM, {params:,} parameters in {len(plan)} safetensors "
        f"file(s), step {step}"
    )
    return {
        "dir": str(out), "parameters": params, "step": step, "files": len(plan),
        "checkpoint": str(checkpoint),
    }  # fmt: skip


@contextlib.contextmanager
def exported_step(config: str | os.PathLike, step: int, where: Path) -> Iterator[dict]:
    """The Hugging Face export of checkpoint `step` of run.yaml `config` (export_hf's record:
    its "dir" and "checkpoint"), made on the fly in directory `where`, removed afterwards (also
    when the harness fails): the run's checkpoints and its own export are only read."""
    shutil.rmtree(where, ignore_errors=True)  # debris of a killed job
    try:
        yield export_hf(config, where, step=step)
    finally:
        shutil.rmtree(where, ignore_errors=True)
