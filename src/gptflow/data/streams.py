"""The bytes under the documents: a format's name (:data:`FORMATS`), its decompression, and the
damage found in a byte stream -- the layer :mod:`gptflow.data.readers` reads documents from.

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
next zip member are read again) is one ``corrupt_data`` *region*.
:func:`gptflow.data.readers.batch_texts` turns a region into an error, or with
``on_bad="skip"`` into one count under ``corrupt_data``. A checksum covers a whole gzip member
or zstd frame and is checked at its end, so with "skip" the documents kept before a checksum
failure may themselves hold the damaged bytes -- re-download inputs you cannot trust.
Decompressed data is read in fixed pieces (:data:`DECOMPRESS_CHUNK`) whatever the batch size,
so what is kept before the damage is the same for ``count-documents`` and every ``tokenize``
range job.
"""

from __future__ import annotations

import io
import logging
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from gptflow.errors import GptflowError

log = logging.getLogger(__name__)


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


class Place:
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


def damaged(origin: str, line: int | None, error: BaseException | str, source) -> Batch:
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


def stream_batches(
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
            yield damaged(origin, None, e, source)
            return
        if source is not None and (failure := source.end_damage()):
            yield damaged(origin, None, failure, source)
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
        yield damaged(origin, line, failure, source)
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
