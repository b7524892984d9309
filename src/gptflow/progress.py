"""Progress lines for job logs: done / total, rate and ETA, at most one line every few seconds.

Workflow jobs write to log files, not terminals, so a carriage-return bar (tqdm) shows nothing
useful there. :class:`Progress` logs a plain line instead, when at least `every` seconds have
passed since the last one -- an update costs one clock read -- and :func:`progress_line`, the
one formatter of these lines, is shared by downloads and tokenization::

    a.jsonl: 120.4 MB of 1.2 GB (10.0%) at 52.1 MB/s, ETA 20.8 s
    00000-3: 6,000 of 10,000 documents (60.0%), 84.2 MB at 95.3 MB/s, ETA 0:01:12
    a.jsonl.zst: 512.0 MB at 88.0 MB/s (total unknown: compressed input)
    a.jsonl: done, 1.2 GB in 0:01:03 at 19.0 MB/s

Sizes are decimal (1 MB = 10^6 bytes), as in the other log lines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def human_bytes(n: float) -> str:
    """``950 B``, ``12.3 kB``, ``1.5 GB`` (decimal units)."""
    for unit in _UNITS[:-1]:
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} {_UNITS[-1]}"


def hms(seconds: float) -> str:
    """``1:02:03`` (hours unbounded), or ``?`` when not finite."""
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def duration(seconds: float) -> str:
    """``4.2 s`` under a minute, else ``h:mm:ss``; ``?`` when unknown."""
    if not math.isfinite(seconds):
        return "?"
    return f"{seconds:.1f} s" if seconds < 60 else hms(seconds)


def per_second(amount: float, seconds: float, digits: int) -> float | None:
    """`amount` per second, rounded to `digits`; None for no time at all (a manifest's rate)."""
    return round(amount / seconds, digits) if seconds > 0 else None


def _mb_per_s(bytes_per_s: float) -> str:
    mb = bytes_per_s / 1e6
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.1f}" if mb >= 1 else f"{mb:.3f}"


def progress_line(
    name: str,
    *,
    seconds: float,
    nbytes: int,
    total_bytes: int | None = None,
    documents: int | None = None,
    total_documents: int | None = None,
    start_bytes: int = 0,
    unknown: str = "",
    final: bool = False,
) -> str:
    """One progress line of `name` after `seconds`: `nbytes` done (of `total_bytes`), or
    `documents` of `total_documents` when only that total is known; the rate in MB/s over
    the bytes done in these `seconds` (those after `start_bytes`, e.g. a resumed download's
    earlier part) and the ETA at that rate. Without a total, the line says so (`unknown` is
    why) and gives the rate alone. `final`: the closing line with the totals."""
    rate = max(0, nbytes - start_bytes) / seconds if seconds > 0 else 0.0
    docs = f", {documents:,} documents" if documents is not None else ""
    if final:
        return f"{name}: done, {human_bytes(nbytes)}{docs} in {duration(seconds)} at {_mb_per_s(rate)} MB/s"
    eta = math.inf
    if total_bytes is not None:
        done = f"{human_bytes(nbytes)} of {human_bytes(total_bytes)}{_share(nbytes, total_bytes)}"
        done += docs
        if rate > 0:
            eta = max(0, total_bytes - nbytes) / rate
    elif total_documents is not None and documents is not None:
        done = f"{documents:,} of {total_documents:,} documents"
        done += f"{_share(documents, total_documents)}, {human_bytes(nbytes)}"
        if documents > 0 and seconds > 0:
            eta = max(0, total_documents - documents) * seconds / documents
    else:
        why = f": {unknown}" if unknown else ""
        return f"{name}: {human_bytes(nbytes)}{docs} at {_mb_per_s(rate)} MB/s (total unknown{why})"
    return f"{name}: {done} at {_mb_per_s(rate)} MB/s, ETA {duration(eta)}"


def _share(done: float, total: float) -> str:
    return f" ({100 * done / total:.1f}%)" if total > 0 else ""


class Progress:
    """Logs :func:`progress_line` through `emit` at most every `every` seconds, from the
    first update after that; :meth:`finish` logs the closing line. `clock` is injectable
    for tests (monotonic seconds)."""

    def __init__(
        self,
        name: str,
        emit: Callable[[str], object],
        *,
        every: float = 10.0,
        total_bytes: int | None = None,
        total_documents: int | None = None,
        start_bytes: int = 0,
        unknown: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.emit, self.every, self.clock = name, emit, every, clock
        self.total_bytes, self.total_documents = total_bytes, total_documents
        self.start_bytes = self.nbytes = start_bytes
        self.documents: int | None = None if total_documents is None else 0
        self.unknown = unknown
        self.started = self.last = clock()

    def update(self, nbytes: int, documents: int | None = None) -> None:
        """`nbytes` more bytes done (and `documents` more documents)."""
        self.nbytes += nbytes
        if documents is not None:
            self.documents = (self.documents or 0) + documents
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.emit(self.line(now))

    def line(self, now: float | None = None, *, final: bool = False) -> str:
        now = self.clock() if now is None else now
        return progress_line(
            self.name,
            seconds=now - self.started,
            nbytes=self.nbytes,
            total_bytes=self.total_bytes,
            documents=self.documents,
            total_documents=self.total_documents,
            start_bytes=self.start_bytes,
            unknown=self.unknown,
            final=final,
        )

    def finish(self) -> str:
        """Log and return the closing line (totals, time, rate)."""
        line = self.line(final=True)
        self.emit(line)
        return line
