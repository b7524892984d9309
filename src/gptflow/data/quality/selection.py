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
from collections import Counter

from gptflow.data.quality.removal import documents, write_documents
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write, write_json

EXAMPLES = 3  # removed documents kept per reason in the manifest
EXAMPLE_CHARS = 300


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
    """Copy a shard's documents to `out` (JSONL) but those the recipe's `rules` drop on their
    signals; the manifest counts documents and bytes in and out, and the removed by reason."""
    from gptflow.data.quality import filters

    thresholds = filters.thresholds_for(rules)
    counts = {"documents_in": 0, "bytes_in": 0}
    removed: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    dropped: Counter[str] = Counter()

    def kept():
        with open(signals, encoding="utf-8") as side:
            for i, text in enumerate(documents(path, reader, dropped)):
                line = side.readline()
                if not line:
                    raise GptflowError(
                        f"{signals}: {i} lines for more documents of {path}; delete it so "
                        f"that the shard's signals are computed again"
                    )
                counts["documents_in"] += 1
                counts["bytes_in"] += len(text.encode("utf-8"))
                keep, reason = filters.select(json.loads(line), thresholds)
                if keep:
                    yield text
                    continue
                removed[reason] += 1
                if len(shown := examples.setdefault(reason, [])) < EXAMPLES:
                    shown.append(text[:EXAMPLE_CHARS])

    documents_out, bytes_out = write_documents(out, kept())
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
