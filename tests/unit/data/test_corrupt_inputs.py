"""A corpus of damaged archives through the real CLI: every damage is an error naming the file
and the byte where decoding stopped (one line, no traceback, no output under a final name), or
with ``--on-bad-document skip`` exactly one counted ``corrupt_data`` region.

The corpus: 20 real documents (~31 kB of JSONL) in each format below, damaged six ways --
truncated to 1 byte, to half, the last byte missing, one bit flipped in the middle, garbage
with the right extension, an empty file -- 8 formats x 6 = 48 cases, each run through
``count-documents``, ``tokenize`` and ``sample-documents`` under both policies (288 runs,
in-process through ``gptflow.cli.main``), plus one real subprocess per format.

Which mechanism catches what (the ``REASON`` table holds the exact message of each case):

* truncation, every format: the stream ends before its end marker (gzip, xz: ``EOFError``;
  zstd: the frame layout, walked by :class:`gptflow.data.streams.ZstdFrames`; zip and parquet:
  the central directory / footer at the end of the file is gone); the offset is the file size;
* empty file: an empty compressed stream is our own check (gzip would read it as no data);
* garbage: the gzip/xz/zstd magic, the zip end-of-central-directory, the parquet footer magic;
* a flipped bit: gzip's CRC-32 (also under tar), xz's CRC-64 / LZMA2 decoder, zstd's content
  checksum (written by the ``zstd`` CLI by default), zip's deflate decoder, parquet's page
  CRC-32 (``write_page_checksum``). Without a checksum -- zstd written without one, parquet
  written without page CRCs -- the same flip decodes into different text: undetectable by
  format, and asserted as such (all 20 documents read).
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from gptflow.cli import main
from gptflow.data.streams import DECOMPRESS_CHUNK
from tests.support.corpora import documents, jsonl

N_DOCS = 20

# format label -> file suffix
FORMATS = {
    "gz": "jsonl.gz",
    "xz": "jsonl.xz",
    "zst": "jsonl.zst",  # with the content checksum, as the zstd CLI writes
    "zst-nocheck": "jsonl.zst",  # zstandard's Python default: no checksum
    "tar.gz": "tar.gz",
    "zip": "zip",
    "parquet": "parquet",  # with page CRC-32s
    "parquet-nocrc": "parquet",
}
KINDS = ["trunc1", "half", "last-byte-missing", "flip", "garbage", "empty"]

GZ_EOF = r"truncated \(Compressed file ended before the end-of-stream marker was reached\)"
ZST_CUT = r"truncated: the data ends inside a zstd frame"
EMPTY = r"the file is empty, not a compressed stream"
NOT_ZIP = r"not a zip archive \(File is not a zip file\)"
PQ_MAGIC = r"not a readable parquet file \(Parquet magic bytes not found in footer"
# (format, kind) -> message regex; absent: undetectable, read as 20 documents
REASON = {
    ("gz", "trunc1"): r"corrupt data \(BadGzipFile: Not a gzipped file \(b'\\x1f'\)\)",
    ("gz", "half"): GZ_EOF,
    ("gz", "last-byte-missing"): GZ_EOF,
    ("gz", "flip"): r"corrupt data \(BadGzipFile: CRC check failed 0x[0-9a-f]+ != 0x[0-9a-f]+\)",
    ("gz", "garbage"): r"corrupt data \(BadGzipFile: Not a gzipped file \(b'he'\)\)",
    ("gz", "empty"): EMPTY,
    ("xz", "trunc1"): GZ_EOF,
    ("xz", "half"): GZ_EOF,
    ("xz", "last-byte-missing"): GZ_EOF,
    ("xz", "flip"): r"corrupt data \(LZMAError: Corrupt input data\)",
    ("xz", "garbage"): r"corrupt data \(LZMAError: Input format not supported by decoder\)",
    ("xz", "empty"): EMPTY,
    ("zst", "trunc1"): ZST_CUT,
    ("zst", "half"): ZST_CUT,
    ("zst", "last-byte-missing"): ZST_CUT,  # inside the 4-byte checksum: all data decoded
    ("zst", "flip"): r"corrupt data \(ZstdError: .*doesn't match checksum\)",
    ("zst", "garbage"): r"corrupt data \(ZstdError: .*Unknown frame descriptor\)",
    ("zst", "empty"): EMPTY,
    ("zst-nocheck", "trunc1"): ZST_CUT,
    ("zst-nocheck", "half"): ZST_CUT,
    ("zst-nocheck", "last-byte-missing"): ZST_CUT,
    ("zst-nocheck", "garbage"): r"corrupt data \(ZstdError: .*Unknown frame descriptor\)",
    ("zst-nocheck", "empty"): EMPTY,
    ("tar.gz", "trunc1"): r"corrupt data \(BadGzipFile: Not a gzipped file \(b'\\x1f'\)\)",
    ("tar.gz", "half"): GZ_EOF,
    ("tar.gz", "last-byte-missing"): GZ_EOF,  # tarfile's own gzip reader would miss this
    ("tar.gz", "flip"): r"corrupt data \(BadGzipFile: CRC check failed",  # tarfile's: too
    ("tar.gz", "garbage"): r"corrupt data \(BadGzipFile: Not a gzipped file \(b'he'\)\)",
    ("tar.gz", "empty"): EMPTY,
    ("zip", "trunc1"): NOT_ZIP,
    ("zip", "half"): NOT_ZIP,
    ("zip", "last-byte-missing"): NOT_ZIP,
    ("zip", "flip"): r"corrupt data \(error: Error -3 while decompressing data",
    ("zip", "garbage"): NOT_ZIP,
    ("zip", "empty"): NOT_ZIP,
    ("parquet", "trunc1"): r"not a readable parquet file \(Parquet file size is 1 bytes",
    ("parquet", "half"): PQ_MAGIC,
    ("parquet", "last-byte-missing"): PQ_MAGIC,
    ("parquet", "flip"): r"corrupt row group 2 \(rows 11-15; OSError: .*CRC checksum verification",
    ("parquet", "garbage"): PQ_MAGIC,
    ("parquet", "empty"): r"not a readable parquet file \(Parquet file size is 0 bytes\)",
    ("parquet-nocrc", "trunc1"): r"not a readable parquet file \(Parquet file size is 1 bytes",
    ("parquet-nocrc", "half"): PQ_MAGIC,
    ("parquet-nocrc", "last-byte-missing"): PQ_MAGIC,
    ("parquet-nocrc", "garbage"): PQ_MAGIC,
    ("parquet-nocrc", "empty"): r"not a readable parquet file \(Parquet file size is 0 bytes\)",
}
# where the message says decoding stopped: the file's end (truncation, empty), at or after the
# flipped byte, or anywhere in the file (garbage; a parquet row group's column data)
# the damage is found inside a member: the message names it
IN_MEMBER = {
    ("tar.gz", "half"): "!d/x.jsonl",
    ("tar.gz", "last-byte-missing"): "!d/x.jsonl",
    ("tar.gz", "flip"): "!d/x.jsonl",
    ("zip", "flip"): "!x.jsonl",
}
KEPT_ON_SKIP = {
    ("parquet", "flip"): 15,  # the other three row groups of 5 rows each
    # all data decoded, the checksum cut: the frame walk finds the cut after the decoder is done
    ("zst", "last-byte-missing"): N_DOCS,
}


def _clean(fmt: str, data: bytes, docs: list[str]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    if fmt == "gz":
        return gzip.compress(data, mtime=0)
    if fmt == "xz":
        return lzma.compress(data)
    if fmt.startswith("zst"):
        return zstandard.ZstdCompressor(level=3, write_checksum=fmt == "zst").compress(data)
    if fmt == "tar.gz":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            info = tarfile.TarInfo("d/x.jsonl")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        return buf.getvalue()
    if fmt == "zip":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("x.jsonl", data)
        return buf.getvalue()
    buf = io.BytesIO()
    pq.write_table(
        pa.table({"text": docs}),
        buf,
        row_group_size=5,
        compression="none",
        write_page_checksum=fmt == "parquet",
    )
    return buf.getvalue()


def _damage(kind: str, blob: bytes) -> tuple[bytes, int]:
    """The damaged bytes, and the flipped byte's offset (-1 when nothing is flipped)."""
    n = len(blob)
    if kind == "trunc1":
        return blob[:1], -1
    if kind == "half":
        return blob[: n // 2], -1
    if kind == "last-byte-missing":
        return blob[:-1], -1
    if kind == "flip":
        flipped = bytearray(blob)
        flipped[n // 2] ^= 0x01
        return bytes(flipped), n // 2
    if kind == "garbage":
        return b"hello garbage" * 10, -1
    return b"", -1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, int]]:
    """(format, kind) -> (damaged file, flipped offset) for all 48 cases."""
    root = tmp_path_factory.mktemp("corrupt")
    docs = documents(N_DOCS)
    assert len(docs) == N_DOCS
    data = jsonl(docs)
    cases = {}
    for fmt, suffix in FORMATS.items():
        clean = _clean(fmt, data, docs)
        for kind in KINDS:
            damaged, flipped = _damage(kind, clean)
            path = root / fmt / kind / f"in.{suffix}"
            path.parent.mkdir(parents=True)
            path.write_bytes(damaged)
            cases[fmt, kind] = (path, flipped)
    return cases


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _check_error(path: Path, fmt: str, kind: str, flipped: int, rc: int, err: str, cmd: str):
    size = path.stat().st_size
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc == 1 and "Traceback" not in err and len(lines) == 1, err
    member = re.escape(IN_MEMBER.get((fmt, kind), ""))
    head = rf"gptflow {cmd}: error: {re.escape(str(path))}{member}: "
    assert re.match(head + REASON[fmt, kind], lines[0]), lines[0]
    assert "on_bad_document: skip" in lines[0] and "download the file again" in lines[0]
    at = re.search(r"stopped at (?:the row group's column data at )?(?:compressed )?byte (\d+) "
                   r"of (\d+)", lines[0])  # fmt: skip
    assert at, lines[0]
    offset, total = int(at[1]), int(at[2])
    assert total == size
    if kind in ("trunc1", "half", "last-byte-missing", "empty"):
        if fmt.startswith("parquet"):
            assert offset == max(0, size - 8)  # the footer's length and magic
        else:
            assert offset == size
    elif kind == "flip" and not fmt.startswith("parquet"):
        assert flipped < offset <= size
    else:
        assert 0 <= offset <= size


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_damaged_inputs_fail_each_stage_with_the_byte_and_publish_nothing(
    corpus, tokenizer_json, tmp_path, capsys, fmt
):
    for kind in KINDS:
        path, flipped = corpus[fmt, kind]
        out = tmp_path / kind
        out.mkdir()
        common = ["--input", str(path)]
        runs = {
            "count-documents": [*common, "--out", str(out / "count.json")],
            "tokenize": [*common, "--tokenizer", str(tokenizer_json), "--append-eod",
                         "--output-prefix", str(out / "shard")],
            "sample-documents": [*common, "--max-mb", "1", "--out", str(out / "sample.jsonl")],
        }  # fmt: skip
        for cmd, args in runs.items():
            rc, stdout, err = _run([cmd, *args], capsys)
            if (fmt, kind) not in REASON:  # undetectable by format: read as it decodes
                assert rc == 0 and "dropped none" in stdout, (kind, cmd, err)
                continue
            _check_error(path, fmt, kind, flipped, rc, err, cmd)
        if (fmt, kind) in REASON:
            assert sorted(p.name for p in out.iterdir()) == [], kind  # not even a temporary
        else:
            assert json.loads((out / "count.json").read_text())["documents"] == N_DOCS


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_skip_counts_each_damaged_input_as_one_region(
    corpus, tokenizer_json, tmp_path, capsys, fmt
):
    for kind in KINDS:
        path, _ = corpus[fmt, kind]
        detected = (fmt, kind) in REASON
        kept = KEPT_ON_SKIP.get((fmt, kind), 0) if detected else N_DOCS
        want = {"corrupt_data": 1} if detected else {}
        out = tmp_path / kind
        common = ["--input", str(path), "--on-bad-document", "skip"]
        rc, _, err = _run(["count-documents", *common, "--out", str(out / "count.json")], capsys)
        assert rc == 0 and "Traceback" not in err, err
        counted = json.loads((out / "count.json").read_text())
        assert (counted["documents"], counted["dropped"]) == (kept, want), kind
        rc, _, err = _run(
            ["tokenize", *common, "--tokenizer", str(tokenizer_json), "--append-eod",
             "--output-prefix", str(out / "shard")],
            capsys,
        )  # fmt: skip
        assert rc == 0, err
        manifest = json.loads((out / "shard.json").read_text())
        assert (manifest["documents"], manifest["dropped"]) == (kept, want), kind
        rc, stdout, err = _run(
            ["sample-documents", *common, "--max-mb", "1", "--out", str(out / "sample.jsonl")],
            capsys,
        )
        if kept:
            assert rc == 0 and f"{kept} documents" in stdout, err
            assert f"dropped {want or 'none'}" in stdout, stdout
        else:  # nothing left to sample: an error, and no empty sample published
            assert rc == 1 and "no documents in the inputs; nothing to sample" in err, err
            assert not (out / "sample.jsonl").exists()
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_hf_worker_processes_stop_and_publish_nothing(corpus, tokenizer_json, tmp_path, capsys):
    """The hf engine's worker pool is torn down when the reader meets damage."""
    path, _ = corpus["zst", "flip"]
    rc, _, err = _run(
        ["tokenize", "--input", str(path), "--tokenizer", str(tokenizer_json), "--engine", "hf",
         "--workers", "2", "--output-prefix", str(tmp_path / "shard")],
        capsys,
    )  # fmt: skip
    assert rc == 1 and re.search(REASON["zst", "flip"], err), err
    assert list(tmp_path.iterdir()) == []


def test_a_real_process_prints_one_line_per_damaged_format(corpus, tmp_path):
    """The console script's stderr itself: one line, exit status 1, no traceback."""
    procs = {}
    for fmt in FORMATS:
        path, _ = corpus[fmt, "half"]
        procs[fmt] = subprocess.Popen(
            [sys.executable, "-m", "gptflow", "count-documents", "--input", str(path),
             "--out", str(tmp_path / f"{fmt}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    for fmt, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        path, _ = corpus[fmt, "half"]
        assert proc.returncode == 1 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"gptflow count-documents: error: {path}")
        assert re.search(REASON[fmt, "half"], err), err
    assert list(tmp_path.glob("*.json")) == []


# ------------------------------------------------------- what comes before the damage is kept


def _big_jsonl() -> tuple[bytes, list[int]]:
    """~3 MB of JSONL (documents of real words in a seeded random order, so that every part
    compresses alike) and the end offset of each line."""
    import random

    words = re.findall(r"\w+", " ".join(documents(N_DOCS)))
    rng = random.Random(16)
    lines = [
        json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 600)))}).encode() + b"\n"
        for _ in range(1600)
    ]
    ends, total = [], 0
    for line in lines:
        total += len(line)
        ends.append(total)
    return b"".join(lines), ends


def _decodable_prefix(fmt: str, path: Path) -> int:
    """How many bytes a one-shot decoder object gets out of a cut file: the reference, outside
    our streaming layers (gzip -dc, xz -dc and zstd -dc print as many)."""
    import zlib

    import zstandard

    cut = path.read_bytes()
    if fmt == "gz":
        return len(zlib.decompressobj(wbits=31).decompress(cut))
    if fmt == "xz":
        return len(lzma.LZMADecompressor().decompress(cut))
    return len(zstandard.ZstdDecompressor().decompressobj().decompress(cut))


@pytest.mark.parametrize("fmt", ["gz", "xz", "zst"])
def test_skip_keeps_the_whole_lines_before_the_damage_in_every_stage(
    tokenizer_json, tmp_path, capsys, fmt
):
    """Truncated at 80%: the whole lines read before the decoder stopped are kept -- the same
    number for count-documents, tokenize and a document range of it -- and the rest is one
    corrupt_data region. gzip and xz raise inside the read that meets the cut, so what that
    read would have returned is lost: the whole DECOMPRESS_CHUNK pieces before it are kept;
    zstd hands on all it decoded, and the frame walk finds the cut after it."""
    data, ends = _big_jsonl()
    blob = _clean(fmt, data, [])
    cut = blob[: len(blob) * 4 // 5]
    path = tmp_path / f"big.{FORMATS[fmt]}"
    path.write_bytes(cut)
    decoded = _decodable_prefix(fmt, path)
    if fmt != "zst":
        decoded -= decoded % DECOMPRESS_CHUNK
    kept = sum(1 for end in ends if end <= decoded)
    assert decoded >= DECOMPRESS_CHUNK and 0 < kept < len(ends)
    common = ["--input", str(path), "--on-bad-document", "skip"]

    assert _run(["count-documents", *common, "--out", str(tmp_path / "c.json")], capsys)[0] == 0
    counted = json.loads((tmp_path / "c.json").read_text())
    assert (counted["documents"], counted["dropped"]) == (kept, {"corrupt_data": 1})

    rc, _, err = _run(
        ["tokenize", *common, "--tokenizer", str(tokenizer_json), "--append-eod",
         "--output-prefix", str(tmp_path / "all")],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    whole = json.loads((tmp_path / "all.json").read_text())
    assert (whole["documents"], whole["dropped"]) == (kept, {"corrupt_data": 1})
    rc, _, err = _run(
        ["tokenize", *common, "--tokenizer", str(tokenizer_json), "--append-eod",
         "--documents", f"{kept - 3}:", "--counts", str(tmp_path / "c.json"),
         "--output-prefix", str(tmp_path / "tail")],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert json.loads((tmp_path / "tail.json").read_text())["documents"] == 3

    # the kept documents are the file's first ones, token for token
    plain = tmp_path / "prefix.jsonl"
    plain.write_bytes(data[: ends[kept - 1]])
    rc, _, err = _run(
        ["tokenize", "--input", str(plain), "--tokenizer", str(tokenizer_json), "--append-eod",
         "--output-prefix", str(tmp_path / "ref")],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert (tmp_path / "all.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()

    # with 'error' the same input names the line the damage cut
    rc, _, err = _run(
        ["count-documents", "--input", str(path), "--out", str(tmp_path / "e.json")], capsys
    )
    assert rc == 1 and f"compressed byte {len(cut)} of {len(cut)}, in line {kept + 1};" in err


# ---------------------------------------------------------------- documents that attack parsers


@pytest.mark.parametrize(
    ("line", "reason", "message"),
    [
        (b'{"text": "a", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too_deep",
         r"JSON nested deeper than the parser's recursion limit"),
        (b"[" * 100_000, "too_deep", r"JSON nested deeper than the parser's recursion limit"),
        (b'{"text": "caf\xe9 \xff\xfe"}', "invalid_utf8", r"invalid UTF-8 at byte 13 of the line"),
    ],
)  # fmt: skip
def test_hostile_lines_are_named_or_counted(
    tokenizer_json, tmp_path, capsys, line, reason, message
):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "ok"}\n' + line + b'\n{"text": "after"}\n')
    runs = [
        ("count-documents", ["--out", str(tmp_path / "c.json")]),
        ("tokenize", ["--tokenizer", str(tokenizer_json), "--output-prefix", str(tmp_path / "t")]),
        ("sample-documents", ["--max-mb", "1", "--out", str(tmp_path / "s.jsonl")]),
    ]
    for cmd, extra in runs:
        rc, _, err = _run([cmd, "--input", str(src), *extra], capsys)
        assert rc == 1 and "Traceback" not in err
        assert re.match(rf"gptflow {cmd}: error: {re.escape(str(src))}:2: {message}", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    for cmd, extra in runs:
        rc, stdout, err = _run([cmd, "--input", str(src), *extra, "--on-bad-document", "skip"],
                               capsys)  # fmt: skip
        assert rc == 0, err
        assert f"dropped {{'{reason}': 1}}" in stdout, stdout


def test_invalid_utf8_in_a_parquet_row_is_named_by_row(tokenizer_json, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = pa.py_buffer(b"\x00\x00\x00\x00\x02\x00\x00\x00\x06\x00\x00\x00")  # int32: 0, 2, 6
    texts = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"okcaf\xe9")])
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts}), src)
    rc, _, err = _run(
        ["count-documents", "--input", str(src), "--out", str(tmp_path / "c")], capsys
    )
    assert rc == 1
    assert f"error: {src}: row 2: 'text' is not valid UTF-8 (at byte 3); fix the row" in err
    args = ["count-documents", "--input", str(src), "--on-bad-document", "skip"]
    assert _run([*args, "--out", str(tmp_path / "c.json")], capsys)[0] == 0
    counted = json.loads((tmp_path / "c.json").read_text())
    assert (counted["documents"], counted["dropped"]) == (1, {"invalid_utf8": 1})


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


A_LINES = b'{"text": "one"}\n' * 40  # 640 bytes: member a.jsonl is 512 + 1024 bytes
GOOD_TAR = _tar([("a.jsonl", A_LINES), ("b.jsonl", b'{"text": "two"}\n' * 40)])
SECOND = 1536  # the second header ("b.jsonl" in its first bytes: a flipped "j" is a "k")
END = SECOND + 512 + 1024  # the end blocks


@pytest.mark.parametrize(
    ("name", "blob", "kept", "message"),
    [
        ("flip-in-second-header", GOOD_TAR[: SECOND + 2] + b"k" + GOOD_TAR[SECOND + 3 :], 40,
         r"corrupt tar header at byte 1536 of the archive \(bad checksum or fields\); the "
         r"decoder stopped at byte 10240 of 10240;"),
        ("cut-at-second-header", GOOD_TAR[:SECOND], 40,
         r"truncated: the tar archive ends at byte 1536, without its end blocks; the decoder "
         r"stopped at byte 1536 of 1536;"),
        ("cut-inside-second-header", GOOD_TAR[: SECOND + 100], 40,
         r"truncated: the tar archive ends at byte 1636, without its end blocks"),
        ("no-end-blocks", GOOD_TAR[:END], 80,
         r"truncated: the tar archive ends at byte 3072, without its end blocks"),
        ("one-end-block", GOOD_TAR[: END + 512], 80, None),
        ("whole", GOOD_TAR, 80, None),
    ],
)  # fmt: skip
def test_tar_headers_tarfile_takes_for_the_end_are_found(
    tmp_path, capsys, name, blob, kept, message
):
    """tarfile ends a stream quietly on an unreadable header after the first (a flipped byte, a
    cut); the block where it stopped tells a real end (zero blocks) from damage."""
    src = tmp_path / "in.tar"
    src.write_bytes(blob)
    rc, _, err = _run(
        ["count-documents", "--input", str(src), "--out", str(tmp_path / "e")], capsys
    )
    if message is None:
        assert rc == 0, err
        assert json.loads((tmp_path / "e").read_text())["documents"] == kept
        return
    assert rc == 1 and re.match(
        rf"gptflow count-documents: error: {re.escape(str(src))}: {message}", err
    ), err
    args = ["count-documents", "--input", str(src), "--on-bad-document", "skip"]
    assert _run([*args, "--out", str(tmp_path / "c.json")], capsys)[0] == 0
    counted = json.loads((tmp_path / "c.json").read_text())
    assert (counted["documents"], counted["dropped"]) == (kept, {"corrupt_data": 1})


@pytest.mark.parametrize("fmt", ["gz", "xz", "zst"])
def test_a_damaged_text_document_is_one_region(tmp_path, capsys, fmt):
    """A .txt.* file is one document: damage anywhere loses it whole."""
    text = "\n".join(documents(N_DOCS)).encode()
    blob = _clean(fmt, text, [])
    src = tmp_path / f"book.txt.{FORMATS[fmt].split('.')[-1]}"
    src.write_bytes(blob[: len(blob) // 2])
    rc, _, err = _run(
        ["count-documents", "--input", str(src), "--out", str(tmp_path / "e")], capsys
    )
    size = len(blob) // 2
    assert rc == 1 and f"{src}: truncated" in err and f"compressed byte {size} of {size};" in err
    args = ["count-documents", "--input", str(src), "--on-bad-document", "skip"]
    assert _run([*args, "--out", str(tmp_path / "c.json")], capsys)[0] == 0
    counted = json.loads((tmp_path / "c.json").read_text())
    assert (counted["documents"], counted["dropped"]) == (0, {"corrupt_data": 1})


def test_a_damaged_zip_member_ends_only_itself(tmp_path, capsys):
    """Members are found through the central directory: the next one is read again."""
    lines = [json.dumps({"text": f"document {i}"}).encode() + b"\n" for i in range(30)]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("a.jsonl", b"".join(lines[:10]))
        z.writestr("b.jsonl", b"".join(lines[10:20]))
        z.writestr("c.jsonl", b"".join(lines[20:]))
    blob = bytearray(buf.getvalue())
    at = blob.index(b"document 15")
    blob[at] ^= 0x20  # stored, so only b.jsonl's CRC-32 can tell
    src = tmp_path / "in.zip"
    src.write_bytes(bytes(blob))
    rc, _, err = _run(
        ["count-documents", "--input", str(src), "--out", str(tmp_path / "e")], capsys
    )
    assert (
        rc == 1
        and f"{src}!b.jsonl: corrupt data (BadZipFile: Bad CRC-32 for file 'b.jsonl')" in err
    )
    args = ["count-documents", "--input", str(src), "--on-bad-document", "skip"]
    assert _run([*args, "--out", str(tmp_path / "c.json")], capsys)[0] == 0
    counted = json.loads((tmp_path / "c.json").read_text())
    assert (counted["documents"], counted["dropped"]) == (20, {"corrupt_data": 1})
