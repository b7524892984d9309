"""What this machine's CPU can train. fp16: DeepSpeed refuses it on a CPU whose oneDNN has no
fp16 (AMD EPYC without AVX-512 FP16, for one), so a test that trains fp16 runs its processes
with :func:`fp16_env`, which lifts that gate where it is closed: the same DeepSpeed code runs
on PyTorch's reference fp16 kernels. A test that cannot do without an instruction set skips
with :data:`MISSING_HARDWARE` in its reason (tests/conftest.py lets such a skip stand under
GPTFLOW_REQUIRE_ALL, which is for missing services, not hardware)."""

from __future__ import annotations

import os
from pathlib import Path

MISSING_HARDWARE = "this machine's CPU lacks"


def cpu_fp16() -> bool:
    """DeepSpeed trains fp16 on a CPU only where oneDNN computes in fp16 (AVX-512 FP16 or AMX;
    its CPU accelerator's ``is_fp16_supported`` asks the same), else it refuses with "Type fp16
    is not supported on your device"."""
    import torch  # here: tests/conftest.py imports this module before anything needs torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


NO_CPU_FP16 = (
    f"{MISSING_HARDWARE} fp16 (oneDNN has no fp16 here: no AVX-512 FP16/AMX), so DeepSpeed "
    "refuses fp16 training on it"
)


GATE = Path(__file__).parent / "cpu_fp16_gate"  # its sitecustomize.py lifts DeepSpeed's check


def fp16_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a process that trains fp16 through DeepSpeed: as it
    is where the CPU has fp16; else with :data:`GATE` first on PYTHONPATH. What such a run
    does not exercise is oneDNN's fp16 kernels, only their reference equivalents."""
    env = dict(os.environ if env is None else env)
    if cpu_fp16():
        return env
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(GATE), env.get("PYTHONPATH")) if p)
    return env
