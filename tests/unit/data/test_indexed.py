"""The .bin/.idx format: byte layout, round trip, and megatron-core as an independent reader."""

import struct

import numpy as np
import pytest

from gptflow.data.indexed import (
    MAGIC,
    IndexedDataset,
    IndexedDatasetWriter,
    dtype_for_vocab,
    merge_datasets,
)
from gptflow.errors import GptflowError


def write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        w.add_documents([np.asarray(d, dtype=np.int64) for d in docs])
        w.finalize()
    return w


def test_worked_example_is_byte_exact(tmp_path):
    """Two 3-token documents ending in EOD 0, vocab 50257: the 82-byte index NeoX writes."""
    prefix = tmp_path / "ex"
    write(prefix, [[3258, 7115, 0], [4372, 794, 0]], dtype_for_vocab(50257))
    assert (tmp_path / "ex.bin").read_bytes() == bytes.fromhex("ba0ccb1b000014111a030000")
    expected = (
        MAGIC
        + struct.pack("<QBQQ", 1, 8, 2, 3)
        + struct.pack("<2i", 3, 3)
        + struct.pack("<2q", 0, 6)
        + struct.pack("<3q", 0, 1, 2)
    )
    idx = (tmp_path / "ex.idx").read_bytes()
    assert len(idx) == 82
    assert idx == expected


def test_round_trip_with_empty_documents(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=n) for n in (5, 0, 17, 1, 0, 300)]
    w = write(tmp_path / "rt", docs)
    ds = IndexedDataset(tmp_path / "rt")
    assert len(ds) == 4  # empty documents have no sequence...
    assert ds.num_documents == 6  # ...but are still documents (Megatron semantics)
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3, 3, 4]
    nonempty = [d for d in docs if len(d)]
    for i, d in enumerate(nonempty):
        assert ds[i].tolist() == d.tolist()
    assert ds.get(3, offset=10, length=5).tolist() == nonempty[3][10:15].tolist()
    assert ds.num_tokens == w.tokens == sum(len(d) for d in docs)


def test_dtype_follows_megatron_rule():
    assert dtype_for_vocab(65499) == np.uint16
    assert dtype_for_vocab(65500) == np.int32
    assert dtype_for_vocab(50257) == np.uint16


@pytest.mark.parametrize("vocab", [50257, 100_000])
def test_megatron_core_reads_our_files(tmp_path, vocab):
    """megatron-core's own IndexedDataset (PyPI megatron-core) is the independent reader."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, vocab, size=n) for n in (10, 0, 4, 99)]
    write(tmp_path / "m", docs, dtype_for_vocab(vocab))
    theirs = MegatronIndexed(str(tmp_path / "m"))
    assert theirs.index.dtype == dtype_for_vocab(vocab)
    assert len(theirs) == 3
    assert theirs.document_indices.tolist() == [0, 1, 1, 2, 3]
    for i, d in enumerate(d for d in docs if len(d)):
        assert theirs[i].tolist() == d.tolist()


def test_writer_failure_publishes_nothing(tmp_path):
    prefix = tmp_path / "bad"
    with pytest.raises(RuntimeError), IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents([np.arange(10)])
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_truncated_files_are_named(tmp_path):
    prefix = tmp_path / "t"
    write(prefix, [[1, 2, 3], [4, 5]])
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-2])
    with pytest.raises(GptflowError, match=r"t\.bin: 8 bytes, index implies 10"):
        IndexedDataset(prefix)
    (tmp_path / "t.bin").write_bytes(data)
    idx = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(idx[:-8])
    with pytest.raises(GptflowError, match=r"t\.idx: .*truncated"):
        IndexedDataset(prefix)
    (tmp_path / "t.idx").write_bytes(b"NOTANIDX" + idx[8:])
    with pytest.raises(GptflowError, match="bad magic"):
        IndexedDataset(prefix)


def test_ambiguous_float_dtype_code_is_refused(tmp_path):
    prefix = tmp_path / "f"
    write(prefix, [[1, 2]])
    idx = bytearray((tmp_path / "f.idx").read_bytes())
    idx[17] = 6
    (tmp_path / "f.idx").write_bytes(bytes(idx))
    with pytest.raises(GptflowError, match="ambiguous"):
        IndexedDataset(prefix)


def test_a_file_longer_than_its_pair_implies_is_refused(tmp_path):
    """A .bin longer than its .idx says (a pair from two tokenizations: the samples would be
    read from the wrong bytes) and an .idx longer than its header says (other than Megatron's
    one byte a sequence of multimodal modes) are refused, not read."""
    prefix = tmp_path / "t"
    write(prefix, [[1, 2, 3], [4, 5]])
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data + b"\x07\x00")
    with pytest.raises(GptflowError, match=r"t\.bin: 12 bytes, index implies 10"):
        IndexedDataset(prefix)
    (tmp_path / "t.bin").write_bytes(data)
    idx = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(idx + bytes(2))  # the multimodal modes: N = 2 bytes more
    assert len(IndexedDataset(prefix)) == 2
    (tmp_path / "t.idx").write_bytes(idx + bytes(8))
    with pytest.raises(GptflowError, match=r"t\.idx: .*header implies .*truncated or corrupt"):
        IndexedDataset(prefix)


def test_a_document_index_that_does_not_end_at_the_sequences_is_refused(tmp_path):
    """doc[-1] must be N: an index whose last document stops short would hide sequences from
    every reader that walks documents (Megatron's GPTDataset does)."""
    prefix = tmp_path / "d"
    write(prefix, [[1, 2], [3], [4, 5, 6]])
    idx = bytearray((tmp_path / "d.idx").read_bytes())
    idx[-8:] = struct.pack("<q", 2)  # doc index [0, 1, 2, 2]: sequence 2 in no document
    (tmp_path / "d.idx").write_bytes(bytes(idx))
    with pytest.raises(GptflowError, match=r"d\.idx: document index does not span the 3"):
        IndexedDataset(prefix)


def test_a_merge_of_shards_of_two_token_dtypes_is_refused(tmp_path):
    """uint16 and int32 shards (two tokenizers) concatenated would read one's bytes in the
    other's dtype: the merge names both and writes nothing."""
    write(tmp_path / "small", [[1, 2, 3]], np.uint16)
    write(tmp_path / "large", [[70_000, 2]], np.int32)
    with pytest.raises(GptflowError, match=r"different token dtypes .*small=uint16, .*large=int32"):
        merge_datasets([tmp_path / "small", tmp_path / "large"], tmp_path / "merged")
    assert not list(tmp_path.glob("merged*"))


def test_a_merge_keeps_every_shards_document_boundaries(tmp_path):
    """The merged document index is each shard's shifted by the sequences before it: empty
    documents stay documents (GPT-NeoX's merge_datasets.py writes one document a sequence)."""
    write(tmp_path / "a", [[1, 2], [], [3]])
    write(tmp_path / "b", [[], [4, 5, 6]])
    counts = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    merged = IndexedDataset(tmp_path / "m")
    assert merged.document_indices.tolist() == [0, 1, 1, 2, 2, 3]
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], [3], [4, 5, 6]]
    assert (counts["documents"], counts["sequences"], counts["tokens"]) == (5, 3, 6)
