"""The blend index: which dataset, and which of its samples, each sample of a blend is --
megatron-core's greedy rule (its C++ ``build_blending_indices``) vectorised in numpy, index for
index the C++ loop's (:func:`blending_indices` says how; tests/unit/data/test_blend.py,
bench/blend_index.py). :mod:`gptflow.data.dataset` builds and caches it beside the other
indices.
"""

from __future__ import annotations

import math

import numpy as np

from gptflow.errors import GptflowError

BLEND_MIN_CHUNK = 64  # samples per chunk of the blend index, at least (see blending_indices)


BLEND_SLOW = 8  # a dataset expected fewer times than this in a chunk is "slow" (_chunk_starts)


BLEND_ROUNDS = 8  # re-runs of disagreeing chunks before the rest is redone in longer chunks


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: sample s comes from the dataset furthest below its share.

    Returns ``(dataset_index, dataset_sample_index)`` (int16, int64), identical to megatron-core's
    C++ ``build_blending_indices`` given the weights normalized: sample s comes from the first
    dataset i with the largest ``w_i * max(s, 1) - count_i`` (float64, as helpers.cpp computes
    it; ties to the lowest index, as its strict ``>``), the count-th sample of it.

    The rule is sequential, but its state (the counts) forgets a wrong start: two runs of it from
    counts a few samples apart make the same choices after a few steps, the dataset that is
    behind being picked until it has caught up. So the samples are cut into chunks, all run at
    once, one numpy step per position in a chunk, each from a guess of the counts at its start
    (every dataset at its share, :func:`_chunk_starts`). A chunk whose guess differs from where
    the chunk before it ended is run again from there, alongside its first run, until both runs
    have the same counts; from there on the first run was right (:func:`_rerun`). Once every
    chunk starts where the one before it ends, and chunk 0 at zero counts, the result is the
    sequential loop's, bit for bit. If starts still disagree after a few rounds (a dataset so
    rare that a miscount of it outlives many chunks), the rest is redone in longer chunks, in the
    end one chunk: the plain loop.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not 0 < len(w) <= np.iinfo(np.int16).max:
        raise GptflowError(f"blend weights {weights}: expected 1 to 32767 of them")
    if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
        raise GptflowError(f"blend weights {weights}: expected finite, >= 0, with a positive sum")
    w = w / w.sum()
    if size <= 0:
        return np.zeros(0, np.int16), np.zeros(0, np.int64)
    length = min(size, max(BLEND_MIN_CHUNK, math.isqrt(size) // 8))
    return _blend(w, 0, size, np.zeros(len(w)), length)


class _GreedyStep:
    """One step of the greedy blend for many chunks at once.

    Column c of ``counts`` (datasets x chunks, float64, C order) holds the samples each dataset
    has given before position ``t[c]``; a step picks, in every column, the first dataset with the
    largest ``w * t - counts``, counts the pick, and returns the picks and their counts before.
    """

    def __init__(self, w: np.ndarray, chunks: int) -> None:
        n = len(w)
        self.w = w[:, None]
        self.z = np.empty((n, chunks))
        self.best = np.empty(chunks)
        self.top = np.empty((n, chunks), dtype=np.bool_)
        # the "is a maximum" flags of 8 datasets make a byte; lowest[byte] is its first set bit
        self.bits = np.tile(1 << np.arange(8, dtype=np.uint8), -(-n // 8))[:n, None]
        self.lowest = np.array([(b & -b).bit_length() - 1 for b in range(256)], dtype=np.int16)
        self.groups = [(lo, min(lo + 8, n)) for lo in range(0, n, 8)]
        self.columns = np.arange(chunks)

    def __call__(self, t: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert counts.flags.c_contiguous  # counts.reshape(-1) below must be a view
        p = counts.shape[1]
        z, best, top = self.z[:, :p], self.best[:p], self.top[:, :p]
        np.multiply(self.w, t, out=z)
        z -= counts
        np.maximum.reduce(z, axis=0, out=best)
        flags = np.equal(z, best, out=top).view(np.uint8)
        flags *= self.bits
        pick = None
        for lo, hi in reversed(self.groups):  # the first group holding a maximum has the say
            byte = np.add.reduce(flags[lo:hi], axis=0, dtype=np.uint8)
            first = self.lowest.take(byte)
            if lo:
                first += lo
            if pick is None:
                pick = first
            else:
                np.copyto(pick, first, where=byte != 0)
        flat = np.multiply(pick, p, dtype=np.intp)
        flat += self.columns[:p]
        counts_flat = counts.reshape(-1)
        taken = counts_flat.take(flat)
        counts_flat[flat] = taken + 1
        return pick, taken


def _apportion(ideal: np.ndarray) -> np.ndarray:
    """Hamilton's method, row by row: the floors of `ideal`, plus one for the largest fractions
    until each row has its (integral) sum; ties to the lowest index."""
    rows, m = ideal.shape
    counts = np.floor(ideal)
    fraction = ideal - counts
    fraction += np.arange(m)[::-1] * 1e-12
    short = np.rint(ideal.sum(axis=1) - counts.sum(axis=1)).astype(np.intp).clip(0, m)
    ranked = np.concatenate([np.sort(fraction, axis=1), np.full((rows, 1), np.inf)], axis=1)
    counts += fraction >= ranked[np.arange(rows), m - short][:, None]
    return counts


def _chunk_starts(w: np.ndarray, starts: np.ndarray, slow: np.ndarray) -> np.ndarray:
    """A guess of the counts (datasets x chunks) before each chunk start: every dataset at its share.

    A slow dataset gets its share rounded down, which is never more than the greedy has given
    it (it is picked only once it is owed a sample): when the guess is wrong, it is owed one
    more and is picked at once, instead of many chunks later. The others share the rest by
    Hamilton's method, the largest weight taking any rounding slip.
    """
    ideal = starts.astype(np.float64)[:, None] * w
    if slow.all() or not slow.any():
        counts = _apportion(ideal)
    else:
        counts = np.floor(ideal)
        fast = ~slow
        rest = starts - counts[:, slow].sum(axis=1)
        counts[:, fast] = _apportion(rest[:, None] * (w[fast] / w[fast].sum()))
    counts[:, np.argmax(w)] += starts - counts.sum(axis=1)
    return np.ascontiguousarray(counts.T)


def _blend(
    w: np.ndarray, begin: int, size: int, before: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """The greedy's picks for samples [begin, begin + size), `before` the counts at `begin`."""
    chunks = -(-size // length)
    starts = begin + length * np.arange(chunks, dtype=np.int64)
    step = _GreedyStep(w, chunks)
    slow = w * length < BLEND_SLOW
    guess = _chunk_starts(w, starts, slow)
    guess[:, 0] = before
    ends = guess.copy()
    picks = np.empty((chunks, length), dtype=np.int16)
    taken = np.empty((chunks, length), dtype=np.int64)
    t = starts.astype(np.float64)
    t[0] = max(begin, 1)  # helpers.cpp weighs sample 0 as sample 1
    for m in range(length):
        picks[:, m], taken[:, m] = step(t, ends)
        t[0] = begin + m
        t += 1
    for rounds in range(BLEND_ROUNDS + 1):
        want = _wanted_starts(ends, slow, int(np.argmax(w)))
        bad = np.flatnonzero((guess[:, 1:] != want).any(axis=0)) + 1
        if len(bad) == 0:
            break
        if rounds == BLEND_ROUNDS:
            head = int(bad[0])  # chunks [0, head) are right: redo the rest in longer chunks
            rest = _blend(w, int(starts[head]), size - head * length, ends[:, head - 1], 4 * length)
            return (
                np.concatenate([picks[:head].reshape(-1), rest[0]]),
                np.concatenate([taken[:head].reshape(-1), rest[1]]),
            )
        _rerun(step, starts, bad, want.take(bad - 1, axis=1), guess, ends, picks, taken)
    return picks.reshape(-1)[:size], taken.reshape(-1)[:size]


def _wanted_starts(ends: np.ndarray, slow: np.ndarray, heaviest: int) -> np.ndarray:
    """Where chunks 1.. should start: where the chunk before each ended.

    Counts only grow, so a slow dataset's count at a chunk start is also at least what any
    earlier chunk ended with: one chunk that caught up with a miscount of it corrects the
    guesses of all the chunks after it at once (the heaviest dataset giving up the difference).
    """
    want = ends[:, :-1].copy()
    if slow.any() and not slow[heaviest]:
        floor = np.maximum.accumulate(want[slow], axis=1)
        want[heaviest] -= (floor - want[slow]).sum(axis=0)
        want[slow] = floor
    return want


def _rerun(step, starts, bad, new, guess, ends, picks, taken) -> None:
    """Run chunks `bad` again from counts `new` (instead of `guess`), alongside their first run,
    until both runs have the same counts; a chunk that never agrees gets a new end."""
    old = guess.take(bad, axis=1)
    guess[:, bad] = new
    t = starts[bad].astype(np.float64)
    for m in range(picks.shape[1]):
        first_run = picks[bad, m]
        picks[bad, m], taken[bad, m] = step(t, new)
        flat = first_run.astype(np.intp)
        flat *= len(bad)
        flat += np.arange(len(bad))
        old.reshape(-1)[flat] += 1
        differ = (new != old).any(axis=0)
        if not differ.all():
            bad, t = bad[differ], t[differ]
            new, old = new.compress(differ, axis=1), old.compress(differ, axis=1)
            if len(bad) == 0:
                return
        t += 1
    ends[:, bad] = new
