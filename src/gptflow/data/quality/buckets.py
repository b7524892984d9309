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
(:mod:`gptflow.data.quality.arrays`: nothing mapped, so /proc/self/io counts it); the records
read past the pass are kept for the next (at most a chunk a shard). Passes cost no re-reading,
so their number only bounds memory. The documents without a signature (all ones, sorted
last) are never paired and, past the chunk that meets them, never read.
"""

from __future__ import annotations

import os

import numpy as np

from gptflow.data.quality import arrays
from gptflow.data.quality.minhash import NO_SIGNATURE, pass_of, signature_header
from gptflow.errors import GptflowError

ROWS_PER_PASS = 1 << 23  # documents held at once: ~140 bytes each at the peak (measured)
CHUNK_BYTES = 1 << 16  # read at once from one shard, and at most kept for the next pass


class BandReader:
    """One shard's band, read front to back a chunk at a time: :meth:`run` gives a pass's
    records, keeping those read past it for the next."""

    def __init__(self, header: arrays.Npy, band: int) -> None:
        self.header = header
        self.n = header.shape[1]
        self.start = band * self.n  # the band's first record (flat)
        self.read = 0  # records read
        self.chunk = max(1, CHUNK_BYTES // header.dtype.itemsize)
        self.carry = np.empty(0, dtype=header.dtype)

    def run(self, p: int, passes: int) -> np.ndarray:
        """The band's records in pass p (those before were taken by the passes before)."""
        pieces = [self.carry]
        fd = None
        try:
            while self.read < self.n and _continues(pieces[-1], p, passes):
                if fd is None:
                    fd = os.open(self.header.path, os.O_RDONLY)
                count = min(self.chunk, self.n - self.read)
                pieces.append(arrays.read_items(fd, self.header, self.start + self.read, count))
                self.read += count
        finally:
            if fd is not None:
                os.close(fd)
        records = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        first = records["values"][:, 0]
        end = int(((first != NO_SIGNATURE) & (pass_of(first, passes) <= p)).sum())
        if end < len(records) and first[end] == NO_SIGNATURE:  # the rest: no signature
            self.read, self.carry = self.n, records[:0]
        else:
            self.carry = records[end:].copy()  # not a view: the run's memory is freed
        return records[:end]


def _continues(records: np.ndarray, p: int, passes: int) -> bool:
    """Whether a shard's run of pass p may go on past `records` (the last read)."""
    if not len(records):
        return True
    last = records["values"][-1, 0]
    return last != NO_SIGNATURE and pass_of(last, passes) <= p


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
    readers = [BandReader(h, band) for h in headers]
    count = 0
    with arrays.npy_writer(out, np.uint32, (4,)) as writer:
        for p in range(passes):
            pairs = pairs_of_pass([reader.run(p, passes) for reader in readers])
            writer.append(pairs)
            count += len(pairs)
    return count


def pairs_of_pass(runs: list[np.ndarray]) -> np.ndarray:
    """The pairs among one pass's records (`runs`: each shard's, in ordinal order).

    Sorted as a lexsort by (values, ordinal, index) would sort them, at a fraction of its
    memory: a stable argsort of the first value (the runs are concatenated in ordinal order,
    each sorted by (first value, index), so ties stay by place), then, only among the records
    whose first value another shares (a bucket's candidates), by the other values and place."""
    if not runs:
        return np.zeros((0, 4), dtype=np.uint32)
    sizes = [len(r) for r in runs]
    recs = np.concatenate(runs)
    runs.clear()  # the caller's list: each run is freed here, not at the pass's end
    ordinals = np.repeat(np.arange(len(sizes), dtype=np.uint32), sizes)
    first = np.ascontiguousarray(recs["values"][:, 0])
    order = np.argsort(first, kind="stable")
    first = first[order]
    tie = np.flatnonzero(first[1:] == first[:-1])  # sorted position tie + 1 equals tie's
    del first
    if not len(tie):
        return np.zeros((0, 4), dtype=np.uint32)
    # the records in a run of equal first values, by (other values, ordinal, index)
    member = np.zeros(len(order), dtype=bool)
    member[tie] = member[tie + 1] = True
    at = np.flatnonzero(member)
    del member
    follows = np.zeros(len(order), dtype=bool)  # a sorted position tied with the one before
    follows[tie + 1] = True
    group = np.cumsum(~follows[at])  # a run of equal first values
    del follows
    sub = order[at]
    values = recs["values"][sub]
    keys = (recs["index"][sub], ordinals[sub], *values[:, :0:-1].T, group)
    order[at] = sub[np.lexsort(keys)]
    # a sorted position whose values equal the one's before it: a bucket's next document
    same = tie[(recs["values"][order[tie + 1]] == recs["values"][order[tie]]).all(axis=1)] + 1
    run_start = np.ones(len(same), dtype=bool)
    run_start[1:] = same[1:] != same[:-1] + 1
    firsts = (same[run_start] - 1)[np.cumsum(run_start) - 1]
    pairs = np.empty((len(same), 4), dtype=np.uint32)
    pairs[:, 0], pairs[:, 1] = ordinals[order[firsts]], recs["index"][order[firsts]]
    pairs[:, 2], pairs[:, 3] = ordinals[order[same]], recs["index"][order[same]]
    return pairs
