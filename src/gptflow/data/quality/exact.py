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


def find_repeats(hash_files: list[str | os.PathLike], out: str | os.PathLike) -> dict:
    """The removal list of a group (its shards' hash files in the group's order): every
    document whose digest an earlier (shard ordinal, index) has."""
    parts = []
    for ordinal, path in enumerate(hash_files):
        raw = np.fromfile(path, dtype=">u8").reshape(-1, 2)  # big-endian halves: byte order
        n = len(raw)
        place = np.empty((n, 2), dtype=np.uint32)
        place[:, 0], place[:, 1] = ordinal, np.arange(n, dtype=np.uint32)
        parts.append((raw, place))
    hashes = np.concatenate([p[0] for p in parts]) if parts else np.zeros((0, 2), ">u8")
    places = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, 2), np.uint32)
    # sorted by digest, then place: each digest's first row is its kept copy
    order = np.lexsort((places[:, 1], places[:, 0], hashes[:, 1], hashes[:, 0]))
    h = hashes[order]
    repeat = np.zeros(len(h), dtype=bool)
    repeat[1:] = (h[1:] == h[:-1]).all(axis=1)
    removed = places[order][repeat]
    write_removed(out, removed)
    return {"shards": len(hash_files), "documents": len(h), "repeats": int(repeat.sum())}
