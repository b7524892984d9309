"""The data-quality stage (rules/quality.smk) through Snakemake (issue 39): data.quality's
steps run as cached jobs between collection and tokenization, remove exactly the planted copies
across datasets, count documents and bytes per step and shard, print the recipe at -n, and an
edit reruns only the step it touches and what follows. Off, the plan is today's."""

from __future__ import annotations

import copy
import json
import random
import shutil

import pytest

from .conftest import job_counts


def prose(rng: random.Random, words: int = 120) -> str:
    """Letters only: simplify_text turns digits into 0, which would make every text alike."""
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(50)]
    return " ".join(rng.choice(vocab) + rng.choice("aeiou") for _ in range(words)) + ".\n"


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory, snakemake, write_config, tiny):
    """Two datasets of one-document files: a holds 12 documents, a case-and-spacing copy of
    its first and a one-word edit of its second; b repeats a's third and fourth and has four
    of its own. Planned, then run through tokenization."""
    wd = tmp_path_factory.mktemp("quality")
    rng = random.Random(39)
    base = [prose(rng) for _ in range(12)]
    own = [prose(rng) for _ in range(4)]
    near = base[1].split()
    near[60] = "changed"
    files = {
        **{f"a/{i:02d}.txt": t for i, t in enumerate(base)},
        "a/20.txt": base[0].upper().replace(" ", "  "),
        "a/21.txt": " ".join(near) + "\n",
        "b/00.txt": base[2],
        "b/01.txt": base[3],
        **{f"b/{i + 2:02d}.txt": t for i, t in enumerate(own)},
    }
    for name, text in files.items():
        (wd / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (wd / "corpus" / name).write_text(text)
    cfg = copy.deepcopy(tiny)
    cfg["datasets"] = {
        d: {"type": "local", "root": f"corpus/{d}", "include": ["*.txt"], "shards": 2}
        for d in ("a", "b")
    }
    cfg["tokenizer"]["train"]["datasets"] = ["a", "b"]
    cfg["data"]["blend"] = [{"dataset": "a"}, {"dataset": "b"}]
    cfg["data"]["quality"] = {"steps": [{"step": "exact"}, {"step": "minhash"}]}
    config = write_config(wd / "config.yaml", cfg)
    plan = snakemake(wd, config, "-n", "data")
    run = snakemake(wd, config, "data")
    assert run.returncode == 0, run.out[-4000:]
    return wd, cfg, plan, base, own, write_config


def step_dirs(wd):
    """The step directories in recipe order (and a filters step's signals)."""
    return sorted(p.name for p in (wd / "results" / "quality").iterdir())


def test_the_plan_prints_the_recipe_and_its_threshold(cleaned):
    _, _, plan, _, _, _ = cleaned
    assert plan.returncode == 0, plan.out[-3000:]
    assert "gptflow: data quality of a, b:" in plan.out
    assert "1. exact (BLAKE2b-128 of normalized text, scope blend): will run" in plan.out
    assert (
        "2. minhash (5-gram words by regex, 14 bands x 8 rows, Jaccard threshold "
        "(1/14)^(1/8) = 0.719, scope blend): will run" in plan.out
    )
    counts = job_counts(plan.out)
    assert counts["hash_documents"] == counts["minhash_signatures"] == 4  # 2 shards x 2
    assert counts["find_exact_repeats"] == counts["cluster_minhash_pairs"] == 1  # blend
    assert counts["minhash_buckets"] == 14 and counts["remove_duplicates"] == 8


def test_exactly_the_copies_are_removed_across_datasets(cleaned):
    wd, _, _, base, own, _ = cleaned
    (last,) = [d for d in step_dirs(wd) if d.startswith("02-minhash-")]
    kept = {
        d: [
            json.loads(line)["text"]
            for shard in ("00000", "00001")
            for line in (wd / "results/quality" / last / d / f"{shard}.jsonl").read_text().splitlines()
        ]
        for d in ("a", "b")
    }  # fmt: skip
    assert sorted(kept["a"]) == sorted(base)  # the exact copy and the near copy gone
    assert sorted(kept["b"]) == sorted(own)  # a's repeats gone from b, a's copies kept
    manifests = {
        (step, d, s): json.loads((wd / "results/quality" / step / d / f"{s}.manifest.json").read_text())
        for step in step_dirs(wd) if step[:2] in ("01", "02")
        for d in ("a", "b") for s in ("00000", "00001")
    }  # fmt: skip
    removed = {}
    for (step, _, _), m in manifests.items():
        kind = step.split("-")[1]
        assert set(m["removed"]) <= {kind}
        assert m["documents_in"] - m["documents_out"] == m["removed"].get(kind, 0)
        assert m["bytes_out"] <= m["bytes_in"]
        assert len(m["examples"].get(kind, [])) == min(m["removed"].get(kind, 0), 3)
        removed[kind] = removed.get(kind, 0) + m["removed"].get(kind, 0)
    assert removed == {"exact": 3, "minhash": 1}
    tokens = json.loads((wd / "results/tokens/tiny-bpe/b/00000.json").read_text())
    assert tokens["documents"] + json.loads(
        (wd / "results/tokens/tiny-bpe/b/00001.json").read_text()
    )["documents"] == len(own)


def test_an_edit_reruns_its_step_and_what_follows_and_off_adds_no_job(cleaned, snakemake):
    wd, cfg, _, _, _, write_config = cleaned
    edited = copy.deepcopy(cfg)
    edited["data"]["quality"]["steps"][1]["bands"] = 20
    plan = snakemake(wd, write_config(wd / "edited.yaml", edited), "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert "1. exact (BLAKE2b-128 of normalized text, scope blend): outputs present" in plan.out
    assert "hash_documents" not in counts and "find_exact_repeats" not in counts
    assert counts["minhash_signatures"] == 4 and counts["minhash_buckets"] == 20
    assert counts["remove_duplicates"] == 4 and counts["tokenize_shard"] == 4

    off = copy.deepcopy(cfg)
    del off["data"]["quality"]
    plan = snakemake(wd, write_config(wd / "off.yaml", off), "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    assert "data quality" not in plan.out
    assert set(job_counts(plan.out)) == {"tokenize_shard", "data"}  # from the collected shards


# one of each path to -n's line (the schema, the recipe, the filters module); the recipe's other
# refusals (a dataset not blended, a language model missing) are in tests/unit/test_quality_recipe.py
@pytest.mark.parametrize(
    ("quality", "message"),
    [
        (
            {"steps": [{"step": "minhash", "bandz": 3}]},
            "unknown key 'data.quality.steps[0].bandz'",
        ),
        (
            {"steps": [{"step": "minhash", "rows": 0}]},
            "'data.quality.steps[0].rows' is 0",
        ),
        (
            {"steps": [{"step": "exact"}, {"step": "filters", "rules": {"gopher_quality": {"min_words": 50}}}]},
            "data.quality.steps[1].rules: quality filter gopher_quality: threshold 'min_words' is unknown",
        ),
    ],
)  # fmt: skip
def test_a_bad_recipe_stops_the_plan_with_one_line(
    quality, message, tmp_path, snakemake, write_config, tiny
):
    cfg = copy.deepcopy(tiny)
    cfg["data"]["quality"] = quality
    plan = snakemake(tmp_path, write_config(tmp_path / "config.yaml", cfg), "-n")
    assert plan.returncode != 0
    assert message in plan.out, plan.out[-2000:]
    assert "Traceback" not in plan.out


def test_filters_thresholds_rerun_the_selection_not_the_signals(cleaned, snakemake):
    """The filters step (gptflow.data.quality.filters): its signals are computed once per
    shard; an edited threshold reruns only the selection."""
    wd, cfg, _, _, _, write_config = cleaned
    filtered = copy.deepcopy(cfg)
    filtered["data"]["quality"]["steps"].append(
        {"step": "filters", "rules": {"gopher_quality": {}}}
    )
    config = write_config(wd / "filtered.yaml", filtered)
    run = snakemake(wd, config, "data")
    assert run.returncode == 0, run.out[-4000:]
    counts = job_counts(run.out)
    assert counts["compute_filter_signals"] == counts["select_documents"] == 4
    assert not {"hash_documents", "minhash_signatures", "remove_duplicates"} & set(counts)
    (filters_dir,) = [d for d in step_dirs(wd) if d.startswith("03-filters-")]
    assert [d for d in step_dirs(wd) if d.startswith("03-signals-")]
    manifests = [
        json.loads((wd / "results/quality" / filters_dir / d / f"{s}.manifest.json").read_text())
        for d in ("a", "b") for s in ("00000", "00001")
    ]  # fmt: skip
    # random words hold none of Gopher's stop words: every document goes, for that reason
    assert {r for m in manifests for r in m["removed"]} == {
        "gopher_quality:gopher_enough_stop_words"
    }
    assert sum(m["documents_out"] for m in manifests) == 0
    assert all(
        len(m["examples"]["gopher_quality:gopher_enough_stop_words"]) <= 3 for m in manifests
    )

    filtered["data"]["quality"]["steps"][-1]["rules"]["gopher_quality"]["min_stop_words"] = 0
    plan = snakemake(wd, write_config(wd / "threshold.yaml", filtered), "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert "compute_filter_signals" not in counts
    assert counts["select_documents"] == 4 and counts["tokenize_shard"] == 4


def test_a_data_ablation_cleans_each_recipe_once_and_holds_out_the_base(
    cleaned, snakemake, tmp_path, monkeypatch
):  # the held-out splits read from `heldout`: tests/unit/test_dataset.py
    """A study whose runs differ in data.quality (issue 39): each distinct recipe gets its own
    steps and shards, runs with equal recipes share them, the base's steps and shards are
    reused as they are; every run is validated on the base's shards; editing one threshold in
    one run's recipe replans that recipe's selection and shards and that run alone."""
    from gptflow.train.run_config import RunConfig

    wd = tmp_path / "wd"
    shutil.copytree(cleaned[0], wd, symlinks=True)  # the module's data, tokenized once
    cfg, write_config = cleaned[1], cleaned[5]
    study = copy.deepcopy(cfg)
    study["run"] = "ablation"
    filters = {
        "steps": [{"step": "exact"}, {"step": "filters", "rules": {"gopher_repetition": {}}}]
    }
    study["study"] = {"runs": {
        "base": {},  # the base config's recipe: exact + minhash
        "filtered": {"data": {"quality": filters}},
        "filtered-lr": {"data": {"quality": copy.deepcopy(filters)}, "train": {"lr": 1e-3}},
    }}  # fmt: skip
    run_yamls = [f"results/runs/{r}/run.yaml" for r in study["study"]["runs"]]
    run = snakemake(wd, write_config(wd / "study.yaml", study), "data", *run_yamls)
    assert run.returncode == 0, run.out[-4000:]
    counts = job_counts(run.out)
    # exact is the base's first step (its outputs present); the filters step once for two runs
    # (the base's shards may be retokenized: another test of this module edits its recipe)
    assert not {"hash_documents", "minhash_signatures"} & set(counts)
    assert counts["compute_filter_signals"] == counts["select_documents"] == 4  # 2 x 2 shards
    assert counts["tokenize_variant_shard"] == 4 and counts["render_run_config"] == 3
    assert "gptflow: study runs filtered, filtered-lr:" in run.out
    monkeypatch.chdir(wd)
    runs = {r: RunConfig.load(f"results/runs/{r}/run.yaml") for r in study["study"]["runs"]}
    prefixes = {r: [s.prefix for d in c.datasets for s in d.shards] for r, c in runs.items()}
    assert prefixes["base"][0] == "results/tokens/tiny-bpe/a/00000" and not runs["base"].heldout
    assert prefixes["filtered"] == prefixes["filtered-lr"] != prefixes["base"]
    assert prefixes["filtered"][0].startswith("results/tokens/tiny-bpe/a/02-filters-")
    for name in ("filtered", "filtered-lr"):  # held out: the base's shards
        assert [s.prefix for d in runs[name].heldout for s in d.shards] == prefixes["base"]
    assert runs["filtered"].data_index == runs["filtered-lr"].data_index != runs["base"].data_index

    study["study"]["runs"]["filtered"]["data"]["quality"]["steps"][1]["rules"] = {
        "gopher_repetition": {"dup_line_frac": 0.5}
    }
    plan = snakemake(wd, write_config(wd / "edited.yaml", study), "-n", "data", *run_yamls)
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert not {"compute_filter_signals", "hash_documents", "tokenize_shard"} & set(counts)
    assert counts["select_documents"] == counts["tokenize_variant_shard"] == 4
    assert counts["render_run_config"] == 1 and "results/runs/filtered/run.yaml" in plan.out
