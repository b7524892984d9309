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

:func:`iter_batches` yields :class:`Batch` es -- raw JSON lines (parsed later, in worker
processes, so that errors can still name the line) or texts. :func:`collect_local_documents`
turns files on disk, one document each, into a JSONL shard. Dropped documents are counted by
reason, never silently lost.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import tarfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write


def collect_local_documents(
    files: list[Path], root: Path, out: str | os.PathLike, key: str = "text"
) -> dict:
    """Write one JSON line ``{key: text, "source": relative path}`` per non-empty UTF-8 file.

    Returns counts: documents, bytes (UTF-8 text), files, dropped by reason.
    """
    dropped: Counter[str] = Counter()
    documents = 0
    text_bytes = 0
    with atomic_write(out, "w") as f:
        for path in files:
            data = path.read_bytes()
            if not data.strip():
                dropped["empty"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                dropped["not_utf8"] += 1
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


# ----------------------------------------------------------------------------- formats

# format -> (kind, compression); kind is how a stream turns into documents
FORMATS: dict[str, tuple[str, str | None]] = {
    "jsonl": ("jsonl", None),
    "jsonl.zst": ("jsonl", "zst"),
    "jsonl.xz": ("jsonl", "xz"),
    "jsonl.gz": ("jsonl", "gz"),
    "json.gz": ("jsonl", "gz"),  # C4 and friends: JSON lines, gzipped
    "txt": ("txt", None),
    "txt.zst": ("txt", "zst"),
    "txt.xz": ("txt", "xz"),
    "txt.gz": ("txt", "gz"),
    "zip": ("zip", None),
    "tar": ("tar", None),
    "tar.gz": ("tar", None),
    "tgz": ("tar", None),
    "tar.xz": ("tar", None),
    "tar.zst": ("tar", "zst"),
    "parquet": ("parquet", None),
}
SUFFIXES = sorted(FORMATS, key=len, reverse=True)


def infer_format(name: str, default: str | None = None) -> str:
    """The format of a file from its name (longest known suffix wins)."""
    lower = name.lower()
    for suffix in SUFFIXES:
        if lower.endswith("." + suffix):
            return suffix
    if default is not None:
        return default
    raise GptflowError(
        f"{name}: cannot tell the format from the name; set the format explicitly "
        f"(one of {', '.join(sorted(FORMATS))})"
    )


def check_format(fmt: str, where: str) -> str:
    if fmt not in FORMATS:
        raise GptflowError(
            f"{where}: format '{fmt}' is not supported; use one of {', '.join(sorted(FORMATS))}"
        )
    return fmt


def open_decompressed(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    """A streaming, decompressing binary reader over `raw`."""
    if compression is None:
        return raw
    if compression == "gz":
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "xz":
        import lzma

        return lzma.LZMAFile(raw, mode="rb")
    if compression == "zst":
        import zstandard

        reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(
            raw, read_across_frames=True
        )
        return io.BufferedReader(reader, buffer_size=1 << 20)
    raise AssertionError(compression)


@dataclass
class Batch:
    """Documents of one input, in order: raw JSON lines ("jsonl") or texts ("text")."""

    origin: str  # file, or file!member
    first_line: int  # line number of items[0] in a JSONL stream (1 for texts)
    kind: str
    items: list  # jsonl: one chunk of whole lines (bytes); text: the texts
    lines: int = 0  # jsonl: lines in the chunk


class HashingReader(io.RawIOBase):
    """A raw reader that feeds every byte read from `raw` to `digest` (hashlib)."""

    def __init__(self, raw: IO[bytes], digest) -> None:
        self._raw = raw
        self._digest = digest

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._raw.readinto(b)
        if n:
            self._digest.update(memoryview(b)[:n])
        return n

    def drain(self) -> None:
        """Read (and hash) whatever the consumer left unread."""
        while chunk := self._raw.read(1 << 22):
            self._digest.update(chunk)


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

    With `digest` (a hashlib object), the file's bytes are hashed as they are read, once the
    iteration has run to its end; formats read out of order (zip, parquet) are not hashed and
    leave `digest` untouched -- see :func:`hashes_while_reading`.
    """
    path = str(path)
    fmt = check_format(fmt or infer_format(path), path)
    kind, compression = FORMATS[fmt]
    if kind == "parquet":
        yield from _parquet_batches(path, json_key)
        return
    with open(path, "rb", buffering=0) as f:
        raw = f
        if digest is not None and hashes_while_reading(fmt):
            raw = HashingReader(f, digest)
        buffered = io.BufferedReader(raw, buffer_size=1 << 20)
        if kind == "zip":
            yield from _zip_batches(path, buffered, member, member_format, json_key, batch_bytes)
        elif kind == "tar":
            stream = open_decompressed(buffered, compression)
            yield from _tar_batches(path, stream, member, member_format, json_key, batch_bytes)
        else:
            stream = open_decompressed(buffered, compression)
            yield from _stream_batches(path, stream, kind, batch_bytes)
        if isinstance(raw, HashingReader):
            buffered.detach()
            raw.drain()


def hashes_while_reading(fmt: str) -> bool:
    """Whether :func:`iter_batches` can hash a file of this format while reading it."""
    return FORMATS[fmt][0] in ("jsonl", "txt", "tar")


def _stream_batches(origin: str, stream: IO[bytes], kind: str, batch_bytes: int) -> Iterator[Batch]:
    if kind == "txt":
        yield Batch(origin, 1, "text", [_decode(stream.read(), origin)])
        return
    # JSONL: chunks of whole lines, about `batch_bytes` each (a longer line is one chunk)
    line, rest = 1, b""
    while True:
        data = stream.read(batch_bytes)
        if not data:
            break
        data = rest + data if rest else data
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            rest = data
            continue
        chunk, rest = data[:cut], data[cut:]
        lines = chunk.count(b"\n")
        yield Batch(origin, line, "jsonl", [chunk], lines)
        line += lines
    if rest:
        yield Batch(origin, line, "jsonl", [rest], rest.count(b"\n") + 1)


def _decode(data: bytes, origin: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        # e.g. enwik8 is the first 10^8 bytes of a dump and may cut a character in two
        return data.decode("utf-8", errors="replace")


def _member_kind(name: str, member_format: str | None, origin: str) -> tuple[str, str | None]:
    fmt = member_format or infer_format(name, default="txt")
    check_format(fmt, origin)
    kind, compression = FORMATS[fmt]
    if kind not in ("jsonl", "txt"):
        raise GptflowError(f"{origin}: member format '{fmt}' is not supported inside an archive")
    return kind, compression


def _zip_batches(path, raw, member, member_format, json_key, batch_bytes) -> Iterator[Batch]:
    try:
        zf = zipfile.ZipFile(raw)
    except zipfile.BadZipFile as e:
        raise GptflowError(
            f"{path}: not a zip archive ({e}); delete it to download it again"
        ) from None
    names = [
        i.filename
        for i in zf.infolist()
        if not i.is_dir() and fnmatch.fnmatchcase(i.filename, member)
    ]
    if not names:
        raise GptflowError(f"{path}: no member matches '{member}' (members: {zf.namelist()[:10]})")
    for name in names:
        kind, compression = _member_kind(name, member_format, f"{path}!{name}")
        with zf.open(name) as fh:
            yield from _stream_batches(
                f"{path}!{name}", open_decompressed(fh, compression), kind, batch_bytes
            )


def _tar_batches(path, stream, member, member_format, json_key, batch_bytes) -> Iterator[Batch]:
    matched = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tf:
            for info in tf:
                if not info.isfile() or not fnmatch.fnmatchcase(info.name, member):
                    continue
                matched += 1
                kind, compression = _member_kind(info.name, member_format, f"{path}!{info.name}")
                fh = tf.extractfile(info)
                yield from _stream_batches(
                    f"{path}!{info.name}", open_decompressed(fh, compression), kind, batch_bytes
                )
    except tarfile.TarError as e:
        raise GptflowError(
            f"{path}: not a readable tar archive ({e}); delete it to download it again"
        ) from None
    if not matched:
        raise GptflowError(f"{path}: no member matches '{member}'")


def _parquet_batches(path: str, column: str) -> Iterator[Batch]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise GptflowError(f"{path}: not a readable parquet file ({e})") from None
    if column not in pf.schema_arrow.names:
        raise GptflowError(
            f"{path}: no column '{column}' (columns: {pf.schema_arrow.names}); set the JSON key "
            f"(--json-key / json_key) to the column holding the text"
        )
    for rb in pf.iter_batches(columns=[column], batch_size=2048):
        yield Batch(path, 1, "text", rb.column(0).to_pylist())


ON_BAD_DOCUMENT = ("error", "skip")


def batch_texts(batch: Batch, key: str, on_bad: str = "error") -> tuple[list[str], Counter[str]]:
    """The document texts of a batch (parsing JSON lines), with drops counted by reason."""
    if batch.kind == "jsonl":
        return parse_jsonl_batch(
            batch.origin, batch.first_line, batch.items[0], key, on_bad, batch.lines
        )
    texts, dropped = [], Counter()
    for t in batch.items:
        if t is None:
            dropped["null_text"] += 1
        elif not isinstance(t, str):
            raise GptflowError(f"{batch.origin}: '{key}' holds {type(t).__name__}, not text")
        else:
            texts.append(t)
    return texts, dropped


def iter_texts(path, fmt=None, *, member="*", member_format=None, json_key="text") -> Iterator[str]:
    """Every document text of `path`, in order."""
    for batch in iter_batches(
        path, fmt, member=member, member_format=member_format, json_key=json_key
    ):
        texts, _ = batch_texts(batch, json_key)
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

    Blank lines are skipped and counted. A bad line -- not JSON, not UTF-8, not an object, no
    `key`, or not a string under it -- raises an error naming file and line, or with
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
