"""Every catalog format reads back the documents written into it, streaming."""

import io
import json

import pytest

from gptflow.data.readers import infer_format, iter_texts
from gptflow.errors import GptflowError
from tests.support.corpora import documents, write_all

MEMBERS = {"docs.tar.gz": "docs/*"}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    return root, write_all(root, documents())


@pytest.mark.parametrize(
    "name",
    ["enwik8.zip", "train/00.jsonl.zst", "oscar-1GB.jsonl.xz", "c4-train.00000-of-00001.json.gz",
     "docs.tar.gz", "data.parquet", "book.txt"],
)  # fmt: skip
def test_format_round_trip(corpora, name):
    root, made = corpora
    texts = list(iter_texts(root / name, member=MEMBERS.get(name, "*")))
    assert texts == made[name]


def test_format_inference():
    assert infer_format("train/00.jsonl.zst") == "jsonl.zst"
    assert infer_format("c4-train.00000-of-01024.json.gz") == "json.gz"
    assert infer_format("x.TAR.GZ") == "tar.gz"
    with pytest.raises(
        GptflowError, match=r"enwik8: cannot tell the format from the name; set the format"
    ):
        infer_format("enwik8")


def test_unsupported_and_mismatched_inputs_are_named(corpora, tmp_path):
    root, _ = corpora
    with pytest.raises(GptflowError, match=r"format 'rar' is not supported; use one of"):
        list(iter_texts(root / "book.txt", "rar"))
    with pytest.raises(GptflowError, match=r"no member matches 'nothing/\*'"):
        list(iter_texts(root / "enwik8.zip", member="nothing/*"))
    with pytest.raises(GptflowError, match=r"no column 'content' \(columns: \['text', 'id'\]\)"):
        list(iter_texts(root / "data.parquet", json_key="content"))
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip")
    with pytest.raises(GptflowError, match=r"bad\.zip: not a zip archive"):
        list(iter_texts(bad))


def test_member_line_numbers_in_errors(tmp_path):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b'{"text": "a"}\n{"txt": "b"}\n'
        info = tarfile.TarInfo("d/x.jsonl")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    (tmp_path / "a.tar").write_bytes(buf.getvalue())
    with pytest.raises(
        GptflowError, match=r"a\.tar!d/x\.jsonl:2: no key 'text' \(found \['txt'\]\)"
    ):
        list(iter_texts(tmp_path / "a.tar"))


def _zstd_variants(data: bytes) -> dict[str, bytes]:
    """The frame layouts writers produce: one-shot (content size in the header), streamed (no
    content size, a window descriptor), with a checksum, several frames (pzstd, appends) and a
    skippable frame (seekable-format indexes)."""
    import struct

    import zstandard

    half = data.rfind(b"\n", 0, len(data) // 2) + 1  # frames split between lines
    streamed = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(streamed, closefd=False) as w:
        w.write(data)
    skippable = struct.pack("<II", 0x184D2A5E, 5) + b"index"
    one = zstandard.ZstdCompressor(level=3)
    checked = zstandard.ZstdCompressor(level=3, write_checksum=True)
    return {
        "one-shot": one.compress(data),
        "streamed": streamed.getvalue(),
        "checksum": checked.compress(data),
        "two frames": checked.compress(data[:half]) + one.compress(data[half:]),
        "skippable frame": one.compress(data[:half]) + skippable + checked.compress(data[half:]),
        "tiny blocks": zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(
                window_log=10, target_length=64, strategy=zstandard.STRATEGY_FAST
            )
        ).compress(data),
    }


def test_zstd_frame_walk_accepts_every_layout_and_finds_every_cut(tmp_path):
    """The frame walk must accept what writers produce, and a cut anywhere -- a header, a
    block, a checksum, between frames' bytes -- must fail; cut exactly between two frames the
    first frame is whole, and the stream reads as what it is."""
    import zstandard

    from gptflow.data.streams import ZstdFrames

    docs = documents(12)
    data = b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)
    whole_frames = set()
    for name, blob in _zstd_variants(data).items():
        path = tmp_path / "v.jsonl.zst"
        path.write_bytes(blob)
        assert list(iter_texts(path)) == docs, name
        walk = ZstdFrames()
        boundaries = []  # offsets where the bytes so far end a frame
        for i in range(len(blob)):
            walk.feed(blob[i : i + 1])
            if walk.complete():
                boundaries.append(i + 1)
        assert not walk.foreign and boundaries[-1] == len(blob), name
        for cut in sorted({1, 5, 13, len(blob) // 3, len(blob) // 2, len(blob) - 1, *boundaries}):
            path.write_bytes(blob[:cut])
            if cut == len(blob):
                continue
            if cut in boundaries:  # whole frames: exactly what they hold
                whole_frames.add(name)
                expected = zstandard.ZstdDecompressor().decompressobj().decompress(blob[:cut])
                assert (
                    b"".join(json.dumps({"text": t}).encode() + b"\n" for t in iter_texts(path))
                    == expected
                ), (name, cut)
                continue
            with pytest.raises(GptflowError, match=rf"compressed byte {cut} of {cut}"):
                list(iter_texts(path))
    assert whole_frames == {"two frames", "skippable frame"}


def test_empty_inputs(tmp_path):
    """An empty plain file holds no documents; an empty compressed file is damage."""
    (tmp_path / "e.jsonl").write_bytes(b"")
    assert list(iter_texts(tmp_path / "e.jsonl")) == []
    for suffix in ("jsonl.gz", "jsonl.xz", "jsonl.zst", "txt.gz"):
        (tmp_path / f"e.{suffix}").write_bytes(b"")
        with pytest.raises(
            GptflowError, match=r"the file is empty, not a compressed stream; the decoder "
            r"stopped at compressed byte 0 of 0"
        ):  # fmt: skip
            list(iter_texts(tmp_path / f"e.{suffix}"))
