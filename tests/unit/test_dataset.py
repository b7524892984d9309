"""Training samples: identical to megatron-core's GPTDataset and BlendedDataset, index for index."""

import numpy as np
import pytest

from gptflow.data.dataset import (
    ShardSet,
    blending_indices,
    build_sample_index,
    build_split_datasets,
    split_bounds,
)
from gptflow.data.indexed import IndexedDatasetWriter
from gptflow.errors import GptflowError

SIZES = {"train": 3000, "valid": 200, "test": 40}


def make_prefix(path, n_docs, seed, vocab=500):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(2, vocab, size=int(n)) for n in rng.integers(0, 300, size=n_docs)]
    with IndexedDatasetWriter(path, np.uint16) as w:
        w.add_documents(docs)
        w.finalize()
    return str(path), docs


def megatron_builder(cache, blend, split, sizes, seq):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tok:  # just what GPTDataset reads; pad must not occur in the data
        eod, pad, vocab_size, unique_identifiers = 0, 1, 512, {"class": "stub"}

    cfg = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq,
        blend=blend,
        split=split,
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=cache,  # its BlendedDataset cache needs torch.distributed: None there
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()


def reference_sample_index(lengths, doc_index, seq, num_samples):
    """megatron-core helpers.cpp build_sample_idx, transcribed loop for loop."""
    out = [(0, 0)]
    di, off = 0, 0
    while len(out) <= num_samples:
        remaining = seq + 1
        while remaining:
            length = lengths[doc_index[di]] - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - 1
                remaining = 0
            else:
                di += 1
                off = 0
        out.append((di, off))
    return np.array(out)


def test_sample_index_matches_the_cpp_loop():
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 40, size=300).astype(np.int32)
    doc_index = rng.permutation(np.tile(np.arange(300, dtype=np.int32), 2))
    for seq in (1, 7, 64):
        n = (int(lengths.sum()) * 2 - 1) // seq
        ours = build_sample_index(lengths, doc_index, seq, n)
        assert np.array_equal(ours, reference_sample_index(lengths, doc_index, seq, n)), seq


def test_identical_to_megatron_gpt_dataset(tmp_path):
    prefix, _ = make_prefix(tmp_path / "d", 200, seed=0)
    theirs = megatron_builder(
        str(tmp_path / "mc"), ([prefix], None), "90,9,1", list(SIZES.values()), 64
    )
    ours = build_split_datasets(
        [("d", 1.0, [prefix], ["sha"])], "90,9,1", SIZES, 64, 1234, tmp_path / "c"
    )
    for split, m in zip(SIZES, theirs, strict=True):
        o = ours[split]
        assert np.array_equal(o.index.document_index, m.document_index)
        assert np.array_equal(o.index.sample_index, m.sample_index)
        assert np.array_equal(o.index.shuffle_index, m.shuffle_index)
        for i in range(len(m)):
            sample = m[i]
            assert np.array_equal(o[i][:-1], sample["tokens"].numpy())
            assert np.array_equal(o[i][1:], sample["labels"].numpy())


def test_identical_to_megatron_blend(tmp_path):
    a, _ = make_prefix(tmp_path / "a", 150, seed=1)
    b, _ = make_prefix(tmp_path / "b", 90, seed=2)
    theirs = megatron_builder(None, ([a, b], [0.3, 0.7]), "90,9,1", list(SIZES.values()), 32)
    ours = build_split_datasets(
        [("a", 0.3, [a], ["sa"]), ("b", 0.7, [b], ["sb"])], "90,9,1", SIZES, 32, 1234
    )
    for split, m in zip(SIZES, theirs, strict=True):
        o = ours[split]
        assert np.array_equal(o.dataset_index, m.dataset_index)
        assert np.array_equal(o.dataset_sample_index, m.dataset_sample_index)
        for i in range(0, len(o), 7):
            assert np.array_equal(o[i][:-1], m[i]["tokens"].numpy())


def test_blending_indices_match_megatron_helper():
    from megatron.core.datasets import helpers_cpp

    weights = [0.5, 0.2, 0.3]
    size = 1000
    di = np.zeros(size, dtype=np.int16)
    dsi = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(di, dsi, np.array(weights), 3, size, False)
    ours = blending_indices(weights, size)
    assert np.array_equal(ours[0], di) and np.array_equal(ours[1], dsi)


def test_shards_read_as_one_merged_prefix(tmp_path):
    a, docs_a = make_prefix(tmp_path / "a", 20, seed=4)
    b, docs_b = make_prefix(tmp_path / "b", 30, seed=5)
    s = ShardSet([a, b])
    nonempty = [d for d in docs_a + docs_b if len(d)]
    assert len(s) == len(nonempty)
    for i, d in enumerate(nonempty):
        assert s.get(i).tolist() == d.tolist()
    assert s.get(len(s) - 1, 2, 3).tolist() == nonempty[-1][2:5].tolist()


def test_split_bounds_round_like_megatron():
    assert split_bounds("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_bounds("90/10", 7) == [(0, 6), (6, 7), (7, 7)]


def test_empty_split_is_an_error_not_an_endless_loop(tmp_path):
    """Megatron loops forever here; we name the split and the fix."""
    prefix, _ = make_prefix(tmp_path / "d", 30, seed=6)
    with pytest.raises(
        GptflowError, match=r"data\.split '949,50,1' gives the test split of dataset 'd' 0 of its"
    ):
        build_split_datasets([("d", 1.0, [prefix], ["s"])], "949,50,1", SIZES, 16, 1)


def test_indices_are_cached_on_disk(tmp_path):
    prefix, _ = make_prefix(tmp_path / "d", 200, seed=7)
    cache = tmp_path / "cache"
    first = build_split_datasets([("d", 1.0, [prefix], ["s"])], "90,9,1", SIZES, 16, 1, cache)
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 3 * 4  # 3 splits x (3 arrays + description)
    again = build_split_datasets(
        [("d", 1.0, [prefix], ["s"])], "90,9,1", SIZES, 16, 1, cache, build_allowed=False
    )
    assert np.array_equal(first["train"][5], again["train"][5])


def test_a_data_ablation_run_is_validated_and_tested_on_the_held_out_shards(tmp_path):
    """A study run with its own data.quality trains on its recipe's shards and reads the
    validation and test splits of the base's (`heldout`): every run the same held-out text."""
    cleaned, _ = make_prefix(tmp_path / "cleaned", 150, seed=8)
    base, _ = make_prefix(tmp_path / "base", 200, seed=9)
    alone = build_split_datasets([("d", 1.0, [cleaned], ["c"])], "90,9,1", SIZES, 16, 1)
    data = build_split_datasets(
        [("d", 1.0, [cleaned], ["c"])], "90,9,1", SIZES, 16, 1, heldout=[("d", 1.0, [base], ["b"])]
    )
    assert str(data["train"].shards.parts[0].prefix) == cleaned
    assert np.array_equal(data["train"][3], alone["train"][3])  # training as without it
    # the base's own validation and test samples, exactly (its documents 180..199 of 200)
    own = build_split_datasets([("d", 1.0, [base], ["b"])], "90,9,1", SIZES, 16, 1)
    for split in ("valid", "test"):
        assert str(data[split].shards.parts[0].prefix) == base
        assert all(np.array_equal(data[split][i], own[split][i]) for i in range(0, 40, 7))
        assert not np.array_equal(data[split][0], alone[split][0])
