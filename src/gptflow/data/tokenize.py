"""Documents -> one Megatron ``.bin``/``.idx`` shard + a ``.json`` manifest.

Same token stream as Megatron-LM ``tools/preprocess_data.py --append-eod`` with the same
tokenizer.json: each document is one sequence, EOD appended to every non-empty document, an
empty text kept as an empty document. Inputs are any format :mod:`gptflow.data.readers` reads,
streamed in batches (bounded memory whatever the file size); with ``workers > 1`` batches are
encoded in worker processes and written back in input order. A document longer than
:data:`LONG_DOCUMENT_CHARS` (enwik8 is one 100 MB document) is encoded in pieces cut where the
tokenizer provably does not merge across the cut, so its tokens are those of one ``encode``
without its memory (one ``encode`` of 100 MB takes ~12 GB). The three files appear only when
complete.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gptflow.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from gptflow.data.readers import Batch, batch_texts, iter_batches
from gptflow.data.tokenizer import load_tokenizer, tokenizer_info
from gptflow.errors import GptflowError
from gptflow.fsutil import sha256_file, write_json

log = logging.getLogger(__name__)

ENGINE = "hf"  # Hugging Face `tokenizers`, the reference engine
LONG_DOCUMENT_CHARS = 1 << 20  # longer documents are encoded piecewise
_CUT_WINDOW = 512  # characters each side of a cut that are re-encoded to prove it safe

_worker_state: dict = {}


def _init_worker(tokenizer_path: str, eod: int, append_eod: bool, key: str, dtype: str) -> None:
    _worker_state.update(
        tokenizer=load_tokenizer(tokenizer_path),
        eod=eod,
        append_eod=append_eod,
        key=key,
        dtype=np.dtype(dtype),
    )


def _encode_batch(batch: Batch) -> tuple[list[np.ndarray], Counter, int]:
    """Parse and encode one batch of documents (runs in a worker or in-process)."""
    st = _worker_state
    tok = st["tokenizer"]
    texts, dropped = batch_texts(batch, st["key"])
    short = [t for t in texts if len(t) <= LONG_DOCUMENT_CHARS]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    encoded = iter(encode(short))
    docs = []
    eod, dtype = st["eod"], st["dtype"]
    for text in texts:
        ids = (
            next(encoded).ids
            if len(text) <= LONG_DOCUMENT_CHARS
            else encode_long(tok, text, batch.origin)
        )
        if ids and st["append_eod"]:
            ids.append(eod)
        docs.append(np.array(ids, dtype=dtype))
    size = sum(len(x) for x in batch.items if x is not None)
    return docs, dropped, size


def _safe_cuts(tok, text: str, target: int) -> Iterator[int]:
    """Cut positions about `target` characters apart, after a newline, where encoding the two
    sides separately gives exactly the tokens of encoding them together."""
    pos = 0
    while len(text) - pos > target:
        cut = text.find("\n", pos + target)
        while cut != -1:
            c = cut + 1
            left, right = text[max(pos, c - _CUT_WINDOW) : c], text[c : c + _CUT_WINDOW]
            together = tok.encode(left + right, add_special_tokens=False).ids
            apart = (
                tok.encode(left, add_special_tokens=False).ids
                + tok.encode(right, add_special_tokens=False).ids
            )
            if together == apart:
                break
            cut = text.find("\n", c)
        if cut == -1:
            return
        pos = cut + 1
        yield pos


def encode_long(
    tok, text: str, origin: str = "document", piece_chars: int = LONG_DOCUMENT_CHARS
) -> list[int]:
    """Token ids of one long document, encoded in pieces (see the module docstring)."""
    probe = "a"
    if tok.encode(probe).ids != tok.encode(probe, add_special_tokens=False).ids:
        raise GptflowError(
            f"{origin}: a {len(text) / 1e6:.0f} MB document and a tokenizer whose post-processor "
            f"adds tokens cannot be encoded piecewise; split the document"
        )
    ids: list[int] = []
    start = 0
    for cut in [*_safe_cuts(tok, text, piece_chars), len(text)]:
        ids += tok.encode(text[start:cut], add_special_tokens=False).ids
        start = cut
    return ids


def _tasks(inputs: list[str], reader: dict, batch_bytes: int) -> Iterator[Batch]:
    for path in inputs:
        yield from iter_batches(path, batch_bytes=batch_bytes, **reader)


def tokenize_to_shard(
    inputs: list[str],
    tokenizer_path: str,
    output_prefix: str,
    *,
    json_key: str = "text",
    append_eod: bool = True,
    eod_token: str = "<|endoftext|>",
    workers: int = 1,
    batch_bytes: int = 1 << 20,
    fmt: str | None = None,
    member: str = "*",
    member_format: str | None = None,
) -> dict:
    """Tokenize `inputs` (in order; format from the name unless `fmt`) into
    ``output_prefix.{bin,idx,json}``. Returns the manifest also written to ``output_prefix.json``.
    """
    for p in inputs:
        if not Path(p).is_file():
            raise GptflowError(f"{p}: input file does not exist")
    info = tokenizer_info(tokenizer_path, eod_token)
    dtype = dtype_for_vocab(info.vocab_size)
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    init_args = (tokenizer_path, info.eod_id, append_eod, json_key, dtype.str)
    reader = {"fmt": fmt, "member": member, "member_format": member_format, "json_key": json_key}

    t0 = time.perf_counter()
    dropped: Counter[str] = Counter()
    read_bytes = 0
    last_report = t0
    with IndexedDatasetWriter(prefix, dtype) as writer:
        if workers > 1:
            ctx = multiprocessing.get_context("spawn")
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=init_args)
            results = pool.imap(_encode_batch, _tasks(inputs, reader, batch_bytes), chunksize=1)
        else:
            _init_worker(*init_args)
            pool = None
            results = map(_encode_batch, _tasks(inputs, reader, batch_bytes))
        try:
            for docs, batch_dropped, nbytes in results:
                writer.add_documents(docs)
                dropped.update(batch_dropped)
                read_bytes += nbytes
                now = time.perf_counter()
                if now - last_report > 10:
                    last_report = now
                    log.info(
                        "%s: %d documents, %.1f MB, %.2f MB/s",
                        prefix.name,
                        writer.documents,
                        read_bytes / 1e6,
                        read_bytes / 1e6 / (now - t0),
                    )
        finally:
            if pool is not None:
                pool.terminate()
        writer.finalize()
    seconds = time.perf_counter() - t0

    import tokenizers

    manifest = {
        "prefix": str(prefix),
        "format": "megatron-mmidx-v1",
        "dtype": dtype.name,
        "tokenizer": {
            "path": str(tokenizer_path),
            "sha256": info.sha256,
            "vocab_size": info.vocab_size,
            "eod_token": info.eod_token,
            "eod_id": info.eod_id,
        },
        "append_eod": append_eod,
        "json_key": json_key,
        "reader": {k: v for k, v in reader.items() if v not in (None, "*")},
        "sources": [
            {"path": str(p), "bytes": os.path.getsize(p), "sha256": source_sha256(p)}
            for p in inputs
        ],
        "documents": writer.documents,
        "sequences": writer.sequences,
        "tokens": writer.tokens,
        "empty_documents": writer.documents - writer.sequences,
        "dropped": dict(sorted(dropped.items())),
        "bin_sha256": writer.bin_sha256,
        "idx_sha256": sha256_file(f"{prefix}.idx"),
        "engine": {"name": ENGINE, "tokenizers": tokenizers.__version__, "workers": workers},
        "seconds": round(seconds, 3),
        "mb_per_s": round(read_bytes / 1e6 / seconds, 3) if seconds > 0 else None,
    }
    write_json(f"{prefix}.json", manifest)
    return manifest


def source_sha256(path: str | os.PathLike) -> str:
    """sha256 of an input: from the download's ``.sha256`` sidecar when it is there (written
    only after verification), else computed."""
    sidecar = Path(f"{path}.sha256")
    if sidecar.is_file():
        recorded = sidecar.read_text().split()[0]
        if len(recorded) == 64:
            return recorded
    return sha256_file(path)


def read_manifest(prefix: str | os.PathLike) -> dict:
    import json

    path = Path(f"{prefix}.json")
    if not path.is_file():
        raise GptflowError(f"{path}: shard manifest missing; re-run tokenization for {prefix}")
    with open(path) as f:
        return json.load(f)


def reference_tokens(texts: list[str], tokenizer_path: str, eod_token: str) -> list[list[int]]:
    """The Megatron ``--append-eod`` token stream, one ``encode`` per document (for checks)."""
    tok = load_tokenizer(tokenizer_path)
    eod = tok.token_to_id(eod_token)
    out = []
    for text in texts:
        ids = tok.encode(text).ids
        out.append([*ids, eod] if ids else ids)
    return out
