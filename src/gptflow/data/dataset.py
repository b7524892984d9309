"""Training samples from shards, with Megatron-LM ``GPTDataset`` semantics, built in numpy.

For one dataset (the sequences of its shards, concatenated in order, exactly as a merged
prefix) and one split:

1. the split takes sequences ``[round(beg*N), round(end*N))`` of the ``'969,30,1'`` bookends
   (a data ablation's recipe: its train split ends before the base's held-out documents,
   :func:`heldout_train_ends`);
2. the *document index* repeats those sequences for as many epochs as the requested samples
   need and shuffles them with ``numpy.random.RandomState(seed)`` (the last epoch separately
   when it is used for less than 80 %);
3. the *sample index* cuts the shuffled token stream into samples of ``seq_length + 1`` tokens
   that overlap by one (inputs and shifted labels), crossing document boundaries; row k is
   (position in document index, offset) of token ``k * seq_length``;
4. the *shuffle index* permutes the samples with the same random state.

Same seed, same shards, same split -> the same indices as megatron-core (tested against it), so
sample ``i`` of a run is a pure function of (seed, i). Several datasets are blended by weight
with Megatron's greedy rule. All these indices, the blend's included, are cached on disk as .npy
files keyed by a hash of their inputs: built once before training, memory-mapped by the trainer.

Over 500 lines: Megatron's GPTDataset semantics in one place -- split, document, sample and
shuffle indices, the blended dataset, their cache on disk -- held as one to megatron-core in the
tests. The blend index's greedy rule is :mod:`gptflow.data.blend`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptflow.data.blend import blending_indices
from gptflow.data.indexed import IndexedDataset
from gptflow.errors import GptflowError
from gptflow.fsutil import publish, temp_path, write_json

SPLITS = ("train", "valid", "test")
INDEX_VERSION = 1  # bump when the index construction changes
FINAL_EPOCH_THRESHOLD = 0.80  # Megatron: shuffle a final epoch used < 80 % separately
BLEND_SURPLUS = 0.005  # Megatron's mid_level_dataset_surplus


def parse_split(split: str) -> list[float]:
    """``'969,30,1'`` -> normalized train/valid/test fractions (missing values are 0)."""
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    if not values or len(values) > 3 or sum(values) <= 0:
        raise GptflowError(
            f"data.split '{split}' must be 1-3 non-negative numbers with a positive sum, e.g. '969,30,1'"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_bounds(split: str, num_sequences: int) -> list[tuple[int, int]]:
    """Sequence ranges [begin, end) of train/valid/test, rounded as Megatron rounds them."""
    fractions = parse_split(split)
    edges = [0.0]
    for f in fractions:
        edges.append(edges[-1] + f)
    return [
        (round(edges[i] * num_sequences), round(edges[i + 1] * num_sequences)) for i in range(3)
    ]


def _held_out_from(split: str, base: list[tuple[np.ndarray, np.ndarray | None]]):
    """(shard, ordinal in its collected shard) of the base's first held-out document, or
    None when nothing is held out; `base` as :func:`heldout_train_end`'s."""
    num_sequences = sum(int(starts[-1]) for starts, _ in base)
    end = split_bounds(split, num_sequences)[0][1]  # the train split is [0, end)
    for shard, (starts, origins) in enumerate(base):
        if end < int(starts[-1]):
            # the document holding sequence `end` (documents hold one sequence, or none)
            document = int(np.searchsorted(starts, end, side="right")) - 1
            return shard, int(origins[document]) if origins is not None else document
        end -= int(starts[-1])
    return None


def heldout_train_end(
    name: str,
    split: str,
    base: list[tuple[np.ndarray, np.ndarray | None]],
    run: list[tuple[np.ndarray, np.ndarray | None]],
) -> int:
    """Where a data ablation's run ends the train split of dataset `name` on its own shards
    (its sequences ``[0, end)``): exactly its documents that come, in collection order, before
    the first of the base's held-out documents (the validation and test splits every run is
    evaluated on: `split` over the base's shards), so no held-out document is trained on.

    `base` and `run` give each shard (one per collected shard, in order) as (its document
    index: document j is sequences ``[starts[j], starts[j + 1])``; its documents' ordinals in
    the collected shard, gptflow.data.quality.origins, or None: the collected documents
    themselves). Steps keep order, so the run's train documents are a prefix of its shards.
    """
    if len(base) != len(run):
        raise GptflowError(
            f"dataset '{name}': the run's recipe has {len(run)} shards, the base's {len(base)}; "
            f"both are one per collected shard: make the shards again"
        )
    first = _held_out_from(split, base)
    if first is None:
        return sum(int(starts[-1]) for starts, _ in run)
    shard, ordinal = first
    before = sum(int(starts[-1]) for starts, _ in run[:shard])
    starts, origins = run[shard]
    documents = len(starts) - 1
    kept = (
        int(np.searchsorted(origins, ordinal)) if origins is not None else min(ordinal, documents)
    )
    end = before + int(starts[kept])
    if end == 0:
        raise GptflowError(
            f"dataset '{name}': the run's data.quality keeps none of the documents before the "
            f"base's held-out ones (data.split '{split}' holds out the base's documents from "
            f"shard {shard}'s document {ordinal} on), so it has nothing to train on; keep "
            f"more documents in its recipe or give the train split a larger share of data.split"
        )
    return end


def heldout_train_ends(
    split: str,
    shards: dict[str, list[str]],
    heldout: dict[str, list[str]],
    origins: dict[str, dict[str, list[str]]],
) -> dict[str, int]:
    """:func:`heldout_train_end` of each dataset in `origins` (a data ablation's datasets
    whose recipe differs from the base's: {dataset: {"run": files, "base": files}}, each
    shard's origins file, or [] for the collected documents themselves), over its shard
    prefixes in `shards` (the run's) and `heldout` (the base's). A shard must hold exactly
    the documents its origins file lists (tokenization keeps every document it is given)."""
    from gptflow.data.quality.origins import read_origins

    def documents(prefixes: list[str], files: list[str]) -> list[tuple]:
        out = []
        for i, prefix in enumerate(prefixes):
            starts = IndexedDataset(prefix).document_indices
            kept = read_origins(files[i]) if files else None
            if kept is not None and len(kept) != len(starts) - 1:
                raise GptflowError(
                    f"{prefix}: {len(starts) - 1} documents, but {files[i]} gives the origins "
                    f"of {len(kept)}; delete the shard so that it is tokenized again from its "
                    f"step's documents"
                )
            out.append((starts, kept))
        return out

    return {
        name: heldout_train_end(
            name,
            split,
            documents(heldout[name], files["base"]),
            documents(shards[name], files["run"]),
        )
        for name, files in origins.items()
    }


class ShardSet:
    """The shards of one dataset read as one prefix: their sequences concatenated in order."""

    def __init__(self, prefixes: list[str]) -> None:
        if not prefixes:
            raise GptflowError("a dataset needs at least one shard")
        self.parts = [IndexedDataset(p) for p in prefixes]
        counts = [len(p) for p in self.parts]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.sequence_lengths = (
            np.concatenate([p.sequence_lengths for p in self.parts]).astype(np.int32)
            if self.parts
            else np.zeros(0, np.int32)
        )

    def __len__(self) -> int:
        return int(self._starts[-1])

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        part = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.parts[part].get(i - int(self._starts[part]), offset, length)


# ----------------------------------------------------------------------------- index building


# Token positions in a split's sample index are int64 (build_sample_index): no split, of any
# size or number of epochs, gives more tokens than this
MAX_SPLIT_TOKENS = int(np.iinfo(np.int64).max)


def split_samples(train) -> dict[str, int]:
    """Samples each split must give a run (`train`: its TrainConfig): every step's global
    batch, and every evaluation's eval_iters global batches of the validation split."""
    return {
        "train": train.train_iters * train.global_batch_size,
        "valid": train.eval_iters * train.global_batch_size,
    }


def check_split_samples(train) -> None:
    """Refuse a run whose samples no split could give (:data:`MAX_SPLIT_TOKENS`)."""
    iters = {"train": "train.train_iters", "valid": "train.eval_iters"}
    for split, samples in split_samples(train).items():
        tokens = samples * train.seq_length + 1
        if tokens > MAX_SPLIT_TOKENS:
            raise GptflowError(
                f"the {split} split would have to give {samples:,} samples of "
                f"train.seq_length {train.seq_length} ({tokens:.3g} tokens, train.global_batch_size "
                f"{train.global_batch_size} x {iters[split]}), beyond the 2^63 - 1 token "
                f"positions of a data index; lower train.global_batch_size or the iterations"
            )


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """Smallest number of epochs whose tokens cover `num_samples` samples (+1 extra token)."""
    needed = num_samples * seq_length + 1
    return max(1, math.ceil(needed / tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """(num_samples + 1, 2) rows of (position in document index, token offset).

    Row k locates token ``k * seq_length`` of the concatenated shuffled documents; sample k
    reads from row k through row k+1's token inclusive. A vectorised equivalent of
    megatron-core's C++ ``build_sample_idx`` (which walks the documents one by one).
    """
    doc_lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(doc_lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[doc] - doc_lengths[doc])
    rows = np.stack([doc, offsets], axis=1)
    rows[0] = (0, 0)  # Megatron starts at the first document even when it is empty
    return rows


def build_shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass(frozen=True)
class SampleIndex:
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray

    def __len__(self) -> int:
        return len(self.sample_index) - 1


def build_gpt_indices(
    sequence_lengths: np.ndarray, begin: int, end: int, num_samples: int, seq_length: int, seed: int
) -> SampleIndex:
    """Megatron ``GPTDataset._build_document_sample_shuffle_indices`` for sequences [begin, end)."""
    documents = np.arange(begin, end, dtype=np.int32)
    tokens_per_epoch = int(sequence_lengths[begin:end].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = from_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, total_samples)
    first = sans_final if separate_final_epoch else total_samples
    shuffle_index = build_shuffle_index(first, total_samples, rng)
    return SampleIndex(document_index, sample_index, shuffle_index)


# ----------------------------------------------------------------------------- datasets


class GPTDataset:
    """Samples of ``seq_length + 1`` token ids (int64) of one dataset split."""

    def __init__(self, shards: ShardSet, index: SampleIndex, seq_length: int) -> None:
        self.shards = shards
        self.index = index
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> np.ndarray:
        idx = self.index
        s = int(idx.shuffle_index[i])
        beg_doc, beg_off = (int(v) for v in idx.sample_index[s])
        end_doc, end_off = (int(v) for v in idx.sample_index[s + 1])
        docs = idx.document_index
        if beg_doc == end_doc:
            parts = [self.shards.get(int(docs[beg_doc]), beg_off, end_off - beg_off + 1)]
        else:
            parts = [self.shards.get(int(docs[beg_doc]), beg_off)]
            parts += [self.shards.get(int(docs[j])) for j in range(beg_doc + 1, end_doc)]
            parts.append(self.shards.get(int(docs[end_doc]), 0, end_off + 1))
        return np.concatenate(parts).astype(np.int64)


class BlendedDataset:
    """Several datasets mixed by weight; sample s = datasets[index[s]][sample_index[s]]."""

    def __init__(
        self,
        datasets: list[GPTDataset],
        dataset_index: np.ndarray,
        dataset_sample_index: np.ndarray,
    ) -> None:
        self.datasets = datasets
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


# ----------------------------------------------------------------------------- cache + build


SAMPLE_INDEX_ARRAYS = ("document_index", "sample_index", "shuffle_index")
BLEND_INDEX_ARRAYS = ("dataset_index", "dataset_sample_index")


def index_paths(cache_dir: Path, key: dict, names: tuple[str, ...]) -> dict[str, Path]:
    """Where the arrays `names` built from `key` are cached: ``{hash of key}-{split}-{name}.npy``
    (the key itself in ``{hash}-{split}.json``)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stem = f"{digest}-{key['split']}"
    return {"key": cache_dir / f"{stem}.json"} | {n: cache_dir / f"{stem}-{n}.npy" for n in names}


def _cached_arrays(
    cache_dir: Path | None, key: dict, names: tuple[str, ...], build, *, build_allowed: bool = True
) -> tuple[np.ndarray, ...]:
    """The arrays cached under `key`, memory-mapped; built (and cached) if missing.

    Each file is written under a temporary name and renamed, so a file under its final name is
    complete. With ``build_allowed=False`` (ranks > 0) a missing file is an error, never a build.
    """
    if cache_dir is None:
        return build()
    paths = index_paths(cache_dir, key, names)
    if all(paths[n].is_file() for n in names):
        return tuple(np.load(paths[n], mmap_mode="r") for n in names)
    if not build_allowed:
        raise GptflowError(
            f"{paths[names[0]]} is missing: the data indices are built before training (the "
            f"build_data_index rule, `gptflow build-index`) or by rank 0"
        )
    arrays = build()
    write_json(paths["key"], key)
    for n, array in zip(names, arrays, strict=True):
        tmp = temp_path(paths[n])
        with open(tmp, "wb") as f:
            np.save(f, array)
        publish(tmp, paths[n])
    return arrays


def _cached_indices(
    cache_dir: Path | None, key: dict, build, *, build_allowed: bool = True
) -> SampleIndex:
    """A dataset split's document, sample and shuffle indices (:func:`_cached_arrays`)."""

    def arrays():
        index = build()
        return tuple(getattr(index, n) for n in SAMPLE_INDEX_ARRAYS)

    cached = _cached_arrays(
        cache_dir, key, SAMPLE_INDEX_ARRAYS, arrays, build_allowed=build_allowed
    )
    return SampleIndex(*cached)


def build_blend_indices(
    weights: list[float], size: int, available: list[int], names: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`blending_indices`, checked as Megatron checks it: no dataset is asked for more
    samples than its index holds (``available``)."""
    dataset_index, dataset_sample_index = blending_indices(weights, size)
    used = np.bincount(dataset_index, minlength=len(weights))
    for name, n, have in zip(names, used, available, strict=True):
        if n > have:
            raise GptflowError(
                f"the blend takes {n} samples from dataset '{name}', whose index holds {have}"
            )
    return dataset_index, dataset_sample_index


def build_split_datasets(
    datasets: list[tuple[str, float, list[str], list[str]]],
    split: str,
    num_samples: dict[str, int],
    seq_length: int,
    seed: int,
    cache_dir: str | os.PathLike | None = None,
    build_allowed: bool = True,
    heldout: list[tuple[str, float, list[str], list[str]]] | None = None,
    train_ends: dict[str, int] | None = None,
) -> dict[str, GPTDataset | BlendedDataset | None]:
    """Datasets for each split that asks for samples.

    `datasets` is ``[(name, weight, shard prefixes, shard idx sha256s)]``; `num_samples` maps
    ``train``/``valid``/``test`` to the samples needed (0 = not built). `heldout`, alike, gives
    the validation and test splits their own shards (a data ablation's run: the base's, the
    same held-out text for every recipe); the train split is always `datasets`', and with
    `train_ends` a dataset's sequences ``[0, train_ends[name])`` (:func:`heldout_train_ends`:
    a recipe's documents from before the base's held-out ones), not its share of `split`."""
    cache = Path(cache_dir) if cache_dir is not None else None
    train_sets = [(name, w, ShardSet(prefixes), shas) for name, w, prefixes, shas in datasets]
    held_sets = [(name, w, ShardSet(prefixes), shas) for name, w, prefixes, shas in heldout or []]
    out: dict[str, GPTDataset | BlendedDataset | None] = {}
    weights = [w for _, w, _, _ in train_sets]
    total_w = sum(weights)
    for split_i, split_name in enumerate(SPLITS):
        wanted = num_samples.get(split_name, 0)
        if wanted <= 0:
            out[split_name] = None
            continue
        shard_sets = held_sets if held_sets and split_name != "train" else train_sets
        parts = []
        for name, w, shards, shas in shard_sets:
            if len(shard_sets) == 1:
                need = wanted
            else:
                need = math.ceil(math.ceil(wanted * w / total_w) * (1 + BLEND_SURPLUS))
            begin, end = split_bounds(split, len(shards))[split_i]
            if split_name == "train" and name in (train_ends or {}):
                begin, end = 0, train_ends[name]  # a data ablation's recipe (docstring)
            if end <= begin or shards.sequence_lengths[begin:end].sum() == 0:
                raise GptflowError(
                    f"data.split '{split}' gives the {split_name} split of dataset '{name}' "
                    f"{end - begin} of its {len(shards)} sequences (no tokens), but {wanted} "
                    f"{split_name} samples are needed; give that split a larger share (e.g. "
                    f"'90,9,1') or use more data"
                )
            key = {
                "version": INDEX_VERSION,
                "dataset": name,
                "shards": list(shas),
                "split": split_name,
                "range": [begin, end],
                "num_samples": need,
                "seq_length": seq_length,
                "seed": seed,
            }

            def build(b=begin, e=end, n=need, lengths=shards.sequence_lengths):
                return build_gpt_indices(lengths, b, e, n, seq_length, seed)

            index = _cached_indices(cache, key, build, build_allowed=build_allowed)
            parts.append(GPTDataset(shards, index, seq_length))
        if len(parts) == 1:
            out[split_name] = parts[0]
            continue
        names = [name for name, _, _, _ in shard_sets]
        key = {
            "version": INDEX_VERSION,
            "blend": names,
            "weights": weights,
            "split": split_name,
            "num_samples": wanted,
        }
        available = [len(p) for p in parts]
        build = functools.partial(build_blend_indices, weights, wanted, available, names)
        arrays = _cached_arrays(cache, key, BLEND_INDEX_ARRAYS, build, build_allowed=build_allowed)
        out[split_name] = BlendedDataset(parts, *arrays)
    return out


def run_split_datasets(cfg, build_allowed: bool = True) -> dict:
    """The train/valid datasets of a run config (:class:`gptflow.train.run_config.RunConfig`), their
    indices cached in the run's ``data-index/`` under a hash of everything they depend on.

    The workflow's ``build_data_index`` rule calls this before training (a CPU job); the
    trainer then only loads the cached files (``build_allowed=False`` on ranks > 0).
    """
    t = cfg.train
    samples = split_samples(t)

    def blend(datasets) -> list[tuple]:
        return [
            (d.name, d.weight, [s.prefix for s in d.shards], [s.idx_sha256 for s in d.shards])
            for d in datasets
        ]

    return build_split_datasets(
        blend(cfg.datasets),
        cfg.split,
        samples,
        t.seq_length,
        t.seed,
        cfg.index_cache_dir,
        build_allowed=build_allowed,
        heldout=blend(cfg.heldout) if cfg.heldout else None,
        train_ends=cfg.train_ends,
    )
