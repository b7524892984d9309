"""What the accelerators gptflow knows can do: their peak throughput, for MFU (model FLOPs
utilisation), and the precision a run trains in when the config leaves it to the device.

MFU = achieved model FLOP/s per device / the device's peak. The peak is dense bf16 tensor-core
throughput from the vendors' data sheets (no 2:4 sparsity); `train.peak_tflops` overrides it,
and is the only source on a CPU or an accelerator not in the table. How many GPUs this machine
shows, and their memory, read without torch (planning imports none): :func:`visible_gpus`,
:func:`gpu_memory_mib`. What a memory estimate leaves free on a GPU (:func:`fit_margin`) and in
a process's host memory (:data:`HOST_OVERHEAD_BYTES`): one home for training's fit check and
the evaluation's plan.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

# name fragment as torch.cuda.get_device_name() reports it -> dense bf16 TFLOP/s
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM and NVL
    ("A100", 312.0),
)


def peak_tflops(
    device_name: str | None, configured: float | None = None
) -> tuple[float | None, str]:
    """(peak TFLOP/s per device, where it came from); (None, why) when it is unknown."""
    if configured:
        return configured, "train.peak_tflops"
    if not device_name:
        return None, "no accelerator: set train.peak_tflops to report MFU on this machine"
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in device_name:
            return tflops, f"{device_name} (dense bf16 peak)"
    return None, f"{device_name} is not in gptflow.hardware's table: set train.peak_tflops"


def mfu(tflops_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None when the peak is unknown."""
    return tflops_per_device / peak if peak else None


# bf16 tensor cores: compute capability 8.0 (Ampere) and later; earlier GPUs emulate bf16 slowly
BF16_MIN_CAPABILITY = (8, 0)


def training_precision(
    configured: str, zero_stage: int, device_name: str | None, capability: tuple[int, int] | None
) -> tuple[str, str]:
    """(the precision a run trains in, why) for `train.precision` on this device.

    An explicit fp32/bf16/fp16 is kept. ``auto`` is bf16 on a GPU with bf16 tensor cores when
    the ZeRO stage can train it (1 or more: fp32 master weights and fp32 gradient sums), and
    fp32 otherwise -- on a CPU, where bf16 matmuls are slower than fp32 ones, and on older GPUs,
    where fp16 would need loss scaling and is left to an explicit choice.
    """
    if configured != "auto":
        return configured, "train.precision"
    if device_name is None or capability is None:
        return "fp32", "auto on a CPU"
    if capability < BF16_MIN_CAPABILITY:
        major, minor = capability
        return "fp32", (
            f"auto on {device_name} (compute capability {major}.{minor}: no bf16 tensor cores; "
            f"set train.precision fp16 for half precision with loss scaling)"
        )
    if zero_stage == 0:
        return "fp32", (
            f"auto on {device_name} at train.zero_stage 0, which cannot train bf16 with fp32 "
            f"master weights: set train.zero_stage 1 for bf16"
        )
    return "bf16", f"auto on {device_name} (bf16 tensor cores, ZeRO stage {zero_stage})"


# Compute capability by name fragment, as torch.cuda.get_device_name() or a Slurm gres type
# ("gpu:a100:8") names the GPU, for the precision ``auto`` is planned in before any GPU is seen
# (gptflow.plan.preflight). Longer fragments first: A100 before A10, L40 before L4, P40 before
# P4. Not "RTX6000": the Quadro RTX 6000 is 7.5, the RTX 6000 Ada 8.9.
CAPABILITY: tuple[tuple[str, tuple[int, int]], ...] = (
    ("GB200", (10, 0)),
    ("B200", (10, 0)),
    ("H200", (9, 0)),
    ("H100", (9, 0)),
    ("L40", (8, 9)),
    ("L4", (8, 9)),
    ("A100", (8, 0)),
    ("A6000", (8, 6)),
    ("A40", (8, 6)),
    ("A30", (8, 0)),
    ("A10", (8, 6)),
    ("V100", (7, 0)),
    ("T4", (7, 5)),
    ("P100", (6, 0)),
    ("P40", (6, 1)),
)
# A gres without a GPU type is planned for the GPUs the GPU memory check assumes (80 GB
# A100/H100)
ASSUMED_CAPABILITY = (8, 0)


def planned_gpu(gpu_type: str | None) -> tuple[str, tuple[int, int] | None]:
    """(name, compute capability) of the GPUs a run is planned for: the type the profile's
    gres names (``a100`` of ``gpu:a100:8``) when :data:`CAPABILITY` knows it; A100/H100s,
    named as assumed, for a gres without a type; None for a type the table does not know
    (an A100 or H100 would have matched: its capability, and so ``auto``'s precision, cannot be
    planned)."""
    for fragment, capability in CAPABILITY:
        if gpu_type and fragment in gpu_type.upper():
            return f"{gpu_type} GPUs (the gres's type)", capability
    if gpu_type:
        return f"{gpu_type} GPUs (the gres's type, not in gptflow.hardware's table)", None
    why = "the profile's gres names no GPU type"
    return f"GPUs assumed to be A100/H100 (compute capability 8.0+: {why})", ASSUMED_CAPABILITY


def background_saves(configured: bool | str, on_gpus: bool) -> tuple[bool, str]:
    """(whether checkpoints are written in the background, why) for `train.async_save`.

    An explicit true/false is kept. ``auto`` is on with GPUs: the snapshot is a copy over the
    host link and the write then uses host cores the training does not. On CPUs the write
    competes with the training for the same cores: bench/async_save.py on 2 cores held
    training 0.09-0.14x as long per save, but the whole loop took 0.72-1.12x the synchronous
    one with the host's load, so ``auto`` is off there."""
    if configured != "auto":
        return bool(configured), "train.async_save"
    if on_gpus:
        return True, "auto with GPUs"
    return False, "auto on CPUs, where the write would compete with training for the cores"


# ----------------------------------------------------------------- what an estimate leaves free

# What a memory estimate (training's fit at -n: gptflow.plan.gpu_memory and host_memory;
# the evaluation's placement: gptflow.results.sizing) leaves for what its terms do not see.
GIB = 2**30
# Room on a GPU, on top of the estimate's terms:
# - CUDA context, cuBLAS/cuDNN workspaces and NCCL's communication buffers: a fixed amount a
#   rank loses before its first tensor (NCCL_BUFFSIZE is 4 MiB a channel and peer; the context
#   is a few hundred MB). Not measured here (no GPU): a round figure, on the safe side.
RUNTIME_OVERHEAD_BYTES = 2 * GIB
# - the caching allocator's fragmentation at the peak: DeepSpeed's activation-offload planner
#   leaves 10 % of device memory to the allocator (MARGIN and MIN_MEASURED_MARGIN in
#   deepspeed/compile/passes/offload_activation.py: "what a margin has to cover is peak-time
#   fragmentation", calibrated there on GPUs).
FRAGMENTATION_SHARE = 0.10


def fit_margin(gpu_bytes: int) -> int:
    """Bytes of a GPU an estimate leaves free: runtime overhead plus fragmentation (training's
    fit check and the evaluation's plan alike)."""
    return RUNTIME_OVERHEAD_BYTES + int(FRAGMENTATION_SHARE * gpu_bytes)


# Host memory of a process besides its tensors: Python, torch, DeepSpeed, tokenizers, the shard
# index and, on a GPU, CUDA's host side. Measured here: 0.40 GB max RSS for a training rank after
# a step on the CPU (torch 2.13, DeepSpeed 0.19.8); a CUDA context adds ~1.7 GB
# (pytorch/pytorch#113326: 2.06 GB max RSS with one CUDA tensor, 0.32 GB without; torch 2.2,
# lazy module loading). Not measured on a GPU here.
HOST_OVERHEAD_BYTES = 2 * GIB


# --------------------------------------------------------------------------- GPUs on this machine

NVIDIA_SMI_LIST = ["nvidia-smi", "-L"]  # one "GPU <i>: <name> (UUID: GPU-...)" line per GPU


def cuda_visible_count(value: str) -> int:
    """GPUs ``CUDA_VISIBLE_DEVICES=value`` lets a process see, as CUDA reads it: its entries up
    to the first that is not a GPU (a negative or non-numeric index: ``-1`` hides them all),
    an index or a ``GPU-``/``MIG-`` UUID each; empty: none."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or re.match(r"(GPU|MIG)-", entry)):
            break
        count += 1
    return count


def listed_gpus() -> tuple[int | None, str]:
    """(the GPUs ``nvidia-smi -L`` lists, how), None where it is missing or fails (no driver)."""
    if shutil.which(NVIDIA_SMI_LIST[0]) is None:
        return None, "no nvidia-smi on PATH"
    try:
        out = subprocess.run(NVIDIA_SMI_LIST, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi -L: {e}"
    if out.returncode != 0:
        return None, f"nvidia-smi -L exited {out.returncode}"
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")), "nvidia-smi -L"


def visible_gpus(env: dict | None = None) -> tuple[int, str]:
    """(NVIDIA GPUs a process started here would see, how that was counted), without torch:
    ``CUDA_VISIBLE_DEVICES`` when set (no more than ``nvidia-smi -L`` lists, when it runs),
    else ``nvidia-smi -L``'s GPUs; none without either."""
    env = os.environ if env is None else env
    listed, how = listed_gpus()
    if "CUDA_VISIBLE_DEVICES" in env:
        visible = cuda_visible_count(env["CUDA_VISIBLE_DEVICES"])
        if listed is not None:
            visible = min(visible, listed)
        return visible, f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
    return listed or 0, how


NVIDIA_SMI_MEMORY = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]


def gpu_memory_mib() -> tuple[int | None, str]:
    """(the memory of the smallest GPU ``nvidia-smi`` lists, in MiB, how it was read); None
    where nvidia-smi is missing, fails or prints no number a line (no GPU, no driver)."""
    if shutil.which(NVIDIA_SMI_MEMORY[0]) is None:
        return None, "no nvidia-smi on PATH"
    try:
        out = subprocess.run(NVIDIA_SMI_MEMORY, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi --query-gpu=memory.total: {e}"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0:
        return None, f"nvidia-smi --query-gpu=memory.total exited {out.returncode}"
    if not lines or not all(line.isdigit() for line in lines):
        return None, "nvidia-smi --query-gpu=memory.total printed no MiB figures"
    sizes = [int(line) for line in lines]
    return min(sizes), f"nvidia-smi: the smallest of {len(sizes)} GPU(s), {min(sizes):,} MiB"
