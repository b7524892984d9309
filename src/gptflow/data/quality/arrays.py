"""Parts of ``.npy`` files read by explicit reads, never memory-mapped: the MinHash bucket
jobs' band slices, the clustering's pair files, a removal job's slice of its group's list.

Why not ``np.load(mmap_mode="r")``: a mapped file's pages count in the process's resident
memory once touched and stay mapped while the array lives, so a job streaming a file through
a map peaks (VmHWM, what Slurm's memory limit sees) with the file, though it holds one block
at a time; reads through a map are invisible to /proc/self/io's ``rchar``, which is how the
benchmark and the tests count the bytes a job reads; and ``np.searchsorted`` of a strided
column of a map copies the whole column first. Here a read is ``os.preadv`` into an array of
exactly the rows asked for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write


@dataclass(frozen=True)
class Npy:
    """An ``.npy`` file's header: where its C-order data starts, its shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # bytes before the data

    @property
    def items(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def npy_header(path: str | os.PathLike, what: str = "array") -> Npy:
    """Read only the header; a file that is not a C-order ``.npy`` of its full size is refused
    in one line (a truncated or foreign file must not be half-read)."""
    try:
        with open(path, "rb", buffering=0) as f:  # the header's bytes alone (rchar)
            # no readahead: it would mark a page that starts an 8 MiB readahead (some disks'
            # read_ahead_kb) when a later read of the data reaches it, whatever its advice
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            version = np.lib.format.read_magic(f)
            read = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read is None:
                raise ValueError(f"npy version {version}")
            shape, fortran, dtype = read(f)
            offset = f.tell()
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise GptflowError(
            f"{path}: no such {what} file; the job that writes it has not run (Snakemake "
            f"runs it first when the file is an input)"
        ) from None
    except (OSError, ValueError) as e:
        raise GptflowError(
            f"{path}: not a {what} .npy file ({e}); delete it so that the job writing it runs again"
        ) from None
    header = Npy(str(path), tuple(shape), dtype, offset)
    if fortran or size != offset + header.items * dtype.itemsize:
        raise GptflowError(
            f"{path}: a {what} file of {size} bytes, not the {offset + header.items * dtype.itemsize} "
            f"its header says; delete it so that the job writing it runs again"
        )
    return header


def read_items(
    fd: int, header: Npy, first: int, count: int, out: np.ndarray | None = None
) -> np.ndarray:
    """`count` items of the file's dtype from flat index `first` (C order), as a 1-D array
    (into `out`, a contiguous 1-D array of `count` items of the dtype, when given)."""
    if out is None:
        out = np.empty(count, dtype=header.dtype)
    view = memoryview(out.view(np.uint8).reshape(-1))
    at, offset = 0, header.offset + first * header.dtype.itemsize
    while at < len(view):
        got = os.preadv(fd, [view[at:]], offset + at)
        if got == 0:
            raise GptflowError(
                f"{header.path}: ended {len(view) - at} bytes early; delete it so that the job "
                f"writing it runs again"
            )
        at += got
    return out


def bisect(
    fd: int, header: Npy, lo: int, hi: int, below: Callable[[object], bool], stride: int = 1
) -> int:
    """The first row i in [lo, hi) whose first item (flat index i * stride) is not `below`,
    for rows sorted so that `below` holds for a prefix; one read of one item per step (log2
    of the range), not the column."""
    while lo < hi:
        mid = (lo + hi) // 2
        if below(read_items(fd, header, mid * stride, 1)[0]):
            lo = mid + 1
        else:
            hi = mid
    return lo


HEADER_BYTES = 256  # an NpyWriter's header: any dtype and shape written here fit


def npy_header_bytes(dtype: np.dtype, shape: tuple[int, ...], size: int = HEADER_BYTES) -> bytes:
    """An ``.npy`` (version 1.0) header of exactly `size` bytes (a multiple of 64, as the
    format asks), so that it can be rewritten in place once the row count is known."""
    text = repr(
        {
            "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
            "fortran_order": False,
            "shape": shape,
        }
    )
    pad = size - len(np.lib.format.MAGIC_PREFIX) - 2 - 2 - len(text) - 1
    assert pad >= 0 and size % 64 == 0, (text, size)
    body = (text + " " * pad + "\n").encode("latin1")
    return np.lib.format.magic(1, 0) + len(body).to_bytes(2, "little") + body


class NpyWriter:
    """Rows appended to an ``.npy`` file whose row count is known only at the end: the header
    is written first for 0 rows and rewritten, the same size, when the writer closes."""

    def __init__(self, f: IO[bytes], dtype: np.dtype, tail: tuple[int, ...]) -> None:
        self.f, self.dtype, self.tail, self.rows = f, np.dtype(dtype), tail, 0
        f.write(npy_header_bytes(self.dtype, (0, *tail)))

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        assert rows.shape[1:] == self.tail, (rows.shape, self.tail)
        self.f.write(rows.data)
        self.rows += len(rows)

    def close(self) -> None:
        self.f.seek(0)
        self.f.write(npy_header_bytes(self.dtype, (self.rows, *self.tail)))
        self.f.seek(0, os.SEEK_END)


@contextlib.contextmanager
def npy_writer(
    path: str | os.PathLike, dtype: np.dtype, tail: tuple[int, ...] = ()
) -> Iterator[NpyWriter]:
    """Write an ``.npy`` of rows `tail`-shaped, appended as they come, published complete
    (:func:`gptflow.fsutil.atomic_write`)."""
    with atomic_write(path, "wb") as f:
        writer = NpyWriter(f, dtype, tail)
        yield writer
        writer.close()
