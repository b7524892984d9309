"""Tensor memory as PyTorch's allocator counts it (for the tests that bound a peak)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def peak_allocated(fn) -> int:
    """Peak bytes of CPU tensor memory allocated while `fn()` runs, above what was allocated
    before: PyTorch's own allocator accounting (the profiler's ``[memory]`` events with
    profile_memory=True report every CPU allocation and free with the running total).
    Memory-mapped checkpoint files are not allocations (the kernel pages them in and out as
    page cache), so they do not count; every tensor the export creates does (copies, torch.cat,
    dtype conversions). Python objects other than tensors are not counted; the export holds no
    tensor data outside tensors (it writes tensors' memory as it is)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gptflow-trace-{os.getpid()}.json"
    try:
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())["traceEvents"]
    finally:
        path.unlink(missing_ok=True)
    totals = [e["args"]["Total Allocated"] for e in trace if e.get("name") == "[memory]"]
    return max(totals, default=0)
