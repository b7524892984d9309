"""Existing Megatron / GPT-NeoX shards, checked and imported as gptflow shards without a copy.

A team that ran Megatron-LM's or GPT-NeoX's ``tools/preprocess_data.py`` has ``PREFIX.bin`` +
``PREFIX.idx`` pairs (the layout: :mod:`gptflow.data.indexed`). A ``megatron`` dataset imports
each pair as ``results/tokens/{tokenizer}/{dataset}/{name}.bin|.idx`` -- symlinks to the
user's files -- beside the ``.json`` manifest a tokenized shard has, so the run config, the
data index, training, evaluation and the report read it as any other shard.

The files record no tokenizer, so :func:`import_shard` checks them against the run's, from the
data, and refuses with the file, what is wrong and the fix named:

1. **Structure.** What :class:`~gptflow.data.indexed.IndexedDataset` checks (magic, version,
   dtype code, the ``.idx`` and ``.bin`` sizes the header implies), and then every entry: no
   negative length, ``pointer[0] = 0`` and ``pointer[i+1] = pointer[i] + length[i] x itemsize``,
   the document index non-decreasing from 0 to the sequence count, no multimodal sequence modes.
2. **Dtype.** It must hold every id of the run's tokenizer. gptflow's rule
   (:func:`~gptflow.data.indexed.dtype_for_vocab`, Megatron's ``optimal_dtype``) writes uint16
   below 65,500 ids, else int32. A wider dtype than the rule's (int32 for a 50k vocabulary, as
   GPT-NeoX writes when not told the vocabulary size) is accepted and recorded; a narrower one
   was made for a smaller vocabulary, i.e. another tokenizer.
3. **Vocabulary.** Every token of the ``.bin`` is scanned, memory-mapped, a chunk at a time,
   vectorised: each id must be in ``[0, vocab_size)``. The ``.bin``'s sha256 is computed in the
   same pass on a second thread (hashlib releases the GIL), so the bytes are read once; that
   sha256 is the shard's identity in the run's fingerprint, as for a tokenized shard (a hash
   of the .idx and a sample would make two different .bin files the same run). The hash sets
   the pace: ``bench/import_megatron.py`` on a 2 GB shard, on this shared 2-core machine under
   load, 908 MB/s from the page cache and 604 MB/s after evicting the file, against 888 MB/s
   for sha256 alone (1.7 GB/s on an idle core with SHA-NI) and 18.7 GB/s for numpy's max --
   once per shard, its jobs in parallel.
4. **Tokenizer identity.** Up to :data:`ROUND_TRIP_SEQUENCES` sequences spread evenly over the
   shard are decoded with the run's tokenizer (special tokens kept) and encoded again; each
   must give back exactly its ids. A sequence is one ``encode`` of a document (or of a sentence,
   with Megatron's ``--split-sentences``) plus EOD, so it is split at EOD ids (packed
   sequences too) and stripped of the tokens the tokenizer's post-processor adds (a BOS)
   before the comparison. Decoding a byte-level BPE gives the encoded text's bytes back and
   encoding is deterministic (a normalizer such as NFC is idempotent), so a sequence made by
   this tokenizer always comes back; one that does not was made by another tokenizer, or is
   not a whole encode. No mismatch is tolerated.
5. **EOD.** Whether every non-empty document ends with the tokenizer's EOD id (Megatron's
   ``--append-eod``) is counted and recorded as the manifest's ``append_eod``; not required.

Not checked: what the text is, and anything a valid encode of this tokenizer can hide
(documents reordered, truncated at a token boundary or duplicated); sequences outside the
sample are covered by the vocabulary scan only. The user's files must stay where they are:
the imported shard is a pair of symlinks (training checks the ``.idx`` sha256 at start).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gptflow import paths
from gptflow.data.engines import LONG_DOCUMENT_CHARS, encode_long
from gptflow.data.indexed import (
    HEADER_SIZE,
    IndexedDataset,
    bin_path,
    dtype_for_vocab,
    idx_path,
)
from gptflow.data.tokenizer import TokenizerInfo, load_tokenizer, tokenizer_info
from gptflow.errors import GptflowError
from gptflow.fsutil import publish_symlink, sha256_file, write_json
from gptflow.progress import per_second

log = logging.getLogger(__name__)

ROUND_TRIP_SEQUENCES = 64  # sequences sampled, evenly spread, for the tokenizer check
ROUND_TRIP_SEQUENCE_TOKENS = 1 << 16  # longer sequences are passed over (memory of an encode)
ROUND_TRIP_TOKENS = 1 << 20  # tokens decoded and encoded again, at most, per shard
SCAN_CHUNK_BYTES = 64 << 20  # .bin bytes per step of the vocabulary scan
INDEX_CHUNK = 1 << 24  # .idx entries per step of the structure checks


FIX_SHARD = (
    "re-create it with Megatron's tools/preprocess_data.py, or remove it from the dataset's "
    "prefixes"
)
DTYPE_RULE = "uint16 below 65,500 ids, else int32: Megatron's rule"


def _fix_tokenizer(info: TokenizerInfo) -> str:
    return (
        f"re-create the shard with {info.path} (Megatron: tools/preprocess_data.py "
        f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model <its directory> --append-eod), "
        f"or set the config's tokenizer to the one the shard was made with"
    )


def open_shard(prefix: str | os.PathLike) -> IndexedDataset:
    """The shard read with gptflow's reader and its structure checked, entry by entry."""
    try:
        ds = IndexedDataset(prefix)
    except GptflowError as e:
        raise GptflowError(f"{e} (megatron shard {prefix}: {FIX_SHARD})") from None
    check_structure(ds)
    return ds


def check_structure(ds: IndexedDataset) -> None:
    """What the reader leaves to its users: every length, pointer and document boundary."""
    ipath, n = idx_path(ds.prefix), len(ds)
    where = f"{ipath} (megatron shard {ds.prefix})"
    size = ipath.stat().st_size
    if n and size != HEADER_SIZE + 12 * n + 8 * len(ds.document_indices):
        raise GptflowError(
            f"{where}: has multimodal sequence modes, and gptflow trains on text shards only; "
            f"{FIX_SHARD}"
        )
    itemsize = ds.dtype.itemsize
    lengths, pointers, docs = ds.sequence_lengths, ds.sequence_pointers, ds.document_indices
    if n and pointers[0] != 0:
        raise GptflowError(
            f"{where}: sequence 0 starts at byte {int(pointers[0])} of the .bin, not 0 "
            f"(corrupt index); {FIX_SHARD}"
        )
    for start in range(0, n, INDEX_CHUNK):
        stop = min(n, start + INDEX_CHUNK + 1)  # one past: the next chunk's first pointer
        length = lengths[start:stop].astype(np.int64)
        bad = np.flatnonzero(length < 0)
        if len(bad):
            i = start + int(bad[0])
            raise GptflowError(
                f"{where}: sequence {i} has length {int(lengths[i])} (corrupt index); {FIX_SHARD}"
            )
        step = np.diff(pointers[start:stop]) != length[:-1] * itemsize
        bad = np.flatnonzero(step)
        if len(bad):
            i = start + int(bad[0])
            raise GptflowError(
                f"{where}: sequence {i + 1} starts at byte {int(pointers[i + 1])}, but sequence "
                f"{i} starts at {int(pointers[i])} with {int(lengths[i])} tokens of "
                f"{itemsize} bytes (corrupt index); {FIX_SHARD}"
            )
    d = len(docs)
    for start in range(0, d, INDEX_CHUNK):
        bad = np.flatnonzero(np.diff(docs[start : start + INDEX_CHUNK + 1]) < 0)
        if len(bad):
            j = start + int(bad[0])
            raise GptflowError(
                f"{where}: the document index goes back from {int(docs[j])} to "
                f"{int(docs[j + 1])} at document {j} (corrupt index); {FIX_SHARD}"
            )


def check_dtype(ds: IndexedDataset, info: TokenizerInfo) -> str | None:
    """None when the shard has gptflow's dtype for the vocabulary, a note when it has a wider
    one; an error when its dtype cannot hold every id of the tokenizer."""
    rule = dtype_for_vocab(info.vocab_size)
    if ds.dtype == rule:
        return None
    why = f"gptflow writes {rule.name} for {info.vocab_size:,} ids ({DTYPE_RULE})"
    top = np.iinfo(ds.dtype).max
    if top < info.vocab_size - 1:
        raise GptflowError(
            f"{idx_path(ds.prefix)} (megatron shard {ds.prefix}): token dtype {ds.dtype.name} "
            f"holds ids up to {top:,}, but tokenizer {info.path} has {info.vocab_size:,} ids; "
            f"{why}. The shard was made for a smaller vocabulary, i.e. with another tokenizer: "
            f"{_fix_tokenizer(info)}"
        )
    return f"{ds.dtype.name}, wider than needed: {why}; it holds every id, read as is"


def _locate(ds: IndexedDataset, token: int) -> tuple[int, int, int]:
    """(sequence, offset in it, document) of the `token`-th token of the .bin."""
    starts = ds.sequence_pointers // ds.dtype.itemsize
    seq = int(np.searchsorted(starts, token, side="right")) - 1
    doc = int(np.searchsorted(ds.document_indices, seq, side="right")) - 1
    return seq, token - int(starts[seq]), doc


def _refuse_id(ds: IndexedDataset, info: TokenizerInfo, token: int, value: int) -> None:
    seq, offset, doc = _locate(ds, token)
    raise GptflowError(
        f"{bin_path(ds.prefix)} (megatron shard {ds.prefix}): token id {value} (token {offset} "
        f"of sequence {seq}, document {doc}) is not in the vocabulary of tokenizer {info.path} "
        f"(ids 0..{info.vocab_size - 1}); the shard was made with another tokenizer, or is "
        f"corrupt: {_fix_tokenizer(info)}"
    )


def document_ends(ds: IndexedDataset) -> np.ndarray:
    """Position in the .bin (in tokens) of the last token of every non-empty document."""
    docs = ds.document_indices
    last = docs[1:][docs[1:] > docs[:-1]] - 1  # last sequence of each document with one
    last = last[ds.sequence_lengths[last] > 0]
    return ds.sequence_pointers[last] // ds.dtype.itemsize + ds.sequence_lengths[last] - 1


def scan_tokens(
    ds: IndexedDataset, info: TokenizerInfo, chunk_bytes: int = SCAN_CHUNK_BYTES
) -> dict:
    """Every token id checked against the vocabulary; the .bin's sha256, the EOD tokens and
    the documents ending with EOD counted, in one memory-mapped pass."""
    t0 = time.perf_counter()
    path = bin_path(ds.prefix)
    size = path.stat().st_size
    data = np.memmap(path, mode="r", dtype=ds.dtype) if size else np.zeros(0, ds.dtype)
    ends = document_ends(ds)
    sha = hashlib.sha256()
    signed = np.issubdtype(ds.dtype, np.signedinteger)
    step = max(1, chunk_bytes // ds.dtype.itemsize)
    top, eod_tokens, eod_ends = -1, 0, 0
    with ThreadPoolExecutor(1) as hasher:
        for start in range(0, len(data), step):
            chunk = data[start : start + step]
            hashed = hasher.submit(sha.update, chunk)
            try:
                high = int(chunk.max())
                if high >= info.vocab_size or (signed and int(chunk.min()) < 0):
                    bad = int(np.flatnonzero((chunk >= info.vocab_size) | (chunk < 0))[0])
                    _refuse_id(ds, info, start + bad, int(chunk[bad]))
                top = max(top, high)
                eod_tokens += int(np.count_nonzero(chunk == info.eod_id))
                lo, hi = np.searchsorted(ends, [start, start + len(chunk)])
                eod_ends += int(np.count_nonzero(chunk[ends[lo:hi] - start] == info.eod_id))
            finally:
                hashed.result()
    seconds = time.perf_counter() - t0
    return {
        "bin_sha256": sha.hexdigest(),
        "max_token_id": top if len(data) else None,
        "eod_tokens": eod_tokens,
        "nonempty_documents": len(ends),
        "documents_ending_with_eod": eod_ends,
        "bytes": size,
        "seconds": round(seconds, 3),
        "mb_per_s": per_second(size / 1e6, seconds, 1),
    }


def sample_sequences(lengths: np.ndarray) -> list[int]:
    """Sequences for the round trip: evenly spread, each at most ROUND_TRIP_SEQUENCE_TOKENS,
    ROUND_TRIP_TOKENS in all; the shortest non-empty one when every one is longer."""
    n = len(lengths)
    if not n:
        return []
    picked, budget = [], ROUND_TRIP_TOKENS
    spread = np.unique(np.linspace(0, n - 1, min(n, ROUND_TRIP_SEQUENCES)).round().astype(int))
    for i in spread.tolist():
        if 0 < lengths[i] <= min(ROUND_TRIP_SEQUENCE_TOKENS, budget):
            picked.append(i)
            budget -= int(lengths[i])
    nonempty = np.flatnonzero(lengths > 0)
    if not picked and len(nonempty):
        picked.append(int(nonempty[np.argmin(lengths[nonempty])]))
    return picked


def _added_tokens(tok) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text's own (a BOS)."""
    probe = "a"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe).ids
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return [], []


def _pieces(ids: list[int], eod_id: int) -> list[list[int]]:
    """A sequence split at its EOD ids: what was encoded at once (one document, or each
    document of a packed sequence)."""
    pieces, current = [], []
    for t in ids:
        if t == eod_id:
            pieces.append(current)
            current = []
        else:
            current.append(t)
    pieces.append(current)
    return [p for p in pieces if p]


def _encode(tok, text: str) -> list[int]:
    if len(text) > LONG_DOCUMENT_CHARS:  # one encode of a long text needs ~100x its memory
        return encode_long(tok, text).tolist()
    return tok.encode(text, add_special_tokens=False).ids


def check_round_trip(ds: IndexedDataset, tok, info: TokenizerInfo) -> dict:
    """Sampled sequences decoded with the run's tokenizer and encoded again: the same ids, or
    an error naming the first sequence that differs, where, and how."""
    before, after = _added_tokens(tok)
    sequences = pieces = tokens = 0
    mismatched: list[tuple[int, list[int], list[int], str]] = []
    for i in sample_sequences(ds.sequence_lengths):
        sequences += 1
        ids = ds[i]
        bad = np.flatnonzero((ids >= info.vocab_size) | (ids < 0))
        if len(bad):  # the scan's error, not a failed decode
            start = int(ds.sequence_pointers[i]) // ds.dtype.itemsize
            _refuse_id(ds, info, start + int(bad[0]), int(ids[bad[0]]))
        for piece in _pieces(ids.tolist(), info.eod_id):
            if before and piece[: len(before)] == before:
                piece = piece[len(before) :]
            if after and piece[-len(after) :] == after:
                piece = piece[: -len(after)]
            if not piece:
                continue
            text = tok.decode(piece, skip_special_tokens=False)
            again = _encode(tok, text)
            pieces += 1
            tokens += len(piece)
            if again != piece:
                mismatched.append((i, piece, again, text))
    if mismatched:
        i, ids, again, text = mismatched[0]
        k = next(
            (j for j, (a, b) in enumerate(zip(ids, again, strict=False)) if a != b),
            min(len(ids), len(again)),
        )
        raise GptflowError(
            f"{bin_path(ds.prefix)} (megatron shard {ds.prefix}) was not made with tokenizer "
            f"{info.path}: {len(mismatched)} of {pieces} sampled documents do not encode back "
            f"to their ids (sequence {i}, from token {k}: ids {ids[k : k + 6]} decode to "
            f"{text[:80]!r}..., which encodes to {again[k : k + 6]}); {_fix_tokenizer(info)}"
        )
    return {"sequences": sequences, "documents": pieces, "tokens": tokens, "mismatches": 0}


def import_shard(
    prefix: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    eod_token: str = "<|endoftext|>",
) -> dict:
    """Check the shard `prefix` against the tokenizer, then publish ``output_prefix.bin|.idx``
    as symlinks to its files and ``output_prefix.json``, the manifest (returned)."""
    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer_path)
    info = tokenizer_info(tokenizer_path, eod_token, tok=tok)
    ds = open_shard(prefix)
    dtype_note = check_dtype(ds, info)
    round_trip = check_round_trip(ds, tok, info)  # before the scan: a wrong tokenizer fails fast
    scan = scan_tokens(ds, info)
    log.info(
        "%s: %d sequences round-trip; every id below %d; %.1f MB scanned at %s MB/s",
        prefix, round_trip["sequences"], info.vocab_size, scan["bytes"] / 1e6, scan["mb_per_s"],
    )  # fmt: skip
    source = Path(os.path.abspath(prefix))
    sources = [
        {"path": str(idx_path(source)), "bytes": idx_path(source).stat().st_size,
         "sha256": sha256_file(idx_path(source))},
        {"path": str(bin_path(source)), "bytes": scan["bytes"], "sha256": scan["bin_sha256"]},
    ]  # fmt: skip
    out = Path(output_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    publish_symlink(bin_path(source), bin_path(out))
    publish_symlink(idx_path(source), idx_path(out))
    nonempty, ending = scan["nonempty_documents"], scan["documents_ending_with_eod"]
    seconds = time.perf_counter() - t0
    manifest = {
        "prefix": str(out),
        "format": "megatron-mmidx-v1",
        "dtype": ds.dtype.name,
        "tokenizer": info.manifest_record(tokenizer_path),
        "append_eod": nonempty > 0 and ending == nonempty,
        "json_key": None,
        "reader": {},
        "on_bad_document": None,
        "sources": sources,
        "document_range": None,
        "documents": ds.num_documents,
        "sequences": len(ds),
        "tokens": ds.num_tokens,
        "empty_documents": ds.num_documents - nonempty,
        "dropped": {},
        "bin_sha256": scan["bin_sha256"],
        "idx_sha256": sources[0]["sha256"],
        "imported": {
            "from": str(source),
            "as": "symlinks",
            "dtype_note": dtype_note,
            "max_token_id": scan["max_token_id"],
            "eod_tokens": scan["eod_tokens"],
            "documents_ending_with_eod": ending,
            "round_trip": round_trip,
            "scan_seconds": scan["seconds"],
            "scan_mb_per_s": scan["mb_per_s"],
        },
        "seconds": round(seconds, 3),
        "mb_per_s": per_second(scan["bytes"] / 1e6, seconds, 3),
    }
    write_json(paths.shard_manifest(str(out)), manifest)  # last
    return manifest
