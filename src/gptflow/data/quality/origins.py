"""Where a quality step's kept documents come from: their ordinals in the collected shard.

Every step that writes documents (:func:`gptflow.data.quality.removal.filter_shard`) also
writes ``results/quality/{step}/{dataset}/{shard}.origins.npy`` (gptflow.paths.QUALITY_ORIGINS):
a 1-D uint32 numpy array, one entry per kept document in order, its ordinal among the
documents of the collected shard (the texts the recipe's first step reads, in order:
``removal.documents``). A later step maps its kept documents through its input's array
(:func:`compose`). Steps keep order, so the array is strictly increasing, and a shard
tokenized from a step's documents holds them one document each (gptflow.data.shards): a
data ablation cuts each recipe's train split by document identity with it
(gptflow.data.dataset.heldout_train_ends).
"""

from __future__ import annotations

import os

import numpy as np

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write

DTYPE = np.uint32  # a document's ordinal in its shard (as in a removal list's pairs)


def compose(before: np.ndarray | None, kept: np.ndarray) -> np.ndarray:
    """The origins of the documents a step keeps: `kept` (their indices in the step's input)
    mapped through `before` (the input's origins; None when the input is the collected
    shard: its documents are their own ordinals)."""
    kept = np.asarray(kept, dtype=np.int64)
    return kept.astype(DTYPE) if before is None else before[kept]


def write_origins(path: str | os.PathLike, origins: np.ndarray) -> None:
    if len(origins) and int(np.max(origins)) > np.iinfo(DTYPE).max:
        raise GptflowError(f"{path}: a shard of over 2^32 documents; cut the input into shards")
    with atomic_write(path, "wb") as f:
        np.save(f, np.asarray(origins, dtype=DTYPE))


def read_origins(path: str | os.PathLike) -> np.ndarray:
    """An origins file, checked: 1-D, integers, strictly increasing."""
    try:
        origins = np.load(path)
    except (OSError, ValueError) as e:
        raise GptflowError(
            f"{path}: not a document origins file ({e}); delete it so that its quality step "
            f"runs again"
        ) from None
    if (
        origins.ndim != 1
        or origins.dtype.kind not in "iu"
        or (np.diff(origins.astype(np.int64)) <= 0).any()
    ):
        raise GptflowError(
            f"{path}: not a document origins file (a strictly increasing 1-D integer array); "
            f"delete it so that its quality step runs again"
        )
    return origins
