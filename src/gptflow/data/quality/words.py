"""The quality filters' word tokenizers, by name (:data:`TOKENIZERS`): a text's words, and the
number of sentences of one line, which the signals of :mod:`gptflow.data.quality.signals` count.

``spacy`` is DataTrove's own (spaCy's blank English tokenizer plus its sentencizer, DataTrove >=
0.4), with which every decision and reason is DataTrove's
(tests/unit/data/quality/test_quality_filters.py checks it document by document); ``regex`` is
~25x faster and decides differently on some documents (bench/quality.py prints the per-rule
agreement).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

from gptflow.errors import GptflowError


class Tokenizer(NamedTuple):
    """A named word tokenizer: words of a text, and the number of sentences of one line."""

    words: Callable[[str], list[str]]
    sentences: Callable[[str], int]
    # None, or a text's words with each line's (str.splitlines) number of them, where the
    # text's words are its lines' words in order (C4's leftover text is then counted from them)
    line_words: Callable[[str], tuple[list[str], list[int]]] | None


# The fast tokenizer, shaped after spaCy's English rules (which DataTrove uses) at regex
# speed: whitespace-separated chunks keep their inner punctuation ("foo(self", "x==y",
# "3.14", URLs); the punctuation spaCy splits off a chunk's edges (EDGE, and a final '.') is one
# token per character; "..." is one token; a hyphen between letters is a token of its own.
_EDGE = r"""[,:;!?()\[\]{}<>_#*&"'=%§]"""
_REGEX_WORD = re.compile(
    r"\.\.\."
    rf"|(?<![^\s{_EDGE[1:-1]}]){_EDGE}"  # at a chunk's start, or after another such
    r"|[^\W\d_]++(?=-[^\W\d_])|(?<=[^\W\d_])-(?=[^\W\d_])"  # well - known
    rf"|[^\s{_EDGE[1:-1]}.](?:\S*[^\s{_EDGE[1:-1]}.])?"  # the chunk's inside
    r"|\S"  # its trailing punctuation, one character each
)
# A sentence ends at '.', '!' or '?' (not in "..."), closing quotes or brackets, then space
_REGEX_SENTENCE_END = re.compile(r"""(?:(?<!\.)\.(?!\.)|[!?])["')\]]*\s+(?=\S)""")


def _regex_words(text: str) -> list[str]:
    words: list[str] = []
    for chunk in text.split():  # the same whitespace as the pattern's \s
        if chunk.isalnum():  # most chunks: the pattern would give them whole
            words.append(chunk)
        else:
            words += _REGEX_WORD.findall(chunk)
    return words


def _regex_line_words(text: str) -> tuple[list[str], list[int]]:
    """No regex token spans whitespace, so a text's tokens are its lines' tokens."""
    words: list[str] = []
    counts: list[int] = []
    findall = _REGEX_WORD.findall
    for line in text.splitlines():
        before = len(words)
        for chunk in line.split():
            if chunk.isalnum():
                words.append(chunk)
            else:
                words += findall(chunk)
        counts.append(len(words) - before)
    return words, counts


def _regex_sentences(line: str) -> int:
    if "." not in line and "!" not in line and "?" not in line:
        return 1
    return 1 + len(_REGEX_SENTENCE_END.findall(line))


@lru_cache(1)
def _spacy_nlp():
    try:
        import spacy
    except ImportError:
        raise GptflowError(
            "the quality filters' word tokenizer 'spacy' needs spaCy, which is not installed; "
            "install it (pip install 'gptflow[quality]') or name the tokenizer 'regex'"
        ) from None
    nlp = spacy.blank("en")  # rule-based: no model download
    nlp.add_pipe("sentencizer")
    return nlp


def _spacy_docs(text: str):
    # As DataTrove's SpaCyTokenizer: one string breaks spaCy's tokenizer; it is dropped
    nlp = _spacy_nlp()
    nlp.max_length = len(text) + 10
    try:
        return nlp(text, disable=["parser", "tagger", "ner"])
    except Exception:
        if "IS_ALPHA" not in text:
            raise
        return nlp(text.replace("IS_ALPHA", ""), disable=["parser", "tagger", "ner"])


def _spacy_words(text: str) -> list[str]:
    with _spacy_nlp().memory_zone():
        return [s for s in (t.text.strip() for t in _spacy_docs(text)) if s]


def _spacy_sentences(line: str) -> int:
    # DataTrove's split_into_sentences cuts at each sentence's end: one part at least
    with _spacy_nlp().memory_zone():
        return max(1, len(list(_spacy_docs(line).sents)))


TOKENIZERS = {
    "regex": Tokenizer(_regex_words, _regex_sentences, _regex_line_words),
    "spacy": Tokenizer(_spacy_words, _spacy_sentences, None),
}


def get_tokenizer(name: str) -> Tokenizer:
    if name not in TOKENIZERS:
        raise GptflowError(
            f"the quality filters' word tokenizer is {name!r}; expected one of "
            f"{sorted(TOKENIZERS)} (regex: fast; spacy: DataTrove's own, for its exact decisions)"
        )
    return TOKENIZERS[name]
