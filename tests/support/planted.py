"""Planted near-duplicate pairs at known Jaccard similarity of their word 5-grams: the MinHash
unit test (tests/unit/data/quality/test_quality_dedup.py) and bench/quality.py read the same
pairs."""

from __future__ import annotations

import numpy as np

from gptflow.data.quality import minhash


def shingle_set(text: str, n: int = 5) -> set[tuple[str, ...]]:
    w = minhash.words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def planted_pairs(count: int, rng: np.random.Generator, length: int = 300) -> list:
    """`count` (original, copy, true Jaccard) with Jaccard targets spread over [0, 1]: a
    copy replaces a share of the original's words so that 2J/(1+J) of its 5-grams survive."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(w) for w in letters[rng.integers(0, 26, (20000, 7))]])
    pairs = []
    for target in rng.uniform(0, 1, count):
        words = rng.integers(0, len(vocab), length)
        share = 1 - (2 * target / (1 + target)) ** (1 / 5)
        edited = np.where(rng.random(length) < share, rng.integers(0, len(vocab), length), words)
        original, copy = " ".join(vocab[words]), " ".join(vocab[edited])
        a, b = shingle_set(original), shingle_set(copy)
        pairs.append((original, copy, len(a & b) / len(a | b)))
    return pairs
