"""Training samples from shards, with Megatron-LM ``GPTDataset`` semantics, built in numpy.

For one dataset (the sequences of its shards, concatenated in order, exactly as a merged
prefix) and one split:

1. the split takes sequences ``[round(beg*N), round(end*N))`` of the ``'969,30,1'`` bookends;
2. the *document index* repeats those sequences for as many epochs as the requested samples
   need and shuffles them with ``numpy.random.RandomState(seed)`` (the last epoch separately
   when it is used for less than 80 %);
3. the *sample index* cuts the shuffled token stream into samples of ``seq_length + 1`` tokens
   that overlap by one (inputs and shifted labels), crossing document boundaries; row k is
   (position in document index, offset) of token ``k * seq_length``;
4. the *shuffle index* permutes the samples with the same random state.

Same seed, same shards, same split -> the same indices as megatron-core (tested against it), so
sample ``i`` of a run is a pure function of (seed, i). Several datasets are blended by weight
with Megatron's greedy rule. Indices are cached on disk, keyed by a hash of their inputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptflow.data.indexed import IndexedDataset
from gptflow.errors import GptflowError
from gptflow.fsutil import publish, temp_path

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


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: sample s comes from the dataset furthest below its share."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    counts = np.zeros(len(w), dtype=np.int64)
    for s in range(size):
        i = int(np.argmax(w * max(s, 1) - counts))
        dataset_index[s] = i
        dataset_sample_index[s] = counts[i]
        counts[i] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Several datasets mixed by weight; sample s = datasets[index[s]][sample_index[s]]."""

    def __init__(self, datasets: list[GPTDataset], weights: list[float], size: int) -> None:
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = blending_indices(weights, size)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


# ----------------------------------------------------------------------------- cache + build


def _cached_indices(
    cache_dir: Path | None, key: dict, build, *, build_allowed: bool = True
) -> SampleIndex:
    """Load indices cached under a hash of `key`, or build (and cache) them."""
    if cache_dir is None:
        return build()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    names = ("document_index", "sample_index", "shuffle_index")
    paths = {n: cache_dir / f"{digest}-{key['split']}-{n}.npy" for n in names}
    if all(p.is_file() for p in paths.values()):
        return SampleIndex(*(np.load(paths[n], mmap_mode="r") for n in names))
    if not build_allowed:
        raise GptflowError(f"{cache_dir}: sample index {digest} missing (built by rank 0)")
    index = build()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{digest}-{key['split']}.json", "w") as f:
        json.dump(key, f, indent=1)
    for n in names:
        tmp = temp_path(paths[n])
        with open(tmp, "wb") as f:
            np.save(f, getattr(index, n))
        publish(tmp, paths[n])
    return index


def build_split_datasets(
    datasets: list[tuple[str, float, list[str], list[str]]],
    split: str,
    num_samples: dict[str, int],
    seq_length: int,
    seed: int,
    cache_dir: str | os.PathLike | None = None,
    build_allowed: bool = True,
) -> dict[str, GPTDataset | BlendedDataset | None]:
    """Datasets for each split that asks for samples.

    `datasets` is ``[(name, weight, shard prefixes, shard idx sha256s)]``; `num_samples` maps
    ``train``/``valid``/``test`` to the samples needed (0 = not built).
    """
    cache = Path(cache_dir) if cache_dir is not None else None
    shard_sets = [(name, w, ShardSet(prefixes), shas) for name, w, prefixes, shas in datasets]
    out: dict[str, GPTDataset | BlendedDataset | None] = {}
    weights = [w for _, w, _, _ in shard_sets]
    total_w = sum(weights)
    for split_i, split_name in enumerate(SPLITS):
        wanted = num_samples.get(split_name, 0)
        if wanted <= 0:
            out[split_name] = None
            continue
        parts = []
        for name, w, shards, shas in shard_sets:
            if len(shard_sets) == 1:
                need = wanted
            else:
                need = math.ceil(math.ceil(wanted * w / total_w) * (1 + BLEND_SURPLUS))
            begin, end = split_bounds(split, len(shards))[split_i]
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
        else:
            out[split_name] = BlendedDataset(parts, weights, wanted)
    return out


def run_split_datasets(cfg, build_allowed: bool = True) -> dict:
    """The train/valid datasets of a run config (:class:`gptflow.config.RunConfig`), their
    indices cached in the run's ``data-index/`` under a hash of everything they depend on.

    The workflow's ``build_data_index`` rule calls this before training (a CPU job); the
    trainer then only loads the cached files (``build_allowed=False`` on ranks > 0).
    """
    t = cfg.train
    samples = {
        "train": t.train_iters * t.global_batch_size,
        "valid": t.eval_iters * t.global_batch_size,
    }
    blend = [
        (d.name, d.weight, [s.prefix for s in d.shards], [s.idx_sha256 for s in d.shards])
        for d in cfg.datasets
    ]
    return build_split_datasets(
        blend,
        cfg.split,
        samples,
        t.seq_length,
        t.seed,
        cfg.index_cache_dir,
        build_allowed=build_allowed,
    )
