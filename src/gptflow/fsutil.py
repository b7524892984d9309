"""Publish files atomically: write to a temporary name beside the target, fsync, rename.

No reader ever sees a half-written file under a final name, whatever kills the writer.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(final: str | os.PathLike) -> Path:
    """A unique temporary name next to `final` (same filesystem, so rename is atomic)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(name)


def publish(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """fsync `tmp`, rename it to `final`, fsync the directory."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


@contextlib.contextmanager
def atomic_write(final: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """`with atomic_write(p) as f:` writes `p` completely or not at all."""
    tmp = temp_path(final)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(Path(final).parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write `obj` as pretty JSON with a trailing newline."""
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
