"""The example configs plan cleanly (no network is touched by a dry run): the exact jobs of each
recipe, and download commands with the URLs and mirrors its config and the catalog name."""

import subprocess

import pytest
import yaml

from .conftest import BIN, REPO, job_counts
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


# Model-parallel recipes: planned through the shipped Slurm profile (2 nodes x 8 GPUs), whose
# ranks the tensor-parallel size must divide; their data is neox-pile-enwik8's
PLANS["pythia-6.9b"] = PLANS["pythia-12b"] = PLANS["neox-pile-enwik8"]
ON_THE_CLUSTER = {"pythia-6.9b": 2, "pythia-12b": 4}  # example: its tensor_parallel


def download_command(url: str, mirrors: list[str]) -> str:
    return " ".join([f"gptflow download {url}", *(f"--mirror {m}" for m in mirrors)])


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_config_dry_runs(example, tmp_path, snakemake):
    if example.stem in ON_THE_CLUSTER:
        out = plan_on_the_cluster(tmp_path, example)
    else:
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


def plan_on_the_cluster(workdir, example):
    """`snakemake --profile profiles/slurm ... -n`: a dry run submits nothing (the Slurm
    executor is not started), so it needs no cluster."""
    cmd = [
        str(BIN / "snakemake"), "-n", "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir), "--profile", str(REPO / "profiles" / "slurm"),
        "--configfile", str(example), "--replace-workflow-config",
    ]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.out = proc.stdout
    return proc


@pytest.mark.parametrize("name", sorted(ON_THE_CLUSTER))
def test_model_parallel_examples_split_over_the_shipped_profile(name, tmp_path):
    """The published layout on the shipped profile's ranks: the tensor-parallel size divides
    them, the heads and the MLP, and the global batch splits over the data-parallel ranks; a
    laptop's plan (one rank) refuses it with the way on named."""
    from gptflow.config import ModelConfig, TrainConfig, check_model_parallel, load_yaml
    from gptflow.distributed import launched_ranks

    example = load_yaml(REPO / "config" / "examples" / f"{name}.yaml")
    profile = load_yaml(REPO / "profiles" / "slurm" / "config.yaml")["set-resources"]["train_gpt"]
    ranks = launched_ranks(profile["nodes"], profile["tasks_per_node"])
    train = TrainConfig(**example["train"])
    assert train.tensor_parallel == ON_THE_CLUSTER[name] and ranks == 16
    model = load_yaml(REPO / "config" / "models" / f"{example['model']['preset']}.yaml")
    check_model_parallel(ModelConfig(**{**model, "vocab_size": 50304}), train)
    dp = train.data_parallel_size(ranks)
    assert train.micro_batch_size * train.grad_accum_steps(ranks) * dp == 1024
    local = subprocess.run(
        [str(BIN / "snakemake"), "-n", "--snakefile", str(REPO / "Snakefile"), "--directory",
         str(tmp_path), "--configfile", str(REPO / "config" / "examples" / f"{name}.yaml"),
         "--replace-workflow-config", "--cores", "1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert local.returncode != 0
    assert f"train.tensor_parallel {train.tensor_parallel} does not divide the 1 training" in (
        local.stdout + local.stderr
    )


def test_examples_cover_the_recipes():
    assert {p.stem for p in EXAMPLES} == set(PLANS) >= {"neox-pile-enwik8", "megatron-oscar-gpt2"}
