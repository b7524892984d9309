"""Quality filters: a recipe's rules, their thresholds and their decisions on a document's
signals (:mod:`gptflow.data.quality.signals`).

The rules are Gopher repetition and Gopher quality (Rae et al. 2021, Table A1), C4 (Raffel et
al. 2020, TFDS ``c4_utils``) and FineWeb's line filters, as DataTrove 0.10.1 defines them
(``GopherRepetitionFilter``, ``GopherQualityFilter``, ``C4QualityFilter``,
``FineWebQualityFilter``): their thresholds (:data:`THRESHOLDS`), their names and their reasons
are DataTrove's; a language rule (DataTrove's ``LanguageFilter``) decides on fastText's scores.

`thresholds_for(recipe)` checks a recipe's thresholds over the defaults; `select(signals,
thresholds)` applies them, rule by rule in the recipe's order, and returns ``(keep, reason)``
with the reason DataTrove's filter gives. Each rule's own `decide` stops at the first failing
check in DataTrove's order, so the reason is the one DataTrove names, not merely a failing one.
As in a DataTrove pipeline, FineWeb's rule after C4's judges the text C4 left
(``fineweb_after_c4_*``, for C4 as FineWeb runs it); Gopher's rules judge the whole text
wherever they stand.

A document no rule can evaluate (not a string; a ratio whose denominator is zero, where
DataTrove's filter raises ZeroDivisionError, e.g. GopherQuality on an empty text with its
word minimum off) is dropped with the reason `UNPARSABLE` and counted like any other reason:
never a crash.

The signals and the word tokenizers were this module's too (gptflow 0.1): their names read
from here still work, with a DeprecationWarning, until 0.3 (CHANGELOG.md).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable
from typing import Any

from gptflow.data.quality import signals as _signals
from gptflow.data.quality import words as _words
from gptflow.data.quality.signals import AFTER_C4, DUP_N, LID_MIN_SCORE, TOP_N, UNPARSABLE
from gptflow.errors import GptflowError

RULES = ("gopher_repetition", "gopher_quality", "c4", "fineweb")

# One table: each rule's thresholds at the reference's values, under DataTrove 0.10.1's
# parameter names. A falsy value turns that check off, as in DataTrove (`if self.x and ...`).
THRESHOLDS: dict[str, dict[str, Any]] = {
    "gopher_repetition": {
        "dup_line_frac": 0.3,  # duplicate lines / lines
        "dup_para_frac": 0.3,  # duplicate paragraphs / paragraphs
        "dup_line_char_frac": 0.2,  # characters in duplicate lines / characters
        "dup_para_char_frac": 0.2,  # characters in duplicate paragraphs / characters
        "top_n_grams": {2: 0.2, 3: 0.18, 4: 0.16},  # n: top n-gram's characters / characters
        # n: characters in repeated n-grams / characters
        "dup_n_grams": {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
    },
    "gopher_quality": {
        "min_doc_words": 50,  # words with a non-punctuation character
        "max_doc_words": 100_000,
        "min_avg_word_length": 3,  # characters, over those words
        "max_avg_word_length": 10,
        "max_symbol_word_ratio": 0.1,  # '#' per word; '...' and '…' per word
        "max_bullet_lines_ratio": 0.9,  # lines starting with '•' or '-'
        "max_ellipsis_lines_ratio": 0.3,  # lines ending with '...' or '…'
        "max_non_alpha_words_ratio": 0.8,  # a MINIMUM: words with a letter / words
        "min_stop_words": 2,  # distinct words of GOPHER_STOP_WORDS
    },
    "c4": {
        "filter_no_terminal_punct": True,  # keep only lines ending . ? ! " ' (FineWeb: False)
        "min_num_sentences": 5,  # in the kept lines; -1: off
        "filter_lorem_ipsum": True,  # drop the document on a kept line with "lorem ipsum"
        "filter_curly_bracket": True,  # drop the document on a kept line with '{'
    },
    "language": {  # DataTrove's LanguageFilter, fastText LID-176 (language_signals)
        "languages": None,  # keep these (codes: "en", ...); None: any language
        "language_threshold": 0.65,  # a MINIMUM: the (best, or a kept language's) score
    },
    "fineweb": {
        "line_punct_thr": 0.12,  # a MINIMUM: lines ending in terminal punctuation / lines
        "line_punct_exclude_zero": False,  # True: no such line at all passes
        "short_line_thr": 0.67,  # lines of <= FINEWEB_SHORT_LINE characters / lines
        "char_duplicates_ratio": 0.01,  # characters in duplicate lines / characters
        "new_line_ratio": 0.3,  # newlines / words
    },
}


# ---------------------------------------------------------------------------------------------
# Decisions


def _gopher_repetition_decide(s: dict[str, Any], t: dict[str, Any]) -> tuple[bool, str]:
    if not s["chars"]:
        return False, "empty"
    for key in ("dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac"):
        if t[key] and _over(s[key], t[key]):
            return False, key
    for n, frac in t["top_n_grams"].items():
        if s[f"top_{n}_gram"] is not None and _over(s[f"top_{n}_gram"], frac):
            return False, f"top_{n}_gram"
    for n, frac in t["dup_n_grams"].items():
        if _over(s[f"duplicated_{n}_n_grams"], frac):
            return False, f"duplicated_{n}_n_grams"
    return True, ""


def _gopher_quality_decide(s: dict[str, Any], t: dict[str, Any]) -> tuple[bool, str]:
    words = s["gopher_non_symbol_words"]
    avg = s["gopher_avg_word_length"]  # None (DataTrove: nan, which passes both checks)
    checks = (
        ("min_doc_words", "gopher_short_doc", lambda v: words < v),
        ("max_doc_words", "gopher_long_doc", lambda v: words > v),
        ("min_avg_word_length", "gopher_below_avg_threshold", lambda v: avg is not None and avg < v),
        ("max_avg_word_length", "gopher_above_avg_threshold", lambda v: avg is not None and avg > v),
        ("max_symbol_word_ratio", "gopher_too_many_hashes", lambda v: _over(s["gopher_hash_ratio"], v)),
        ("max_symbol_word_ratio", "gopher_too_many_ellipsis",
         lambda v: _over(s["gopher_ellipsis_ratio"], v)),
        ("max_bullet_lines_ratio", "gopher_too_many_bullets",
         lambda v: _over(s["gopher_bullet_lines_ratio"], v)),
        ("max_ellipsis_lines_ratio", "gopher_too_many_end_ellipsis",
         lambda v: _over(s["gopher_end_ellipsis_lines_ratio"], v)),
        ("max_non_alpha_words_ratio", "gopher_below_alpha_threshold",
         lambda v: _under(s["gopher_alpha_words_ratio"], v)),
        ("min_stop_words", "gopher_enough_stop_words", lambda v: s["gopher_stop_words"] < v),
    )  # fmt: skip
    for key, reason, fails in checks:
        if t[key] and fails(t[key]):
            return False, reason
    return True, ""


def _c4_decide(s: dict[str, Any], t: dict[str, Any]) -> tuple[bool, str]:
    p = "c4_" if t["filter_no_terminal_punct"] else "c4_any_end_"
    lorem = s[p + "lorem_ipsum_line"] if t["filter_lorem_ipsum"] else None
    curly = s[p + "curly_bracket_line"] if t["filter_curly_bracket"] else None
    if lorem is not None and (curly is None or lorem <= curly):
        return False, "lorem_ipsum"
    if curly is not None:
        return False, "curly_bracket"
    if s[p + "sentences"] < t["min_num_sentences"]:
        return False, "too_few_sentences"
    return True, ""


def _fineweb_decide(s: dict[str, Any], t: dict[str, Any]) -> tuple[bool, str]:
    if not s["fineweb_lines"]:
        return False, "empty"
    ratio = s["fineweb_punct_lines_ratio"]
    if ratio < t["line_punct_thr"] and not (ratio == 0 and t["line_punct_exclude_zero"]):
        return False, "line_punct_ratio"
    if s["fineweb_short_lines_ratio"] > t["short_line_thr"]:
        return False, "short_line_ratio"
    if _over(s["fineweb_char_dup_ratio"], t["char_duplicates_ratio"]):
        return False, "char_dup_ratio"
    if _over(s["fineweb_list_ratio"], t["new_line_ratio"]):
        return False, "list_ratio"
    return True, ""


def _language_decide(s: dict[str, Any], t: dict[str, Any]) -> tuple[bool, str]:
    if "lid_scores" not in s:
        raise GptflowError(
            "the recipe filters on language, but these signals hold no language scores; "
            "compute them with language_signals (a language ID model)"
        )
    limit, languages = t["language_threshold"], t["languages"]
    if languages:
        keep = any(s["lid_scores"].get(lang, 0.0) > limit for lang in languages)
    else:
        keep = s["lid_score"] > limit
    return (True, "") if keep else (False, "language")


class _Unparsable(Exception):
    """A ratio DataTrove would divide by zero for: the rule cannot evaluate the document."""


def _over(value: float | None, limit: float) -> bool:
    if value is None:
        raise _Unparsable
    return value > limit


def _under(value: float | None, limit: float) -> bool:
    if value is None:
        raise _Unparsable
    return value < limit


_DECIDE = {
    "gopher_repetition": _gopher_repetition_decide,
    "gopher_quality": _gopher_quality_decide,
    "c4": _c4_decide,
    "fineweb": _fineweb_decide,
    "language": _language_decide,
}


_COUNTS = ("min_doc_words", "max_doc_words", "min_stop_words", "min_num_sentences")
# DataTrove tests these with `if self.x and ...`: null (or 0) turns them off. An n-gram check
# is off when its n is left out.
_NULLABLE = (*THRESHOLDS["gopher_quality"], "dup_line_frac", "dup_para_frac",
             "dup_line_char_frac", "dup_para_char_frac")  # fmt: skip


def _check_threshold(rule: str, key: str, value: Any) -> None:
    """A switch is a bool; a fraction (a key ending in _frac, _ratio, _thr, _threshold, or an
    n-gram's) lies in [0, 1]; a count of words or sentences is a whole number; a length is a
    number >= 0; None turns off the checks DataTrove lets be turned off (`_NULLABLE`)."""
    name = key.split(".")[0]
    default = THRESHOLDS[rule][name]
    where = f"quality filter {rule}: {key} is {value!r}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise GptflowError(f"{where}; expected true or false")
    elif name == "languages":
        if value is not None and not (
            isinstance(value, str | list) and all(isinstance(v, str) for v in value)
        ):
            raise GptflowError(f"{where}; expected a language code or a list of them ('en')")
    elif isinstance(default, dict) and "." not in key:
        if not isinstance(value, dict):
            raise GptflowError(f"{where}; expected {{n: fraction}}, e.g. {default}")
    elif value is None:
        if "." in key or name not in _NULLABLE:
            raise GptflowError(f"{where}; expected a number (this check has no off switch)")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise GptflowError(f"{where}; expected a number (or null: off)")
    elif "." in key or name.endswith(("_frac", "_ratio", "_thr", "_threshold")):
        if not 0 <= value <= 1:
            raise GptflowError(f"{where}; expected a fraction from 0 to 1 (or null: off)")
    elif name in _COUNTS:
        if value != int(value) or value < -1:
            raise GptflowError(f"{where}; expected a whole number")
    elif value < 0:
        raise GptflowError(f"{where}; expected a number >= 0 (or null: off)")


def thresholds_for(recipe: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """A recipe's rules (in its order) with its thresholds over `THRESHOLDS`' defaults;
    one line naming the rule, the key and the fix for an unknown one, or an n-gram size whose
    signal is not computed."""
    out: dict[str, dict[str, Any]] = {}
    for rule, given in recipe.items():
        if rule not in THRESHOLDS:
            raise GptflowError(
                f"quality filter {rule!r} is unknown; expected one of {list(THRESHOLDS)}"
            )
        merged = dict(THRESHOLDS[rule])
        for key, value in (given or {}).items():
            if key not in merged:
                raise GptflowError(
                    f"quality filter {rule}: threshold {key!r} is unknown; "
                    f"expected one of {sorted(merged)}"
                )
            _check_threshold(rule, key, value)
            merged[key] = value
        for key, sizes in (("top_n_grams", TOP_N), ("dup_n_grams", DUP_N)):
            if key in merged:
                merged[key] = {int(n): f for n, f in merged[key].items()}
                if not set(merged[key]) <= set(sizes):
                    raise GptflowError(
                        f"quality filter {rule}: {key} has n = {sorted(merged[key])}; "
                        f"signals are computed for n in {list(sizes)} only"
                    )
                for n, fraction in merged[key].items():
                    _check_threshold(rule, f"{key}.{n}", fraction)
        if rule == "language":
            if isinstance(merged["languages"], str):
                merged["languages"] = [merged["languages"]]
            if merged["language_threshold"] < LID_MIN_SCORE:
                raise GptflowError(
                    f"quality filter language: language_threshold is "
                    f"{merged['language_threshold']}; scores below {LID_MIN_SCORE} are not "
                    "kept, so the threshold must be at least that"
                )
        out[rule] = merged
    rules = list(out)
    late = (
        [r for r in rules[rules.index("c4") + 1 :] if r.startswith("gopher_")]
        if "c4" in out
        else []
    )
    if late:
        raise GptflowError(
            f"quality filters: {late[0]} after c4 would judge the whole text (gptflow computes "
            "Gopher's signals of the text as read), where DataTrove's pipeline judges what C4 "
            f"leaves; put {late[0]} before c4, as FineWeb does"
        )
    if (
        "c4" in out
        and "fineweb" in rules[rules.index("c4") :]
        and out["c4"]["filter_no_terminal_punct"]
    ):
        raise GptflowError(
            "quality filters: fineweb after c4 judges the text C4 leaves, whose signals are "
            "computed for C4 without its terminal-punctuation rule (FineWeb's setting); set "
            "c4.filter_no_terminal_punct: false, or put fineweb before c4"
        )
    return out


def decide(rule: str, sig: dict[str, Any], thresholds: dict[str, Any]) -> tuple[bool, str]:
    """One rule's (keep, reason) on a document's signals, with DataTrove's reason; the
    thresholds are a full set for that rule (`thresholds_for`)."""
    if UNPARSABLE in sig:
        return False, UNPARSABLE
    try:
        return _DECIDE[rule](sig, thresholds)
    except _Unparsable:
        return False, UNPARSABLE


def select(sig: dict[str, Any], thresholds: dict[str, dict[str, Any]]) -> tuple[bool, str]:
    """A recipe's decision: its rules in order (`thresholds_for`), the first that drops the
    document gives the reason (``"<rule>:<DataTrove's reason>"``); ``(True, "")`` kept. As in
    a DataTrove pipeline, FineWeb's rule after C4's judges the text C4 left. Gopher's rules
    judge the whole text (their signals are of it alone), so `thresholds_for` refuses them
    after C4, where DataTrove's pipeline would judge C4's text: FineWeb's order puts them
    before C4."""
    after_c4 = False
    for rule, rule_thresholds in thresholds.items():
        if rule == "fineweb" and after_c4 and UNPARSABLE not in sig:
            view = {k.replace(AFTER_C4, "fineweb_", 1): v for k, v in sig.items()
                    if k.startswith(AFTER_C4)}  # fmt: skip
            keep, reason = decide(rule, view, rule_thresholds)
        else:
            keep, reason = decide(rule, sig, rule_thresholds)
        if not keep:
            return False, f"{rule}:{reason}"
        after_c4 = after_c4 or rule == "c4"
    return True, ""


def select_rows(
    rows: Iterable[dict[str, Any]], thresholds: dict[str, dict[str, Any]]
) -> tuple[list[int], Counter]:
    """The kept documents' indices and the dropped ones counted by reason."""
    kept: list[int] = []
    dropped: Counter = Counter()
    for row in rows:
        keep, reason = select(row, thresholds)
        if keep:
            kept.append(row["doc"])
        else:
            dropped[reason] += 1
    return kept, dropped


# ---------------------------------------------------------------------------------------------
# Names that moved (gptflow 0.1 read them here): until 0.3, with a DeprecationWarning

_MOVED = {
    **dict.fromkeys(("Tokenizer", "TOKENIZERS", "get_tokenizer"), _words),
    **dict.fromkeys(
        ("GOPHER_STOP_WORDS", "C4_MAX_WORD_LENGTH", "C4_MIN_WORDS_PER_LINE", "C4_CITATION",
         "C4_END_PUNCTUATION", "C4_POLICY", "FINEWEB_SHORT_LINE", "PUNCTUATION",
         "TERMINAL_PUNCTUATION", "PUNCTUATION_SET", "BATCH_CHARS", "char_hashes",
         "batch_signals", "signals", "iter_signals", "shipped_lid_model", "load_lid_model",
         "language_signals", "write_signals", "read_signals"),
        _signals,
    ),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        where = _MOVED[name].__name__
        warnings.warn(
            f"gptflow.data.quality.filters.{name} is {where}.{name} now; the old name goes in "
            "gptflow 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_MOVED[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
