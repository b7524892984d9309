"""The example configs plan cleanly (no network is touched by a dry run)."""

import pytest

from .conftest import REPO, job_counts

EXAMPLES = sorted((REPO / "config" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_config_dry_runs(example, tmp_path, snakemake):
    out = snakemake(tmp_path, example, "-n")
    assert out.returncode == 0, out.out[-3000:]
    counts = job_counts(out.out)
    assert counts["download_dataset"] >= 1 and counts["download_tokenizer_file"] >= 1
    assert counts["train_gpt"] == 1


def test_examples_cover_the_two_recipes():
    assert {p.stem for p in EXAMPLES} >= {"neox-pile-enwik8", "megatron-oscar-gpt2"}
