"""MinHash's clustering stage: the connected components of a group's candidate pairs, every
document of a component but its earliest removed.

The pair files are streamed, a block of pairs at a time, through a union-find over an array
indexed by document number (a document's number: its shard's offset, the documents of the
shards before it in the group's order, plus its index), so memory grows with the group's
documents (4 bytes each below 2**31, else 8), not with its pairs -- a pair repeats in every
band where two documents collide, all 14 for near-copies. Each block's pairs are reduced to
their roots and joined by scipy's connected components over those roots alone; every root
points at the smallest document of its component (a root is always its component's smallest),
so the document kept -- the earliest by (shard ordinal, index), as before -- is the root, and
the removal list comes out sorted, written as it is found.
"""

from __future__ import annotations

import os

import numpy as np

from gptflow.data.quality import arrays
from gptflow.errors import GptflowError

BLOCK_PAIRS = 1 << 18  # pairs read at once: 4 MiB, ~25 MiB of the block's arrays (measured)
BLOCK_DOCUMENTS = 1 << 20  # documents resolved at once at the end: ~25 MiB of arrays


def _find(parent: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The roots of documents `x` (following parents until a document is its own)."""
    r = parent[x]
    todo = np.flatnonzero(parent[r] != r)
    while len(todo):
        r[todo] = parent[r[todo]]
        todo = todo[parent[r[todo]] != r[todo]]
    return r


def union(parent: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Join the components of each pair (a[i], b[i]); every root joined points at the smallest
    root of its new component, and a, b at their roots (path compression)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    ra, rb = _find(parent, a), _find(parent, b)
    apart = ra != rb
    if apart.any():
        roots, inverse = np.unique(np.concatenate([ra[apart], rb[apart]]), return_inverse=True)
        k = int(apart.sum())
        graph = coo_matrix(
            (np.ones(k, dtype=np.int8), (inverse[:k], inverse[k:])), shape=(len(roots),) * 2
        )
        _, labels = connected_components(graph, directed=False)
        # roots are sorted: a label's first root is its component's smallest
        smallest = np.full(labels.max() + 1, len(roots), dtype=np.int64)
        np.minimum.at(smallest, labels, np.arange(len(roots)))
        parent[roots] = roots[smallest[labels]]
    parent[a] = parent[ra]
    parent[b] = parent[rb]


def _resolve(parent: np.ndarray) -> None:
    """Point every document at its root, a block at a time in document order: a parent is never
    after its document, so the blocks before are resolved already and pointer jumping inside
    the block (its depth halves each round) finishes it."""
    for start in range(0, len(parent), BLOCK_DOCUMENTS):
        block = parent[start : start + BLOCK_DOCUMENTS]
        while True:
            up = parent[block]
            if np.array_equal(up, block):
                break
            block[:] = up


def _pair_blocks(pair_files: list, offsets: np.ndarray):
    """Each pair file's pairs as (a, b) document numbers, BLOCK_PAIRS at a time, checked
    against the shards' document counts."""
    for path in pair_files:
        header = arrays.npy_header(path, "MinHash pairs")
        if header.dtype != np.uint32 or len(header.shape) != 2 or header.shape[1] != 4:
            raise GptflowError(
                f"{path}: not MinHash pairs ((n, 4) uint32; dtype {header.dtype}, shape "
                f"{header.shape}); delete it so that minhash_buckets writes it again"
            )
        fd = os.open(path, os.O_RDONLY)
        try:
            for start in range(0, header.shape[0], BLOCK_PAIRS):
                count = min(BLOCK_PAIRS, header.shape[0] - start)
                block = arrays.read_items(fd, header, 4 * start, 4 * count).reshape(-1, 4)
                yield _numbers(block[:, :2], offsets, path), _numbers(block[:, 2:], offsets, path)
        finally:
            os.close(fd)


def _numbers(places: np.ndarray, offsets: np.ndarray, path: str) -> np.ndarray:
    """(ordinal, index) -> document number; a place past the group's documents is refused."""
    ordinal, index = places[:, 0].astype(np.int64), places[:, 1].astype(np.int64)
    counts = np.diff(offsets)
    known = ordinal < len(counts)
    bad = ~known
    bad[known] = index[known] >= counts[ordinal[known]]
    if bad.any():
        o, i = (int(v) for v in places[np.argmax(bad)])
        held = f"{counts[o]} documents" if o < len(counts) else "no such shard"
        raise GptflowError(
            f"{path}: a pair names document {i} of shard {o} of {len(counts)} in the group "
            f"({held}); the signatures changed after the pairs were found: delete the group's "
            f"pair files so that minhash_buckets finds them again"
        )
    return offsets[ordinal] + index


def cluster(pair_files: list, documents: list[int], out: str | os.PathLike) -> dict:
    """The removal list of a group (its shards' document counts, `documents`, in the group's
    order) from its bands' pair files: every document of a component but its earliest.
    Memory: the parent array (4 bytes a document below 2**31 documents, else 8), a block of
    pairs and a block of documents; never the pairs at once (bench/minhash_scale.py)."""
    offsets = np.concatenate([[0], np.cumsum(documents, dtype=np.int64)])
    total = int(offsets[-1])
    parent = np.arange(total, dtype=np.int32 if total < 2**31 else np.int64)
    pairs = 0
    for a, b in _pair_blocks(pair_files, offsets):
        union(parent, a.astype(parent.dtype), b.astype(parent.dtype))
        pairs += len(a)
    _resolve(parent)
    removed = _write_removed(parent, offsets, out)
    parent.sort()  # in place: each cluster a run of its root, every other document a run of 1
    sizes = _run_lengths(parent)
    return {
        "pairs": pairs,
        "documents_in_clusters": removed + sum(sizes.values()),
        "clusters": sum(sizes.values()),
        "removed": removed,
        "cluster_sizes": {str(s): c for s, c in sorted(sizes.items())},
    }


def _write_removed(parent: np.ndarray, offsets: np.ndarray, out: str | os.PathLike) -> int:
    """Write every document that is not its own root as (ordinal, index), in document order
    (so sorted), a block at a time; returns their count."""
    removed = 0
    with arrays.npy_writer(out, np.uint32, (2,)) as writer:
        for start in range(0, len(parent), BLOCK_DOCUMENTS):
            block = parent[start : start + BLOCK_DOCUMENTS]
            number = np.flatnonzero(block != np.arange(start, start + len(block))) + start
            ordinal = np.searchsorted(offsets, number, side="right") - 1
            place = np.empty((len(number), 2), dtype=np.uint32)
            place[:, 0], place[:, 1] = ordinal, number - offsets[ordinal]
            writer.append(place)
            removed += len(number)
    return removed


def _run_lengths(values: np.ndarray) -> dict[int, int]:
    """{length: runs of it} of the runs of equal values of a sorted array longer than 1 (a
    cluster's size), a block at a time, a run crossing blocks carried over."""
    sizes: dict[int, int] = {}

    def count(lengths: np.ndarray) -> None:
        for length, runs in enumerate(np.bincount(lengths[lengths > 1])):
            if runs:
                sizes[length] = sizes.get(length, 0) + int(runs)

    carry, carried = None, 0  # the last run's value and length so far
    for start in range(0, len(values), BLOCK_DOCUMENTS):
        block = values[start : start + BLOCK_DOCUMENTS]
        bounds = np.concatenate([[0], np.flatnonzero(block[1:] != block[:-1]) + 1, [len(block)]])
        lengths = np.diff(bounds)
        if carried and block[0] == carry:
            lengths[0] += carried
        elif carried:
            count(np.array([carried]))
        count(lengths[:-1])
        carry, carried = block[-1], int(lengths[-1])
    if carried:
        count(np.array([carried]))
    return sizes
