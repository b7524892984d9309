"""Publish files atomically: write to a temporary name beside the target, fsync, rename.

No reader ever sees a half-written file under a final name, whatever kills the writer.

This module is the one home of "publish a file" (and a directory): every writer in gptflow
gets its temporary name from :func:`temp_path` / :func:`temp_dir` and renames it into place
with :func:`publish`. Two promises beyond atomicity:

* **Modes as plain ``open``.** A published file gets ``0o666 & ~umask`` and a directory
  ``0o777 & ~umask`` -- what ``open(path, "w")`` / ``mkdir`` give -- so outputs are as readable
  by a cluster group as any other file the user writes (``tempfile.mkstemp``/``mkdtemp`` would
  leave 0600/0700). :func:`publish` sets the mode itself, so a temporary that an external tool
  wrote (mksquashfs, apptainer) is published the same way.
* **No stale temporaries.** Names are ``.{name}.{host}-{pid}-{random}.tmp``: unique, and they
  say who made them. Making a temporary for a target first removes that target's temporaries
  left by dead processes of this host (a killed job's debris); those of other hosts, or of a
  live process, are left alone and never collide.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TEMP_SUFFIX = ".tmp"
# a temporary's name is capped below the usual 255-byte limit: the target name is shortened
MAX_TARGET_NAME = 160
_OWNER = re.compile(r"(?P<host>[A-Za-z0-9-]*)-(?P<pid>\d+)-[0-9a-f]{8}")


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """The process umask, read without changing it (Linux: /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not atomic against other threads)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """What ``open(path, "w")`` creates a file with: 0o666 & ~umask."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """What ``os.mkdir(path)`` creates a directory with: 0o777 & ~umask."""
    return 0o777 & ~umask()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])


def _temp_prefix(final: Path) -> str:
    return f".{final.name[:MAX_TARGET_NAME]}."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(final: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of `final` left by dead processes of this host; return them."""
    final = Path(final)
    prefix, host, removed = _temp_prefix(final), _host(), []
    try:
        entries = list(os.scandir(final.parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(TEMP_SUFFIX)):
            continue
        owner = _OWNER.fullmatch(name[len(prefix) : -len(TEMP_SUFFIX)])
        if owner is None or owner["host"] != host:
            continue
        pid = int(owner["pid"])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed.append(path)
    return removed


def _new_temp(final: str | os.PathLike, make) -> Path:
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    stem = f"{_temp_prefix(final)}{_host()}-{os.getpid()}-"
    while True:
        path = Path(final.parent, f"{stem}{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            make(path)
            return path
        except FileExistsError:
            continue


def temp_path(final: str | os.PathLike) -> Path:
    """A new, empty, unique temporary file next to `final` (same filesystem, so the rename is
    atomic), created as ``open`` would (0o666 & ~umask)."""
    return _new_temp(
        final, lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    )


def temp_dir(final: str | os.PathLike) -> Path:
    """A new, empty, unique temporary directory next to `final` (0o777 & ~umask)."""
    return _new_temp(final, lambda p: os.mkdir(p, 0o777))


def publish(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Give `tmp` the mode plain ``open``/``mkdir`` would, fsync it, rename it to `final`,
    fsync the directory. A directory replaces an existing `final` directory whole (the old
    one is moved aside under a temporary name, then removed)."""
    tmp, final = Path(tmp), Path(final)
    if tmp.is_dir():
        fsync_dir(tmp)
        os.chmod(tmp, dir_mode())
        old = None
        if final.exists():
            old = temp_dir(final)
            os.replace(final, old / final.name)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, file_mode())  # after the fsync: the mode may take away our own write bit
    os.replace(tmp, final)
    fsync_dir(final.parent)


def publish_symlink(target: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make `final` a symlink to `target`, atomically: made under a temporary name beside
    `final`, then renamed over it (an existing `final` is replaced, never followed)."""
    tmp = _new_temp(final, lambda p: os.symlink(target, p))
    try:
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(Path(final).parent)


@contextlib.contextmanager
def atomic_write(final: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """`with atomic_write(p) as f:` writes `p` completely or not at all."""
    tmp = temp_path(final)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
        publish(tmp, final)
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
