"""Tokenized shards made: documents -> one Megatron ``.bin``/``.idx`` shard + a ``.json`` manifest
(``gptflow tokenize``); shards merged; documents counted for ranges. The tokenizer itself is
:mod:`gptflow.data.tokenizer`, the shard format :mod:`gptflow.data.indexed`.

Same token stream as Megatron-LM ``tools/preprocess_data.py --append-eod`` with the same
tokenizer.json: each document is one sequence, EOD appended to every non-empty document, an
empty text kept as an empty document. Inputs are any format :mod:`gptflow.data.readers` reads.

The pipeline, in bounded memory whatever the input size:

1. a reader thread reads chunks of whole lines (``batch_bytes``), decompresses and parses them
   (msgspec) -- a document range (``documents=(start, stop)``) is applied here, before any
   encoding;
2. the engine (:mod:`gptflow.data.engines`) encodes each batch: gigatoken on ``workers``
   threads in this process, or hf in ``workers`` processes;
3. EOD is appended and the tokens are streamed to ``PREFIX.bin``; the ``.idx`` is written at
   the end, and the three files appear, by atomic rename, only when complete.

Over 500 lines: the streaming pipeline above (reader thread, engines, sink) with the manifest
it writes, and :func:`count_documents` and :func:`merge_shards`, which read and write the same
manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gptflow import paths
from gptflow.data.engines import (
    LONG_DOCUMENT_CHARS,
    GigatokenEngine,
    HFEngine,
    encode_long,
    peak_rss_bytes,
    select_engine,
)
from gptflow.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from gptflow.data.readers import (
    FORMATS,
    ON_BAD_DOCUMENT,
    batch_texts,
    check_format,
    hashes_while_reading,
    infer_format,
    iter_batches,
)
from gptflow.data.tokenizer import load_tokenizer, tokenizer_info
from gptflow.errors import GptflowError
from gptflow.fsutil import sha256_file, write_json
from gptflow.progress import Progress, per_second

__all__ = [
    "LONG_DOCUMENT_CHARS",
    "count_documents",
    "encode_long",
    "read_counts",
    "read_manifest",
    "tokenize_to_shard",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_RSS_MB = 1024
_CACHE_SHARE = 0.7  # gigatoken caches are dropped when RSS passes this share of the limit


@dataclass
class Parsed:
    """The texts of one batch, after parsing and the document range."""

    origin: str
    texts: list[str]
    nbytes: int
    dropped: Counter = field(default_factory=Counter)


def _parsed(
    inputs: list[str],
    reader: dict,
    batch_bytes: int,
    on_bad: str,
    documents: tuple[int, int | None],
    digests: dict[str, object],
) -> Iterator[Parsed]:
    start, stop = documents
    seen = 0  # documents before the current batch
    for path in inputs:
        batches = iter_batches(path, batch_bytes=batch_bytes, digest=digests.get(path), **reader)
        for batch in batches:
            nbytes = sum(len(x) for x in batch.items if x is not None)
            if (
                start
                and on_bad == "error"
                and batch.kind == "jsonl"
                and seen + batch.lines <= start
            ):
                # before the range: with on_bad 'error' every line is one document (a bad one
                # would have failed the count that chose this range), so nothing is parsed
                seen += batch.lines
                continue
            texts, dropped = batch_texts(batch, reader["json_key"], on_bad)
            first, seen = seen, seen + len(texts)
            if start and seen <= start:
                continue
            if first < start or (stop is not None and seen > stop):
                lo = max(0, start - first)
                hi = len(texts) if stop is None else max(lo, min(len(texts), stop - first))
                texts = texts[lo:hi]
            yield Parsed(batch.origin, texts, nbytes, dropped)
            if stop is not None and seen >= stop:
                return


class _Prefetch:
    """Iterates `items` in a background thread, `depth` ahead, from construction on;
    exceptions are re-raised to the consumer. ``close()`` stops and joins the thread."""

    def __init__(self, items: Iterable, depth: int = 2) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._done = object()
        self._stop = threading.Event()
        self._items = items
        self._thread = threading.Thread(target=self._run, name="gptflow-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._items:
                if self._stop.is_set():
                    return
                self._q.put(item)
        except BaseException as e:  # handed to the consumer
            self._q.put(e)
        self._q.put(self._done)

    def __iter__(self) -> Iterator:
        while (item := self._q.get()) is not self._done:
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a reader waiting on a full queue
            with contextlib.suppress(queue.Empty):
                self._q.get(timeout=0.1)


def with_eod(
    flat: np.ndarray, lengths: np.ndarray, eod: int, dtype: np.dtype | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """EOD appended to every non-empty document of a flat batch, as `dtype` (default: flat's).

    Written in one pass into the output array: per document when documents are long (a copy
    each), else through a mask (per token); ``np.insert`` plus a cast took 2-5x as long.
    """
    dtype = np.dtype(dtype or flat.dtype)
    nonempty = lengths > 0
    count = int(nonempty.sum())
    out = np.empty(len(flat) + count, dtype)
    ends = np.cumsum(lengths)
    if count * 256 < len(flat):
        o = 0
        starts = (ends - lengths)[nonempty].tolist()
        for start, end in zip(starts, ends[nonempty].tolist(), strict=True):
            n = end - start
            out[o : o + n] = flat[start:end]
            out[o + n] = eod
            o += n + 1
    else:
        eods = ends[nonempty] + np.arange(count)
        keep = np.ones(len(out), bool)
        keep[eods] = False
        out[keep] = flat
        out[eods] = eod
    return out, lengths + nonempty


class _Sink:
    """Runs `consume(item)` in a background thread, in order; errors surface in put/close."""

    def __init__(self, consume, depth: int = 2) -> None:
        self._consume = consume
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gptflow-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if self._error is None:
                try:
                    self._consume(item)
                except BaseException as e:  # re-raised in the producer
                    self._error = e

    def put(self, item) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(item)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


_hf_worker: dict = {}


def _init_hf_worker(tokenizer_path: str) -> None:
    _hf_worker["engine"] = HFEngine(tokenizer_path)


def _hf_encode(p: Parsed) -> tuple[np.ndarray, np.ndarray, Parsed]:
    flat, lengths = _hf_worker["engine"].encode(p.texts, p.origin)
    return flat, lengths, Parsed(p.origin, [], p.nbytes, p.dropped)


def _input_of(origin: str) -> str:
    return origin.split("!", 1)[0]


HF_BATCH_CHARS = 1 << 18  # hf encodes this much text at once: it takes ~130-250 B per char


def _regrouped(parsed: Iterable[Parsed], max_chars: int) -> Iterator[Parsed]:
    """Batches split into groups of about `max_chars` characters (a longer document alone);
    the first group of a batch carries its byte count and drops."""
    for p in parsed:
        group: list[str] = []
        chars = 0
        first = True
        for text in p.texts:
            if group and chars + len(text) > max_chars:
                yield Parsed(
                    p.origin, group, p.nbytes if first else 0, p.dropped if first else Counter()
                )
                group, chars, first = [], 0, False
            group.append(text)
            chars += len(text)
        if group or first:
            yield Parsed(
                p.origin, group, p.nbytes if first else 0, p.dropped if first else Counter()
            )


def _encoded(
    parsed: Iterator[Parsed], hf: HFEngine, gt: GigatokenEngine | None, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray, Parsed]]:
    """(tokens, lengths, batch) for every parsed batch, in order."""
    if gt is not None:
        for p in parsed:
            flat, lengths = gt.encode(p.texts, p.origin)
            yield flat, lengths, p
            gt.bound_memory()
        return
    parsed = _regrouped(parsed, HF_BATCH_CHARS)
    if workers > 1:
        tokenizer_path = hf.path
        pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_hf_worker, initargs=(tokenizer_path,)
        )
        try:
            # a bounded window of batches in flight: Pool.imap would read the whole input
            # ahead into its task queue
            pending: deque = deque()
            for p in parsed:
                pending.append(pool.apply_async(_hf_encode, (p,)))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
        finally:
            pool.terminate()
    else:
        for p in parsed:
            flat, lengths = hf.encode(p.texts, p.origin)
            yield flat, lengths, p


def tokenize_to_shard(
    inputs: list[str],
    tokenizer_path: str,
    output_prefix: str,
    *,
    json_key: str = "text",
    append_eod: bool = True,
    eod_token: str = "<|endoftext|>",
    workers: int = 1,
    engine: str = "auto",
    on_bad_document: str = "error",
    documents: tuple[int, int | None] = (0, None),
    max_rss_mb: int = DEFAULT_MAX_RSS_MB,
    batch_bytes: int | None = None,
    fmt: str | None = None,
    member: str = "*",
    member_format: str | None = None,
    source_sha256s: dict[str, str] | None = None,
) -> dict:
    """Tokenize `inputs` (in order; format from the name unless `fmt`) into
    ``output_prefix.{bin,idx,json}``. Returns the manifest also written to ``output_prefix.json``.

    `source_sha256s` gives inputs' sha256 already known (from :func:`count_documents`), so a
    job that tokenizes one range of a large file does not hash all of it again.
    """
    t0 = time.perf_counter()
    _check_arguments(inputs, on_bad_document, documents)
    known_sha256 = dict(source_sha256s or {})
    # hf batches are regrouped to HF_BATCH_CHARS of text for encoding (see _encoded)
    batch_bytes = batch_bytes or (1 << 20 if engine == "hf" else 16 << 20)
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    reader = {"fmt": fmt, "member": member, "member_format": member_format, "json_key": json_key}
    digests = _hashed_while_reading(inputs, fmt, documents, known_sha256)
    # reading and parsing start now, on the reader thread, while the tokenizers load
    parsed = _Prefetch(_parsed(inputs, reader, batch_bytes, on_bad_document, documents, digests))
    with contextlib.closing(parsed):
        hf = HFEngine(tokenizer_path)  # the reference, also for vocabulary size and EOD
        info = tokenizer_info(tokenizer_path, eod_token, tok=hf.tok)
        gt, auto_reason = select_engine(
            engine,
            tokenizer_path,
            hf,
            threads=workers,
            reset_rss=int(max_rss_mb * 1e6 * _CACHE_SHARE),
        )
        progress = Progress(prefix.name, log.info, **_progress_totals(inputs, fmt, documents))
        writer, dropped = _write_shard(
            prefix, _encoded(parsed, hf, gt, workers), hf, gt, info, append_eod, progress
        )
        progress.finish()
    seconds = time.perf_counter() - t0
    manifest = {
        "prefix": str(prefix),
        "format": "megatron-mmidx-v1",
        "dtype": writer.dtype.name,
        "tokenizer": info.manifest_record(tokenizer_path),
        "append_eod": append_eod,
        "json_key": json_key,
        "reader": {k: v for k, v in reader.items() if v not in (None, "*")},
        "on_bad_document": on_bad_document,
        "sources": _sources(inputs, digests, known_sha256),
        "document_range": None if documents == (0, None) else list(documents),
        "documents": writer.documents,
        "sequences": writer.sequences,
        "tokens": writer.tokens,
        "empty_documents": writer.documents - writer.sequences,
        "dropped": dict(sorted(dropped.items())),
        "bin_sha256": writer.bin_sha256,
        "idx_sha256": sha256_file(f"{prefix}.idx"),
        "engine": _engine_record(hf, gt, auto_reason, workers),
        **_speed(seconds, progress.nbytes, writer.documents),
    }
    write_json(paths.shard_manifest(str(prefix)), manifest)  # last
    return manifest


def _speed(seconds: float, nbytes: int, documents: int) -> dict:
    """A shard manifest's last fields: how long the job took, how fast it read, and its peak
    resident memory (this process; hf workers not included)."""
    return {
        "seconds": round(seconds, 3),
        "mb_per_s": per_second(nbytes / 1e6, seconds, 3),
        "documents_per_s": per_second(documents, seconds, 1),
        "peak_rss_mb": round(peak_rss_bytes() / 1e6, 1),
    }


def _check_arguments(inputs: list[str], on_bad_document: str, documents: tuple) -> None:
    for p in inputs:
        if not Path(p).is_file():
            raise GptflowError(f"{p}: input file does not exist")
    if on_bad_document not in ON_BAD_DOCUMENT:
        raise GptflowError(
            f"on_bad_document '{on_bad_document}' is not one of {', '.join(ON_BAD_DOCUMENT)}"
        )
    start, stop = documents
    if start < 0 or (stop is not None and stop < start):
        raise GptflowError(f"document range {start}:{stop} is empty or negative")


def _hashed_while_reading(
    inputs: list[str], fmt: str | None, documents: tuple, known_sha256: dict[str, str]
) -> dict:
    """{input: sha256 object} of the sources hashed as they are read: all of an input read
    whole, unless its hash is known already (a verified download recorded it, or a count)."""
    return {
        p: hashlib.sha256()
        for p in inputs
        if documents == (0, None)
        and p not in known_sha256
        and recorded_sha256(p) is None
        and hashes_while_reading(check_format(fmt or infer_format(p), p))
    }


def _write_shard(prefix: Path, encoded, hf, gt, info, append_eod: bool, progress: Progress):
    """Write the encoded batches (EOD appended) to ``prefix.bin/.idx``, checking gigatoken
    against hf on the first documents of each input; returns the finalized writer and the
    documents dropped, by reason."""
    dtype = dtype_for_vocab(info.vocab_size)
    dropped: Counter[str] = Counter()
    with IndexedDatasetWriter(prefix, dtype) as writer:
        checked: set[str] = set()

        def write(item: tuple[np.ndarray, np.ndarray, Parsed]) -> None:
            flat, lengths, p = item
            if gt is not None and p.texts and _input_of(p.origin) not in checked:
                # on this thread, while the next batch encodes (tokenizers frees the GIL)
                checked.add(_input_of(p.origin))
                gt.check_parity(hf, p.texts, flat, lengths, p.origin)
            if append_eod:
                flat, lengths = with_eod(flat, lengths, info.eod_id, dtype)
            writer.add_flat(flat, lengths)
            dropped.update(p.dropped)
            progress.update(p.nbytes, len(lengths))

        sink = _Sink(write)
        try:
            for item in encoded:
                sink.put(item)
        finally:
            sink.close()
        writer.finalize()
    return writer, dropped


def _engine_record(hf, gt, auto_reason: str | None, workers: int) -> dict:
    """The manifest's record of the engine that encoded the shard (key "engine")."""
    if gt is not None:
        return {"name": "gigatoken", "workers": workers, "version": gt.version,
                "parity_documents": gt.parity_documents, "cache_resets": gt.cache_resets}  # fmt: skip
    record = {"name": "hf", "workers": workers, "version": hf.version}
    if auto_reason:
        record["auto"] = f"hf, because {auto_reason}"
    return record


def _progress_totals(inputs: list[str], fmt: str | None, documents: tuple[int, int | None]) -> dict:
    """What the progress lines count against (:class:`gptflow.progress.Progress` keywords):
    the documents of a range with an end; the input bytes when they are read as they are
    (plain JSONL); else why the total is unknown."""
    start, stop = documents
    if documents != (0, None):
        if stop is None:
            return {"unknown": f"documents {start:,} to the end of the input"}
        return {"total_documents": stop - start}
    formats = [check_format(fmt or infer_format(p), p) for p in inputs]
    if all(FORMATS[f] == ("jsonl", None) for f in formats):
        return {"total_bytes": sum(os.path.getsize(p) for p in inputs)}
    other = sorted({f for f in formats if FORMATS[f] != ("jsonl", None)})
    what = ("compressed " if any(FORMATS[f][1] for f in other) else "") + ", ".join(other)
    return {"unknown": f"{what} input: its decoded size is known only once read"}


def _sources(inputs: list[str], digests: dict, known: dict[str, str] | None = None) -> list[dict]:
    """Manifest entries of the inputs: size and sha256 -- hashed while read (`digests`), given
    (`known`, from a count file), recorded by a verified download, or computed."""
    known = known or {}
    return [
        {
            "path": str(p),
            "bytes": os.path.getsize(p),
            "sha256": digests[p].hexdigest() if p in digests else known.get(p) or source_sha256(p),
        }
        for p in inputs
    ]


def count_documents(
    inputs: list[str],
    out: str | os.PathLike,
    *,
    json_key: str = "text",
    on_bad_document: str = "error",
    fmt: str | None = None,
    member: str = "*",
    member_format: str | None = None,
) -> dict:
    """Count the documents of `inputs`, as tokenization will see them, into `out` (JSON).

    Records the sources with their size and sha256 (hashed while counting, so the range jobs
    that follow need not hash them again), the document count and drops by reason. Bad
    documents are handled as tokenization will handle them: an input that would fail
    tokenization fails here, before any range job is scheduled.
    """
    t0 = time.perf_counter()
    for p in inputs:
        if not Path(p).is_file():
            raise GptflowError(f"{p}: input file does not exist")
    reader = {"fmt": fmt, "member": member, "member_format": member_format, "json_key": json_key}
    digests = {
        p: hashlib.sha256()
        for p in inputs
        if recorded_sha256(p) is None
        and hashes_while_reading(check_format(fmt or infer_format(p), p))
    }
    total, nbytes, dropped = 0, 0, Counter()
    progress = Progress(Path(out).name, log.info, **_progress_totals(inputs, fmt, (0, None)))
    batches = _parsed(inputs, reader, 16 << 20, on_bad_document, (0, None), digests)
    for parsed in _Prefetch(batches):
        total += len(parsed.texts)
        nbytes += parsed.nbytes
        dropped.update(parsed.dropped)
        progress.update(parsed.nbytes, len(parsed.texts))
    progress.finish()
    seconds = time.perf_counter() - t0
    summary = {
        "sources": _sources(inputs, digests),
        "reader": {k: v for k, v in reader.items() if v not in (None, "*")},
        "on_bad_document": on_bad_document,
        "documents": total,
        "dropped": dict(sorted(dropped.items())),
        "seconds": round(seconds, 3),
        "mb_per_s": per_second(nbytes / 1e6, seconds, 1),
    }
    write_json(out, summary)
    return summary


def read_counts(path: str | os.PathLike, inputs: list[str]) -> dict[str, str]:
    """The source sha256s of a :func:`count_documents` file, checked against `inputs`."""
    import json

    with open(path) as f:
        sources = {s["path"]: s for s in json.load(f)["sources"]}
    for p in inputs:
        s = sources.get(str(p))
        if s is None or s["bytes"] != os.path.getsize(p):
            raise GptflowError(
                f"{path} counted {', '.join(sources)}, not {p} as it is now; "
                "delete it and rerun so that the documents are counted again"
            )
    return {p: s["sha256"] for p, s in sources.items()}


def recorded_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 a verified download recorded in its ``.sha256`` sidecar, if any."""
    sidecar = Path(f"{path}.sha256")
    if sidecar.is_file():
        recorded = sidecar.read_text().split()
        if recorded and len(recorded[0]) == 64:
            return recorded[0]
    return None


def source_sha256(path: str | os.PathLike) -> str:
    """sha256 of an input: from the download's ``.sha256`` sidecar when it is there (written
    only after verification), else computed."""
    return recorded_sha256(path) or sha256_file(path)


def read_manifest(prefix: str | os.PathLike) -> dict:
    import json

    path = Path(paths.shard_manifest(str(prefix)))
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


def merge_shards(prefixes: list[str], output_prefix: str) -> dict:
    """One prefix from several shards (in order), with a manifest that sums theirs.

    Shards must share the tokenizer (sha256) and EOD convention; the merged manifest lists
    each shard with its ``.bin`` sha256 as its sources.
    """
    from gptflow.data.indexed import merge_datasets

    manifests = [read_manifest(p) for p in prefixes]
    first = manifests[0]
    for p, m in zip(prefixes, manifests, strict=True):
        for key in ("tokenizer", "append_eod"):
            if m[key] != first[key]:
                raise GptflowError(
                    f"merge: {p} has a different {key} than {prefixes[0]} "
                    f"({m[key]} vs {first[key]}); re-tokenize with one tokenizer"
                )
    t0 = time.perf_counter()
    counts = merge_datasets(prefixes, output_prefix)
    dropped: Counter[str] = Counter()
    for m in manifests:
        dropped.update(m["dropped"])
    manifest = {
        "prefix": str(output_prefix),
        "format": first["format"],
        "dtype": counts["dtype"],
        "tokenizer": first["tokenizer"],
        "append_eod": first["append_eod"],
        "json_key": first["json_key"],
        "merged_from": [
            {"prefix": str(p), "bin_sha256": m["bin_sha256"], "documents": m["documents"]}
            for p, m in zip(prefixes, manifests, strict=True)
        ],
        "sources": [s for m in manifests for s in m["sources"]],
        "documents": counts["documents"],
        "sequences": counts["sequences"],
        "tokens": counts["tokens"],
        "empty_documents": counts["documents"] - counts["sequences"],
        "dropped": dict(sorted(dropped.items())),
        "bin_sha256": counts["bin_sha256"],
        "idx_sha256": sha256_file(f"{output_prefix}.idx"),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    write_json(paths.shard_manifest(str(output_prefix)), manifest)  # last
    return manifest
