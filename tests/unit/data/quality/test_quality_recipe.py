"""The data-quality recipe (gptflow.data.quality.recipe): a step's key covers the recipe up to
it and nothing after, so an edit reruns that step and the ones after it; datasets with the
same recipe share their steps and blend-scoped groups; the threshold printed is (1/b)^(1/r)."""

from __future__ import annotations

import copy
import hashlib

import pytest

from gptflow.data.quality import recipe
from gptflow.errors import GptflowError

EXACT = {"step": "exact", "scope": "blend"}
MINHASH = {"step": "minhash", "ngram": 5, "bands": 14, "rows": 8, "seed": 1, "tokenizer": "regex",
           "scope": "blend"}  # fmt: skip
FILTERS = {"step": "filters", "tokenizer": "regex", "rules": {"c4": {"min_num_sentences": 5}}}


def cfg(steps, datasets=None):
    quality = {"steps": steps, **({"datasets": datasets} if datasets is not None else {})}
    return {"data": {"blend": [], "quality": quality}}


def test_an_edit_changes_its_steps_key_and_those_after_only():
    before = recipe.chain([EXACT, MINHASH, FILTERS])
    edited = copy.deepcopy(MINHASH) | {"bands": 20}
    after = recipe.chain([EXACT, edited, FILTERS])
    assert before[0].name == after[0].name
    assert before[1].name != after[1].name and before[2].name != after[2].name
    assert [s.name[:-13] for s in before] == ["01-exact", "02-minhash", "03-filters"]


def test_a_threshold_edit_keeps_the_filters_signals():
    stricter = copy.deepcopy(FILTERS)
    stricter["rules"]["c4"]["min_num_sentences"] = 3
    a, b = recipe.chain([EXACT, FILTERS])[1], recipe.chain([EXACT, stricter])[1]
    assert a.name != b.name and a.signals_name == b.signals_name
    spacy = copy.deepcopy(FILTERS) | {"tokenizer": "spacy"}
    assert recipe.chain([EXACT, spacy])[1].signals_name != a.signals_name


def test_language_scores_are_keyed_by_the_models_digest_only():
    lid = {"step": "language", "model": "/a/lid.176.ftz", "sha256": "a" * 64,
           "languages": ["en"], "threshold": 0.65}  # fmt: skip
    a = recipe.chain([EXACT, lid])[1]
    for edit in ({"threshold": 0.9}, {"languages": ["en", "de"]}):
        b = recipe.chain([EXACT, lid | edit])[1]
        assert a.name != b.name and a.scores_name == b.scores_name
    moved = recipe.chain([EXACT, lid | {"model": "/b/lid.176.ftz"}])[1]
    assert moved.name == a.name  # a model is its digest: moving the file reruns nothing
    other = recipe.chain([EXACT, lid | {"sha256": "b" * 64}])[1]
    assert other.scores_name != a.scores_name and other.name != a.name
    assert a.scores_name.startswith("02-lid-")


def test_signals_and_scores_are_keyed_by_the_step_before():
    """Issue 49: a filters step's signals and a language step's scores are those of its
    input, the documents the step before kept: after another step, or the same kind with
    other settings, they are others (never one side file for two inputs: a count mismatch at
    best, another input's signals selecting documents at worst)."""
    lid = {"step": "language", "model": "/a/lid.176.ftz", "sha256": "a" * 64,
           "languages": ["en"], "threshold": 0.65}  # fmt: skip
    before = [EXACT, MINHASH, MINHASH | {"bands": 20}, EXACT | {"scope": "dataset"}]
    signals = {recipe.chain([b, FILTERS])[1].signals_name for b in before}
    scores = {recipe.chain([b, lid])[1].scores_name for b in before}
    assert len(signals) == len(scores) == len(before)
    # and two steps back: the whole recipe before it, not the step before alone
    assert (
        recipe.chain([EXACT, MINHASH, FILTERS])[2].signals_name
        != recipe.chain([EXACT | {"scope": "dataset"}, MINHASH, FILTERS])[2].signals_name
    )


def test_datasets_with_one_recipe_share_steps_and_blend_groups():
    steps = [EXACT, MINHASH | {"scope": "dataset"}]
    recipes = recipe.recipes(cfg(steps, {"c": [EXACT]}), ["a", "b", "c"], "my.yaml")
    assert recipes["a"] == recipes["b"] and recipes["c"][0].name == recipes["a"][0].name
    exact, near = recipes["a"]
    # exact: one group over a, b and c (their first steps agree); minhash: a group per dataset
    assert recipe.group_members(recipes, ["a", "b", "c"], exact.name, "_blend") == ["a", "b", "c"]
    assert near.group("a") == "a" and exact.group("a") == recipe.BLEND_GROUP
    assert recipe.group_members(recipes, ["a", "b", "c"], near.name, "b") == ["b"]
    assert recipe.recipes(cfg([], {"a": [EXACT]}), ["a", "b"], "my.yaml").keys() == {"a"}


def test_the_plan_names_each_step_its_threshold_and_whether_it_runs():
    recipes = recipe.recipes(cfg([EXACT, MINHASH]), ["a", "b"], "my.yaml")
    done = {(recipes["a"][0].name, "a"): True, (recipes["a"][0].name, "b"): True}
    lines = recipe.plan_lines(recipes, done)
    assert lines[0] == "gptflow: data quality of a, b:"
    assert lines[1].startswith(
        "  1. exact (BLAKE2b-128 of normalized text, scope blend): outputs present"
    )
    assert "Jaccard threshold (1/14)^(1/8) = 0.719" in lines[2] and ": will run" in lines[2]
    assert len(lines) == 3  # without sizes, no copies line


def test_the_plan_says_every_step_writes_a_full_copy_and_its_size():
    """Issue 48: each step's kept documents are a full JSONL copy: -n says how many and how
    large, from the collected shards' size (and that a compressed input grows as JSONL)."""
    recipes = recipe.recipes(cfg([EXACT, MINHASH]), ["a", "b"], "my.yaml")
    lines = recipe.plan_lines(recipes, {}, {"a": (2_500_000_000, False), "b": (500, True)})
    assert lines[3] == (
        "  every step writes the documents it keeps in full (JSONL): 2 copies of at most "
        "2.5 GB (the collected shards, compressed: more as JSONL); tokenization reads the last"
    )
    lines = recipe.plan_lines(recipes, {}, {"a": (10, False), "b": None})
    assert lines[3].endswith(
        "2 copies of at most the collected documents' size (not known before they are "
        "collected); tokenization reads the last"
    )


@pytest.mark.parametrize(
    ("bands", "rows", "threshold"), [(14, 8, 0.7190), (20, 5, 0.5493), (1, 1, 1.0)]
)
def test_jaccard_threshold_is_where_the_s_curve_turns(bands, rows, threshold):
    assert recipe.jaccard_threshold(bands, rows) == pytest.approx(threshold, abs=1e-4)
    assert recipe.detection_probability(1.0, bands, rows) == 1.0
    assert recipe.detection_probability(0.0, bands, rows) == 0.0


def test_recipe_mistakes_the_schema_cannot_see_are_one_line(tmp_path):
    with pytest.raises(
        GptflowError, match=r"data\.quality\.datasets\.x: 'x' is not in data\.blend"
    ):
        recipe.recipes(cfg([], {"x": [EXACT]}), ["a"], "my.yaml")
    with pytest.raises(GptflowError, match=r"type megatron"):
        recipe.recipes(cfg([EXACT]), ["a"], "my.yaml", imported=["a"])
    language = {"step": "language", "model": str(tmp_path / "lid.bin"), "sha256": "0" * 64,
                "languages": ["en"], "threshold": 0.65}  # fmt: skip
    with pytest.raises(GptflowError, match=r"data\.quality\.steps\[0\]\.model .* does not exist"):
        recipe.recipes(cfg([language]), ["a"], "my.yaml")
    (tmp_path / "lid.bin").write_bytes(b"model")
    with pytest.raises(
        GptflowError,
        match=r"^my\.yaml: data\.quality\.steps\[0\]\.model .*lid\.bin: its sha256 is "
        r"[0-9a-f]{64}, not data\.quality\.steps\[0\]\.sha256 0{64}; ",
    ):
        recipe.recipes(cfg([language]), ["a"], "my.yaml")
    language["sha256"] = hashlib.sha256(b"model").hexdigest()
    assert recipe.recipes(cfg([language]), ["a"], "my.yaml")["a"][0].kind == "language"
    assert recipe.recipes({"data": {"blend": []}}, ["a"], "my.yaml") == {}
