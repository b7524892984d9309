"""JSONL documents -> one Megatron ``.bin``/``.idx`` shard + a ``.json`` manifest.

Same token stream as Megatron-LM ``tools/preprocess_data.py --append-eod`` with the same
tokenizer.json: each JSON line is one document and one sequence, EOD appended to every
non-empty document, an empty text kept as an empty document. Input is streamed in batches
(bounded memory whatever the file size); with ``workers > 1`` batches are encoded in worker
processes and written back in input order. The three files appear only when complete.
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
from gptflow.data.readers import iter_jsonl_batches, parse_jsonl_batch
from gptflow.data.tokenizer import load_tokenizer, tokenizer_info
from gptflow.errors import GptflowError
from gptflow.fsutil import sha256_file, write_json

log = logging.getLogger(__name__)

ENGINE = "hf"  # Hugging Face `tokenizers`, the reference engine

_worker_state: dict = {}


def _init_worker(tokenizer_path: str, eod: int, append_eod: bool, key: str, dtype: str) -> None:
    _worker_state.update(
        tokenizer=load_tokenizer(tokenizer_path),
        eod=eod,
        append_eod=append_eod,
        key=key,
        dtype=np.dtype(dtype),
    )


def _encode_batch(task: tuple[str, int, list[bytes]]) -> tuple[list[np.ndarray], Counter, int]:
    """Parse and encode one batch of JSONL lines (runs in a worker or in-process)."""
    path, first, lines = task
    st = _worker_state
    texts, dropped = parse_jsonl_batch(path, first, lines, st["key"])
    encode = getattr(st["tokenizer"], "encode_batch_fast", st["tokenizer"].encode_batch)
    docs = []
    eod, dtype = st["eod"], st["dtype"]
    for enc in encode(texts):
        ids = enc.ids
        if ids and st["append_eod"]:
            ids.append(eod)
        docs.append(np.array(ids, dtype=dtype))
    return docs, dropped, sum(len(line) for line in lines)


def _tasks(inputs: list[str], batch_bytes: int) -> Iterator[tuple[str, int, list[bytes]]]:
    for path in inputs:
        for first, lines in iter_jsonl_batches(path, batch_bytes):
            yield path, first, lines


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
) -> dict:
    """Tokenize `inputs` (JSONL files, in order) into ``output_prefix.{bin,idx,json}``.

    Returns the manifest that is also written to ``output_prefix.json``.
    """
    for p in inputs:
        if not Path(p).is_file():
            raise GptflowError(f"{p}: input file does not exist")
    info = tokenizer_info(tokenizer_path, eod_token)
    dtype = dtype_for_vocab(info.vocab_size)
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    init_args = (tokenizer_path, info.eod_id, append_eod, json_key, dtype.str)

    t0 = time.perf_counter()
    dropped: Counter[str] = Counter()
    read_bytes = 0
    last_report = t0
    with IndexedDatasetWriter(prefix, dtype) as writer:
        if workers > 1:
            ctx = multiprocessing.get_context("spawn")
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=init_args)
            results = pool.imap(_encode_batch, _tasks(inputs, batch_bytes), chunksize=1)
        else:
            _init_worker(*init_args)
            pool = None
            results = map(_encode_batch, _tasks(inputs, batch_bytes))
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
        "sources": [
            {"path": str(p), "bytes": os.path.getsize(p), "sha256": sha256_file(p)} for p in inputs
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
