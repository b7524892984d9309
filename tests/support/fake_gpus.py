"""A stand-in `nvidia-smi` for tests of planning on a machine with GPUs: no GPU exists here.

It answers the two queries planning makes (gptflow.hardware): ``nvidia-smi -L`` (a line per
GPU) and ``nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits`` (MiB per GPU),
as a real driver prints them; anything else exits 9."""

from __future__ import annotations

import os
from pathlib import Path


def fake_nvidia_smi(directory: Path, mib: list[int]) -> Path:
    """Write `directory`/nvidia-smi showing one GPU of each `mib` MiB; returns the directory
    (put it first on PATH)."""
    directory.mkdir(parents=True, exist_ok=True)
    listing = "".join(
        f"echo 'GPU {i}: NVIDIA A100-SXM4-80GB (UUID: GPU-{i:04d}f2a)'\n" for i in range(len(mib))
    )
    memory = "".join(f"echo {m}\n" for m in mib)
    script = directory / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f"  *--query-gpu=memory.total*)\n{memory}    ;;\n"
        f"  -L)\n{listing}    ;;\n"
        "  *) exit 9 ;;\n"
        "esac\n"
    )
    script.chmod(0o755)
    return directory


def path_with(directory: Path) -> dict[str, str]:
    """os.environ with `directory` first on PATH."""
    return {**os.environ, "PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}
