"""Peak throughput of the accelerators gptflow knows, for MFU (model FLOPs utilisation).

MFU = achieved model FLOP/s per device / the device's peak. The peak is dense bf16 tensor-core
throughput from the vendors' data sheets (no 2:4 sparsity); `train.peak_tflops` overrides it,
and is the only source on a CPU or an accelerator not in the table.
"""

from __future__ import annotations

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
