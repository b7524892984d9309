"""The filters and language steps' two jobs each, around :mod:`gptflow.data.quality.signals`
(each document's signals) and :mod:`gptflow.data.quality.filters` (the decisions on them): per
shard, the signals of every document into a side file, once per input and word tokenizer
(filters) or model file's sha256 (language); then, per shard and recipe, a cheap selection
that applies the recipe's thresholds to them and writes the kept documents. An edit to a
threshold reruns only the selection.

A side file is JSONL, one ``signals.signals`` (or ``signals.language_signals``) mapping per
document in document order. The manifest counts the removed by reason (``rule:reason``, the
reference's reason; ``language:<the document's top language>`` for the language step) and
keeps the first few removed documents of each reason, shortened, to show why.
"""

from __future__ import annotations

import json
import os

from gptflow.data.quality.recipe import check_language_model
from gptflow.data.quality.removal import documents, filter_shard
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write


def check_rules(rules: dict | None, where: str, source: str) -> None:
    """The recipe's rules and thresholds as the filters module knows them (at -n); None: the
    step names none."""
    from gptflow.data.quality import filters

    try:
        if not rules:
            raise GptflowError(
                "a filters step needs its rules, e.g. rules: {gopher_repetition: null, c4: null} "
                "(null: the reference's thresholds)"
            )
        if "language" in rules:
            raise GptflowError(
                "rule 'language' needs language scores, which a filters step does not "
                "compute; use a step of its own ({step: language, model: ..., sha256: ...})"
            )
        filters.thresholds_for(rules)
    except GptflowError as e:
        raise GptflowError(f"{source}: {where}.rules: {e}; fix {source}") from None


def language_rule(settings: dict) -> dict:
    """A language step's decision as the filters module's language rule (its thresholds)."""
    from gptflow.data.quality import filters

    rule = {"languages": list(settings["languages"]), "language_threshold": settings["threshold"]}
    return filters.thresholds_for({"language": rule})


def check_language(settings: dict, where: str, source: str) -> None:
    """A language step's languages and threshold as the filters module takes them (at -n)."""
    try:
        language_rule(settings)
    except GptflowError as e:
        raise GptflowError(f"{source}: {where}.threshold: {e}; fix {source}") from None


def _write_rows(path: str | os.PathLike, reader: dict, out: str | os.PathLike, rows) -> int:
    """`rows(texts)`: a row for each document of a shard, in order, one JSON line each,
    written atomically to `out` (a side file the selection reads); returns the rows."""
    n = 0
    with atomic_write(out, "w") as f:
        for row in rows(documents(path, reader)):
            f.write(json.dumps(row, ensure_ascii=False))
            f.write("\n")
            n += 1
    return n


def write_signals(
    path: str | os.PathLike, reader: dict, tokenizer: str, out: str | os.PathLike
) -> dict:
    """The signals of a shard's documents, one JSON line each; returns the counts."""
    from gptflow.data.quality import signals

    n = _write_rows(path, reader, out, lambda texts: signals.iter_signals(texts, tokenizer))
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
    origins: tuple = (None, None),
) -> dict:
    """A shard's documents but those the recipe's `rules` drop on their signals, counted by
    the reason the rule gives (:func:`~gptflow.data.quality.removal.filter_shard`, as its
    `origins`)."""
    from gptflow.data.quality import filters

    thresholds = filters.thresholds_for(rules)

    def reason(row: dict) -> str | None:
        keep, why = filters.select(row, thresholds)
        return None if keep else why

    return _select(path, reader, signals, reason, out, manifest, about, origins)


def _select(path, reader, side_file, reason, out, manifest, about, origins) -> dict:
    """filter_shard with `reason(row)` deciding on the side file's row of each document."""
    with open(side_file, encoding="utf-8") as side:

        def drop(index: int, _text: str) -> str | None:
            line = side.readline()
            if not line:
                raise GptflowError(
                    f"{side_file}: {index} lines for more documents of {path}; delete it so "
                    f"that the shard's signals are computed again"
                )
            return reason(json.loads(line))

        stats = filter_shard(path, reader, drop, out, manifest, about, origins)
        if side.readline():
            raise GptflowError(
                f"{side_file}: more lines than {path} has documents; delete it so that the "
                f"shard's signals are computed again"
            )
        return stats


def write_language_scores(
    path: str | os.PathLike, reader: dict, model: dict, out: str | os.PathLike, where: str
) -> dict:
    """fastText's language scores of a shard's documents, one JSON line each
    (``signals.language_signals``); `model`: the step's model and sha256, checked first
    (`where`: its config key, for the error). Returns the counts."""
    from gptflow.data.quality import signals

    model_path = str(check_language_model(model, where))
    signals.load_lid_model(model_path)
    n = _write_rows(
        path, reader, out, lambda texts: (signals.language_signals(t, model_path) for t in texts)
    )
    return {"documents": n, "model": model_path, "sha256": model["sha256"]}


def select_language(
    path: str | os.PathLike,
    reader: dict,
    scores: str | os.PathLike,
    languages: list[str],
    threshold: float,
    out: str | os.PathLike,
    manifest: str | os.PathLike,
    *,
    about: dict,
    origins: tuple = (None, None),
) -> dict:
    """A shard's documents but those whose score in every one of `languages` is at most
    `threshold` (DataTrove's LanguageFilter decision, ``filters``' language rule), each
    removed one counted as ``language:<its top language>`` (`origins`: filter_shard's)."""
    from gptflow.data.quality import filters

    thresholds = language_rule({"languages": languages, "threshold": threshold})

    def reason(row: dict) -> str | None:
        keep, why = filters.select(row, thresholds)
        if keep:
            return None
        return f"language:{row['lid_language'] or 'none'}" if "lid_language" in row else why

    return _select(path, reader, scores, reason, out, manifest, about, origins)
