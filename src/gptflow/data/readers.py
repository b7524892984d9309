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

Damaged inputs (a truncated download, flipped bits, an HTML error page saved under a corpus
name) are found, not read as fewer documents: each layer's own integrity check is used --

=============  ======================================================================
format         what catches damage
=============  ======================================================================
gzip           the deflate decoder; the CRC-32 and length in each member's trailer; a
               stream that ends before its trailer (truncation); an empty file
xz             the LZMA2 decoder; the block check (CRC-64 by default); truncation
zstd           the decoder; the frame's content checksum when the writer stored one (the
               ``zstd`` CLI does, by default); truncation, by walking the frame layout as
               the bytes go by (zstandard's stream reader takes a cut frame for an end)
zip            the central directory; each member's CRC-32 and its deflate decoder
tar            header checksums and sizes (``tarfile``), under the compression's checks;
               a bad header after the first, or no end blocks, which ``tarfile`` takes
               for the end, by looking at the block where it stopped; a flipped byte
               inside a plain tar member's data has no check to fail
parquet        the footer (length, magic, thrift metadata); the page decoders; page
               CRC-32s when the writer stored them (``write_page_checksum``); invalid
               UTF-8 in the text column is a bad row, as in JSONL
=============  ======================================================================

A damaged stream cannot in general be resynchronised, so damage ends what can be read of it:
the whole lines decoded before the decoder stopped are kept, and the rest of the stream (of
the tar archive; of the zip member; of the parquet row group -- the next row group and the
next zip member are read again) is one ``corrupt_data`` *region*. :func:`batch_texts` turns a
region into an error naming the file, the byte where the decoder stopped and the line, or with
``on_bad="skip"`` into one count under ``corrupt_data`` (regions, not documents: how many
documents a cut stream held is unknown). A checksum covers a whole gzip member or zstd frame
and is checked at its end, so with "skip" the documents kept before a checksum failure may
themselves hold the damaged bytes -- re-download inputs you cannot trust. Decompressed data is
read in fixed pieces (:data:`DECOMPRESS_CHUNK`) whatever the batch size, so what is kept
before the damage is the same for ``count-documents`` and every ``tokenize`` range job.

Over 500 lines: one short reader per format of the table above and the format inference they
share, dispatched through one table (:data:`FORMATS`); a module per format would split it.
"""

from __future__ import annotations

import fnmatch
import io
import json
import logging
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
    # decompressed here, not by tarfile: its gzip reader checks no CRC and no trailer
    "tar.gz": ("tar", "gz"),
    "tgz": ("tar", "gz"),
    "tar.xz": ("tar", "xz"),
    "tar.zst": ("tar", "zst"),
    "parquet": ("parquet", None),
}
SUFFIXES = sorted(FORMATS, key=len, reverse=True)
COMPRESSION_NAMES = {"gz": "gzip", "xz": "xz", "zst": "zstd"}

DECOMPRESS_CHUNK = 1 << 20  # decompressed streams are read in pieces of this size (see above)
CORRUPT_DATA = "corrupt_data"  # the drop reason of a damaged region


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
    """A streaming, decompressing binary reader over `raw` (wrap `raw` in :class:`Tracked`
    to have truncation and empty input raised, and positions for messages)."""
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


class StreamDamage(Exception):
    """Damage found by our own checks (a cut zstd frame, an empty compressed file)."""


_damage_errors: tuple[type[BaseException], ...] = ()


def damage_errors() -> tuple[type[BaseException], ...]:
    """What decoders raise on damaged data (disk read errors are not among them)."""
    global _damage_errors
    if not _damage_errors:
        import gzip
        import lzma
        import zlib

        import zstandard

        _damage_errors = (
            StreamDamage,
            EOFError,  # gzip, lzma, zipfile: the stream ended before its end marker
            gzip.BadGzipFile,
            lzma.LZMAError,
            zlib.error,
            zstandard.ZstdError,
            zipfile.BadZipFile,  # a zip member's CRC-32 or header
            tarfile.TarError,
        )
    return _damage_errors


class Tracked:
    """The raw bytes under a decoder, counted as it reads them, so that an error can name the
    byte where the decoder stopped (:meth:`where`), and how they end checked
    (:meth:`end_damage`): an empty compressed stream is damage, and a zstd stream must end on
    a frame boundary. `outer` places a member's stream inside its archive."""

    def __init__(
        self, raw: IO[bytes], compression: str | None, size: int | None, outer=None
    ) -> None:
        self._raw = raw
        self.compression = compression
        self.size = size
        self.outer = outer
        self.position = 0
        self.eof = False
        self._frames = ZstdFrames() if compression == "zst" else None

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        if data:
            self.position += len(data)
            if self._frames is not None:
                self._frames.feed(data)
        elif n != 0:
            # not raised here: the decoder first hands on all it could decode
            self.eof = True
        return data

    def end_damage(self) -> StreamDamage | None:
        """What is wrong with the way the input ended, once it has (else None)."""
        if not self.eof or self.compression is None:
            return None
        if self.position == 0:
            return StreamDamage("the file is empty, not a compressed stream")
        if self._frames is not None and not self._frames.complete():
            return StreamDamage("truncated: the data ends inside a zstd frame")
        return None

    def where(self) -> str:
        unit = "compressed byte" if self.compression else "byte"
        if self.outer is not None:
            return f"{unit} {self.position} of the member, {self.outer.where()}"
        of = f" of {self.size}" if self.size is not None else ""
        return f"{unit} {self.position}{of}"


class _Place:
    """Where a decoder without a :class:`Tracked` under it stopped (a zip member)."""

    def __init__(self, where) -> None:
        self.where = where

    def end_damage(self) -> None:
        return None


_ZSTD_MAGIC = 0xFD2FB528
_FCS_BYTES = (0, 2, 4, 8)  # frame content size field by its flag (flag 0: 1 byte if single segment)


class ZstdFrames:
    """Follows the frame layout of a zstd stream (RFC 8878, 3.1) as its bytes go by: frame
    headers, block headers (3 bytes: last flag, type, size), skipped payloads, checksums.

    Only the layout is read, so that a stream cut anywhere -- inside a header, a block or the
    checksum -- is told from a complete one; decoding and checksums are the decoder's. A layout
    that is not zstd's stops the walk (the decoder reports that input itself)."""

    def __init__(self) -> None:
        self._state, self._need, self._head, self._skip = "magic", 4, b"", 0
        self._checksum = False
        self.frames = 0
        self.foreign = False

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n and not self.foreign:
            if self._skip:
                step = min(self._skip, n - i)
                self._skip -= step
                i += step
                continue
            take = min(self._need - len(self._head), n - i)
            self._head += data[i : i + take]
            i += take
            if len(self._head) == self._need:
                head, self._head = self._head, b""
                self._advance(head)

    def _advance(self, head: bytes) -> None:
        state = self._state
        if state == "magic":
            magic = int.from_bytes(head, "little")
            if magic == _ZSTD_MAGIC:
                self._state, self._need = "descriptor", 1
            elif magic & 0xFFFFFFF0 == 0x184D2A50:  # skippable frame: 4-byte size, then data
                self._state, self._need = "skippable", 4
            else:
                self.foreign = True
        elif state == "skippable":
            self._skip = int.from_bytes(head, "little")
            self._end_frame()
        elif state == "descriptor":
            d = head[0]
            fcs_flag, single = d >> 6, (d >> 5) & 1
            self._checksum = bool(d & 4)
            rest = (0 if single else 1) + (0, 1, 2, 4)[d & 3]
            rest += single if fcs_flag == 0 else _FCS_BYTES[fcs_flag]
            self._state, self._need = ("header", rest) if rest else ("block", 3)
        elif state == "header":
            self._state, self._need = "block", 3
        elif state == "block":
            h = int.from_bytes(head, "little")
            btype = (h >> 1) & 3
            if btype == 3:  # reserved
                self.foreign = True
                return
            self._skip = 1 if btype == 1 else h >> 3  # an RLE block stores one byte
            if h & 1:  # last block
                if self._checksum:
                    self._state, self._need = "checksum", 4
                else:
                    self._end_frame()
        elif state == "checksum":
            self._end_frame()

    def _end_frame(self) -> None:
        self.frames += 1
        self._state, self._need = "magic", 4

    def complete(self) -> bool:
        """Whether the bytes so far end where a frame ends (or are not zstd at all)."""
        if self.foreign:
            return True
        return self.frames > 0 and self._state == "magic" and not self._head and not self._skip


@dataclass
class Batch:
    """Documents of one input, in order: raw JSON lines ("jsonl") or texts ("text"); or a
    damaged region ("damaged": `damage` says what and where, `items` is empty)."""

    origin: str  # file, or file!member
    first_line: int  # line number of items[0] in a JSONL stream; row number in parquet; else 1
    kind: str
    items: list  # jsonl: one chunk of whole lines (bytes); text: the texts
    lines: int = 0  # jsonl: lines in the chunk
    damage: str | None = None


def _damaged(origin: str, line: int | None, error: BaseException | str, source) -> Batch:
    error = source.end_damage() or error  # a cut stream makes the layers above it fail too
    if isinstance(error, str):
        what = error
    elif isinstance(error, EOFError | StreamDamage):
        what = str(error) or "truncated"
        if isinstance(error, EOFError):
            what = f"truncated ({error})"
    else:
        what = f"corrupt data ({type(error).__name__}: {error})"
    at = f", in line {line}" if line is not None else ""
    message = f"{origin}: {what}; the decoder stopped at {source.where()}{at}"
    return Batch(origin, line or 1, "damaged", [], 0, message.replace("\n", " "))


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
            yield from _parquet_batches(path, json_key)
            return
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f
            if digest is not None and hashes_while_reading(fmt):
                raw = HashingReader(f, digest)
            buffered = io.BufferedReader(raw, buffer_size=1 << 20)
            if kind == "zip":
                yield from _zip_batches(path, buffered, size, member, member_format, batch_bytes)
            elif kind == "tar":
                source = Tracked(buffered, compression, size)
                stream = open_decompressed(source, compression)
                yield from _tar_batches(path, stream, source, member, member_format, batch_bytes)
            elif compression is None:
                yield from _stream_batches(path, buffered, kind, batch_bytes)
            else:
                source = Tracked(buffered, compression, size)
                stream = open_decompressed(source, compression)
                yield from _stream_batches(path, stream, kind, batch_bytes, source)
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


def _stream_batches(
    origin: str, stream: IO[bytes], kind: str, batch_bytes: int, source=None
) -> Iterator[Batch]:
    """Batches of a byte stream. For a decoded stream, `source` (:class:`Tracked`) places the
    damage: what the decoder raises, or a bad end of its input, ends the stream with a
    "damaged" batch, after the whole lines read before it."""
    damage = damage_errors() if source is not None else ()
    if kind == "txt":
        try:
            data = stream.read()
        except damage as e:
            yield _damaged(origin, None, e, source)
            return
        if source is not None and (failure := source.end_damage()):
            yield _damaged(origin, None, failure, source)
            return
        yield Batch(origin, 1, "text", [_decode(data, origin)])
        return
    # JSONL: chunks of whole lines, about `batch_bytes` each (a longer line is one chunk)
    if source is not None:
        stream = _Pieces(stream, damage)
    line, rest, failure = 1, b"", None
    while True:
        try:
            data = stream.read(batch_bytes)
        except damage as e:
            failure = e
            break
        if not data:
            if source is not None:
                failure = source.end_damage()
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
    if failure is not None:  # `rest`, the line the damage cut, is part of the damage
        yield _damaged(origin, line, failure, source)
    elif rest:
        yield Batch(origin, line, "jsonl", [rest], rest.count(b"\n") + 1)


class _Pieces:
    """``read(n)`` of a decoded stream, done by reading it in :data:`DECOMPRESS_CHUNK` pieces:
    the good bytes before damage are the same whatever `n` (a decoder's error loses what the
    failing read would have returned), and are all handed on before the error is raised."""

    def __init__(self, stream: IO[bytes], damage: tuple[type[BaseException], ...]) -> None:
        self._stream, self._damage = stream, damage
        self._parts: list[bytes] = []
        self._size = 0
        self._end = False
        self._failure: BaseException | None = None

    def read(self, n: int) -> bytes:
        while self._size < n and not self._end:
            try:
                part = self._stream.read(DECOMPRESS_CHUNK)
            except self._damage as e:
                self._failure, self._end = e, True
                break
            if not part:
                self._end = True
                break
            self._parts.append(part)
            self._size += len(part)
        if not self._parts:
            if self._failure is not None:
                raise self._failure
            return b""
        data = b"".join(self._parts)
        out, rest = (data, b"") if len(data) <= n else (data[:n], data[n:])
        self._parts, self._size = ([rest], len(rest)) if rest else ([], 0)
        return out


def _decode(data: bytes, origin: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        # e.g. enwik8 is the first 10^8 bytes of a dump and may cut a character in two
        log.warning(
            "%s: invalid UTF-8 at byte %d of the text; decoded with U+FFFD in its place",
            origin,
            e.start,
        )
        return data.decode("utf-8", errors="replace")


def _member_kind(name: str, member_format: str | None, origin: str) -> tuple[str, str | None]:
    fmt = member_format or infer_format(name, default="txt")
    check_format(fmt, origin)
    kind, compression = FORMATS[fmt]
    if kind not in ("jsonl", "txt"):
        raise GptflowError(f"{origin}: member format '{fmt}' is not supported inside an archive")
    return kind, compression


def _member_batches(origin, fh, kind, compression, batch_bytes, source) -> Iterator[Batch]:
    """One archive member's batches; a compressed member's damage is placed inside it."""
    if compression is None:
        yield from _stream_batches(origin, fh, kind, batch_bytes, source)
        return
    inner = Tracked(fh, compression, None, outer=source)
    yield from _stream_batches(
        origin, open_decompressed(inner, compression), kind, batch_bytes, inner
    )


def _zip_batches(path, raw, size, member, member_format, batch_bytes) -> Iterator[Batch]:
    """Members are found through the central directory, so a damaged member ends only itself."""

    place = _Place(lambda: f"byte {raw.tell()} of {size}")
    try:
        zf = zipfile.ZipFile(raw)
    except (*damage_errors(), ValueError) as e:
        yield _damaged(path, None, f"not a zip archive ({e})", place)
        return
    names = [
        i.filename
        for i in zf.infolist()
        if not i.is_dir() and fnmatch.fnmatchcase(i.filename, member)
    ]
    if not names:
        raise GptflowError(f"{path}: no member matches '{member}' (members: {zf.namelist()[:10]})")
    for name in names:
        origin = f"{path}!{name}"
        kind, compression = _member_kind(name, member_format, origin)
        try:
            fh = zf.open(name)
        except damage_errors() as e:
            yield _damaged(origin, None, e, place)
            continue
        except (NotImplementedError, RuntimeError) as e:  # a compression method, encryption
            raise GptflowError(
                f"{origin}: cannot read this member ({e}); repack the archive with deflate, "
                f"unencrypted, or select other members (--member / member)"
            ) from None
        with fh:
            yield from _member_batches(origin, fh, kind, compression, batch_bytes, place)


class _Recent:
    """A stream that keeps its last bytes read (`KEEP`), so that a block tarfile has read can
    be looked at again."""

    KEEP = 1 << 16  # tarfile reads 10 kB records

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.position = 0
        self._recent: list[tuple[int, bytes]] = []  # (stream offset, bytes)

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        if data:
            self._recent.append((self.position, data))
            self.position += len(data)
            while len(self._recent) > 1 and self.position - self._recent[1][0] >= self.KEEP:
                del self._recent[0]
        return data

    def block(self, offset: int, size: int = tarfile.BLOCKSIZE) -> bytes | None:
        """The bytes at [offset, offset + size) that were read (fewer at the stream's end);
        None when they are no longer kept."""
        if not self._recent or offset < self._recent[0][0]:
            return None
        return b"".join(
            data[max(0, offset - start) : offset + size - start]
            for start, data in self._recent
            if start < offset + size and start + len(data) > offset
        )


def _tar_end_damage(recent: _Recent, offset: int) -> str | None:
    """tarfile ends a stream quietly on a header it cannot read after the first; a real end
    is a zero block (POSIX writes two, and pads to a 10 kB record)."""
    block = recent.block(offset)
    if block is None or (len(block) == tarfile.BLOCKSIZE and not block.strip(b"\0")):
        return None
    if len(block) < tarfile.BLOCKSIZE:
        return f"truncated: the tar archive ends at byte {recent.position}, without its end blocks"
    return f"corrupt tar header at byte {offset} of the archive (bad checksum or fields)"


def _tar_batches(path, stream, source, member, member_format, batch_bytes) -> Iterator[Batch]:
    """A tar stream has no index to resynchronise on: damage ends the archive."""
    matched = 0
    recent = _Recent(stream)
    try:
        tf = tarfile.open(fileobj=recent, mode="r|*")  # noqa: SIM115 - closed below
    except damage_errors() as e:
        yield _damaged(path, None, _tar_error(e), source)
        return
    with tf:
        members = iter(tf)
        while True:
            try:
                info = next(members, None)
            except damage_errors() as e:
                yield _damaged(path, None, _tar_error(e), source)
                return
            if info is None:
                # tarfile may take a cut stream or an unreadable header for the end
                if failure := source.end_damage() or _tar_end_damage(recent, tf.offset):
                    yield _damaged(path, None, failure, source)
                    return
                break
            if not info.isfile() or not fnmatch.fnmatchcase(info.name, member):
                continue
            matched += 1
            origin = f"{path}!{info.name}"
            kind, compression = _member_kind(info.name, member_format, origin)
            fh = tf.extractfile(info)
            for batch in _member_batches(origin, fh, kind, compression, batch_bytes, source):
                yield batch
                if batch.damage is not None:
                    return
    if not matched:
        raise GptflowError(f"{path}: no member matches '{member}'")


def _tar_error(e: BaseException) -> BaseException | str:
    if isinstance(e, tarfile.TarError):
        return f"not a readable tar archive ({e})"
    return e


def _parquet_batches(path: str, column: str) -> Iterator[Batch]:
    """Row groups are found through the footer, so a damaged row group ends only itself.
    Batches carry their first row number (from 1) as `first_line`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = os.path.getsize(path)
    errors = (pa.ArrowException, OSError, ValueError)
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        names = pf.schema_arrow.names
    except errors as e:  # ArrowInvalid and friends
        footer = max(0, size - 8)  # the footer's length and magic: the last 8 bytes
        place = _Place(lambda: f"byte {footer} of {size}")
        yield _damaged(path, None, f"not a readable parquet file ({e})", place)
        return
    if column not in names:
        raise GptflowError(
            f"{path}: no column '{column}' (columns: {names}); set the JSON key "
            f"(--json-key / json_key) to the column holding the text"
        )
    ctype = pf.schema_arrow.field(column).type
    if pa.types.is_binary(ctype) or pa.types.is_large_binary(ctype):
        raise GptflowError(
            f"{path}: column '{column}' is {ctype}, not string; store the text as a string "
            f"(UTF-8) column"
        )
    meta = pf.metadata
    ci = names.index(column) if meta.num_columns == len(names) else 0
    row = 1
    for group in range(pf.num_row_groups):
        chunk = meta.row_group(group).column(ci)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else 0
        start = start or chunk.data_page_offset
        end = row + meta.row_group(group).num_rows
        try:
            for rb in pf.iter_batches(columns=[column], batch_size=2048, row_groups=[group]):
                col = rb.column(0)
                try:
                    texts = col.to_pylist()
                except UnicodeDecodeError:  # a bad row: handed on as bytes, named in batch_texts
                    texts = [_utf8_or_bytes(b) for b in col.cast(pa.binary()).to_pylist()]
                yield Batch(path, row, "text", texts)
                row += len(texts)
        except errors as e:
            place = _Place(
                lambda start=start: f"the row group's column data at byte {start} of {size}"
            )
            what = f"corrupt row group {group} (rows {row}-{end - 1}; {type(e).__name__}: {e})"
            yield _damaged(path, None, what, place)
        row = end


def _utf8_or_bytes(b: bytes | None) -> str | bytes | None:
    if b is None:
        return None
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return b


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
