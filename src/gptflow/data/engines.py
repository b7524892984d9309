"""Tokenizing engines: texts in, one flat token array and per-document lengths out.

The config key ``tokenize.engine`` and ``gptflow tokenize --engine`` choose one of
:data:`ENGINES` (DeepSpeed's training engine is another thing: :mod:`gptflow.train.engine`).

``hf``
    The Hugging Face ``tokenizers`` package: the reference, the token stream of Megatron-LM's
    ``HuggingFaceTokenizer`` for the same ``tokenizer.json``. ~2-3 MB/s per core.
``gigatoken``
    The Rust BPE that Megatron-LM's ``preprocess_data_fast.py`` uses (MIT licence), ~50 MB/s per
    thread on this corpus and 130-200 MB/s on two. Its per-thread encode caches grow without
    bound in 0.10.0 (gigatoken issue #36: 1.6 GB after 240 MB of rare words); the engine drops
    and rebuilds its tokenizer, then returns the freed memory to the OS, whenever the process
    RSS passes a limit. Cache contents never change tokens.

:func:`select_engine` resolves ``auto``: gigatoken where it can load the tokenizer and the
tokenizer adds no tokens of its own (a BOS/EOS post-processor), else hf. Whichever way gigatoken
was chosen, :meth:`GigatokenEngine.check_parity` compares it with hf on the first documents of
each input; a mismatch is an error naming the document, never a silent fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import re
from importlib import metadata
from itertools import chain, islice

import numpy as np

from gptflow.data.tokenizer import load_tokenizer
from gptflow.errors import GptflowError

log = logging.getLogger(__name__)

ENGINES = ("auto", "gigatoken", "hf")  # the choices of tokenize.engine and --engine
LONG_DOCUMENT_CHARS = 1 << 18  # hf encodes longer documents piecewise (see encode_long)
_CUT_WINDOW = 512  # characters each side of a cut that are re-encoded to prove it safe
PARITY_DOCUMENTS = 64  # documents of each input compared between gigatoken and hf ...
PARITY_CHARS = 1 << 17  # ... up to this many characters in all
PARITY_DOC_CHARS = 1 << 15  # each compared on its first characters (both engines see the same)


def rss_bytes() -> int:
    """Resident set size of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """Peak RSS of this process since it started (VmHWM: unlike getrusage's ru_maxrss, it does
    not inherit the high-water mark of the process that forked it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _release_memory() -> None:
    gc.collect()
    # not glibc: the freed memory is reused by the process, not returned
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _lengths_of(docs: list[list[int]]) -> np.ndarray:
    return np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))


class HFEngine:
    """Hugging Face ``tokenizers``, one process; run several for parallelism."""

    name = "hf"

    def __init__(self, tokenizer_path: str) -> None:
        import tokenizers

        self.path = str(tokenizer_path)
        self.tok = load_tokenizer(tokenizer_path)
        self.version = tokenizers.__version__

    def encode_list(
        self, texts: list[str], origin: str = "document"
    ) -> list[list[int] | np.ndarray]:
        """Ids per document: lists, or uint32 arrays for documents over LONG_DOCUMENT_CHARS."""
        tok = self.tok
        short = [t for t in texts if len(t) <= LONG_DOCUMENT_CHARS]
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        encoded = iter(encode(short))
        return [
            next(encoded).ids if len(t) <= LONG_DOCUMENT_CHARS else encode_long(tok, t, origin)
            for t in texts
        ]

    def encode(self, texts: list[str], origin: str = "document") -> tuple[np.ndarray, np.ndarray]:
        docs = self.encode_list(texts, origin)
        lengths = _lengths_of(docs)
        if any(isinstance(d, np.ndarray) for d in docs):  # long documents come as arrays
            flat = np.concatenate([np.asarray(d, np.uint32) for d in docs])
        else:
            flat = np.fromiter(chain.from_iterable(docs), np.uint32, count=int(lengths.sum()))
        return flat, lengths


class GigatokenEngine:
    """gigatoken in this process; `threads` > 1 encodes each batch on that many threads."""

    name = "gigatoken"

    def __init__(
        self, tokenizer_path: str, *, threads: int = 1, reset_rss: int = 0, tok=None
    ) -> None:
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, threads)))
        import gigatoken

        self._gigatoken = gigatoken
        self.path = str(tokenizer_path)
        self.parallel = threads > 1
        self.reset_rss = reset_rss
        self.cache_resets = 0
        self.parity_documents = 0
        self.version = metadata.version("gigatoken")
        self.tok = tok or self._load()

    def _load(self):
        try:
            return self._gigatoken.Tokenizer(self.path)
        except Exception as e:  # the Rust loader raises ValueError and friends
            raise GptflowError(f"{self.path}: gigatoken cannot load this tokenizer ({e})") from None

    def encode(self, texts: list[str], origin: str = "document") -> tuple[np.ndarray, np.ndarray]:
        arr = self.tok.encode_batch(texts, parallel=self.parallel)
        layout = arr.layout
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        flat = np.asarray(layout.content.data)[offsets[0] : offsets[-1]]
        return flat, np.diff(offsets)

    def bound_memory(self) -> bool:
        """Drop the encode caches when the process RSS is over the limit; True if dropped."""
        if not self.reset_rss or rss_bytes() <= self.reset_rss:
            return False
        before = rss_bytes()
        self.tok = None
        _release_memory()
        self.tok = self._load()
        self.cache_resets += 1
        log.info(
            "gigatoken encode caches dropped at %.0f MB RSS (now %.0f MB)",
            before / 1e6,
            rss_bytes() / 1e6,
        )
        return True

    def check_parity(
        self,
        reference: HFEngine,
        texts: list[str],
        flat: np.ndarray,
        lengths: np.ndarray,
        origin: str,
    ) -> int:
        """Compare this engine's tokens of `texts` (`flat`, `lengths`) with `reference`'s on the
        first documents (up to PARITY_CHARS, documents over PARITY_DOC_CHARS left out).

        Returns how many documents were compared; raises an error naming the first document
        whose tokens differ.
        """
        ends = np.cumsum(lengths)
        picked, chars = [], 0
        for i, text in enumerate(texts[:PARITY_DOCUMENTS]):
            if len(text) <= PARITY_DOC_CHARS:
                picked.append(i)
                chars += len(text)
                if chars >= PARITY_CHARS:
                    break
        want = reference.encode_list([texts[i] for i in picked], origin)
        for i, a in zip(picked, want, strict=True):
            b = flat[ends[i] - lengths[i] : ends[i]].tolist()
            if a != b:
                pairs = enumerate(zip(a, b, strict=False))
                at = next((j for j, (x, y) in pairs if x != y), min(len(a), len(b)))
                raise GptflowError(
                    f"{origin}: document {i + 1} is tokenized differently by gigatoken "
                    f"{self.version} and by Hugging Face tokenizers (first difference at token "
                    f"{at}: {b[at : at + 4]} vs {a[at : at + 4]}); use --engine hf "
                    f"(tokenize.engine: hf) for this tokenizer"
                )
        self.parity_documents += len(picked)
        return len(picked)


def load_gigatoken(hf: HFEngine):
    """(gigatoken tokenizer, None) when gigatoken can stand in for hf, else (None, why not)."""
    try:
        import gigatoken
    except ImportError:
        return None, "the gigatoken package is not installed"
    if hf.tok.encode("a").ids != hf.tok.encode("a", add_special_tokens=False).ids:
        return None, "its post-processor adds special tokens, which gigatoken does not"
    try:
        return gigatoken.Tokenizer(hf.path), None
    except Exception as e:  # the Rust loader raises ValueError and friends
        return None, f"gigatoken cannot load it ({str(e).splitlines()[0][:200]})"


def select_engine(
    requested: str, tokenizer_path: str, hf: HFEngine, *, threads: int = 1, reset_rss: int = 0
) -> tuple[GigatokenEngine | None, str | None]:
    """For `requested` (auto|gigatoken|hf): the gigatoken engine to run, or None for hf, and
    why gigatoken was not taken."""
    if requested not in ENGINES:
        raise GptflowError(f"engine '{requested}' is not one of {', '.join(ENGINES)}")
    if requested == "hf":
        return None, None
    tok, reason = load_gigatoken(hf)
    if tok is not None:
        return GigatokenEngine(tokenizer_path, threads=threads, reset_rss=reset_rss, tok=tok), None
    if requested == "gigatoken":
        raise GptflowError(
            f"{tokenizer_path}: --engine gigatoken cannot be used: {reason}; "
            f"use --engine hf or --engine auto"
        )
    log.info("engine auto: using hf, because %s", reason)
    return None, reason


def _cut_is_safe(tok, text: str, pos: int, c: int) -> bool:
    left, right = text[max(pos, c - _CUT_WINDOW) : c], text[c : c + _CUT_WINDOW]
    together = tok.encode(left + right, add_special_tokens=False).ids
    apart = (
        tok.encode(left, add_special_tokens=False).ids
        + tok.encode(right, add_special_tokens=False).ids
    )
    return together == apart


# Cut candidates, most likely safe first: a newline followed by a non-space (a pre-tokenizer
# never joins these), a space preceded by a non-space (cut before it: " word" is one piece),
# then any newline. Indented text (JSON, code) makes plain "after a newline" cuts fail: the
# newline joins the indentation that follows it.
_CUT_PATTERNS = (
    (re.compile(r"\n(?=\S)"), "end"),
    (re.compile(r"(?<=\S) "), "start"),
    (re.compile(r"\n"), "end"),
)
_CUT_TRIES = 64  # failed candidates of one kind before the next kind is tried


def _candidates(text: str, lo: int, hi: int):
    """Cut positions in [lo, hi), by kind (see _CUT_PATTERNS), at most _CUT_TRIES of each, then
    after any newline past `hi` (a piece stays near its target even without newlines)."""
    for pattern, side in _CUT_PATTERNS:
        for m in islice(pattern.finditer(text, lo, hi), _CUT_TRIES):
            yield m.end() if side == "end" else m.start()
    i = text.find("\n", hi)
    while i != -1:
        yield i + 1
        i = text.find("\n", i + 1)


def _safe_cuts(tok, text: str, target: int):
    """Cut positions about `target` characters apart where encoding the two sides separately
    gives exactly the tokens of encoding them together."""
    pos = 0
    while len(text) - pos > target:
        cut = next(
            (c for c in _candidates(text, pos + target, pos + 2 * target) if c < len(text)
             and _cut_is_safe(tok, text, pos, c)),
            None,
        )  # fmt: skip
        if cut is None:
            return
        pos = cut
        yield pos


def encode_long(
    tok, text: str, origin: str = "document", piece_chars: int = LONG_DOCUMENT_CHARS
) -> np.ndarray:
    """Token ids (uint32) of one long document with hf, encoded in pieces cut where the tokenizer
    provably does not merge across the cut: the ids of one ``encode`` without its memory
    (one ``encode`` of a 100 MB document takes ~12 GB)."""
    probe = "a"
    if tok.encode(probe).ids != tok.encode(probe, add_special_tokens=False).ids:
        raise GptflowError(
            f"{origin}: a {len(text) / 1e6:.0f} MB document and a tokenizer whose post-processor "
            f"adds tokens cannot be encoded piecewise; split the document"
        )
    pieces: list[np.ndarray] = []
    start = 0
    for cut in [*_safe_cuts(tok, text, piece_chars), len(text)]:
        ids = tok.encode(text[start:cut], add_special_tokens=False).ids
        pieces.append(np.array(ids, np.uint32))  # 4 bytes a token, not a Python int's ~36
        start = cut
    return np.concatenate(pieces)
