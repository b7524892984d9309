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


def kept_bytes(engine) -> int:
    """Bytes of the distinct tensor storages a DeepSpeed engine keeps between steps: the
    module's parameters (and gradients, if kept), the optimizer's state and DeepSpeed's own
    buffers (fp32 partitions, accumulation buffers), found by walking the objects."""
    import torch

    seen: dict[int, int] = {}

    def walk(o, depth: int = 0) -> None:
        if depth > 4:
            return
        if isinstance(o, torch.Tensor):
            # meta tensors (DeepSpeed's round_robin_bit16_meta: shapes only) hold no memory
            if o.numel() and o.device.type != "meta":
                storage = o.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            if o.is_leaf and o.grad is not None:
                walk(o.grad, depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v, depth + 1)

    walk(list(engine.module.parameters()))
    opt = engine.optimizer
    for o in {
        id(opt): opt,
        id(getattr(opt, "optimizer", opt)): getattr(opt, "optimizer", opt),
    }.values():
        walk(list(o.state.values()))
        walk(list(vars(o).values()))
    return sum(seen.values())


def saved_peak(fn, params) -> int:
    """Peak bytes of the tensors autograd keeps for backward while `fn()` runs (forward and
    backward passes, a pipeline's interleaved ones too): every tensor a saved-tensors hook
    packs, counted by distinct storage while autograd holds it, parameters left out (they
    are model state). Taken at each pack, so at the end of each forward: where they peak."""
    import weakref

    import torch

    weights = {p.untyped_storage().data_ptr() for p in params}
    live: dict[int, tuple] = {}
    peak = 0

    def pack(t):
        nonlocal peak
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            live[id(t)] = (weakref.ref(t), storage.data_ptr(), storage.nbytes())
            held = {ptr: n for ref, ptr, n in live.values() if ref() is not None}
            peak = max(peak, sum(held.values()))
        return t  # autograd holds it: the weak reference dies when autograd lets it go

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return peak
