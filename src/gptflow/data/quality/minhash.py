"""Near-duplicate deduplication by MinHash LSH, in DataTrove's four stages: signatures per
shard, candidate pairs per band, one clustering job, removal per shard
(:mod:`gptflow.data.quality.removal`).

Shingles are word n-grams of the text after DataTrove's ``simplify_text`` (:func:`simplify`:
lowercase, numbers as ``0``, its fixed list of punctuation as space, accents stripped), words split on whitespace (the recipe's
``tokenizer: regex``). Each word is hashed (a polynomial hash of its characters, all words at
once in numpy: :func:`gptflow.data.quality.signals.char_hashes`, then splitmix64; modulo 2**64
such a hash has known colliding strings, Thue-Morse words of 2**11 characters and more, and a
collision only merges two shingles), an n-gram's hash mixes its words' (:func:`shingle_hashes`),
and signature column k is min over the shingles of a_k * shingle + b_k (mod 2**64, a_k odd: a
permutation of the 64-bit values; the shingles are already mixed, and the minimum is decided by
the product's high bits, which depend on all of the shingle's): bands x rows 64-bit values.
A document with fewer than n words
has no signature (all ones, :data:`NO_SIGNATURE`) and is never a duplicate, as in DataTrove.

Files (VERSIONS["minhash"] 3 on): a shard's signatures ``.npy``, band-major: shape (bands,
documents) of records (:func:`record_dtype`: a band's rows values and the document's index in
the shard, 68 bytes at 8 rows), each band's records sorted by their first value, so that a
bucket job reads its band alone, each byte once, one pass's run at a time
(:mod:`gptflow.data.quality.buckets`);
a band's pairs ``.npy`` (pairs, 4) uint32 (ordinal, index, ordinal, index), each pair's first
document the earliest of its bucket. The clustering (:mod:`gptflow.data.quality.clusters`)
streams the pairs through a union-find over the group's documents.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import unicodedata

import numpy as np

from gptflow.data.quality import arrays
from gptflow.data.quality.removal import documents
from gptflow.data.quality.signals import char_hashes
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write

NO_SIGNATURE = np.uint64(0xFFFFFFFFFFFFFFFF)
_CHUNK = 2048  # shingles hashed at once: (2048, bands*rows) uint64 temporaries

# DataTrove 0.10.1's datatrove.utils.text.PUNCTUATION, character for character: the fixed list
# its simplify_text turns into spaces (not every Unicode punctuation or symbol: '©', '€', '‘'
# and '′' stay), and the C0/C1 control characters but tab and newline
PUNCTUATION = (
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    + ("".join(chr(c) for a, b in ((0, 9), (11, 13), (13, 32), (127, 160)) for c in range(a, b)))
)
_PUNCTUATION_TABLE = str.maketrans(PUNCTUATION, " " * len(PUNCTUATION))
# its NUMBERS_PATTERN: `\d` of Python's re is Unicode's Nd, as its \p{Nd} (the regex module's
# Unicode tables may be a version newer: digits of scripts added since are the difference)
_NUMBER = re.compile(r"\d+(?:[.,،٫⎖⎗⎘]\d+)?")


@functools.cache
def _marks() -> dict[int, None]:
    """Every nonspacing mark (category Mn) -> deleted (str.translate: in C, not per character
    in Python)."""
    return dict.fromkeys(
        c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Mn"
    )


def simplify(text: str) -> str:
    """DataTrove's simplify_text with its default TextNormConfig, step for step and in its
    order: lowercase, numbers as ``0``, :data:`PUNCTUATION` as spaces, whitespace runs as one
    space (its ``\\s+``: str.split's whitespace), then NFD with the nonspacing marks (category
    Mn) dropped. As in DataTrove, a mark dropped between two spaces leaves both
    (``'a \u0301 b'`` -> ``'a  b'``); words are split on whitespace, so the shingles do not
    see it."""
    text = " ".join(_NUMBER.sub("0", text.lower()).translate(_PUNCTUATION_TABLE).split())
    if not text.isascii():  # NFD leaves ASCII as it is, and it has no marks
        text = unicodedata.normalize("NFD", text).translate(_marks())
    return text.strip()


def words(text: str, tokenizer: str = "regex") -> list[str]:
    """The words shingles are made of (the recipe's `tokenizer`; only 'regex' today)."""
    if tokenizer != "regex":
        raise ValueError(f"unknown word tokenizer {tokenizer!r}")
    return simplify(text).split()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingle_hashes(text: str, ngram: int, tokenizer: str = "regex") -> np.ndarray:
    """The distinct 64-bit hashes of the word n-grams of `text` (its :func:`words`; none below
    n words). The simplified text is its words joined by one space, so each word is a span
    between spaces and all of them are hashed at once."""
    if tokenizer != "regex":
        raise ValueError(f"unknown word tokenizer {tokenizer!r}")
    simple = simplify(text)
    if "  " in simple:  # a dropped mark between two spaces: one space between words
        simple = " ".join(simple.split())
    if not simple:
        return np.zeros(0, dtype=np.uint64)
    codes = np.frombuffer(simple.encode("utf-32-le"), np.uint32)
    spaces = np.flatnonzero(codes == 32)
    if len(spaces) + 1 < ngram:
        return np.zeros(0, dtype=np.uint64)
    starts = np.concatenate([[0], spaces + 1])
    ends = np.concatenate([spaces, [len(codes)]])
    prefix, unscale = char_hashes(simple)
    with np.errstate(over="ignore"):
        word_hash = (prefix[ends] - prefix[starts]) * unscale[starts]
    word_hash = _mix(word_hash ^ (ends - starts).astype(np.uint64))
    count = len(starts) - ngram + 1
    h = word_hash[:count].copy()
    for j in range(1, ngram):
        h = _mix(h) ^ word_hash[j : j + count]
    return np.unique(_mix(h))


def seeds(seed: int, hashes: int) -> np.ndarray:
    """(2, hashes) uint64: the multipliers a_k (odd) and the addends b_k."""
    values = np.random.default_rng(seed).integers(0, 2**64 - 1, (2, hashes), dtype=np.uint64)
    values[0] |= np.uint64(1)
    return values


def signature(shingles: np.ndarray, seed_values: np.ndarray) -> np.ndarray:
    """Column k: min over the shingles of a_k * shingle + b_k (mod 2**64)."""
    a, b = seed_values
    out = np.full(len(a), NO_SIGNATURE, dtype=np.uint64)
    for start in range(0, len(shingles), _CHUNK):
        block = shingles[start : start + _CHUNK, None] * a[None, :]
        block += b[None, :]
        np.minimum(out, block.min(axis=0), out=out)
    return out


def text_signature(text: str, settings: dict) -> np.ndarray:
    """A document's signature under a minhash step's settings (ngram, bands, rows, seed,
    tokenizer)."""
    s = settings
    shingles = shingle_hashes(text, s["ngram"], s["tokenizer"])
    return signature(shingles, seeds(s["seed"], s["bands"] * s["rows"]))


def record_dtype(rows: int) -> np.dtype:
    """One document's record in one band of a signature file: the band's `rows` values and
    the document's index in its shard, packed (DataTrove's ``<8Q I``: 68 bytes at 8 rows)."""
    return np.dtype([("values", "<u8", (rows,)), ("index", "<u4")])


def pass_of(first: np.ndarray | np.uint64, passes: int) -> np.ndarray | np.uint64:
    """The bucket pass (of `passes`) a band's records go to, by the top 32 bits of its first
    value: non-decreasing in it, so a band sorted by its first value holds each pass's records
    in one run, and a bucket (equal values) in one pass."""
    return ((np.uint64(first) >> np.uint64(32)) * np.uint64(passes)) >> np.uint64(32)


def signatures_of_shard(
    path: str | os.PathLike, reader: dict, settings: dict, out: str | os.PathLike
) -> int:
    """Write the signatures of a shard's documents, band-major (the module's docstring);
    returns the document count. Held: the signatures (8 * bands * rows bytes a document) and
    one band's records at a time."""
    bands, rows = settings["bands"], settings["rows"]
    seed_values = seeds(settings["seed"], bands * rows)
    ngram, tokenizer = settings["ngram"], settings["tokenizer"]
    chunks, chunk = [], []
    for text in documents(path, reader):
        chunk.append(signature(shingle_hashes(text, ngram, tokenizer), seed_values))
        if len(chunk) == 4096:  # a list of small arrays costs ~100 bytes each beside them
            chunks.append(np.stack(chunk))
            chunk = []
    if chunk:
        chunks.append(np.stack(chunk))
    return write_signatures(out, chunks, bands, rows)


def write_signatures(out: str | os.PathLike, chunks: list, bands: int, rows: int) -> int:
    """Write a shard's signatures (`chunks`: (k, bands * rows) uint64 arrays, in document
    order) band-major: (bands, documents) records (:func:`record_dtype`), each band's sorted
    by its first value, ties by index. Returns the document count."""
    n = sum(len(c) for c in chunks)
    record = record_dtype(rows)
    with atomic_write(out, "wb") as f:
        f.write(arrays.npy_header_bytes(record, (bands, n)))
        for band in range(bands):
            part = [c[:, band * rows : (band + 1) * rows] for c in chunks]
            part = np.concatenate(part) if part else np.zeros((0, rows), np.uint64)
            order = np.argsort(part[:, 0], kind="stable")  # ties: by index
            records = np.empty(n, dtype=record)
            records["values"], records["index"] = part[order], order
            f.write(records.data)
    return n


def signature_header(path: str | os.PathLike, rows: int) -> arrays.Npy:
    """A signature file's header, checked against the step's `rows` (a file of another
    layout -- an older version's row-major signatures -- is refused in one line)."""
    header = arrays.npy_header(path, "MinHash signature")
    if header.dtype != record_dtype(rows) or len(header.shape) != 2:
        raise GptflowError(
            f"{path}: not band-major MinHash signatures of {rows} rows a band (dtype "
            f"{header.dtype}, shape {header.shape}); delete it so that minhash_signatures "
            f"writes it again"
        )
    return header


def shard_documents(signature_files: list) -> list[int]:
    """The document count of each shard, from its signature file's header alone."""
    return [arrays.npy_header(p, "MinHash signature").shape[1] for p in signature_files]
