"""Real prose and code found offline, cut into documents for the quality filters' agreement
test and bench: Python's own documentation (``pydoc_data.topics``, the reference manual's
text), its standard library's sources, and Debian's common licences; every source is part of
the Python build or of Debian's base system, so the sample is the same on every machine of
the project's kind."""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
LICENSES = Path("/usr/share/common-licenses")
# The sizes documents are cut to, in turn: short ones (< 50 words) and long ones both occur
SIZES = (400, 2500, 6000, 1200, 9000, 3500)


def _sources() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"pydoc:{name}", topics[name]
    for path in sorted(STDLIB.glob("*.py")):
        yield str(path), path.read_text(encoding="utf-8", errors="replace")
    if LICENSES.is_dir():
        for path in sorted(LICENSES.iterdir()):
            if path.is_file() and not path.is_symlink():
                yield str(path), path.read_text(encoding="utf-8", errors="replace")


def _cut(text: str, counter: list[int]) -> Iterator[str]:
    """Consecutive paragraphs (blank-line separated) joined until the next size in SIZES."""
    parts: list[str] = []
    size = 0
    for para in re.split(r"(\n\s*\n)", text):
        parts.append(para)
        size += len(para)
        if size >= SIZES[counter[0] % len(SIZES)]:
            yield "".join(parts).strip("\n")
            counter[0] += 1
            parts, size = [], 0
    if "".join(parts).strip():
        yield "".join(parts).strip("\n")
        counter[0] += 1


def documents(count: int, max_bytes: int) -> list[str]:
    """`count` documents spread evenly over all sources' documents (each at most
    `max_bytes` of UTF-8), in a fixed order."""
    counter = [0]
    every = [d for _, text in _sources() for d in _cut(text, counter)]
    every = [d for d in every if d.strip() and len(d.encode()) <= max_bytes]
    step = max(1, len(every) // count)
    return every[::step][:count]
