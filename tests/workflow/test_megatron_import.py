"""A megatron dataset through Snakemake: shards that megatron-core's tokenizer and writer made
(as Megatron-LM's preprocess_data.py makes them), kept under a directory named with shell
metacharacters, are imported (checked, linked) and trained on by the tiny config; a rerun
plans nothing and a changed shard is imported again. A missing prefix and a hostile shard name
stop the plan; a damaged shard fails its job, which publishes nothing."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from .conftest import job_counts

# a shell that ever interpreted the directory would create one of these
HOSTILE_DIR = "pile $(touch CANARY-1); touch CANARY-2 `touch CANARY-3`"
TOKENS = "results/tokens/tiny-bpe/pile_tok"


def megatron_config(tiny_config: dict, tokenizer_json: Path, prefixes: list[str]) -> dict:
    """The tiny config on a megatron dataset, with the tokenizer its shards were made with,
    training 10 steps."""
    cfg = copy.deepcopy(tiny_config)
    cfg["tokenizer"] = {"name": "tiny-bpe", "source": "file", "path": str(tokenizer_json)}
    cfg["datasets"] = {"pile_tok": {"type": "megatron", "prefixes": prefixes}}
    cfg["data"]["blend"] = [{"dataset": "pile_tok", "weight": 1.0}]
    cfg["train"].update(train_iters=10, save_interval=10)
    return cfg


def place(prefixes: list[str], directory: Path) -> list[str]:
    """Copies of the shards in `directory` (so a test may touch or damage them)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            shutil.copy(f"{prefix}{ext}", directory / f"{Path(prefix).name}{ext}")
        out.append(str(directory / Path(prefix).name))
    return out


def canaries(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("CANARY*")]


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory, snakemake, write_config, tiny_config, tokenizer_json, megatron_shards
):
    root = tmp_path_factory.mktemp("megatron-wf")
    prefixes = place(megatron_shards, root / HOSTILE_DIR)
    config = write_config(
        root / "config.yaml", megatron_config(tiny_config, tokenizer_json, prefixes)
    )
    wd = root / "wd"
    plan = snakemake(wd, config, "-n", "train")
    run = snakemake(wd, config, "train")
    assert run.returncode == 0, run.out[-5000:]
    return root, wd, config, prefixes, plan


def test_megatron_shards_are_imported_and_trained_on(trained):
    root, wd, _, prefixes, plan = trained
    assert plan.returncode == 0, plan.out[-3000:]
    assert job_counts(plan.out) == {
        "import_tokenizer": 1,
        "import_megatron_shard": 2,
        "render_run_config": 1,
        "build_data_index": 1,
        "train_gpt": 1,
        "train": 1,
    }
    run = yaml.safe_load((wd / "results/runs/tiny/run.yaml").read_text())
    shards = run["data"]["datasets"][0]["shards"]
    assert [s["prefix"] for s in shards] == [f"{TOKENS}/{Path(p).name}" for p in prefixes]
    for prefix, shard in zip(prefixes, shards, strict=True):
        for ext in (".bin", ".idx"):
            link = wd / f"{shard['prefix']}{ext}"
            assert link.is_symlink() and os.readlink(link) == f"{prefix}{ext}"
        data = Path(f"{prefix}.bin").read_bytes()
        assert shard["bin_sha256"] == hashlib.sha256(data).hexdigest()
    done = json.loads((wd / "results/runs/tiny/DONE.json").read_text())
    assert done["final_step"] == 10 and done["final_val_loss"] < done["initial_val_loss"]
    assert canaries(root) == []


def test_a_rerun_plans_nothing_and_a_changed_shard_is_imported_again(trained, snakemake, tmp_path):
    """Changed content (shard 0's bytes under shard 1's name): Snakemake checksums inputs this
    small, so a touched file alone would not count. The shard is restored afterwards."""
    _, wd, config, prefixes, _ = trained
    again = snakemake(wd, config, "-n", "train")
    assert again.returncode == 0 and job_counts(again.out) == {}, again.out[-3000:]
    files = [f"{prefixes[1]}{ext}" for ext in (".bin", ".idx")]
    for f in files:
        shutil.copy2(f, tmp_path)
    try:
        for ext in (".bin", ".idx"):
            shutil.copy(f"{prefixes[0]}{ext}", f"{prefixes[1]}{ext}")
        changed = job_counts(snakemake(wd, config, "-n", "train").out)
    finally:
        for f in files:
            shutil.copy2(tmp_path / Path(f).name, f)
    # the index and run.yaml take the shard's manifest, which the import writes last
    assert changed["import_megatron_shard"] == 1 and changed["render_run_config"] == 1, changed
    assert changed["build_data_index"] == 1, changed


def test_beside_a_tokenized_dataset_with_parts_and_merge(
    tmp_path, snakemake, write_config, tiny_config, tokenizer_json, megatron_shards
):
    """stdlib is tokenized in document ranges and merged; the megatron dataset beside it is
    imported only: never counted, split or merged (a merge would copy it)."""
    cfg = megatron_config(tiny_config, tokenizer_json, megatron_shards)
    cfg["datasets"]["stdlib"] = tiny_config["datasets"]["stdlib"]
    cfg["data"]["blend"].append({"dataset": "stdlib", "weight": 1.0})
    cfg["tokenize"].update(documents_per_shard=1000, merge=True)
    plan = snakemake(tmp_path / "wd", write_config(tmp_path / "c.yaml", cfg), "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    assert job_counts(plan.out) == {
        "collect_local_documents": 2,
        "count_documents": 2,
        "import_tokenizer": 1,
        "import_megatron_shard": 2,
        "merge_shards": 1,
        "data": 1,
    }
    assert "results/tokens/tiny-bpe/stdlib/merged.bin" in plan.out
    assert "pile_tok/merged" not in plan.out and "documents/pile_tok" not in plan.out


def config_error(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("gptflow config:")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def test_a_missing_prefix_stops_the_plan(
    tmp_path, snakemake, write_config, tiny_config, tokenizer_json, megatron_shards
):
    missing = str(tmp_path / "pile_02_text_document")
    cfg = megatron_config(tiny_config, tokenizer_json, [megatron_shards[0], missing])
    config = write_config(tmp_path / "c.yaml", cfg)
    out = snakemake(tmp_path / "wd", config, "-n")
    assert out.returncode != 0
    assert config_error(out.out) == (
        f"gptflow config: {config}: datasets.pile_tok.prefixes[1] is '{missing}', but "
        f"{missing}.idx does not exist (relative to {tmp_path / 'wd'}). Fix "
        f"datasets.pile_tok.prefixes[1] in {config}."
    )
    assert not (tmp_path / "wd" / "results").exists()


def test_a_hostile_shard_name_stops_the_plan(
    tmp_path, snakemake, write_config, tiny_config, tokenizer_json
):
    hostile = str(tmp_path / "data" / "$(touch CANARY-name)")
    cfg = megatron_config(tiny_config, tokenizer_json, [hostile])
    config = write_config(tmp_path / "c.yaml", cfg)
    out = snakemake(tmp_path / "wd", config, "-n")
    assert out.returncode != 0
    line = config_error(out.out)
    assert "datasets.pile_tok.prefixes[0]" in line and "a path whose file name" in line, line
    assert not (tmp_path / "wd" / "results").exists() and canaries(tmp_path) == []


def test_a_damaged_shard_fails_its_job_and_publishes_nothing(
    tmp_path, snakemake, write_config, tiny_config, tokenizer_json, megatron_shards
):
    prefix = place(megatron_shards[:1], tmp_path / "data")[0]
    size = os.path.getsize(f"{prefix}.bin")
    os.truncate(f"{prefix}.bin", size - 2)
    config = write_config(
        tmp_path / "c.yaml", megatron_config(tiny_config, tokenizer_json, [prefix])
    )
    wd = tmp_path / "wd"
    out = snakemake(wd, config, "data")
    assert out.returncode != 0 and "Error in rule import_megatron_shard" in out.out, out.out
    name = Path(prefix).name
    log = (wd / f"logs/import_megatron_shard/tiny-bpe/pile_tok/{name}.log").read_text()
    assert log.splitlines() == [
        f"gptflow import-megatron: error: {prefix}.bin: {size - 2} bytes, index implies {size} "
        f"(truncated or mismatched); re-tokenize it (megatron shard {prefix}: re-create it with "
        f"Megatron's tools/preprocess_data.py, or remove it from the dataset's prefixes)"
    ]
    assert list((wd / TOKENS).glob("*")) == []
