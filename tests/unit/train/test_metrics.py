"""What a resume keeps of the trainer's reports (gptflow.train.metrics), without training:
metrics.jsonl cut back to the resumed step, another series' records archived, and a log
interval's sums carried through a checkpoint. The training tests check the same end to end
(a resumed run logs what the uninterrupted one logs); these name each promise alone."""

from __future__ import annotations

import json

import pytest
import torch

from gptflow.train.device import Device
from gptflow.train.metrics import Interval, MetricsLog


def write_records(path, series: str, steps: list[int]) -> None:
    path.write_text("".join(json.dumps({"series": series, "step": s, "kind": "train",
                                        "loss": 10.0 - s}) + "\n" for s in steps))  # fmt: skip


def steps_in(path) -> list[tuple[str, int]]:
    return [(r["series"], r["step"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize(("resume_step", "kept"), [(6, [2, 4, 6]), (5, [2, 4]), (-1, [])])
def test_a_resume_keeps_the_records_up_to_its_step(tmp_path, resume_step, kept):
    """Resumed from step 6, the records of steps 7.. (the interrupted attempt's, repeated by
    this one) go and step 6's stays; a fresh start (-1) keeps none of them."""
    path = tmp_path / "metrics.jsonl"
    write_records(path, "s1", [2, 4, 6, 8])
    log = MetricsLog(path, "s1", tmp_path / "checkpoints" / "s1", resume_step)
    log.write({"step": resume_step + 1, "kind": "train", "loss": 1.0})
    assert steps_in(path) == [("s1", s) for s in kept] + [("s1", resume_step + 1)]


def test_another_series_records_are_archived_and_its_own_brought_back(tmp_path):
    """metrics.jsonl of series s1 when series s2 starts: archived in s1's checkpoint
    directory; s2's own archived records, from before, come back (cut to its resumed step)."""
    path = tmp_path / "metrics.jsonl"
    series_root = tmp_path / "checkpoints"
    write_records(path, "s1", [2, 4])
    (series_root / "s2").mkdir(parents=True)
    write_records(series_root / "s2" / "metrics.jsonl", "s2", [3, 6, 9])
    MetricsLog(path, "s2", series_root / "s2", resume_step=6)
    assert steps_in(path) == [("s2", 3), ("s2", 6)]
    assert steps_in(series_root / "s1" / "metrics.jsonl") == [("s1", 2), ("s1", 4)]


def test_an_intervals_sums_survive_a_checkpoint():
    """A log interval of 4 steps cut after 2 by a save and a resume logs the mean over all 4
    and the non-finite steps counted before the cut (Interval.state is the checkpoint's)."""
    dev = Device(torch.device("cpu"), 1)
    losses = [4.0, float("nan"), 2.0, 6.0]
    straight = Interval(dev)
    for loss in losses:
        straight.add(torch.tensor(2 * loss, dtype=torch.float64), micro_batches=2)
    before = Interval(dev)
    for loss in losses[:2]:
        before.add(torch.tensor(2 * loss, dtype=torch.float64), micro_batches=2)
    saved = json.loads(json.dumps(before.state()))  # through the checkpoint's client state
    resumed = Interval(dev, saved)
    for loss in losses[2:]:
        resumed.add(torch.tensor(2 * loss, dtype=torch.float64), micro_batches=2)
    # the mean is NaN (a NaN step is in it); the counts: 1 non-finite step, 0 of them in a row
    a, b = straight.read(), resumed.read()
    assert a[1:] == b[1:] == [1.0, 0.0]
    assert resumed.steps == straight.steps == 4
    resumed.restart()  # a new interval: the loss sum starts again, the counts go on
    assert resumed.read()[:2] == [0.0, 1.0] and resumed.steps == 0
    clean = Interval(dev, {"sums": [6.0, 0.0, 0.0], "steps": 2})  # steps 1-2: 2.0 and 4.0
    clean.add(torch.tensor(3.0, dtype=torch.float64), micro_batches=1)
    assert clean.read()[0] == pytest.approx(3.0)  # (2 + 4 + 3) / 3
