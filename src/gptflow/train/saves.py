"""How the training loop saves its checkpoint series (:class:`Saves`): synchronously through
:meth:`gptflow.train.checkpoint.CheckpointSeries.save`, or from a snapshot in host memory
written in the background (:mod:`gptflow.train.async_save`, ``train.async_save``), and when a
background save falls back to synchronous ones.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.train.async_save import BackgroundWriter, Batch, pinning_problem
from gptflow.train.checkpoint import CheckpointSeries, _snapshots, tag_for

log = logging.getLogger("gptflow.train")


class Saves:
    """How the loop saves a series: synchronously, or (``train.async_save``) from a snapshot
    in host memory written by a thread of each rank (:mod:`gptflow.train.async_save`).

    An asynchronous save blocks training for the snapshot only: it waits for the previous
    write first (one snapshot in flight, the wait logged), then DeepSpeed's
    ``save_checkpoint`` runs with its checkpoint engine's ``save`` replaced by
    :func:`gptflow.train.async_save.take`, so every file DeepSpeed writes -- model, ZeRO partitions,
    pipeline layers -- is taken as it would have been written, and written byte for byte so.
    The step becomes COMPLETE, then ``latest``, only when every rank's files are on disk:
    the loop's one per-step all-reduce (:meth:`flags`, :meth:`agreed`) carries whether any
    rank is still writing or has failed, and when none is writing rank 0's writer thread
    marks the step complete. Before an exit and before the next save :meth:`settle` waits for
    the write on every rank and marks it complete at once. Until then resume reads the
    previous complete step, so a rank killed mid-write loses that save and nothing else.

    Host memory pinned for a GPU's copies (cudaHostRegister) may be refused on a rank. Saves in
    the background then become synchronous on every rank -- never on some: a save's collectives
    differ between the two. With `pins` (training on GPUs) every rank probes pinning here, at
    the same point of training's start (:func:`gptflow.train.async_save.pinning_problem`), and the
    ranks agree through `any_rank`. A buffer that cannot be pinned later (a larger one, a
    locked-memory limit) is used unpinned for that snapshot, which completes on every rank;
    the per-step all-reduce then carries it (:meth:`flags`) and every rank switches after the
    same step (:meth:`agreed`). Either is one warning; each refused rank logs why.

    `any_rank` and `barrier` are the rank's collectives (:class:`gptflow.train.device.Device`).
    """

    def __init__(self, series: CheckpointSeries, rank: int, in_background: bool,
                 any_rank, barrier, pins: bool = False) -> None:  # fmt: skip
        self.series, self.rank = series, rank
        self.any_rank, self.barrier = any_rank, barrier
        self.writer = BackgroundWriter(rank) if in_background else None
        self.pending: tuple[int, dict | None] | None = None  # written, not yet COMPLETE
        if self.writer is not None and pins:  # the same on every rank: all GPUs, or none
            problem = pinning_problem()
            if problem is not None:
                log.warning("rank %d: pinning host memory for checkpoint snapshots failed: %s",
                            rank, problem)  # fmt: skip
            if self.any_rank(problem is not None)[0]:
                self._synchronous("host memory for the snapshots could not be pinned when "
                                  "training started")  # fmt: skip

    @property
    def in_background(self) -> bool:
        return self.writer is not None

    def save(
        self, engine, step: int, client_state: dict, layout: dict | None
    ) -> tuple[Path, float]:
        """Save `step`; returns its directory and the seconds spent waiting for the previous
        write (0 for a synchronous save)."""
        if self.writer is None:
            path = self.series.save(engine, step, client_state, self.rank, self.barrier, layout)
            return path, 0.0
        waited = self.settle()
        path = self.series.prepare(step, self.rank, self.barrier)
        snapshots = _snapshots(engine, str(self.series.dir), tag_for(step), client_state,
                               self.writer.pool)  # fmt: skip
        self.writer.submit(Batch(tag_for(step), snapshots))
        self.pending = (step, layout)
        return path, waited

    def flags(self) -> tuple[bool, bool, bool]:
        """(this rank's write failed, this rank is still writing, this rank's last snapshot
        could not be pinned): for the per-step all-reduce."""
        if self.writer is None:
            return False, False, False
        writing = self.writer.busy()  # read first: a write that ends has set its failure
        unpinned = self.writer.pool.pin_failure is not None
        return self.writer.failure() is not None, writing, unpinned

    def agreed(self, failed: bool, writing: bool, unpinned: bool = False) -> None:
        """The flags OR-ed over the ranks: a failure stops training; a snapshot that could not
        be pinned on any rank makes every rank's later saves synchronous, once its write is
        done; when no rank is writing, rank 0's writer thread marks the pending step complete
        (and prunes)."""
        if failed:
            raise GptflowError(self.failure_message())
        if unpinned:
            own = self.writer.pool.pin_failure
            if own is not None:
                log.warning("rank %d: pinning host memory for a checkpoint snapshot failed: %s",
                            self.rank, own)  # fmt: skip
            self.settle()  # every rank is here, after the same step: the write, complete
            self._synchronous("host memory for a snapshot could not be pinned (the snapshot "
                              "was taken unpinned and written)")  # fmt: skip
            return
        if writing or self.pending is None:
            return
        step, layout = self.pending
        self.pending = None
        if self.rank == 0:
            self.writer.submit(Batch(tag_for(step), [], then=lambda: self._complete(step, layout)))

    def settle(self) -> float:
        """Every rank: wait for this rank's write, agree that none failed, and (rank 0) mark
        the pending step complete. Returns the seconds waited. Call on every rank."""
        if self.writer is None:
            return 0.0
        waited = self.writer.wait()
        (failed,) = self.any_rank(self.writer.failure() is not None)
        if failed:
            raise GptflowError(self.failure_message())
        if self.pending is not None:
            step, layout = self.pending
            self.pending = None
            if self.rank == 0:
                self._complete(step, layout)
                log.info("checkpoint %s complete after a wait of %.2f s for its write",
                         self.series.dir / tag_for(step), waited)  # fmt: skip
        return waited

    def _synchronous(self, why: str) -> None:
        """Save synchronously from now on (every rank calls this at the same point), said once."""
        self.writer.close()
        self.writer = None  # and with it the pool's buffers
        if self.rank == 0:
            log.warning(
                "checkpoint saves: synchronous from now on, on every rank: %s on at least one "
                "rank (its log says why; cudaHostRegister). Training waits for each write; set "
                "train.async_save false to save synchronously from the start",
                why,
            )

    def _complete(self, step: int, layout: dict | None) -> None:
        self.series.mark_complete(step, layout)
        self.series.start_pruning(step)

    def failure_message(self) -> str:
        step = self.pending[0] if self.pending else None
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        last = self.series.latest_step()
        kept = (f"the last complete checkpoint is step {last}, which a resume reads"
                if last is not None else "no checkpoint is complete yet")  # fmt: skip
        own = self.writer.failure() if self.writer else None
        why = (f"rank {self.rank} could not write its files: {own}" if own
               else "another rank could not write its files (its log says why)")  # fmt: skip
        return (
            f"{self.series.dir}: {what}: {why}; {kept}. Training stopped: fix the cause (free "
            f"space, permissions of {self.series.dir}) and run again, or set train.async_save "
            f"false to save synchronously"
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
