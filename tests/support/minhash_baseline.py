"""The MinHash bucket and clustering stages as they were before issue 48 (commit 3baf7f5),
kept as the baseline the new ones are held to: tests/unit/data/quality/test_quality_minhash_scale.py
checks that the new stages write the same pairs, clusters and removal lists, and
bench/minhash_scale.py measures both in one command. Not used by the package.

Their signatures are row-major, (documents, bands*rows) uint64 per shard, memory-mapped; each
bucket pass reads every shard's whole band; the clustering holds every pair at once (~90 bytes
a pair measured); a removal job copies the list's whole shard column to search it.
"""

from __future__ import annotations

import os

import numpy as np

from gptflow.data.quality.removal import write_removed

NO_SIGNATURE = np.uint64(0xFFFFFFFFFFFFFFFF)


def save(path: str | os.PathLike, array: np.ndarray) -> None:
    """The former atomic_write(...) + np.save, without the atomicity a baseline needs not."""
    np.save(path, array)


def band_pairs(
    signature_files: list,
    band: int,
    rows: int,
    out: str | os.PathLike,
    rows_per_pass: int = 1 << 24,
) -> int:
    """The candidate pairs of one band over a group's shards (in the group's order): the
    documents whose `rows` values in this band agree, each paired with its bucket's first.

    By hash range, as exact deduplication: pass p of P takes the documents whose band starts
    with a value in the p-th of P ranges (a bucket's documents all fall in one), so at most
    about `rows_per_pass` documents' band values (8 * rows + 8 bytes each) are held at once."""
    sigs = [np.load(path, mmap_mode="r") for path in signature_files]
    total = sum(len(s) for s in sigs)
    passes = max(1, -(-total // rows_per_pass))
    pairs = [_band_pairs_in_range(sigs, band, rows, p, passes) for p in range(passes)]
    pairs = np.concatenate(pairs) if pairs else np.zeros((0, 4), dtype=np.uint32)
    save(out, pairs)
    return len(pairs)


def _band_pairs_in_range(sigs: list, band: int, rows: int, p: int, passes: int) -> np.ndarray:
    values, places = [], []
    for ordinal, sig in enumerate(sigs):
        part = np.asarray(sig[:, band * rows : (band + 1) * rows])
        first = part[:, 0] if len(part) else np.zeros(0, dtype=np.uint64)
        in_range = ((first >> np.uint64(32)) * np.uint64(passes)) >> np.uint64(32) == p
        valid = np.flatnonzero((first != NO_SIGNATURE) & in_range)
        values.append(part[valid])
        place = np.empty((len(valid), 2), dtype=np.uint32)
        place[:, 0], place[:, 1] = ordinal, valid
        places.append(place)
    v = np.concatenate(values) if values else np.zeros((0, rows), dtype=np.uint64)
    pl = np.concatenate(places) if places else np.zeros((0, 2), dtype=np.uint32)
    # by the band's values, then place: each bucket's first row is its earliest document
    order = np.lexsort((pl[:, 1], pl[:, 0], *v.T[::-1]))
    v, pl = v[order], pl[order]
    same = np.zeros(len(v), dtype=bool)
    same[1:] = (v[1:] == v[:-1]).all(axis=1)
    first = np.maximum.accumulate(np.where(~same, np.arange(len(v)), 0))
    return np.concatenate([pl[first[same]], pl[same]], axis=1).astype(np.uint32).reshape(-1, 4)


def _distinct(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(keys, return_inverse=True) in half its memory (the inverse int32 below 2**31
    keys): the
    keys sorted by one argsort, the distinct ones, and each key's rank among them."""
    rank = np.int32 if len(keys) < 2**31 else np.int64
    order = np.argsort(keys)
    ranked = keys[order]
    new = np.empty(len(ranked), dtype=bool)
    new[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=new[1:])
    nodes = ranked[new]
    del ranked
    ids = np.cumsum(new, dtype=rank)
    ids -= 1
    del new
    inverse = np.empty(len(ids), dtype=rank)
    inverse[order] = ids
    return nodes, inverse


def cluster(pair_files: list, out: str | os.PathLike) -> dict:
    """Connected components of the duplicate pairs (scipy); every document of a component
    but its earliest is removed. Memory grows with the pairs (52-71 bytes a pair in
    bench/minhash_scale.py; ~90 at 10**7 pairs of 2*10**7 documents): the pair files are
    read one at a time into one array of 64-bit document keys (ordinal << 32 | index), the
    edges are int32 ranks among the distinct keys, and documents in no pair are never seen."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    files = [np.load(path, mmap_mode="r") for path in pair_files]
    count = sum(len(f) for f in files)
    keys = np.empty(2 * count, dtype=np.uint64)  # a of every pair, then b of every pair
    at = 0
    for f in files:
        part = np.asarray(f)
        for end in (0, 1):
            k = keys[end * count + at : end * count + at + len(part)]
            np.left_shift(part[:, 2 * end].astype(np.uint64), np.uint64(32), out=k)
            k |= part[:, 2 * end + 1]
        at += len(part)
        del part
    del files
    nodes, inverse = _distinct(keys)
    del keys
    n = len(nodes)
    edges = coo_matrix(
        (np.ones(count, dtype=np.int8), (inverse[:count], inverse[count:])), shape=(n, n)
    )
    del inverse
    components, labels = connected_components(edges, directed=False)
    del edges
    # nodes are sorted by (ordinal, index): a component's first node is its kept document
    first = np.full(components, n, dtype=np.int32 if n < 2**31 else np.int64)
    np.minimum.at(first, labels, np.arange(n, dtype=first.dtype))
    drop = np.ones(n, dtype=bool)
    drop[first] = False
    del first
    gone = nodes[drop]
    del nodes
    removed = np.empty((len(gone), 2), dtype=np.uint32)
    removed[:, 0], removed[:, 1] = gone >> np.uint64(32), gone & np.uint64(0xFFFFFFFF)
    del gone
    write_removed(out, removed)
    sizes = np.bincount(np.bincount(labels)) if n else np.zeros(0, dtype=int)
    return {
        "pairs": count,
        "documents_in_clusters": n,
        "clusters": int(components),
        "removed": int(drop.sum()),
        "cluster_sizes": {str(s): int(c) for s, c in enumerate(sizes) if c},
    }


def removed_in_shard(path: str | os.PathLike, ordinal: int) -> np.ndarray:
    """The sorted document indices a removal list removes from shard `ordinal`: searchsorted
    on a strided column of the mapped list (which copies the whole column first)."""
    pairs = np.load(path, mmap_mode="r")
    if not len(pairs):
        return np.zeros(0, dtype=np.uint32)
    lo, hi = np.searchsorted(pairs[:, 0], [ordinal, ordinal + 1])
    return np.array(pairs[lo:hi, 1])


def signatures_of_shard(texts: list[str], settings: dict, out: str | os.PathLike) -> int:
    """A shard's signatures as the former stage wrote them: (documents, bands*rows) uint64,
    row-major, in document order (the signature of each document is today's)."""
    from gptflow.data.quality import minhash

    seed_values = minhash.seeds(settings["seed"], settings["bands"] * settings["rows"])
    rows = [
        minhash.signature(minhash.shingle_hashes(t, settings["ngram"]), seed_values) for t in texts
    ]
    sigs = np.stack(rows) if rows else np.zeros((0, seed_values.shape[1]), dtype=np.uint64)
    save(out, sigs)
    return len(rows)
