"""The blend index: identical to megatron-core's C++ build_blending_indices, built once by the
build_data_index rule's command and then memory-mapped, never rebuilt, by the trainer."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

import gptflow.data.blend as blending
import gptflow.data.dataset as dataset
from gptflow.cli import main as gptflow
from gptflow.data.blend import blending_indices
from gptflow.data.dataset import BLEND_INDEX_ARRAYS, run_split_datasets
from gptflow.errors import GptflowError
from gptflow.plan.workflow_config import load_workflow_config
from gptflow.train.run_config import RunConfig, render_run_config, write_run_config
from tests.support.megatron import helpers_cpp as load_megatron_helpers
from tests.support.megatron import megatron_blend

PILE = [18.11, 14.40, 12.07, 10.01, 8.96, 7.59, 6.12, 5.13, 3.65, 3.07, 2.17, 1.55, 1.53, 1.24]
PILE += [0.88, 0.75, 0.73, 0.62, 0.60, 0.38, 0.30, 0.14]  # The Pile's 22 components, in %


@pytest.fixture(scope="module")
def helpers_cpp():
    return load_megatron_helpers()


def assert_same(helpers_cpp, weights, size, what):
    ours = blending_indices(list(weights), size)
    theirs = megatron_blend(helpers_cpp, weights, size)
    assert ours[0].dtype == np.int16 and ours[1].dtype == np.int64, what
    if not np.array_equal(ours[0], theirs[0]) or not np.array_equal(ours[1], theirs[1]):
        first = int(np.flatnonzero((ours[0] != theirs[0]) | (ours[1] != theirs[1]))[0])
        pytest.fail(f"{what}: differs from sample {first} on (weights {list(weights)}, {size})")


def random_weights(rng, n):
    kind = rng.integers(5)
    if kind == 0:
        return rng.random(n)
    if kind == 1:  # small integers: exact ties between datasets
        return rng.integers(1, 6, n).astype(float)
    if kind == 2:
        return np.ones(n)
    if kind == 3:  # down to 1e-5: datasets picked a few times in a run
        return 10.0 ** rng.uniform(-5, 0, n)
    w = rng.random(n)
    w[rng.random(n) < 0.3] = 0.0  # megatron-core refuses weight 0, its C++ does not
    w[0] += 1 - w.any()
    return w


def test_identical_to_megatron_cpp_on_random_blends(helpers_cpp):
    seed = int(os.environ.get("GPTFLOW_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    rng = np.random.default_rng(seed)
    sizes = [1, 2, 3, 7, 64, 65, 100, 1000, 4097, 70_000]
    for case in range(150):
        n = int(rng.integers(1, 24))
        weights, size = random_weights(rng, n), int(rng.choice(sizes))
        assert_same(helpers_cpp, weights, size, f"seed {seed} (GPTFLOW_TEST_SEED), case {case}")


def test_identical_to_megatron_cpp_on_edge_cases(helpers_cpp):
    assert blending_indices([1.0], 0)[0].shape == (0,)
    assert blending_indices([0.3, 0.7], 0)[1].dtype == np.int64
    cases = [
        ([1.0], 1),
        ([1.0], 1000),
        ([0.5, 0.5], 1),
        ([1, 1, 1], 3001),  # ties everywhere: the first dataset wins, as in the C++ loop
        ([0, 0.5, 0.5], 1000),  # a weight of 0 is picked once, at the first exact tie
        ([0.5, 0, 0.5], 1000),
        ([1e6, 1], 100_000),
        ([0.5, 0.3, 0.2], 1_000_000),
        (np.random.default_rng(5).random(5), 1_000_000),
        (PILE, 1_000_000),
        ([1, 1e-4, 1e-4, 1e-4], 1_000_000),
    ]
    for weights, size in cases:
        assert_same(helpers_cpp, weights, size, "edge case")


def test_reruns_and_longer_chunks_give_the_same_index(helpers_cpp, monkeypatch):
    """Tiny chunks (many re-runs) and no re-run allowed (the rest redone in longer chunks)."""
    rng = np.random.default_rng(11)
    for chunk, rounds in [(1, 8), (3, 0), (5, 1)]:
        monkeypatch.setattr(blending, "BLEND_MIN_CHUNK", chunk)
        monkeypatch.setattr(blending, "BLEND_ROUNDS", rounds)
        for case in range(20):
            weights = random_weights(rng, int(rng.integers(1, 12)))
            size = int(rng.choice([10, 257, 3000]))
            assert_same(helpers_cpp, weights, size, f"chunk {chunk}, rounds {rounds}, #{case}")


def test_bad_weights_are_refused():
    for weights in ([], [0.0, 0.0], [1.0, -1.0], [1.0, float("nan")]):
        with pytest.raises(GptflowError, match="blend weights"):
            blending_indices(weights, 10)


def rebuilt(*args, **kwargs):
    raise AssertionError("an index was rebuilt instead of loaded")


@pytest.fixture
def blend_run(repo, tiny_config, tokenizer_json, shards, tmp_path) -> Path:
    """The tiny config's two stdlib shards as two datasets blended 0.3/0.7: run.yaml."""
    config = {
        **tiny_config,
        "datasets": {**tiny_config["datasets"], "more": tiny_config["datasets"]["stdlib"]},
        "data": {**tiny_config["data"], "blend": [
            {"dataset": "stdlib", "weight": 0.3},
            {"dataset": "more", "weight": 0.7},
        ]},
        "train": {**tiny_config["train"], "train_iters": 500},
    }  # fmt: skip
    cfg = load_workflow_config(
        config,
        schema_path=repo / "config/schema/config.schema.yaml",
        models_dir=repo / "config/models",
        source="test",
    )
    run = render_run_config(
        cfg,
        tokenizer_path=str(tokenizer_json),
        shards={"stdlib": shards[:1], "more": shards[1:]},
        run_dir=str(tmp_path / "run"),
    )
    path = tmp_path / "run" / "run.yaml"
    path.parent.mkdir()
    write_run_config(run, path)
    return path


def test_built_once_by_build_data_index_then_memory_mapped(
    blend_run, helpers_cpp, monkeypatch, tmp_path
):
    command = ["build-index", "--config", str(blend_run), "--out", str(tmp_path / "i.json")]
    assert gptflow(command) == 0  # what the build_data_index rule runs
    cfg = RunConfig.load(blend_run)
    files = json.loads((tmp_path / "i.json").read_text())["files"]
    for split, size in (("train", 500 * 8), ("valid", 2 * 8)):
        (path,) = cfg.index_cache_dir.glob(f"*-{split}-dataset_index.npy")
        stem = path.name.removesuffix("-dataset_index.npy")
        key = json.loads((cfg.index_cache_dir / f"{stem}.json").read_text())
        assert key["blend"] == ["stdlib", "more"] and key["weights"] == [0.3, 0.7], key
        assert key["num_samples"] == size, key
        expected = megatron_blend(helpers_cpp, [0.3, 0.7], size)
        for name, array in zip(BLEND_INDEX_ARRAYS, expected, strict=True):
            assert f"{stem}-{name}.npy" in files
            assert np.array_equal(np.load(cfg.index_cache_dir / f"{stem}-{name}.npy"), array)

    monkeypatch.setattr(dataset, "blending_indices", rebuilt)
    monkeypatch.setattr(dataset, "build_gpt_indices", rebuilt)
    built = {}
    for rank, build_allowed in ((0, True), (1, False)):  # the trainer's two calls
        data = run_split_datasets(cfg, build_allowed=build_allowed)
        for split in ("train", "valid"):
            blend = data[split]
            assert isinstance(blend.dataset_index, np.memmap), (rank, split)
            assert isinstance(blend.dataset_sample_index, np.memmap), (rank, split)
            assert len(blend) == {"train": 4000, "valid": 16}[split]
        built[rank] = [data["train"][i] for i in (0, 1, 2, 3999)]
    assert all(np.array_equal(a, b) for a, b in zip(built[0], built[1], strict=True))


def test_missing_blend_index_is_an_error_not_a_build(blend_run, monkeypatch):
    cfg = RunConfig.load(blend_run)
    run_split_datasets(cfg)
    (gone,) = cfg.index_cache_dir.glob("*-train-dataset_index.npy")
    gone.unlink()
    monkeypatch.setattr(dataset, "blending_indices", rebuilt)
    with pytest.raises(GptflowError, match=rf"{gone.name} is missing: the data indices are built"):
        run_split_datasets(cfg, build_allowed=False)
