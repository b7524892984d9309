"""gptflow.train.async_save (train.async_save): a file taken now and written later is the file
torch.save writes now.

torch.save's output is compared byte for byte; the object graph is changed between the take
and the write, as the training does to its tensors and optimizer while a checkpoint is written.
A GPU's tensors cannot exist here: the one GPU-only fact (the file records the device the
tensor was on, not the host buffer's) is checked through a location tag of our own, which
torch.save and the snapshot must both write."""

from __future__ import annotations

import collections
import hashlib
import os
from pathlib import Path

import pytest
import torch
from torch import serialization as ts

from gptflow.train import async_save


class Holder:
    """An object (not a container) that holds a tensor and a number, as DeepSpeed's loss
    scaler and scheduler objects do inside a state dict."""

    def __init__(self) -> None:
        self.scale = 2.0**16
        self.tensor = torch.arange(6.0)


def state() -> dict:
    torch.manual_seed(0)
    flat = torch.randn(1000)  # ZeRO's flat buffer: parameters are views into it
    return {
        "module": collections.OrderedDict(
            w=flat[:600].view(20, 30), b=flat[600:630], t=torch.randn(5, 7).t()
        ),
        "flat": flat,
        "bf16": torch.randn(33).bfloat16(),
        "fp16": torch.randn(3, 3).half(),
        "ints": torch.arange(10, dtype=torch.int64)[::2],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0),
        "holder": Holder(),
        "shapes": [torch.Size([20, 30])],
        "meta": {"step": 7, "name": "x", "none": None, "tuple": (1, 2.5)},
    }


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def take_and_write(obj, tmp_path: Path, change=None) -> Path:
    pool = async_save.BufferPool()
    snap = async_save.take(obj, str(tmp_path / "out" / "model_states.pt"), pool)
    if change is not None:
        change(obj)
    (tmp_path / "out" / ".tmp").mkdir(parents=True)
    return async_save.write(snap, tmp_path / "out" / ".tmp")


def mutate(s: dict) -> None:
    """What training does after the snapshot: in-place updates, new objects, new values."""
    s["flat"].mul_(3)
    s["bf16"].zero_()
    s["holder"].scale = 1.0
    s["holder"].tensor.add_(1)
    s["meta"]["step"] = 8
    s["module"]["extra"] = torch.ones(2)


def test_a_snapshot_writes_torch_saves_bytes_as_of_the_take(tmp_path):
    s = state()
    (tmp_path / "ref").mkdir()
    torch.save(s, tmp_path / "ref" / "model_states.pt")
    written = take_and_write(s, tmp_path, change=mutate)
    assert sha(written) == sha(tmp_path / "ref" / "model_states.pt")
    back = torch.load(written, weights_only=False)
    assert back["meta"]["step"] == 7 and back["holder"].scale == 2.0**16
    # storage sharing kept: the views still share the flat buffer
    assert back["module"]["w"].untyped_storage().data_ptr() == back["flat"].data_ptr()


def test_the_file_records_the_tensors_device_not_the_host_buffers(tmp_path):
    """A CUDA tensor's file says cuda:N. Without a GPU: a location tag of our own for the
    original storages (torch.save's tagger mechanism) must appear in the snapshot's file as it
    does in torch.save's; tagging the host copy instead would write "cpu"."""
    s = {"w": torch.randn(10), "v": torch.randn(3)}
    ours = {s["w"].untyped_storage()._cdata}

    def tagger(storage):
        return "gptflowtest" if storage._cdata in ours else None

    ts.register_package(1, tagger, lambda obj, location: obj if location == "gptflowtest" else None)
    try:
        (tmp_path / "ref").mkdir()
        torch.save(s, tmp_path / "ref" / "model_states.pt")
        written = take_and_write(s, tmp_path)
    finally:
        ts._package_registry[:] = [p for p in ts._package_registry if p[1] is not tagger]
    assert b"gptflowtest" in (tmp_path / "ref" / "model_states.pt").read_bytes()
    assert sha(written) == sha(tmp_path / "ref" / "model_states.pt")


def test_host_buffers_are_reused_from_one_snapshot_to_the_next(tmp_path):
    w = async_save.BackgroundWriter(rank=0)
    (tmp_path / "a").mkdir()
    for step in range(3):
        s = state()
        snaps = [async_save.take(s, str(tmp_path / "a" / f"{step}.pt"), w.pool)]
        if step == 0:
            first = w.pool.held_bytes()
        w.submit(async_save.Batch(f"step{step}", snaps))
        w.wait()
        assert w.failure() is None
    assert first > 4000 and w.pool.held_bytes() == first  # nothing allocated after the first
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["0.pt", "1.pt", "2.pt"]
    w.close()


def test_one_snapshot_in_flight(tmp_path):
    w = async_save.BackgroundWriter(rank=0)
    release = __import__("threading").Event()
    w.submit(async_save.Batch("a", [], then=release.wait))
    with pytest.raises(RuntimeError, match="still being written"):
        w.submit(async_save.Batch("b", []))
    assert w.busy()
    release.set()
    w.wait()
    assert not w.busy()
    w.close()


def test_a_failed_write_is_reported_and_leaves_no_file_under_its_name(tmp_path):
    """The second file's directory is a file: the write fails, the failure names the file,
    the files before it are renamed into place, nothing is left under the failed name and
    no hidden temporary directory stays behind; the writer writes nothing after a failure."""
    w = async_save.BackgroundWriter(rank=3)
    (tmp_path / "ok").mkdir()
    (tmp_path / "blocked").write_text("a file, not a directory")
    s = state()
    snaps = [
        async_save.take(s, str(tmp_path / "ok" / "a.pt"), w.pool),
        async_save.take(s, str(tmp_path / "blocked" / "b.pt"), w.pool),
    ]
    w.submit(async_save.Batch("step1", snaps))
    w.wait()
    message = w.failure()
    assert message is not None and str(tmp_path / "blocked" / "b.pt") in message
    assert "failed" in message
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["a.pt"]
    later = [async_save.take(s, str(tmp_path / "ok" / "c.pt"), w.pool)]
    w.submit(async_save.Batch("step2", later))
    w.wait()
    assert not (tmp_path / "ok" / "c.pt").exists()
    w.close()


def test_pinned_buffers_are_registered_with_cuda_as_they_are(monkeypatch):
    """A GPU storage's host buffer starts a page of its own and is registered with CUDA at its
    own size (cudaHostRegister), unregistered when freed: the pool holds its storages' bytes
    and at most two pages each -- not a power of two, as PyTorch's caching host allocator
    behind ``pin_memory=True`` rounds them (a 600 MB storage would pin 1 GiB). The CUDA runtime
    is a stand-in that records what it is asked (no GPU here): what it is asked is what is
    pinned."""
    import gc

    calls = []

    class Cudart:  # torch.cuda.cudart()'s two calls the pool makes
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    pool = async_save.BufferPool()
    sizes = [600_000_000, 3, async_save.PAGE, 5 * async_save.PAGE + 1, 0]
    got = [pool.get(n, pinned=True) for n in sizes]  # not touched: the pages stay virtual
    assert all(pinned for _, pinned in got) and pool.pin_failure is None
    buffers = [buf for buf, _ in got]
    assert [b.nbytes for b in buffers] == sizes
    registered = [c for c in calls if c[0] == "register"]
    assert [(size, flags) for _, _, size, flags in registered] == [(n, 1) for n in sizes if n]
    for (_, ptr, size, _), buf in zip(registered, buffers, strict=False):
        # its pages are inside its own allocation: registering them touches no one else's
        whole = buf.untyped_storage()
        assert ptr == buf.data_ptr() and ptr % async_save.PAGE == 0
        last_page = ptr + -(-size // async_save.PAGE) * async_save.PAGE
        assert whole.data_ptr() <= ptr and last_page <= whole.data_ptr() + whole.nbytes()
    held = pool.held_bytes()
    assert held == pool.held_bytes(pinned=True) and pool.held_bytes(pinned=False) == 0
    assert sum(sizes) < held <= sum(sizes) + 2 * async_save.PAGE * 4 < 2**30
    pool.give_back([(b, True) for b in buffers])  # reused, not allocated again
    again, pinned = pool.get(3, pinned=True)
    assert again is buffers[1] and pinned and pool.held_bytes() == held
    ptrs = {ptr for _, ptr, _, _ in registered}
    del buffers, got, again, buf, whole, pool
    gc.collect()
    assert {c[1] for c in calls if c[0] == "unregister"} == ptrs


# ----------------------------------------------------------------------------- pinning refused


def cuda_runtime(refuse_above: int | None, calls: list | None = None):
    """A stand-in for torch.cuda.cudart() (no GPU here): cudaHostRegister refuses a buffer of
    more than `refuse_above` bytes with cudaErrorMemoryAllocation (2), as a locked-memory
    limit or a driver that does not allow it would; None refuses nothing."""
    calls = [] if calls is None else calls

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", size))
            return 2 if refuse_above is not None and size > refuse_above else 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    return Cudart


def test_a_buffer_that_cannot_be_pinned_is_used_unpinned_and_recorded(monkeypatch):
    """cudaHostRegister refusing a snapshot's buffer mid-save (the CUDA runtime is a stand-in:
    no GPU here) raises nothing -- an exception there would leave its rank's peers waiting in
    DeepSpeed's save -- the buffer is used unpinned and the refusal is kept; a later request is
    served by the unpinned buffers the pool holds (reused: nothing more allocated)."""
    monkeypatch.setattr(torch.cuda, "cudart", cuda_runtime(refuse_above=async_save.PAGE))
    pool = async_save.BufferPool()
    small, pinned = pool.get(100, pinned=True)
    assert pinned and pool.pin_failure is None
    large, pinned = pool.get(10 * async_save.PAGE, pinned=True)
    assert not pinned and large.nbytes == 10 * async_save.PAGE
    assert pool.pin_failure == (
        f"pinning {10 * async_save.PAGE:,} bytes of host memory for a checkpoint snapshot failed: "
        "cudaHostRegister returned 2"
    )
    held = pool.held_bytes()
    pool.give_back([(small, True), (large, False)])
    again, pinned = pool.get(10 * async_save.PAGE, pinned=True)
    assert again is large and not pinned and pool.held_bytes() == held
    reused, pinned = pool.get(100, pinned=True)  # a pinned one made before is still pinned
    assert reused is small and pinned


def test_pinning_is_probed_with_a_page_of_its_own(monkeypatch):
    """What every rank asks when training starts on GPUs: a page registered with CUDA and
    unregistered when the probe returns (a stand-in runtime: no GPU here); its refusal, or no
    CUDA runtime at all, is why."""
    import gc

    calls = []
    monkeypatch.setattr(torch.cuda, "cudart", cuda_runtime(None, calls))
    assert async_save.pinning_problem() is None
    gc.collect()
    assert [c[0] for c in calls] == ["register", "unregister"] and calls[0][1] == async_save.PAGE
    monkeypatch.setattr(torch.cuda, "cudart", cuda_runtime(refuse_above=0))
    assert async_save.pinning_problem() == (
        f"pinning {async_save.PAGE:,} bytes of host memory for a checkpoint snapshot failed: "
        "cudaHostRegister returned 2"
    )

    def no_runtime():
        raise RuntimeError("no CUDA GPUs are available")

    monkeypatch.setattr(torch.cuda, "cudart", no_runtime)
    assert async_save.pinning_problem() == "no CUDA GPUs are available"


SAVES_SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from gptflow.train import async_save
from gptflow.train.checkpoint import CheckpointSeries
from gptflow.train.device import Device
from gptflow.train.saves import Saves

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
dist.init_process_group("gloo")
dev = Device(torch.device("cpu"), 2)
for refused in ("everything", "large"):
    class Cudart:  # stands for the CUDA runtime (no GPU here); rank 1's refuses to pin
        def cudaHostRegister(self, ptr, size, flags):
            refuse = rank == 1 and (refused == "everything" or size > async_save.PAGE)
            return 2 if refuse else 0  # cudaErrorMemoryAllocation
        def cudaHostUnregister(self, ptr):
            return 0

    torch.cuda.cudart = Cudart
    saves = Saves(CheckpointSeries(out / "checkpoints", {}, 2), rank, True, dev.any_rank,
                  dev.barrier, pins=True)  # as training starts on GPUs
    record = {"after_start": saves.in_background}
    if saves.in_background:  # a save of step 1, as Saves.save makes it
        step = saves.series.prepare(1, rank, dev.barrier)
        step.mkdir(exist_ok=True)  # DeepSpeed's save_checkpoint makes it on every rank
        pool = saves.writer.pool
        record["pinned"] = pool.get(4 * async_save.PAGE, pinned=True)[1]  # a GPU storage's
        taken = async_save.take({"w": torch.ones(3)}, str(step / f"rank{rank}.pt"), pool)
        saves.writer.submit(async_save.Batch("step1", [taken]))
        saves.pending = (1, None)
        flags = saves.flags()
        saves.agreed(*dev.any_rank(*flags))  # the loop's per-step all-reduce (stop_reason)
        dev.barrier()  # rank 0 marks the step complete after the others may have gone on
        record.update(flags=flags, after_step=saves.in_background, complete=sorted(
            p.name for p in step.iterdir()))  # fmt: skip
    (out / f"{refused}-rank{rank}.json").write_text(json.dumps(record))
    print(f"{refused} done", file=sys.stderr, flush=True)
dist.destroy_process_group()
"""


def test_saves_turn_synchronous_on_every_rank_when_one_cannot_pin(tmp_path):
    """Two ranks (torchrun, gloo); rank 1's CUDA runtime (a stand-in: no GPU here) refuses to
    pin host memory. Refusing everything, the probe at the start finds it and both ranks save
    synchronously from the start; refusing only what is larger than the probe's page, rank 1's
    snapshot is taken unpinned, the step's all-reduce carries it, and both ranks turn
    synchronous after that same step. A save's collectives differ between the two modes, so
    one rank alone switching would leave the other waiting in DeepSpeed's save. Each is said
    once (rank 0), and rank 1 says why, once."""
    import json
    import subprocess

    from .test_train import BIN

    script = tmp_path / "saves.py"
    script.write_text(SAVES_SCRIPT)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]

    def records(refused: str) -> list[dict]:
        return [json.loads((tmp_path / f"{refused}-rank{r}.json").read_text()) for r in (0, 1)]

    assert records("everything") == [{"after_start": False}] * 2
    large = records("large")
    assert [r["pinned"] for r in large] == [True, False]
    assert [r["flags"][0] for r in large] == [False, False]  # no write failed
    assert [r["flags"][2] for r in large] == [False, True]  # rank 1's snapshot is unpinned
    assert [(r["after_start"], r["after_step"]) for r in large] == [(True, False)] * 2
    # the save in flight is written and marked complete before the switch, on both ranks
    assert [r["complete"] for r in large] == [["COMPLETE", "rank0.pt", "rank1.pt"]] * 2
    warnings = [line for line in out.stderr.splitlines() if "synchronous from now on" in line]
    assert len(warnings) == 2 and all("set train.async_save false" in w for w in warnings)
    assert "could not be pinned when training started" in warnings[0], out.stderr
    assert "the snapshot was taken unpinned and written" in warnings[1], out.stderr
    for why in (f"checkpoint snapshots failed: pinning {async_save.PAGE:,}",
                f"a checkpoint snapshot failed: pinning {4 * async_save.PAGE:,}"):  # fmt: skip
        assert out.stderr.count(f"rank 1: pinning host memory for {why}") == 1, out.stderr
    assert "rank 0: pinning" not in out.stderr
