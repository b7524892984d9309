"""What this machine's CPU can train: tests that need an instruction set ask here, and skip
with :data:`MISSING_HARDWARE` in their reason where it is missing (tests/conftest.py lets
such a skip stand under GPTFLOW_REQUIRE_ALL, which is for missing services, not hardware)."""

from __future__ import annotations

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
