"""Every catalog format reads back the documents written into it, streaming."""

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
