"""Checkpoint files written in the background (``train.async_save``): a snapshot in host memory,
then a writer thread.

``torch.save(obj, path)`` does two things: it pickles `obj` (tensors become references to
their storages) and writes the pickle and each storage's bytes into a zip archive. Here they
are split in time. :func:`take` pickles `obj` at once, exactly as ``torch.save`` would
(same pickler, same storage keys and location tags, so a CUDA tensor still says ``cuda:N``),
and copies each storage into a host buffer; :func:`write` later writes the same records in
the same order through the same ``PyTorchFileWriter``. The file is byte for byte the one
``torch.save`` makes at the moment of :func:`take`, whatever the training does to its
tensors and objects afterwards (tests/unit/train/test_snapshot.py checks it, mutations included).

Host buffers are reused from one snapshot to the next (:class:`BufferPool`: DeepSpeed saves
the same storages every time), pinned when they receive a GPU's memory so the copy runs at the
link's speed. Each buffer starts a page of its own and is pinned by registering it with CUDA
at its own size: it takes its storage's bytes and at most two pages more, which is what the
preflight counts (gptflow.plan.host_memory.snapshot_fit). Not ``pin_memory=True``: PyTorch's caching
host allocator rounds every pinned allocation up to a power of two (``CachingHostAllocator.h``), so
a 10.3 GB fp32 partition would pin 16 GiB. Pinning can fail (a driver or a container that
does not allow it, a locked-memory limit): :func:`pinning_problem` probes it when training starts,
and a buffer that cannot be pinned mid-snapshot is used unpinned (the copy waits for the GPU;
the file is the same) and recorded (:attr:`BufferPool.pin_failure`): never an exception in the
middle of DeepSpeed's save, whose collectives every rank must reach (gptflow.train.saves.Saves
turns either into synchronous saves on every rank). One snapshot is in flight at a time:
:class:`BackgroundWriter` refuses a second before the first is written, and its caller waits (and
says how long).

Each file is written under its own name in a hidden directory beside it (``.writing-rank{r}``:
``PyTorchFileWriter`` names the archive's root folder after the file, so a temporary *name*
would change the bytes), fsynced, renamed into place, and the directory fsynced. A failure is
kept and reported by :meth:`BackgroundWriter.failure` -- the training loop asks at every step.
"""

from __future__ import annotations

import contextlib
import io
import logging
import mmap
import os
import pickle
import queue
import shutil
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import serialization as ts

from gptflow.fsutil import publish

log = logging.getLogger("gptflow.train")

PICKLE_PROTOCOL = 2  # torch.save's default (torch.serialization.DEFAULT_PROTOCOL)


PAGE = mmap.PAGESIZE


def buffer_bytes(nbytes: int) -> int:
    """Host memory a buffer of `nbytes` takes (:func:`host_buffer`): its pages and one more."""
    return -(-nbytes // PAGE) * PAGE + PAGE if nbytes else 0


def host_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of host memory (a uint8 tensor) that starts on a page boundary and shares no
    page with another allocation: a view into an allocation of :func:`buffer_bytes`, so that it
    can be registered with CUDA alone. torch's allocator owns it (nothing of Python's runs when
    it is freed, at exit too)."""
    whole = torch.empty(buffer_bytes(nbytes), dtype=torch.uint8)
    start = -whole.data_ptr() % PAGE
    return whole[start : start + nbytes]


CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as torch's own stager asks


def pin(buf: torch.Tensor) -> None:
    """Page-lock `buf` for a GPU's copies, as it is (cudaHostRegister: no rounding, unlike the
    caching host allocator), and unregister it when it is freed -- what PyTorch's own
    checkpoint stager does (torch.distributed.checkpoint._state_dict_stager)."""
    cudart, ptr = torch.cuda.cudart(), buf.data_ptr()
    error = int(cudart.cudaHostRegister(ptr, buf.nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if error:
        raise RuntimeError(f"pinning {buf.nbytes:,} bytes of host memory for a checkpoint "
                           f"snapshot failed: cudaHostRegister returned {error}")  # fmt: skip
    # not at exit: the CUDA context may be gone by then
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr).atexit = False


def pinning_problem() -> str | None:
    """Why host memory cannot be pinned for a GPU's copies here, or None: a page of its own,
    registered with CUDA as :func:`pin` registers a snapshot's buffers (and unregistered when
    this returns). Every rank asks when training starts, on a GPU only."""
    try:
        pin(host_buffer(PAGE))
    except Exception as e:  # cudaHostRegister's error, or no CUDA runtime to ask
        return str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
    return None


class BufferPool:
    """Host buffers by size, reused across snapshots (pinned when asked, and pinning works).

    :meth:`held_bytes` is what the pool holds: each buffer's :func:`buffer_bytes`, pinned or
    not (what the preflight's estimate is tested against). :attr:`pin_failure` is why a buffer
    could not be pinned: that buffer and every later one are not (pinned ones already made are
    still reused)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._held = {False: 0, True: 0}  # buffer_bytes of its buffers, by pinned
        self.pin_failure: str | None = None

    def get(self, nbytes: int, pinned: bool) -> tuple[torch.Tensor, bool]:
        """A buffer of `nbytes` and whether it is pinned: pinned when `pinned` asks and it can
        be (else unpinned: its copy from a GPU then waits, the bytes are the same)."""
        with self._lock:
            # once pinning failed, an unpinned buffer stands in for a pinned one
            for kind in (pinned, False) if self.pin_failure else (pinned,):
                free = self._free.get((nbytes, kind))
                if free:
                    return free.pop(), kind
        buf = host_buffer(nbytes)
        if pinned and nbytes:
            if self.pin_failure is None:
                try:
                    pin(buf)
                except RuntimeError as e:
                    self.pin_failure = str(e)
            pinned = self.pin_failure is None
        with self._lock:
            self._held[pinned] += buffer_bytes(nbytes)
        return buf, pinned

    def give_back(self, buffers: list[tuple[torch.Tensor, bool]]) -> None:
        with self._lock:
            for buf, pinned in buffers:
                self._free.setdefault((buf.nbytes, pinned), []).append(buf)

    def held_bytes(self, pinned: bool | None = None) -> int:
        """Bytes of host memory the pool holds (those pinned, or not, when `pinned` is given)."""
        with self._lock:
            return sum(self._held.values()) if pinned is None else self._held[pinned]


@dataclass
class Snapshot:
    """One file's content, taken: the pickle and each storage's bytes on the host."""

    path: str
    pickled: bytes
    storages: list[tuple[str, torch.Tensor]]  # (key, host copy: uint8), in torch.save's order
    buffers: list[tuple[torch.Tensor, bool]] = field(default_factory=list)  # pooled

    @property
    def nbytes(self) -> int:
        return len(self.pickled) + sum(b.nbytes for _, b in self.storages)


def take(obj, path: str, pool: BufferPool) -> Snapshot:
    """Pickle `obj` now and copy its storages to host buffers (torch.save's first half)."""
    found: dict[str, torch.UntypedStorage] = {}
    keys: dict[int, str] = {}

    def persistent_id(o):  # torch.serialization._save's, without its dtype-aliasing check
        if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
            if isinstance(o, torch.storage.TypedStorage):
                storage, storage_type = o._untyped_storage, getattr(torch, o._pickle_storage_type())
                numel = o._size()
            else:
                storage, storage_type = o, ts.normalize_storage_type(type(o))
                numel = storage.nbytes()
            key = keys.setdefault(storage._cdata, str(len(keys)))
            found[key] = storage
            return ("storage", storage_type, key, ts.location_tag(storage), numel)
        return None

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            return persistent_id(o)

    data = io.BytesIO()
    Pickler(data, protocol=PICKLE_PROTOCOL).dump(obj)
    snap = Snapshot(path, data.getvalue(), [])
    devices = set()
    for key, storage in found.items():
        on_host = storage.device.type == "cpu"
        buf, pinned = pool.get(storage.nbytes(), pinned=not on_host)
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        buf.copy_(source, non_blocking=pinned)  # into pageable memory it waits for the GPU
        if not on_host:
            devices.add(storage.device)
        snap.storages.append((key, buf))
        snap.buffers.append((buf, pinned))
    for device in devices:  # the copies have landed before anything reads the buffers
        torch.accelerator.current_stream(device.index).synchronize()
    return snap


def write(snap: Snapshot, temp_dir: Path) -> Path:
    """torch.save's second half: the archive under its own name in `temp_dir`. Returns the
    written file, to be published as ``snap.path`` (gptflow.fsutil.publish: fsync, rename)."""
    tmp = temp_dir / os.path.basename(snap.path)
    writer = torch._C.PyTorchFileWriter(
        str(tmp), ts.get_crc32_options(), ts._get_storage_alignment()
    )
    try:
        writer.write_record("data.pkl", snap.pickled, len(snap.pickled))
        writer.write_record(".format_version", "1", 1)
        alignment = str(ts._get_storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, buf in snap.storages:
            writer.write_record(f"data/{key}", buf.data_ptr(), buf.nbytes)
    except BaseException:
        # finalize it even so (it raises again): the writer's destructor would otherwise try,
        # and an exception there aborts the process (std::terminate) -- torch.save does too
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()
    del writer  # closes the file
    return tmp


def free_space(directory: Path) -> str:
    """`` (N bytes free on its file system)``, or nothing where that cannot be read."""
    try:
        return f" ({shutil.disk_usage(directory).free:,} bytes free on its file system)"
    except OSError:
        return ""


@dataclass
class Batch:
    """The files of one checkpoint on this rank, and what to do once they are on disk."""

    tag: str
    snapshots: list[Snapshot]
    then: object = None  # a callable run on the writer thread after the files (rank 0's marker)
    started: float = field(default_factory=time.monotonic)


class WriteFailed(Exception):
    """A background write failed; the message says which file and why."""


class BackgroundWriter:
    """One thread per rank writing :class:`Batch` es, one at a time, in order.

    :meth:`busy` and :meth:`failure` are read by the training loop at every step (no waiting);
    :meth:`wait` blocks until the queue is empty (before the next snapshot, before an exit)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pool = BufferPool()
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self.last_write_s = 0.0
        self.last_bytes = 0
        self.snapshot_bytes = 0  # of the last snapshot submitted

    # -- the loop's side ----------------------------------------------------------------
    def submit(self, batch: Batch) -> None:
        if not self._idle.is_set():
            raise RuntimeError("a snapshot is still being written: wait() first")
        self._idle.clear()
        if batch.snapshots:
            self.snapshot_bytes = sum(s.nbytes for s in batch.snapshots)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, daemon=True,
                                            name=f"checkpoint-writer-{self.rank}")  # fmt: skip
            self._thread.start()
        self._queue.put(batch)

    def busy(self) -> bool:
        return not self._idle.is_set()

    def failure(self) -> str | None:
        """Why the last write failed (also: the thread died with work queued), or None."""
        if self._error is None and self.busy() and not self._thread.is_alive():
            self._error = "the checkpoint writer thread died"
        return self._error

    def wait(self) -> float:
        """Block until every submitted batch is written (or failed); returns seconds waited."""
        started = time.monotonic()
        while not self._idle.wait(timeout=1.0):
            if self._thread is None or not self._thread.is_alive():
                self._error = self._error or "the checkpoint writer thread died"
                break
        return time.monotonic() - started

    # -- the thread's side --------------------------------------------------------------
    def _work(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                if self._error is None:  # after a failure, nothing more is written
                    self._write(batch)
                    if batch.then is not None:
                        batch.then()
            except BaseException as e:  # reported by failure(), at the loop's next step
                self._error = str(e) if isinstance(e, WriteFailed) else f"{type(e).__name__}: {e}"
                log.error("rank %d: writing checkpoint %s failed: %s", self.rank, batch.tag,
                          self._error)  # fmt: skip
            finally:
                self.pool.give_back([b for s in batch.snapshots for b in s.buffers])
                batch.snapshots = []
                if self._queue.empty():
                    self._idle.set()

    def _write(self, batch: Batch) -> None:
        started = time.monotonic()
        temps: dict[Path, Path] = {}
        try:
            for snap in batch.snapshots:
                final = Path(snap.path)
                try:
                    temp = temps.get(final.parent)
                    if temp is None:
                        temp = final.parent / f".writing-rank{self.rank}"
                        shutil.rmtree(temp, ignore_errors=True)  # debris of a killed write
                        temp.mkdir()
                        temps[final.parent] = temp
                    publish(write(snap, temp), final)  # fsync, rename, fsync the directory
                except (OSError, RuntimeError) as e:  # the zip writer raises RuntimeError
                    raise WriteFailed(f"writing {final} ({snap.nbytes:,} bytes) failed: "
                                      f"{e}{free_space(final.parent)}") from e  # fmt: skip
        finally:
            for temp in temps.values():
                shutil.rmtree(temp, ignore_errors=True)
        self.last_write_s = time.monotonic() - started
        self.last_bytes = sum(s.nbytes for s in batch.snapshots)

    def close(self) -> None:
        """Stop the thread once its queue is written (the process may also just exit)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            with contextlib.suppress(RuntimeError):
                self._thread.join()
