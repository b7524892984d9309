"""The example configs plan cleanly (no network is touched by a dry run): the exact jobs of each
recipe, and download commands with the URLs and mirrors its config and the catalog name."""

import pytest
import yaml

from .conftest import REPO, job_counts
from .test_pipeline import AFTER_RUN_CONFIG

EXAMPLES = sorted((REPO / "config" / "examples").glob("*.yaml"))
AFTER_DATA = {**AFTER_RUN_CONFIG, "all": 1}  # the stages after the data
PLANS = {
    # Pile shard 00 + enwik8.zip; the NeoX-20B tokenizer.json by URL; documents_per_shard
    # counts both inputs first (count_documents is a checkpoint: the tokenize_part jobs are
    # planned once the counts exist)
    "neox-pile-enwik8": {
        "download_dataset": 2,
        "download_tokenizer_file": 1,
        "import_tokenizer": 1,
        "count_documents": 2,
        **AFTER_DATA,
    },
    # OSCAR-1GB, one shard; GPT-2 vocab.json + merges.txt downloaded and converted
    "megatron-oscar-gpt2": {
        "download_dataset": 1,
        "download_tokenizer_file": 2,
        "convert_gpt2_tokenizer": 1,
        "tokenize_shard": 1,
        **AFTER_DATA,
    },
}


def download_command(url: str, mirrors: list[str]) -> str:
    return " ".join([f"gptflow download {url}", *(f"--mirror {m}" for m in mirrors)])


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_config_dry_runs(example, tmp_path, snakemake):
    out = snakemake(tmp_path, example, "-n")
    assert out.returncode == 0, out.out[-3000:]
    assert job_counts(out.out) == PLANS[example.stem]
    cfg = yaml.safe_load(example.read_text())
    catalog = yaml.safe_load((REPO / "config/datasets.yaml").read_text())
    tok = cfg["tokenizer"]
    for key in ("url", "vocab", "merges"):
        if key in tok:
            remote = tok[key]
            assert download_command(remote["url"], remote.get("mirrors", [])) in out.out, key
    for name, spec in cfg["datasets"].items():
        for f in catalog[spec["name"]]["files"]:
            file = f["url"].rsplit("/", 1)[1]
            mirrors = " ".join(f"--mirror {m}" for m in f["mirrors"])
            want = f"gptflow download {f['url']} --out resources/raw/{name}/{file} {mirrors}"
            assert want in out.out, want
    assert not list(tmp_path.glob("resources/**/*.part")) and not (tmp_path / "results").exists()


def test_examples_cover_the_two_recipes():
    assert {p.stem for p in EXAMPLES} == set(PLANS) >= {"neox-pile-enwik8", "megatron-oscar-gpt2"}
