"""The progress lines of downloads and tokenization: the formatter, and the cadence on an
injected clock (no sleeping)."""

import math

import pytest

from gptflow.progress import Progress, duration, hms, human_bytes, progress_line


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (12_345_678, "12.3 MB"), (1.5e9, "1.5 GB"),
     (2e15, "2.0 PB"), (3e18, "3000.0 PB")],
)  # fmt: skip
def test_human_bytes_are_decimal(n, text):
    assert human_bytes(n) == text


def test_durations():
    assert [duration(s) for s in (0, 4.24, 59.9, 60, 3725, math.inf)] == [
        "0.0 s", "4.2 s", "59.9 s", "0:01:00", "1:02:05", "?",
    ]  # fmt: skip
    assert hms(90061) == "25:01:01" and hms(math.nan) == "?"


def test_known_total_gives_share_rate_and_eta():
    # 100 MB of 400 MB in 10 s: 10 MB/s, 300 MB left -> 30 s
    line = progress_line("a.jsonl", seconds=10, nbytes=100_000_000, total_bytes=400_000_000)
    assert line == "a.jsonl: 100.0 MB of 400.0 MB (25.0%) at 10.0 MB/s, ETA 30.0 s"


def test_resumed_bytes_count_towards_the_share_but_not_the_rate():
    # 250 MB were there before; 50 MB in 10 s = 5 MB/s; 700 MB left -> 140 s
    line = progress_line(
        "a.bin", seconds=10, nbytes=300_000_000, total_bytes=1_000_000_000, start_bytes=250_000_000
    )
    assert line == "a.bin: 300.0 MB of 1.0 GB (30.0%) at 5.0 MB/s, ETA 0:02:20"


def test_document_range_counts_documents_and_still_gives_mb_per_s():
    line = progress_line(
        "00000-3", seconds=20, nbytes=84_000_000, documents=6_000, total_documents=10_000
    )
    # 6,000 documents in 20 s: 4,000 left at 300/s -> 13.3 s
    assert line == "00000-3: 6,000 of 10,000 documents (60.0%), 84.0 MB at 4.2 MB/s, ETA 13.3 s"


def test_unknown_total_says_so_and_why_and_gives_the_rate():
    line = progress_line(
        "a.jsonl.zst", seconds=4, nbytes=512_000_000, documents=1234, unknown="compressed input"
    )
    assert line == (
        "a.jsonl.zst: 512.0 MB, 1,234 documents at 128 MB/s (total unknown: compressed input)"
    )
    assert progress_line("x", seconds=2, nbytes=1000) == "x: 1.0 kB at 0.001 MB/s (total unknown)"


def test_no_progress_yet_has_no_eta_and_no_division_by_zero():
    assert progress_line("a", seconds=0, nbytes=0, total_bytes=10) == (
        "a: 0 B of 10 B (0.0%) at 0.000 MB/s, ETA ?"
    )
    assert progress_line("a", seconds=5, nbytes=0, documents=0, total_documents=10).endswith(
        "ETA ?"
    )


def test_final_line_has_the_totals():
    line = progress_line(
        "a.bin", seconds=63, nbytes=1_200_000_000, start_bytes=3_000_000, final=True
    )
    assert line == "a.bin: done, 1.2 GB in 0:01:03 at 19.0 MB/s"
    assert progress_line("s", seconds=1.5, nbytes=3e6, documents=7, final=True) == (
        "s: done, 3.0 MB, 7 documents in 1.5 s at 2.0 MB/s"
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_cadence_one_line_per_interval_however_many_updates():
    clock, lines = Clock(), []
    p = Progress("f", lines.append, every=10, total_bytes=100_000_000, clock=clock)
    for _ in range(50):  # 50 updates in 5 s: too soon for a line
        clock.now += 0.1
        p.update(1_000_000)
    assert lines == []
    clock.now += 5  # 10 s after the start
    p.update(1_000_000)
    assert lines == ["f: 51.0 MB of 100.0 MB (51.0%) at 5.1 MB/s, ETA 9.6 s"]
    for _ in range(9):  # 9 s more: still one line
        clock.now += 1
        p.update(1_000_000)
    assert len(lines) == 1
    clock.now += 1  # 10 s after the last line
    p.update(1_000_000)
    assert len(lines) == 2 and lines[1].startswith("f: 61.0 MB of 100.0 MB (61.0%)")
    assert p.finish() == lines[2] == "f: done, 61.0 MB in 20.0 s at 3.0 MB/s"


def test_cadence_counts_documents_and_starts_after_resumed_bytes():
    clock, lines = Clock(), []
    p = Progress("r", lines.append, every=2, start_bytes=40_000_000, unknown="no size", clock=clock)
    clock.now += 2
    p.update(10_000_000, documents=3)
    p.update(10_000_000, documents=4)  # same instant: no second line
    assert lines == ["r: 50.0 MB, 3 documents at 5.0 MB/s (total unknown: no size)"]
    assert p.nbytes == 60_000_000 and p.documents == 7
