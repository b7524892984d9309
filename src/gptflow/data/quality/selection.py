"""The filters step's two jobs around :mod:`gptflow.data.quality.filters` (which computes each
document's signals and decides on them): per shard, the signals of every document into a side
file, once per input and word tokenizer; then, per shard and recipe, a cheap selection that
applies the recipe's thresholds to them and writes the kept documents. An edit to a threshold
reruns only the selection.

The side file is JSONL, one ``filters.signals`` mapping per document in document order. The
manifest counts the removed by reason (``rule:reason``, the reference's reason) and keeps the
first few removed documents of each reason, shortened, to show why.
"""

from __future__ import annotations

import json
import os

from gptflow.data.quality.removal import documents, filter_shard
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write


def check_rules(rules: dict, where: str, source: str) -> None:
    """The recipe's rules and thresholds as the filters module knows them (at -n)."""
    from gptflow.data.quality import filters

    try:
        filters.thresholds_for(rules)
    except GptflowError as e:
        raise GptflowError(f"{source}: {where}.rules: {e}; fix {source}") from None


def write_signals(
    path: str | os.PathLike, reader: dict, tokenizer: str, out: str | os.PathLike
) -> dict:
    """The signals of a shard's documents, one JSON line each; returns the counts."""
    from gptflow.data.quality import filters

    n = 0
    with atomic_write(out, "w") as f:
        for text in documents(path, reader):
            f.write(json.dumps(filters.signals(text, tokenizer), ensure_ascii=False))
            f.write("\n")
            n += 1
    return {"documents": n, "tokenizer": tokenizer}


def select_documents(
    path: str | os.PathLike,
    reader: dict,
    signals: str | os.PathLike,
    rules: dict,
    out: str | os.PathLike,
    manifest: str | os.PathLike,
    *,
    about: dict,
) -> dict:
    """A shard's documents but those the recipe's `rules` drop on their signals, counted by
    the reason the rule gives (:func:`~gptflow.data.quality.removal.filter_shard`)."""
    from gptflow.data.quality import filters

    thresholds = filters.thresholds_for(rules)
    with open(signals, encoding="utf-8") as side:

        def drop(index: int, _text: str) -> str | None:
            line = side.readline()
            if not line:
                raise GptflowError(
                    f"{signals}: {index} lines for more documents of {path}; delete it so "
                    f"that the shard's signals are computed again"
                )
            keep, reason = filters.select(json.loads(line), thresholds)
            return None if keep else reason

        return filter_shard(path, reader, drop, out, manifest, about)
