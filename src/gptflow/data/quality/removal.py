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
from collections.abc import Callable, Iterator

import numpy as np

from gptflow.data.quality import arrays
from gptflow.data.quality.origins import compose, read_origins, write_origins
from gptflow.data.readers import batch_texts, iter_batches
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write, write_json

EXAMPLES = 3  # removed documents kept per reason in a manifest
EXAMPLE_CHARS = 300


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
    """The sorted document indices a removal list removes from shard `ordinal`: its rows found
    by bisection of the ordinals (a few 4-byte reads) and read alone, so that each of a group's
    removal jobs reads its slice, not the list (~1 TB over 2,000 shards of the Pile before)."""
    header = arrays.npy_header(path, "removal list")
    if header.dtype != np.uint32 or len(header.shape) != 2 or header.shape[1] != 2:
        raise GptflowError(
            f"{path}: not a removal list ((n, 2) uint32; dtype {header.dtype}, shape "
            f"{header.shape}); delete it so that its group's job writes it again"
        )
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a bisection's page, not readahead
        n = header.shape[0]
        lo = arrays.bisect(fd, header, 0, n, lambda o: o < ordinal, stride=2)
        hi = arrays.bisect(fd, header, lo, n, lambda o: o <= ordinal, stride=2)
        return arrays.read_items(fd, header, 2 * lo, 2 * (hi - lo))[1::2].copy()
    finally:
        os.close(fd)


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


def filter_shard(
    path: str | os.PathLike,
    reader: dict,
    drop: Callable[[int, str], str | None],
    out: str | os.PathLike,
    manifest: str | os.PathLike,
    about: dict,
    origins: tuple[str | os.PathLike | None, str | os.PathLike | None] = (None, None),
) -> dict:
    """Copy a shard's documents to `out` (JSONL) but those `drop(index, text)` gives a reason
    for; the manifest (`about`: the step, dataset and shard it describes) counts documents
    and bytes in and out, the removed by reason, and keeps the first few of each, shortened.

    `origins` is (the input's origins file, or None when the input is the collected shard;
    the file to write the kept documents' origins to, or None): each kept document's ordinal
    in the collected shard (:mod:`gptflow.data.quality.origins`)."""
    origins_in, origins_out = origins
    before = read_origins(origins_in) if origins_in is not None else None
    counts = {"documents_in": 0, "bytes_in": 0}
    removed: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    dropped: Counter[str] = Counter()
    indices: list[int] = []

    def kept() -> Iterator[str]:
        for i, text in enumerate(documents(path, reader, dropped)):
            counts["documents_in"] += 1
            counts["bytes_in"] += len(text.encode("utf-8"))
            reason = drop(i, text)
            if reason is None:
                indices.append(i)
                yield text
                continue
            removed[reason] += 1
            if len(shown := examples.setdefault(reason, [])) < EXAMPLES:
                shown.append(text[:EXAMPLE_CHARS])
        # checked before write_documents publishes `out`: a mismatch leaves no file behind
        if before is not None and len(before) != counts["documents_in"]:
            raise GptflowError(
                f"{origins_in}: the origins of {len(before)} documents, but {path} holds "
                f"{counts['documents_in']}; delete both so that their quality step runs again"
            )

    documents_out, bytes_out = write_documents(out, kept())
    if origins_out is not None:
        write_origins(origins_out, compose(before, indices))
    stats = {
        **about,
        **counts,
        "documents_out": documents_out,
        "bytes_out": bytes_out,
        "removed": dict(sorted(removed.items())),
        "unreadable": dict(sorted(dropped.items())),
        "examples": examples,
    }
    write_json(manifest, stats)
    return stats


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
    origins: tuple = (None, None),
) -> dict:
    """A shard's documents without those the removal list `removed` lists for shard
    `ordinal`, counted as `reason` (:func:`filter_shard`, as its `origins`)."""
    gone = set(removed_in_shard(removed, ordinal).tolist())
    stats = filter_shard(
        path, reader, lambda i, _: reason if i in gone else None, out, manifest, about, origins
    )
    return stats
