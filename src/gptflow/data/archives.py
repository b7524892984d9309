"""Archives and parquet, read as streams of documents: a zip's members through its central
directory (a damaged member ends only itself), a tar's in order (damage ends the archive: it
has no index to resynchronise on), each member read as its own format; a parquet file's row
groups through its footer (a damaged row group ends only itself). What they yield is
:mod:`gptflow.data.streams`' :class:`~gptflow.data.streams.Batch` es, for
:func:`gptflow.data.readers.iter_batches`."""

from __future__ import annotations

import fnmatch
import os
import tarfile
import zipfile
from collections.abc import Iterator
from typing import IO

from gptflow.data.streams import (
    FORMATS,
    Batch,
    Place,
    Tracked,
    check_format,
    damage_errors,
    damaged,
    infer_format,
    open_decompressed,
    stream_batches,
)
from gptflow.errors import GptflowError


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
        yield from stream_batches(origin, fh, kind, batch_bytes, source)
        return
    inner = Tracked(fh, compression, None, outer=source)
    yield from stream_batches(
        origin, open_decompressed(inner, compression), kind, batch_bytes, inner
    )


def zip_batches(path, raw, size, member, member_format, batch_bytes) -> Iterator[Batch]:
    """Members are found through the central directory, so a damaged member ends only itself."""

    place = Place(lambda: f"byte {raw.tell()} of {size}")
    try:
        zf = zipfile.ZipFile(raw)
    except (*damage_errors(), ValueError) as e:
        yield damaged(path, None, f"not a zip archive ({e})", place)
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
            yield damaged(origin, None, e, place)
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


def tar_batches(path, stream, source, member, member_format, batch_bytes) -> Iterator[Batch]:
    """A tar stream has no index to resynchronise on: damage ends the archive."""
    matched = 0
    recent = _Recent(stream)
    try:
        tf = tarfile.open(fileobj=recent, mode="r|*")  # noqa: SIM115 - closed below
    except damage_errors() as e:
        yield damaged(path, None, _tar_error(e), source)
        return
    with tf:
        members = iter(tf)
        while True:
            try:
                info = next(members, None)
            except damage_errors() as e:
                yield damaged(path, None, _tar_error(e), source)
                return
            if info is None:
                # tarfile may take a cut stream or an unreadable header for the end
                if failure := source.end_damage() or _tar_end_damage(recent, tf.offset):
                    yield damaged(path, None, failure, source)
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


def parquet_batches(path: str, column: str) -> Iterator[Batch]:
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
        place = Place(lambda: f"byte {footer} of {size}")
        yield damaged(path, None, f"not a readable parquet file ({e})", place)
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
            place = Place(
                lambda start=start: f"the row group's column data at byte {start} of {size}"
            )
            what = f"corrupt row group {group} (rows {row}-{end - 1}; {type(e).__name__}: {e})"
            yield damaged(path, None, what, place)
        row = end


def _utf8_or_bytes(b: bytes | None) -> str | bytes | None:
    if b is None:
        return None
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return b
