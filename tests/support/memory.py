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
    import gc

    from torch.profiler import ProfilerActivity, profile

    # garbage still alive counts in the allocator's total: a model built on the meta device
    # sits in a reference cycle (a caught exception's frames) until the collector runs
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gptflow-trace-{os.getpid()}.json"
    try:
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())["traceEvents"]
    finally:
        path.unlink(missing_ok=True)
    events = [e["args"] for e in trace if e.get("name") == "[memory]"]
    if not events:
        return 0
    # the allocator's running total counts what was allocated before the profile too (a
    # cached consolidated model of an earlier test): measured from the total before the
    # first event
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before
