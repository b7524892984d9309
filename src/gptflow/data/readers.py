"""Documents in, documents out: small functions over iterators, in bounded memory.

Every corpus format of the catalog is read here, streaming:

=============  ======================================================================
format         documents
=============  ======================================================================
jsonl          one per line, text under a JSON key (also .jsonl.zst/.xz/.gz, .json.gz)
txt            one per file (also .txt.zst/.xz/.gz), as GPT-NeoX's reader does
zip, tar       one per member matching a glob, each member read as its own format
               (.tar.gz/.tgz/.tar.xz/.tar.zst streamed, never extracted to disk)
parquet        one per row, text in a column, read in row batches
=============  ======================================================================

:func:`iter_batches` yields :class:`~gptflow.data.streams.Batch` es -- raw JSON lines (parsed
later, in worker processes, so that errors can still name the line) or texts -- and
:func:`batch_texts` turns one into texts. :func:`collect_local_documents` turns files on disk,
one document each, into a JSONL shard. Dropped documents are counted by reason, never silently
lost.

Below the documents: a format's name, decompression, and the damage each layer's integrity
check finds in a byte stream are :mod:`gptflow.data.streams`; the archives (zip, tar) and
parquet, read member by member and row group by row group, :mod:`gptflow.data.archives`.
Damage ends what can be read of a stream with a damaged batch: :func:`batch_texts` turns it
into an error naming the file, the byte where the decoder stopped and the line, or with
``on_bad="skip"`` into one count under ``corrupt_data`` (regions, not documents: how many
documents a cut stream held is unknown).
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from gptflow.data.archives import parquet_batches, tar_batches, zip_batches
from gptflow.data.streams import (
    CORRUPT_DATA,
    FORMATS,
    Batch,
    HashingReader,
    Tracked,
    check_format,
    infer_format,
    open_decompressed,
    stream_batches,
)
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write

log = logging.getLogger(__name__)


def blank(text: str) -> bool:
    """Whether a document is empty: nothing but whitespace, Unicode's included (NBSP, U+3000,
    U+2028: what ``str.isspace`` calls whitespace). The one rule the collect steps drop by, a
    local dataset's files and an hf dataset's rows alike; tokenization keeps every document
    it is given, as Megatron's preprocess_data does."""
    return not text.strip()


def collect_local_documents(
    files: list[Path], root: Path, out: str | os.PathLike, key: str = "text"
) -> dict:
    """Write one JSON line ``{key: text, "source": relative path}`` per UTF-8 file that is not
    :func:`blank`.

    Returns counts: documents, bytes (UTF-8 text), files, dropped by reason.
    """
    dropped: Counter[str] = Counter()
    documents = 0
    text_bytes = 0
    with atomic_write(out, "w") as f:
        for path in files:
            try:
                data = path.read_bytes()
            except OSError as e:
                raise GptflowError(
                    f"{path}: cannot read the file ({e.strerror or e}); check that it exists "
                    f"and is readable, or exclude it from the dataset's files"
                ) from None
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                dropped["not_utf8"] += 1
                continue
            if blank(text):
                dropped["empty"] += 1
                continue
            rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
            f.write(json.dumps({key: text, "source": rel}, ensure_ascii=False))
            f.write("\n")
            documents += 1
            text_bytes += len(data)
    return {
        "files": len(files),
        "documents": documents,
        "bytes": text_bytes,
        "dropped": dict(sorted(dropped.items())),
    }


def iter_batches(
    path: str | os.PathLike,
    fmt: str | None = None,
    *,
    member: str = "*",
    member_format: str | None = None,
    json_key: str = "text",
    batch_bytes: int = 1 << 20,
    digest=None,
) -> Iterator[Batch]:
    """Stream the documents of `path` (format inferred from the name unless given).

    Damage ends the stream it is in with a "damaged" batch (see the module docstring); a
    disk read error is a :class:`GptflowError`. With `digest` (a hashlib object), the file's
    bytes are hashed as they are read, once the iteration has run to its end; formats read out
    of order (zip, parquet) are not hashed and leave `digest` untouched -- see
    :func:`hashes_while_reading`.
    """
    path = str(path)
    fmt = check_format(fmt or infer_format(path), path)
    kind, compression = FORMATS[fmt]
    try:
        if kind == "parquet":
            yield from parquet_batches(path, json_key)
            return
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f
            if digest is not None and hashes_while_reading(fmt):
                raw = HashingReader(f, digest)
            buffered = io.BufferedReader(raw, buffer_size=1 << 20)
            if kind == "zip":
                yield from zip_batches(path, buffered, size, member, member_format, batch_bytes)
            elif kind == "tar":
                source = Tracked(buffered, compression, size)
                stream = open_decompressed(source, compression)
                yield from tar_batches(path, stream, source, member, member_format, batch_bytes)
            elif compression is None:
                yield from stream_batches(path, buffered, kind, batch_bytes)
            else:
                source = Tracked(buffered, compression, size)
                stream = open_decompressed(source, compression)
                yield from stream_batches(path, stream, kind, batch_bytes, source)
            if isinstance(raw, HashingReader):
                buffered.detach()
                raw.drain()
    except OSError as e:
        raise GptflowError(
            f"{path}: cannot read the file ({e.strerror or e}); check that it exists, is "
            f"readable and that its disk is healthy"
        ) from None


def hashes_while_reading(fmt: str) -> bool:
    """Whether :func:`iter_batches` can hash a file of this format while reading it."""
    return FORMATS[fmt][0] in ("jsonl", "txt", "tar")


ON_BAD_DOCUMENT = ("error", "skip")
_DAMAGE_FIX = (
    "download the file again (delete it and rerun), or set tokenize.on_bad_document: skip "
    "(--on-bad-document skip) to keep what was read before the damage and count the rest as "
    f"one '{CORRUPT_DATA}' region"
)


def batch_texts(batch: Batch, key: str, on_bad: str = "error") -> tuple[list[str], Counter[str]]:
    """The document texts of a batch (parsing JSON lines), with drops counted by reason; a
    damaged region is an error, or with ``on_bad="skip"`` one ``corrupt_data`` count."""
    if batch.kind == "jsonl":
        return parse_jsonl_batch(
            batch.origin, batch.first_line, batch.items[0], key, on_bad, batch.lines
        )
    if batch.kind == "damaged":
        if on_bad == "skip":
            log.warning("skipped: %s", batch.damage)
            return [], Counter({CORRUPT_DATA: 1})
        raise GptflowError(f"{batch.damage}; {_DAMAGE_FIX}")
    texts, dropped = [], Counter()
    for i, t in enumerate(batch.items):
        if t.__class__ is str:
            texts.append(t)
        elif t is None:
            dropped["null_text"] += 1
        elif isinstance(t, bytes) and on_bad == "skip":
            dropped["invalid_utf8"] += 1
        elif isinstance(t, bytes):
            e = _utf8_error(t)
            raise GptflowError(
                f"{batch.origin}: row {batch.first_line + i}: '{key}' is not valid UTF-8 (at "
                f"byte {e.start}); fix the row, or set tokenize.on_bad_document: skip "
                f"(--on-bad-document skip) to skip and count it"
            )
        else:
            raise GptflowError(f"{batch.origin}: '{key}' holds {type(t).__name__}, not text")
    return texts, dropped


def _utf8_error(b: bytes) -> UnicodeDecodeError:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError as e:
        return e
    raise AssertionError("valid UTF-8")


def iter_texts(
    path, fmt=None, *, member="*", member_format=None, json_key="text", on_bad="error"
) -> Iterator[str]:
    """Every document text of `path`, in order (bad documents and damage per `on_bad`)."""
    for batch in iter_batches(
        path, fmt, member=member, member_format=member_format, json_key=json_key
    ):
        texts, _ = batch_texts(batch, json_key, on_bad)
        yield from texts


_decoders: dict[str, object] = {}


def _fast_decoder(key: str):
    """A msgspec decoder of ``{key: str, ...}`` lines, or None without msgspec."""
    if key not in _decoders:
        try:
            import msgspec
        except ImportError:  # pragma: no cover - msgspec is a dependency
            _decoders[key] = None
        else:
            # the key is data, not a Python name: a fixed field renamed to it
            doc = msgspec.defstruct("Doc", [("text", str)], rename={"text": key})
            _decoders[key] = msgspec.json.Decoder(doc)
    return _decoders[key]


def parse_jsonl_batch(
    path: str,
    first_line: int,
    chunk: bytes,
    key: str,
    on_bad: str = "error",
    lines: int | None = None,
) -> tuple[list[str], Counter[str]]:
    """Texts of a chunk of JSONL lines starting at line `first_line` of `path`.

    Blank lines are skipped and counted. A bad line -- not JSON, not UTF-8, nested too deep
    for the parser, not an object, no `key`, or not a string under it -- raises an error naming file and line, or with
    ``on_bad="skip"`` is skipped and counted by reason. The chunk is first decoded in one call
    (msgspec, ~1 GB/s); only a chunk that is not all clean lines goes through the exact
    per-line parser, so the result is the same either way.
    """
    decoder = _fast_decoder(key)
    if decoder is not None:
        if lines is None:
            lines = chunk.count(b"\n") + (0 if chunk.endswith(b"\n") else 1)
        try:
            docs = decoder.decode_lines(chunk)
        except Exception:  # malformed somewhere: the exact path finds and names it
            docs = None
        if docs is not None and len(docs) == lines:
            return [d.text for d in docs], Counter()
    return _parse_lines(path, first_line, chunk, key, on_bad)


def _parse_lines(
    path: str, first_line: int, chunk: bytes, key: str, on_bad: str
) -> tuple[list[str], Counter[str]]:
    texts: list[str] = []
    dropped: Counter[str] = Counter()
    loads = json.loads
    lines = chunk.split(b"\n")
    if not lines[-1]:
        lines.pop()
    for offset, line in enumerate(lines):
        if not line.strip():
            dropped["blank_line"] += 1
            continue
        where = f"{path}:{first_line + offset}"
        reason = message = None
        try:
            obj = loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            reason = "invalid_utf8"
            message = f"invalid UTF-8 at byte {e.start} of the line"
        except ValueError as e:
            reason, message = "invalid_json", f"invalid JSON ({e})"
        except RecursionError:
            reason = "too_deep"
            message = "JSON nested deeper than the parser's recursion limit"
        else:
            if not isinstance(obj, dict):
                reason = "not_object"
                message = f"a JSON {type(obj).__name__}, not an object"
            elif key not in obj:
                reason = "missing_key"
                message = (
                    f"no key '{key}' (found {sorted(obj)}); set the JSON key "
                    f"(--json-key / json_key) to the field holding the text"
                )
            elif not isinstance(obj[key], str):
                reason = "not_string"
                message = f"'{key}' is {type(obj[key]).__name__}, not a string"
            elif not _encodable(obj[key]):
                reason = "invalid_unicode"
                message = f"'{key}' holds an unpaired surrogate escape (\\ud800-\\udfff)"
        if reason is None:
            texts.append(obj[key])
        elif on_bad == "skip":
            dropped[reason] += 1
        else:
            raise GptflowError(
                f"{where}: {message}; fix or remove the line, or set "
                f"tokenize.on_bad_document: skip (--on-bad-document skip) to skip and count it"
            )
    return texts, dropped


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
