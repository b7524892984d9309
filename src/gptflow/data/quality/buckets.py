"""MinHash's bucket stage: one band's candidate pairs over a group's shards.

A band's documents whose `rows` values all agree share a bucket; each is paired with its
bucket's first (by shard ordinal, then index), and pairs are ``(ordinal, index, ordinal,
index)`` uint32 rows. The work goes by hash range (as exact deduplication's): pass p of P takes
the documents whose band's first value is in the p-th of P ranges
(:func:`gptflow.data.quality.minhash.pass_of`; a bucket's documents all fall in one), so at
most about `rows_per_pass` documents are held at once however large the group.

Reading: a signature file is band-major with each band sorted by its first value
(:mod:`gptflow.data.quality.minhash`), so pass p's records are the next run of every shard's
band. Each shard's band is read front to back, once, a chunk at a time by explicit reads
without readahead (:mod:`gptflow.data.quality.arrays`: nothing mapped, so /proc/self/io
counts it, and no other band's bytes come from storage with it); the records read past the
pass are kept for the next (at most a chunk a shard, CARRY_BYTES in all). Passes cost no
re-reading, so their number only bounds memory. The documents without a signature (all
ones, sorted last) are never paired and, past the chunk that meets them, never read.
"""

from __future__ import annotations

import os

import numpy as np

from gptflow.data.quality import arrays
from gptflow.data.quality.minhash import NO_SIGNATURE, pass_of, signature_header
from gptflow.errors import GptflowError

ROWS_PER_PASS = 1 << 23  # documents held at once: 178 bytes each at the peak (measured): 1.5 GB
# a shard's band is read CARRY_BYTES / shards at a time (64 KiB to 4 MiB: few reads, large
# enough for a network file system), and at most that much of it is kept for the next pass
CARRY_BYTES = 1 << 28
CHUNK_BYTES = (1 << 16, 1 << 22)


class BandReader:
    """One shard's band, read front to back a chunk at a time: :meth:`run` gives a pass's
    records, keeping those read past it for the next."""

    def __init__(self, header: arrays.Npy, band: int, chunk_bytes: int) -> None:
        self.header = header
        self.n = header.shape[1]
        self.start = band * self.n  # the band's first record (flat)
        self.read = 0  # records read
        self.chunk = max(1, chunk_bytes // header.dtype.itemsize)
        self.carry = np.empty(0, dtype=header.dtype)

    def run(self, p: int, passes: int) -> list[np.ndarray]:
        """The band's records in pass p (those before were taken by the passes before), as
        pieces: concatenated by the caller into the pass's array, once."""
        pieces = [self.carry]
        fd = None
        try:
            while self.read < self.n and _continues(pieces[-1], p, passes):
                if fd is None:
                    fd = os.open(self.header.path, os.O_RDONLY)
                    # the chunks are large: the kernel's readahead (8 MiB on some disks)
                    # would read the next band's bytes too, or all the file's
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                count = min(self.chunk, self.n - self.read)
                pieces.append(arrays.read_items(fd, self.header, self.start + self.read, count))
                self.read += count
        finally:
            if fd is not None:
                os.close(fd)
        last = pieces.pop()
        first = last["values"][:, 0]
        end = int(((first != NO_SIGNATURE) & (pass_of(first, passes) <= p)).sum())
        if end < len(last) and first[end] == NO_SIGNATURE:  # the rest: no signature
            self.read, self.carry = self.n, last[:0]
        else:
            self.carry = last[end:].copy()  # not a view: the run's memory is freed
        pieces.append(last[:end])
        return pieces


def _continues(records: np.ndarray, p: int, passes: int) -> bool:
    """Whether a shard's run of pass p may go on past `records` (the last read)."""
    if not len(records):
        return True
    last = records["values"][-1, 0]
    return last != NO_SIGNATURE and pass_of(last, passes) <= p


def chunk_bytes(shards: int) -> int:
    """The bytes a bucket job reads from a shard at once (and at most keeps for the next
    pass): CARRY_BYTES shared among the group's shards, within CHUNK_BYTES."""
    return min(max(CARRY_BYTES // max(shards, 1), CHUNK_BYTES[0]), CHUNK_BYTES[1])


def band_pairs(
    signature_files: list,
    band: int,
    rows: int,
    out: str | os.PathLike,
    rows_per_pass: int = ROWS_PER_PASS,
) -> int:
    """Write the candidate pairs of one band over a group's shards (their signature files in
    the group's order), pass by pass as they are found; returns their count."""
    headers = [signature_header(p, rows) for p in signature_files]
    for h in headers:
        if not 0 <= band < h.shape[0]:
            raise GptflowError(
                f"{h.path}: no band {band} (it holds {h.shape[0]}); delete the group's "
                f"signatures so that minhash_signatures writes them for the step's bands"
            )
    total = sum(h.shape[1] for h in headers)
    passes = max(1, -(-total // rows_per_pass))
    chunk = chunk_bytes(len(headers))
    readers = [BandReader(h, band, chunk) for h in headers]
    count = 0
    with arrays.npy_writer(out, np.uint32, (4,)) as writer:
        for p in range(passes):
            pairs = pairs_of_pass([reader.run(p, passes) for reader in readers])
            writer.append(pairs)
            count += len(pairs)
    return count


def pairs_of_pass(runs: list[list[np.ndarray]]) -> np.ndarray:
    """The pairs among one pass's records (`runs`: each shard's pieces, in ordinal order;
    emptied here, each piece freed once copied).

    Sorted as a lexsort by (values, ordinal, index) would sort them, in a fraction of its
    memory: a stable argsort of the first value (the runs are in ordinal order, each sorted by
    (first value, index), so ties stay by place), then, only among the records whose first
    value another shares (a bucket's candidates), stable sorts by index, ordinal and the other
    values from the last (a radix sort of keys: one key column at a time in memory)."""
    sizes = [sum(len(piece) for piece in pieces) for pieces in runs]
    record = runs[0][0].dtype if runs else None
    if not sum(sizes):
        return np.zeros((0, 4), dtype=np.uint32)
    recs = np.empty(sum(sizes), dtype=record)  # pages are resident once written, as freed
    at = 0
    for pieces in runs:
        while pieces:
            piece = pieces.pop(0)
            recs[at : at + len(piece)] = piece
            at += len(piece)
            del piece
    values = recs["values"]
    rows = values.shape[1]
    ordinals = np.repeat(np.arange(len(sizes), dtype=np.uint32), sizes)
    first = np.ascontiguousarray(values[:, 0])
    order = np.argsort(first, kind="stable")
    first = first[order]
    tie = np.flatnonzero(first[1:] == first[:-1])  # sorted position tie + 1 equals tie's
    del first
    if not len(tie):
        return np.zeros((0, 4), dtype=np.uint32)
    # the records in a run of equal first values (a group), by (other values, ordinal, index)
    member = np.zeros(len(order), dtype=bool)
    member[tie] = member[tie + 1] = True
    at = np.flatnonzero(member)
    del member
    follows = np.zeros(len(order), dtype=bool)  # a sorted position tied with the one before
    follows[tie + 1] = True
    group = np.cumsum(~follows[at])
    del follows
    sub = order[at]
    perm = np.argsort(recs["index"][sub], kind="stable")
    for key in (ordinals, *(values[:, c] for c in range(rows - 1, 0, -1))):
        perm = perm[np.argsort(key[sub[perm]], kind="stable")]
    perm = perm[np.argsort(group[perm], kind="stable")]
    del group
    order[at] = sub[perm]
    del sub, perm, at
    # a sorted position whose values equal the one's before it: a bucket's next document
    a, b = order[tie], order[tie + 1]
    equal = np.ones(len(tie), dtype=bool)
    for c in range(1, rows):  # column 0 is equal: they are ties
        equal &= values[a, c] == values[b, c]
    same = tie[equal] + 1
    del a, b, equal, tie
    run_start = np.ones(len(same), dtype=bool)
    run_start[1:] = same[1:] != same[:-1] + 1
    firsts = order[(same[run_start] - 1)[np.cumsum(run_start) - 1]]
    seconds = order[same]
    pairs = np.empty((len(same), 4), dtype=np.uint32)
    pairs[:, 0], pairs[:, 1] = ordinals[firsts], recs["index"][firsts]
    pairs[:, 2], pairs[:, 3] = ordinals[seconds], recs["index"][seconds]
    return pairs
