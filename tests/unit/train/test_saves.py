"""When a step becomes COMPLETE: only once every rank's files of it are on disk, saved
synchronously (CheckpointSeries.save) or in the background (gptflow.train.saves.Saves).

Without DeepSpeed or a process group: a fake engine writes one file through its checkpoint
engine's ``save`` (as DeepSpeed's save_checkpoint does), and the collectives are stand-ins that
play the other ranks -- a barrier at which they write their files, an all-reduce that ORs in
their flags. The training tests run the real thing; these name the ordering alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gptflow.errors import GptflowError
from gptflow.train.checkpoint import COMPLETE, CheckpointSeries
from gptflow.train.saves import Saves


class FakeEngine:
    """What a save needs of a DeepSpeed engine: save_checkpoint writing its rank's file through
    its checkpoint engine's save."""

    def __init__(self) -> None:
        self.checkpoint_engine = SimpleNamespace(save=lambda sd, path: torch.save(sd, path))

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert not save_latest  # DeepSpeed's own `latest` is written before the others finish
        os.makedirs(Path(save_dir, tag), exist_ok=True)
        self.checkpoint_engine.save(
            {"module": {"w": torch.ones(2)}, **client_state},
            str(Path(save_dir, tag, "mp_rank_00_model_states.pt")),
        )


def test_a_synchronous_save_is_complete_only_after_every_rank_has_its_files(tmp_path):
    """Rank 0 of two: rank 1 writes its partition while rank 0 waits at a barrier, and COMPLETE
    and `latest` appear only after the barrier that follows every rank's writes."""
    series = CheckpointSeries(tmp_path, {"a": 1}, keep_last=2)
    step = tmp_path / "step00000004"
    other = step / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    seen = []

    def barrier():  # rank 1 is at the same barrier; it writes its file before reaching it
        seen.append(((step / COMPLETE).exists(), other.exists()))
        if (step / "mp_rank_00_model_states.pt").exists() and not other.exists():
            other.write_bytes(b"rank 1's optimizer partition")

    series.save(FakeEngine(), 4, {"step": 4}, rank=0, barrier=barrier)
    series.finish_pruning()
    # prepare, every rank's files on disk, after COMPLETE: never COMPLETE without rank 1's file
    assert seen == [(False, False), (False, False), (True, True)]
    assert series.latest_step() == 4 and (tmp_path / "latest").read_text() == "step00000004"


def test_a_save_clears_the_debris_of_an_interrupted_save_of_the_same_step(tmp_path):
    """A step directory without COMPLETE (a save killed part-way, perhaps in another layout)
    is emptied before the step is saved again: its stale files are not in the new step."""
    series = CheckpointSeries(tmp_path, {"a": 1}, keep_last=2)
    stale = tmp_path / "step00000004" / "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    stale.parent.mkdir()
    stale.write_bytes(b"a rank of the layout before")
    series.save(FakeEngine(), 4, {"step": 4}, rank=0, barrier=lambda: None)
    series.finish_pruning()
    assert sorted(p.name for p in stale.parent.iterdir()) == [
        COMPLETE, "mp_rank_00_model_states.pt"
    ]  # fmt: skip


class OtherRank:
    """Rank 1 as rank 0's collectives see it: its flags (still writing, failed) OR-ed into
    rank 0's, as Device.any_rank does across ranks."""

    def __init__(self) -> None:
        self.writing = False
        self.failed = False

    def any_rank(self, *flags: bool) -> list[bool]:
        theirs = {3: (self.failed, self.writing, False), 1: (self.failed,)}[len(flags)]
        return [a or b for a, b in zip(flags, theirs, strict=True)]


def background(tmp_path: Path, other: OtherRank) -> Saves:
    series = CheckpointSeries(tmp_path, {"a": 1}, keep_last=2)
    return Saves(series, rank=0, in_background=True, any_rank=other.any_rank,
                 barrier=lambda: None)  # fmt: skip


def test_a_background_save_is_complete_only_when_no_rank_is_still_writing(tmp_path):
    """Rank 0's own write is done, rank 1's is not: the step's all-reduce says a rank is
    writing, and the step stays incomplete (a resume reads the step before) until a later
    step's all-reduce says none is."""
    other = OtherRank()
    saves = background(tmp_path, other)
    try:
        saves.save(FakeEngine(), 4, {"step": 4}, layout=None)
        saves.writer.wait()  # rank 0's file is on disk
        other.writing = True
        saves.agreed(*other.any_rank(*saves.flags()))
        saves.writer.wait()
        assert not (tmp_path / "step00000004" / COMPLETE).exists()
        assert saves.series.latest_step() is None
        other.writing = False  # a later step: rank 1's write is done too
        saves.agreed(*other.any_rank(*saves.flags()))
        saves.writer.wait()
        assert saves.series.latest_step() == 4
    finally:
        saves.close()


def test_another_ranks_failed_write_leaves_the_step_incomplete_on_every_rank(tmp_path):
    """Before an exit (settle), rank 0's write succeeded but rank 1's failed: training stops
    with the error on rank 0 too, and the step is not marked complete."""
    other = OtherRank()
    saves = background(tmp_path, other)
    try:
        saves.save(FakeEngine(), 4, {"step": 4}, layout=None)
        other.failed = True
        with pytest.raises(GptflowError, match="another rank could not write its files"):
            saves.settle()
        saves.writer.wait()
        assert not (tmp_path / "step00000004" / COMPLETE).exists()
        assert saves.series.latest_step() is None
    finally:
        saves.close()
