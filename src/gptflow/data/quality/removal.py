"""What a deduplication step removes, and the job that removes it from one shard.

A group's removal list (``results/quality/{step}/groups/{group}.remove.npy``) is a numpy
array of shape (n, 2), uint32: (shard ordinal in the group's order, document index in that
shard), sorted. A document's index is its position among the texts the shard's reader yields
(:func:`documents`), the same in every job that reads the shard.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator

import numpy as np

from gptflow.data.readers import batch_texts, iter_batches
from gptflow.fsutil import atomic_write, write_json


def documents(path: str | os.PathLike, reader: dict, dropped: Counter | None = None):
    """The texts of a step's input, in order: `reader` holds iter_batches' keywords (fmt,
    member, member_format, json_key) and ``on_bad``; what the reader drops is counted in
    `dropped`."""
    reader = dict(reader)
    on_bad = reader.pop("on_bad", "error")
    for batch in iter_batches(path, **reader):
        texts, drops = batch_texts(batch, reader.get("json_key", "text"), on_bad)
        if dropped is not None:
            dropped.update(drops)
        yield from texts


def write_removed(path: str | os.PathLike, pairs: np.ndarray) -> None:
    """Save a removal list ((n, 2) uint32 pairs, sorted here)."""
    pairs = np.asarray(pairs, dtype=np.uint32).reshape(-1, 2)
    if len(pairs):
        pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
    with atomic_write(path, "wb") as f:
        np.save(f, pairs)


def removed_in_shard(path: str | os.PathLike, ordinal: int) -> np.ndarray:
    """The sorted document indices a removal list removes from shard `ordinal`."""
    pairs = np.load(path, mmap_mode="r")
    if not len(pairs):
        return np.zeros(0, dtype=np.uint32)
    lo, hi = np.searchsorted(pairs[:, 0], [ordinal, ordinal + 1])
    return np.array(pairs[lo:hi, 1])


def write_documents(out: str | os.PathLike, texts: Iterator[str]) -> tuple[int, int]:
    """Write texts as JSONL ``{"text": ...}``; returns (documents, UTF-8 bytes)."""
    n = size = 0
    with atomic_write(out, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False))
            f.write("\n")
            n += 1
            size += len(text.encode("utf-8"))
    return n, size


def remove_documents(
    path: str | os.PathLike,
    reader: dict,
    removed: str | os.PathLike,
    ordinal: int,
    out: str | os.PathLike,
    manifest: str | os.PathLike,
    *,
    reason: str,
    about: dict,
) -> dict:
    """Copy a shard's documents to `out` (JSONL) without those `removed` lists for shard
    `ordinal`; the manifest counts documents and bytes in and out, and the removed by
    `reason` (`about`: the step, dataset and shard it describes)."""
    gone = set(removed_in_shard(removed, ordinal).tolist())
    counts = {"documents_in": 0, "bytes_in": 0}
    dropped: Counter[str] = Counter()

    def kept() -> Iterator[str]:
        for i, text in enumerate(documents(path, reader, dropped)):
            counts["documents_in"] += 1
            counts["bytes_in"] += len(text.encode("utf-8"))
            if i not in gone:
                yield text

    documents_out, bytes_out = write_documents(out, kept())
    stats = {
        **about,
        **counts,
        "documents_out": documents_out,
        "bytes_out": bytes_out,
        "removed": {reason: counts["documents_in"] - documents_out},
        "unreadable": dict(sorted(dropped.items())),
    }
    write_json(manifest, stats)
    return stats
