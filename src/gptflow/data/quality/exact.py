"""Exact deduplication: a 128-bit hash of each document's normalized text per shard, one job
finding the repeats over a group's shards, the copies after the first removed
(:mod:`gptflow.data.quality.removal`).

A shard's hash file is its documents' BLAKE2b-128 digests, 16 bytes each, in document order.
128 bits, not 64: at 10^9 documents a 64-bit hash has ~3 % odds of a collision, 128 bits
~10^-21. The duplicate search holds the group's hashes (16 bytes per document, plus 8 for its
place), not its documents.
"""

from __future__ import annotations

import hashlib
import os
import unicodedata

import numpy as np

from gptflow.data.quality.removal import documents, write_removed
from gptflow.fsutil import atomic_write

DIGEST_BYTES = 16
ROWS_PER_PASS = 1 << 26  # digests held at once by find_repeats (~100 bytes each at its peak)


def normalize(text: str) -> str:
    """What two copies must agree on: Unicode NFC, lowercased, whitespace runs as one space,
    stripped."""
    return " ".join(unicodedata.normalize("NFC", text).lower().split())


def digest(text: str) -> bytes:
    return hashlib.blake2b(normalize(text).encode("utf-8"), digest_size=DIGEST_BYTES).digest()


def hash_shard(path: str | os.PathLike, reader: dict, out: str | os.PathLike) -> int:
    """Write the digests of a shard's documents to `out`; returns the document count."""
    n = 0
    with atomic_write(out, "wb") as f:
        for text in documents(path, reader):
            f.write(digest(text))
            n += 1
    return n


def find_repeats(
    hash_files: list[str | os.PathLike], out: str | os.PathLike, rows_per_pass: int = ROWS_PER_PASS
) -> dict:
    """The removal list of a group (its shards' hash files in the group's order): every
    document whose digest an earlier (shard ordinal, index) has.

    By hash range: pass p of P takes the digests whose top 32 bits fall in the p-th of P equal
    ranges (a digest's copies all fall in one), so at most about `rows_per_pass` digests (24
    bytes each with their place: 1.5 GiB at the default) are held at once, whatever the group's
    size; the files are read once per pass."""
    hashes = [
        np.memmap(p, dtype=">u8", mode="r") if os.path.getsize(p) else None for p in hash_files
    ]
    total = sum(len(h) // 2 for h in hashes if h is not None)
    passes = max(1, -(-total // rows_per_pass))
    removed, repeats = [], 0
    for p in range(passes):
        found = _repeats_in_range(hashes, p, passes)
        removed.append(found)
        repeats += len(found)
    write_removed(out, np.concatenate(removed) if removed else np.zeros((0, 2), np.uint32))
    return {"shards": len(hash_files), "documents": total, "repeats": repeats, "passes": passes}


def _repeats_in_range(hashes: list, p: int, passes: int) -> np.ndarray:
    """The (ordinal, index) of the repeats among the digests of range p of `passes`."""
    parts, places = [], []
    for ordinal, h in enumerate(hashes):
        if h is None:
            continue
        digests = np.asarray(h).reshape(-1, 2)  # big-endian halves: byte order
        index = np.flatnonzero(
            ((digests[:, 0] >> np.uint64(32)) * np.uint64(passes)) >> np.uint64(32) == p
        )
        parts.append(digests[index])
        place = np.empty((len(index), 2), dtype=np.uint32)
        place[:, 0], place[:, 1] = ordinal, index
        places.append(place)
    if not parts:
        return np.zeros((0, 2), np.uint32)
    digests, place = np.concatenate(parts), np.concatenate(places)
    # sorted by digest, then place: each digest's first row is its kept copy
    order = np.lexsort((place[:, 1], place[:, 0], digests[:, 1], digests[:, 0]))
    d = digests[order]
    repeat = np.zeros(len(d), dtype=bool)
    repeat[1:] = (d[1:] == d[:-1]).all(axis=1)
    return place[order][repeat]
