"""Near-duplicate deduplication by MinHash LSH, in DataTrove's four stages: signatures per
shard, candidate pairs per band, one clustering job, removal per shard
(:mod:`gptflow.data.quality.removal`).

Shingles are word n-grams of the text after DataTrove's ``simplify_text`` (:func:`simplify`:
lowercase, numbers as ``0``, its fixed list of punctuation as space, accents stripped), words split on whitespace (the recipe's
``tokenizer: regex``). Each word is hashed (a polynomial hash of its characters, all words at
once in numpy: :func:`gptflow.data.quality.filters.char_hashes`, then splitmix64; modulo 2**64
such a hash has known colliding strings, Thue-Morse words of 2**11 characters and more, and a
collision only merges two shingles), an n-gram's hash mixes its words' (:func:`shingle_hashes`),
and signature column k is min over the shingles of a_k * shingle + b_k (mod 2**64, a_k odd: a
permutation of the 64-bit values; the shingles are already mixed, and the minimum is decided by
the product's high bits, which depend on all of the shingle's): bands x rows 64-bit values.
A document with fewer than n words
has no signature (all ones, :data:`NO_SIGNATURE`) and is never a duplicate, as in DataTrove.

Files: a shard's signatures ``.npy`` (documents, bands*rows) uint64; a band's pairs ``.npy``
(pairs, 4) uint32 (ordinal, index, ordinal, index), each pair's first document the earliest of
its bucket; the clustering reads only the pairs, so its memory grows with them, not with the
documents.
"""

from __future__ import annotations

import os
import re
import unicodedata

import numpy as np

from gptflow.data.quality.filters import char_hashes
from gptflow.data.quality.removal import documents, write_removed
from gptflow.fsutil import atomic_write

NO_SIGNATURE = np.uint64(0xFFFFFFFFFFFFFFFF)
_CHUNK = 2048  # shingles hashed at once: (2048, bands*rows) uint64 temporaries

# DataTrove 0.10.1's datatrove.utils.text.PUNCTUATION, character for character: the fixed list
# its simplify_text turns into spaces (not every Unicode punctuation or symbol: '©', '€', '‘'
# and '′' stay), and the C0/C1 control characters but tab and newline
PUNCTUATION = (
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    + ("".join(chr(c) for a, b in ((0, 9), (11, 13), (13, 32), (127, 160)) for c in range(a, b)))
)
_PUNCTUATION_TABLE = str.maketrans(PUNCTUATION, " " * len(PUNCTUATION))
# its NUMBERS_PATTERN: `\d` of Python's re is Unicode's Nd, as its \p{Nd} (the regex module's
# Unicode tables may be a version newer: digits of scripts added since are the difference)
_NUMBER = re.compile(r"\d+(?:[.,،٫⎖⎗⎘]\d+)?")
_WHITESPACE = re.compile(r"\s+")


def simplify(text: str) -> str:
    """DataTrove's simplify_text with its default TextNormConfig, step for step and in its
    order: lowercase, numbers as ``0``, :data:`PUNCTUATION` as spaces, whitespace runs as one
    space, then NFD with the nonspacing marks (category Mn) dropped. As in DataTrove, a mark
    dropped between two spaces leaves both (``'a \u0301 b'`` -> ``'a  b'``); words are split
    on whitespace, so the shingles do not see it."""
    text = _NUMBER.sub("0", text.lower())
    text = _WHITESPACE.sub(" ", text.translate(_PUNCTUATION_TABLE).strip())
    if not text.isascii():  # NFD leaves ASCII as it is, and it has no marks
        text = "".join(
            c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn"
        )
    return text.strip()


def words(text: str, tokenizer: str = "regex") -> list[str]:
    """The words shingles are made of (the recipe's `tokenizer`; only 'regex' today)."""
    if tokenizer != "regex":
        raise ValueError(f"unknown word tokenizer {tokenizer!r}")
    return simplify(text).split()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingle_hashes(text: str, ngram: int, tokenizer: str = "regex") -> np.ndarray:
    """The distinct 64-bit hashes of the word n-grams of `text` (its :func:`words`; none below
    n words). The simplified text is its words joined by one space, so each word is a span
    between spaces and all of them are hashed at once."""
    if tokenizer != "regex":
        raise ValueError(f"unknown word tokenizer {tokenizer!r}")
    simple = simplify(text)
    if "  " in simple:  # a dropped mark between two spaces: one space between words
        simple = " ".join(simple.split())
    if not simple:
        return np.zeros(0, dtype=np.uint64)
    codes = np.frombuffer(simple.encode("utf-32-le"), np.uint32)
    spaces = np.flatnonzero(codes == 32)
    if len(spaces) + 1 < ngram:
        return np.zeros(0, dtype=np.uint64)
    starts = np.concatenate([[0], spaces + 1])
    ends = np.concatenate([spaces, [len(codes)]])
    prefix, unscale = char_hashes(simple)
    with np.errstate(over="ignore"):
        word_hash = (prefix[ends] - prefix[starts]) * unscale[starts]
    word_hash = _mix(word_hash ^ (ends - starts).astype(np.uint64))
    count = len(starts) - ngram + 1
    h = word_hash[:count].copy()
    for j in range(1, ngram):
        h = _mix(h) ^ word_hash[j : j + count]
    return np.unique(_mix(h))


def seeds(seed: int, hashes: int) -> np.ndarray:
    """(2, hashes) uint64: the multipliers a_k (odd) and the addends b_k."""
    values = np.random.default_rng(seed).integers(0, 2**64 - 1, (2, hashes), dtype=np.uint64)
    values[0] |= np.uint64(1)
    return values


def signature(shingles: np.ndarray, seed_values: np.ndarray) -> np.ndarray:
    """Column k: min over the shingles of a_k * shingle + b_k (mod 2**64)."""
    a, b = seed_values
    out = np.full(len(a), NO_SIGNATURE, dtype=np.uint64)
    for start in range(0, len(shingles), _CHUNK):
        block = shingles[start : start + _CHUNK, None] * a[None, :]
        block += b[None, :]
        np.minimum(out, block.min(axis=0), out=out)
    return out


def text_signature(text: str, settings: dict) -> np.ndarray:
    """A document's signature under a minhash step's settings (ngram, bands, rows, seed,
    tokenizer)."""
    s = settings
    shingles = shingle_hashes(text, s["ngram"], s["tokenizer"])
    return signature(shingles, seeds(s["seed"], s["bands"] * s["rows"]))


def signatures_of_shard(
    path: str | os.PathLike, reader: dict, settings: dict, out: str | os.PathLike
) -> int:
    """Write the signatures of a shard's documents; returns the document count."""
    seed_values = seeds(settings["seed"], settings["bands"] * settings["rows"])
    ngram, tokenizer = settings["ngram"], settings["tokenizer"]
    rows = [
        signature(shingle_hashes(t, ngram, tokenizer), seed_values) for t in documents(path, reader)
    ]
    sigs = np.stack(rows) if rows else np.zeros((0, seed_values.shape[1]), dtype=np.uint64)
    with atomic_write(out, "wb") as f:
        np.save(f, sigs)
    return len(rows)


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
    with atomic_write(out, "wb") as f:
        np.save(f, pairs)
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
    but its earliest is removed. Memory grows with the pairs (bench/quality.py
    --cluster-pairs: 10**7 pairs in a peak RSS of ~0.9 GiB): the pair files are
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
