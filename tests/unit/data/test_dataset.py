"""Training samples: identical to megatron-core's GPTDataset and BlendedDataset, index for index."""

import numpy as np
import pytest

from gptflow.data.blend import blending_indices
from gptflow.data.dataset import (
    ShardSet,
    build_gpt_indices,
    build_sample_index,
    build_split_datasets,
    heldout_train_end,
    heldout_train_ends,
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
    # a recipe's train split cut before the base's held-out documents (heldout_train_ends)
    cut = build_split_datasets(
        [("d", 1.0, [cleaned], ["c"])], "90,9,1", SIZES, 16, 1,
        heldout=[("d", 1.0, [base], ["b"])], train_ends={"d": 40},
    )  # fmt: skip
    assert set(cut["train"].index.document_index.tolist()) == set(range(40))


def documents(sequences_per_document, origins=None):
    """A shard as heldout_train_end reads it: its document index (document j is sequences
    [starts[j], starts[j + 1]); 0 for an empty document) and its documents' origins."""
    starts = np.concatenate([[0], np.cumsum(sequences_per_document)]).astype(np.int64)
    return starts, None if origins is None else np.array(origins, dtype=np.uint32)


def test_a_cleaned_recipe_trains_on_exactly_its_documents_before_the_held_out_ones():
    """heldout_train_end on hand-made shards: the run's train split ends where its documents
    from before the base's first held-out document end, by identity (shard, ordinal)."""
    raw = [documents([1] * 10), documents([1] * 10)]  # the base: 20 collected documents
    # '80,10,10': the base trains on 16, holds out shard 1's documents 6.. (6 is the first)
    run = [documents([1] * 5, [0, 2, 4, 6, 8]), documents([1] * 6, [1, 3, 5, 6, 7, 9])]
    assert heldout_train_end("d", "80,10,10", raw, run) == 5 + 3
    # the base with a recipe of its own: its 9 documents, 7 trained on; held out from its
    # document 7, shard 1's ordinal 8; a raw run (the collected documents) trains on 10 + 8
    own = [documents([1] * 4, [0, 1, 2, 3]), documents([1] * 5, [0, 5, 6, 8, 9])]
    assert heldout_train_end("d", "80,10,10", own, [documents([1] * 10)] * 2) == 18
    # an empty document (no sequence) and a shard the recipe emptied
    gaps = [documents([], []), documents([1, 0, 1, 1], [2, 4, 7, 9])]
    assert heldout_train_end("d", "80,10,10", own, gaps) == 2  # documents 2 and 4 of shard 1
    assert heldout_train_end("d", "100,0,0", raw, run) == 11  # nothing held out: all of it
    with pytest.raises(
        GptflowError,
        match=r"^dataset 'd': the run's data\.quality keeps none of the documents before the "
        r"base's held-out ones \(data\.split '80,10,10' holds out the base's documents from "
        r"shard 1's document 6 on\), so it has nothing to train on; keep more documents in its "
        r"recipe or give the train split a larger share of data\.split$",
    ):
        heldout_train_end("d", "80,10,10", raw, [documents([], []), documents([1] * 2, [6, 9])])


def test_a_shard_must_hold_the_documents_its_origins_list(tmp_path):
    from gptflow.data.quality.origins import write_origins

    base, _ = make_prefix(tmp_path / "base", 20, seed=10)
    run, _ = make_prefix(tmp_path / "run", 5, seed=11)
    write_origins(tmp_path / "o.npy", np.array([0, 3, 4, 7]))
    origins = {"d": {"run": [str(tmp_path / "o.npy")], "base": []}}
    with pytest.raises(
        GptflowError, match=r"run: 5 documents, but .*o\.npy gives the origins of 4"
    ):
        heldout_train_ends("90,9,1", {"d": [run]}, {"d": [base]}, origins)
    write_origins(tmp_path / "o.npy", np.array([0, 3, 4, 7, 19]))
    assert heldout_train_ends("90,9,1", {"d": [run]}, {"d": [base]}, origins) == {"d": 4}


def test_an_index_holds_the_samples_asked_for_when_they_end_on_an_epoch(tmp_path):
    """Samples of seq_length + 1 tokens overlap by one: 4 samples of 8 need 33 tokens, so 32
    tokens an epoch make 2 epochs, not 1 (Megatron counts the extra token), and the run's
    last sample exists."""
    lengths = np.full(4, 8, dtype=np.int32)
    index = build_gpt_indices(lengths, 0, 4, num_samples=4, seq_length=8, seed=1)
    assert len(index) >= 4
    assert len(index.document_index) == 2 * 4


# what a dataset split's index depends on, one input changed at a time (the blend's too)
INDEX_INPUTS = {
    "seed": {"seed": 2},
    "seq_length": {"seq_length": 32},
    # as many sequences, one of them longer: another index over the same range
    "shards": {"datasets": [("a", 0.3, "a2", ["sa2"]), ("b", 0.7, "b", ["sb"])]},
    "split": {"split": "80,19,1"},
    "samples": {"num_samples": {**SIZES, "train": 2000}},
    "weights": {"datasets": [("a", 0.5, "a", ["sa"]), ("b", 0.5, "b", ["sb"])]},
}


@pytest.mark.parametrize("changed", INDEX_INPUTS)
def test_a_cached_index_is_never_read_for_other_inputs(tmp_path, changed):
    """The cache key holds every input of an index: after the indices of one setting are
    cached, those of a setting that differs in one input are the ones built without a cache,
    not the cached ones (a run whose seed, sequence length, shards, split, samples or blend
    weights changed reads the same cache directory: the run's own data-index/)."""
    prefixes = {n: make_prefix(tmp_path / n, docs, seed=s)[0] for n, docs, s in
                (("a", 150, 12), ("b", 90, 13))}  # fmt: skip
    docs = [d for d in make_prefix(tmp_path / "a", 150, seed=12)[1] if len(d)]
    prefixes["a2"] = str(tmp_path / "a2")
    with IndexedDatasetWriter(prefixes["a2"], np.uint16) as w:
        w.add_documents([np.append(docs[0], 7), *docs[1:]])
        w.finalize()

    def build(cache, datasets=(("a", 0.3, "a", ["sa"]), ("b", 0.7, "b", ["sb"])),
              split="90,9,1", num_samples=SIZES, seq_length=16, seed=1):  # fmt: skip
        blend = [(name, w, [prefixes[p]], shas) for name, w, p, shas in datasets]
        return build_split_datasets(blend, split, num_samples, seq_length, seed, cache)

    cache = tmp_path / "cache"
    build(cache)
    cached, fresh = build(cache, **INDEX_INPUTS[changed]), build(None, **INDEX_INPUTS[changed])
    for split in ("train", "valid"):
        for ours, theirs in zip(cached[split].datasets, fresh[split].datasets, strict=True):
            assert np.array_equal(ours.index.shuffle_index, theirs.index.shuffle_index)
            assert np.array_equal(ours.index.document_index, theirs.index.document_index)
            assert np.array_equal(ours.index.sample_index, theirs.index.sample_index)
        assert np.array_equal(cached[split].dataset_index, fresh[split].dataset_index)
        assert all(np.array_equal(cached[split][i], fresh[split][i]) for i in (0, 7, 99))


def test_an_index_cut_short_by_a_kill_is_built_again(tmp_path):
    """Each array is published whole, one after the other: a build killed between them leaves
    some; the next build (rank 0) makes the missing ones instead of failing to load them."""
    prefix, _ = make_prefix(tmp_path / "d", 200, seed=14)
    cache = tmp_path / "cache"
    first = build_split_datasets([("d", 1.0, [prefix], ["s"])], "90,9,1", SIZES, 16, 1, cache)
    (gone,) = cache.glob("*-train-shuffle_index.npy")
    gone.unlink()
    again = build_split_datasets([("d", 1.0, [prefix], ["s"])], "90,9,1", SIZES, 16, 1, cache)
    assert gone.is_file()
    assert np.array_equal(first["train"][5], again["train"][5])


def test_a_held_out_split_that_starts_a_shard(tmp_path):
    """The base's train split ends exactly where a shard ends: its held-out documents start
    at the next shard's first, whether or not the base's shards have origins of their own."""
    split = "50,25,25"  # 8 sequences: the train split is the first 4, shard 0 exactly
    raw = [documents([1] * 4), documents([1] * 4)]
    own = [documents([1] * 4, [0, 1, 2, 3]), documents([1] * 4, [0, 2, 4, 5])]
    for base in (raw, own):
        assert heldout_train_end("d", split, base, raw) == 4
        cleaned = [documents([1] * 3, [0, 2, 3]), documents([1] * 2, [1, 3])]
        assert heldout_train_end("d", split, base, cleaned) == 3
