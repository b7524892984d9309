"""Deduplication measured, not assumed (issue 39): exact deduplication removes exactly the
repeats, across shards and datasets, keeping the first copy; MinHash LSH with the recipe's
defaults finds planted near-duplicates on the S-curve 1 - (1 - s^r)^b. The package's stage
functions run on files in tmp_path, as the rules run them."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest

from gptflow.data.quality import buckets, clusters, exact, minhash, removal
from gptflow.data.quality.recipe import detection_probability, jaccard_threshold
from gptflow.errors import GptflowError
from tests.support.planted import planted_pairs

READER = {"json_key": "text"}
DEFAULTS = {"ngram": 5, "bands": 14, "rows": 8, "seed": 1, "tokenizer": "regex"}


def write_shard(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def kept_texts(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_exact_removes_exactly_the_repeats_keeping_the_first_copy(tmp_path):
    # two shards; repeats within a shard, across shards, and after normalization (case,
    # whitespace); near-copies (one character apart) are not repeats
    a = ["alpha beta", "gamma", "Alpha  Beta\n", "delta", "gamma", "epsilon."]
    b = ["epsilon.", "zeta", "alpha beta", "epsilon", "ZETA "]
    shards = [write_shard(tmp_path / "a.jsonl", a), write_shard(tmp_path / "b.jsonl", b)]
    hashes = [tmp_path / "a.hashes", tmp_path / "b.hashes"]
    for shard, out in zip(shards, hashes, strict=True):
        assert exact.hash_shard(shard, READER, out) == len(a if out.stem == "a" else b)
        assert out.stat().st_size == 16 * (len(a) if out.stem == "a" else len(b))
    stats = exact.find_repeats(hashes, tmp_path / "group.remove.npy")
    assert stats == {"shards": 2, "documents": 11, "repeats": 5, "passes": 1}
    # by hash range, a few digests per pass: the same list
    stats = exact.find_repeats(hashes, tmp_path / "ranges.remove.npy", rows_per_pass=3)
    assert stats["passes"] == 4 and stats["repeats"] == 5
    assert np.array_equal(
        np.load(tmp_path / "ranges.remove.npy"), np.load(tmp_path / "group.remove.npy")
    )
    assert np.load(tmp_path / "group.remove.npy").tolist() == [
        [0, 2], [0, 4], [1, 0], [1, 2], [1, 4],
    ]  # fmt: skip
    kept = []
    for ordinal, shard in enumerate(shards):
        out = tmp_path / f"{shard.stem}.kept.jsonl"
        m = removal.remove_documents(
            shard, READER, tmp_path / "group.remove.npy", ordinal, out,
            tmp_path / f"{shard.stem}.manifest.json", reason="exact", about={"shard": shard.stem},
        )  # fmt: skip
        assert m["documents_in"] - m["documents_out"] == m["removed"]["exact"]
        assert m["bytes_in"] - m["bytes_out"] == sum(
            len(t.encode()) for t in (a if ordinal == 0 else b)
        ) - sum(len(t.encode()) for t in kept_texts(out))
        kept += kept_texts(out)
    assert kept == ["alpha beta", "gamma", "delta", "epsilon.", "zeta", "epsilon"]


def test_exact_copies_in_another_unicode_form_are_repeats(tmp_path):
    """Issue 49: exact's normalization is NFC first (exact.normalize), so a copy in decomposed
    form ('e' + U+0301, as macOS file names and some extractors write it; Hangul as jamo) is a
    repeat; the text without its accent is not, nor one in another compatibility form (NFC, not
    NFKC: a ligature, full-width letters)."""
    composed = ["Un café crème à Noël.", "한국어 문서"]
    texts = [*composed, "Un cafe\u0301 cre\u0300me a\u0300 Noe\u0308l.", "Un cafe creme a Noel."]
    texts += [unicodedata.normalize("NFD", composed[1]), "a ﬁne ｆｉｌｅ", "a fine file"]
    assert texts[2] != composed[0] and texts[4] != composed[1]  # the shard's bytes differ
    shard = write_shard(tmp_path / "s.jsonl", texts)
    exact.hash_shard(shard, READER, tmp_path / "s.hashes")
    assert exact.find_repeats([tmp_path / "s.hashes"], tmp_path / "r.npy")["repeats"] == 2
    assert np.load(tmp_path / "r.npy").tolist() == [[0, 2], [0, 4]]


def test_each_step_records_where_its_kept_documents_come_from(tmp_path):
    """filter_shard's origins: each kept document's ordinal in the collected shard, composed
    through the steps (gptflow.data.quality.origins); a mismatched input's origins refused."""
    from gptflow.data.quality.origins import read_origins

    texts = ["a", "b", "a", "c", "d", "b", "e"]
    shard = write_shard(tmp_path / "s.jsonl", texts)
    removal.write_removed(tmp_path / "r.npy", np.array([[0, 2], [0, 5]]))
    first = (None, tmp_path / "1.origins.npy")
    removal.remove_documents(shard, READER, tmp_path / "r.npy", 0, tmp_path / "1.jsonl",
                             tmp_path / "1.json", reason="exact", about={}, origins=first)  # fmt: skip
    assert read_origins(first[1]).tolist() == [0, 1, 3, 4, 6]
    second = (first[1], tmp_path / "2.origins.npy")
    stats = removal.filter_shard(tmp_path / "1.jsonl", READER, lambda _, t: "ce" if t in "ce" else None,
                                 tmp_path / "2.jsonl", tmp_path / "2.json", {}, second)  # fmt: skip
    assert kept_texts(tmp_path / "2.jsonl") == ["a", "b", "d"] and stats["documents_out"] == 3
    assert read_origins(second[1]).tolist() == [0, 1, 4]  # a, b, d of the collected shard
    for bad in ([0, 2, 2], [[0, 1]], [0.0, 1.0]):  # a document twice, not 1-D, not integers
        np.save(tmp_path / "bad.npy", np.array(bad))
        with pytest.raises(GptflowError, match=r"bad\.npy: not a document origins file"):
            read_origins(tmp_path / "bad.npy")
    wrong = (first[1], tmp_path / "3.origins.npy")  # the collected shard holds 7, not 5
    with pytest.raises(GptflowError, match=r"1\.origins\.npy: the origins of 5 documents, but "):
        removal.filter_shard(shard, READER, lambda *_: None, tmp_path / "3.jsonl",
                             tmp_path / "3.json", {}, wrong)  # fmt: skip
    # refused before the kept documents are published: no 3.jsonl without its origins
    # (issue 49), no manifest, no temporary
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("3.")] == []


def test_a_manifest_counts_utf8_bytes_and_what_the_reader_skipped(tmp_path):
    """Issue 49: a manifest's bytes are the texts' UTF-8 bytes, not characters (on a
    non-ASCII corpus a step that removes nothing shows no bytes removed), and `unreadable`
    counts by reason the documents the reader skipped (on_bad: skip)."""
    texts = ["Un café crème. " * 30, "中文的文档", "emoji 🙂 ok", "plain"]
    lines = [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts]
    lines[1:1] = [b'{"text": null}', b'{"body": "no text"}', b'{"text": "bad \xff byte"}']
    shard = tmp_path / "s.jsonl"
    shard.write_bytes(b"\n".join(lines) + b"\n")
    size = sum(len(t.encode()) for t in texts)
    assert size > sum(len(t) for t in texts)
    reader = READER | {"on_bad": "skip"}
    m = removal.filter_shard(shard, reader, lambda *_: None, tmp_path / "o.jsonl",
                             tmp_path / "o.json", {})  # fmt: skip
    assert m["documents_in"] == m["documents_out"] == 4
    assert kept_texts(tmp_path / "o.jsonl") == texts
    assert m["bytes_in"] == m["bytes_out"] == size
    assert m["unreadable"] == {"invalid_utf8": 1, "missing_key": 1, "not_string": 1}
    assert json.loads((tmp_path / "o.json").read_text()) == m
    m = removal.filter_shard(shard, reader, lambda i, _: "x" if i == 1 else None,
                             tmp_path / "p.jsonl", tmp_path / "p.json", {})  # fmt: skip
    assert m["bytes_in"] - m["bytes_out"] == len("中文的文档".encode()) == 15
    # every one removed: the first three shown, shortened; without on_bad: skip, a refusal
    m = removal.filter_shard(shard, reader, lambda *_: "x", tmp_path / "q.jsonl",
                             tmp_path / "q.json", {})  # fmt: skip
    assert m["removed"] == {"x": 4} and m["examples"] == {"x": [texts[0][:300], *texts[1:3]]}
    with pytest.raises(GptflowError, match=r"s\.jsonl:2: 'text' is NoneType, not a string; "):
        removal.filter_shard(shard, READER, lambda *_: None, tmp_path / "r.jsonl",
                             tmp_path / "r.json", {})  # fmt: skip


def test_exact_scope_order_decides_which_copy_is_kept(tmp_path):
    """The group's order (datasets in blend order, then shards) decides: the same repeat is
    kept in the shard listed first."""
    first = write_shard(tmp_path / "x.jsonl", ["same text", "x only"])
    second = write_shard(tmp_path / "y.jsonl", ["y only", "same text"])
    for s in (first, second):
        exact.hash_shard(s, READER, tmp_path / f"{s.stem}.hashes")
    exact.find_repeats([tmp_path / "y.hashes", tmp_path / "x.hashes"], tmp_path / "r.npy")
    assert np.load(tmp_path / "r.npy").tolist() == [[1, 0]]  # x's copy, listed second, goes


def test_minhash_finds_planted_near_duplicates_on_the_s_curve(tmp_path, capsys):
    rng = np.random.default_rng(39)
    pairs = planted_pairs(2000, rng)
    # originals in shard 0, copies in shard 1 (documents i and i): the stages as the rules
    # run them -- signatures per shard, pairs per band, one clustering, removal per shard
    shards = [
        write_shard(tmp_path / "orig.jsonl", [p[0] for p in pairs]),
        write_shard(tmp_path / "copy.jsonl", [p[1] for p in pairs]),
    ]
    sigs = [tmp_path / f"{s.stem}.npy" for s in shards]
    for shard, out in zip(shards, sigs, strict=True):
        minhash.signatures_of_shard(shard, READER, DEFAULTS, out)
    bands = [tmp_path / f"band{b:03d}.npy" for b in range(DEFAULTS["bands"])]
    for b, out in enumerate(bands):
        buckets.band_pairs(sigs, b, DEFAULTS["rows"], out)
    stats = clusters.cluster(bands, minhash.shard_documents(sigs), tmp_path / "remove.npy")
    removed = np.load(tmp_path / "remove.npy")
    # by hash range, a few hundred documents per pass: the same pairs
    buckets.band_pairs(sigs, 3, DEFAULTS["rows"], tmp_path / "ranges.npy", rows_per_pass=300)
    assert len(np.load(bands[3])) and np.array_equal(
        np.load(tmp_path / "ranges.npy"), np.load(bands[3])
    )
    assert set(removed[:, 0].tolist()) <= {1}, "a pair's original (shard 0) is always kept"
    found = np.zeros(len(pairs), dtype=bool)
    found[removed[:, 1]] = True
    jaccard = np.array([p[2] for p in pairs])

    print(f"\nMinHash {DEFAULTS['bands']}x{DEFAULTS['rows']}: threshold "
          f"{jaccard_threshold(14, 8):.3f}; {stats['clusters']} clusters")  # fmt: skip
    print(" Jaccard    pairs  found  theory 1-(1-s^8)^14")
    for lo in np.arange(0, 1, 0.1):
        inbin = (jaccard >= lo) & (jaccard < lo + 0.1 + (lo >= 0.9))
        if inbin.any():
            theory = np.mean([detection_probability(s, 14, 8) for s in jaccard[inbin]])
            print(f" {lo:.1f}-{lo + 0.1:.1f}  {inbin.sum():5d}  {found[inbin].mean():5.3f}"
                  f"  {theory:5.3f}")  # fmt: skip
    high, low = jaccard >= 0.85, jaccard <= 0.5
    print(f" recall at J >= 0.85: {found[high].mean():.3f} ({high.sum()} pairs); false "
          f"positives at J <= 0.5: {found[low].mean():.3f} ({low.sum()} pairs)")  # fmt: skip
    assert high.sum() >= 50 and low.sum() >= 200
    assert found[high].mean() >= 0.95
    assert found[low].mean() <= 0.01
    # and between them on the S-curve: within 4 standard errors per 0.1 bin
    for lo in np.arange(0.5, 0.9, 0.1):
        inbin = (jaccard >= lo) & (jaccard < lo + 0.1)
        p = np.mean([detection_probability(s, 14, 8) for s in jaccard[inbin]])
        se = max(np.sqrt(p * (1 - p) / inbin.sum()), 0.02)
        assert abs(found[inbin].mean() - p) <= 4 * se, (lo, found[inbin].mean(), p)


def test_empty_shards_pass_through_every_stage(tmp_path):
    empty = write_shard(tmp_path / "e.jsonl", [])
    assert exact.hash_shard(empty, READER, tmp_path / "e.hashes") == 0
    assert exact.find_repeats([tmp_path / "e.hashes"], tmp_path / "x.npy")["repeats"] == 0
    assert minhash.signatures_of_shard(empty, READER, DEFAULTS, tmp_path / "e.npy") == 0
    assert buckets.band_pairs([tmp_path / "e.npy"], 0, 8, tmp_path / "b.npy") == 0
    documents = minhash.shard_documents([tmp_path / "e.npy"])
    assert clusters.cluster([tmp_path / "b.npy"], documents, tmp_path / "r.npy")["removed"] == 0
    m = removal.remove_documents(
        empty, READER, tmp_path / "r.npy", 0, tmp_path / "o.jsonl", tmp_path / "m.json",
        reason="minhash", about={},
    )  # fmt: skip
    assert m["documents_out"] == 0 and (tmp_path / "o.jsonl").read_text() == ""


def test_minhash_documents_too_short_have_no_signature_and_stay(tmp_path):
    """Below `ngram` (5) words no signature, never a duplicate; at exactly 5 words one
    shingle, a signature, and its copy found (as in DataTrove: issue 49)."""
    texts = ["one two three four", "one two three four", "a b c d e f",
             "The quick brown fox jumps.", "the QUICK brown fox, jumps"]  # fmt: skip
    shard = write_shard(tmp_path / "s.jsonl", texts)
    minhash.signatures_of_shard(shard, READER, DEFAULTS, tmp_path / "s.npy")
    records = np.load(tmp_path / "s.npy")  # (bands, documents), each band sorted
    sig = np.empty((len(texts), 14, 8), np.uint64)
    for band, r in enumerate(records):
        sig[r["index"], band] = r["values"]
    assert (sig[:2] == minhash.NO_SIGNATURE).all() and (sig[2:] != minhash.NO_SIGNATURE).all()
    buckets.band_pairs([tmp_path / "s.npy"], 0, 8, tmp_path / "b.npy")
    assert np.load(tmp_path / "b.npy").tolist() == [[0, 3, 0, 4]]  # the 5-word pair alone


def test_clustering_removes_all_but_the_earliest_of_each_component(tmp_path):
    # chains across bands: (0,5)-(1,2) in one band, (1,2)-(0,9) and (2,0)-(2,1) in another
    np.save(tmp_path / "b0.npy", np.array([[0, 5, 1, 2]], dtype=np.uint32))
    np.save(tmp_path / "b1.npy", np.array([[0, 9, 1, 2], [2, 0, 2, 1]], dtype=np.uint32))
    bands = [tmp_path / "b0.npy", tmp_path / "b1.npy"]
    stats = clusters.cluster(bands, [10, 3, 2], tmp_path / "r.npy")
    assert np.load(tmp_path / "r.npy").tolist() == [[0, 9], [1, 2], [2, 1]]
    assert stats["clusters"] == 2 and stats["cluster_sizes"] == {"2": 1, "3": 1}


@pytest.mark.parametrize(
    ("text", "simplified"),
    [
        ("Hello, World!", "hello world"),
        ("Café costs 1,200 or 3.5 €", "cafe costs 0 or 0 €"),  # '€' is no punctuation of its
        ("tab\tand\n\nnewline", "tab and newline"),
        ("Copyright © 2015", "copyright © 0"),  # issue 48: '©' stayed '© ' -> ' '
        ("‘quoted’ x′ ±1 §2 ™ — ok", "‘quoted x′ ±0 §0 ™ ok"),  # '‘' kept, '’' and '—' spaced
        ("1٫5 and 2⎖3 and 1,200,000", "0 and 0 and 0 0"),  # its decimal separators
        ("a \u0301 b", "a  b"),  # a mark dropped between spaces leaves both, as in its
    ],
)
def test_simplify_is_datatroves_simplify_text(text, simplified):
    from datatrove.utils.text import simplify_text

    assert minhash.simplify(text) == simplified == simplify_text(text)


def test_simplify_agrees_with_datatrove_on_every_assigned_character():
    """Random text over every character Python's Unicode tables assign (its `regex` module's
    tables may be newer: digits of scripts added since are the one known difference), mixed
    with spaces, digits, separators and marks: DataTrove's fixed punctuation list, number and
    whitespace rules, and mark removal, character for character."""
    import unicodedata

    from datatrove.utils.text import PUNCTUATION, simplify_text

    assert minhash.PUNCTUATION == PUNCTUATION
    rng = np.random.default_rng(48)
    assigned = np.array(
        [c for c in range(0x30000) if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    )
    common = np.array([ord(c) for c in " abc1,.\u0301\t\n©٫"])
    for _ in range(3000):
        n = int(rng.integers(0, 40))
        codes = np.where(rng.random(n) < 0.5, rng.choice(assigned, n), rng.choice(common, n))
        text = "".join(map(chr, codes))
        assert minhash.simplify(text) == simplify_text(text), repr(text)
    assert minhash.shingle_hashes("a \u0301 b c d e", 5).size == 1  # five words, one shingle
