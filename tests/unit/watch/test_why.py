"""gptflow why's pieces: config diffs, Snakemake dry-run parsing, the parameter count, the
preflight's FLOPs, GPU-hours and disk figures."""

from __future__ import annotations

import shutil

import pytest

from gptflow.watch.why import config_changes, parse_dry_run

DRY_RUN = """Building DAG of jobs...
Job stats:
job            count
-----------  -------
train_gpt          1
total              1

[Sun Nov 22 12:46:52 2026]
rule train_gpt:
    input: results/runs/tiny/run.yaml, results/runs/tiny/data-index.json
    output: results/runs/tiny/DONE.json
    log: logs/train_gpt/tiny.log
    jobid: 3
    reason: Input files updated by another job: results/runs/tiny/run.yaml; Params have changed since last execution
    wildcards: run=tiny
    threads: 2
    resources: tmpdir=/tmp

[Sun Nov 22 12:46:52 2026]
localrule all:
    input: results/runs/tiny/DONE.json
    jobid: 0
    reason: Input files updated by another job: results/runs/tiny/DONE.json
"""


def test_config_changes_name_keys_with_old_and_new_values():
    old = {"train": {"lr": 0.003, "seed": 1}, "data": {"split": "90,9,1"}}
    new = {"train": {"lr": 0.002, "seed": 1}, "data": {"split": "90,9,1"}, "eval": {"k": 1}}
    assert config_changes(old, new) == [("eval.k", "(unset)", 1), ("train.lr", 0.003, 0.002)]
    assert config_changes(new, new) == []


def test_dry_run_jobs_and_reasons_are_parsed():
    jobs = parse_dry_run(DRY_RUN)
    assert [j.rule for j in jobs] == ["train_gpt", "all"]
    assert jobs[0].outputs == ["results/runs/tiny/DONE.json"]
    assert jobs[0].reasons == [
        "Input files updated by another job: results/runs/tiny/run.yaml",
        "Params have changed since last execution",
    ]
    assert jobs[0].wildcards == "run=tiny" and jobs[1].outputs == []


def size_of(cfg: dict, tmp_path, peak_tflops: float, mfu: float, shards: int = 0) -> dict:
    """The plan's size figures (gptflow.plan.preflight), as `gptflow why` prints them."""
    from gptflow.config.settings import TrainConfig
    from gptflow.plan import run_size

    vocab, _ = run_size.vocab_size(cfg, None)
    model = run_size.model_config(cfg, vocab)
    free = shutil.disk_usage(tmp_path).free
    return run_size.size(model, TrainConfig(**cfg["train"]), shards, free, peak_tflops, mfu)


def test_preflight_figures_of_the_tiny_config_equal_a_hand_calculation(tmp_path):
    """The README's example line: 165,632 parameters (the tiny preset, vocabulary 500 padded
    to 512), 40 x 8 x 64 = 20,480 tokens, FLOPs by Megatron's formula (884,736 a token, as the
    trainer logs it: tests/unit/train/test_train.py), GPU-hours at 40 % MFU of 989 TFLOP/s;
    disk: fp32 weights + Adam moments (16 bytes a parameter) for keep_last + 1 checkpoints."""
    cfg = {
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "intermediate_size": None, "make_vocab_size_divisible_by": 128},
        "tokenizer": {"source": "train", "train": {"vocab_size": 500}},
        "train": {"train_iters": 40, "global_batch_size": 8, "seq_length": 64, "keep_last": 2},
    }  # fmt: skip
    pre = size_of(cfg, tmp_path, peak_tflops=989.0, mfu=0.4)
    assert pre["parameters"] == 165_632
    assert pre["training_tokens"] == 20_480
    # 3 x [2 x (2 x (4 x 64^2 + 2 x 64 x 256) + 4 x 64 x 64) + 2 x 64 x 512] = 884,736 a token
    assert pre["training_flops"] == 18_119_393_280  # 884,736 * 20,480
    # 18,119,393,280 / (989e12 * 0.4) s = 4.58023e-5 s = 1.272286e-8 h
    assert pre["gpu_hours"] == pytest.approx(1.272286e-8, rel=1e-6)
    assert pre["checkpoint_bytes"] == 7_950_336  # 165,632 * 16 * 3
    assert (pre["peak_tflops"], pre["mfu"]) == (989.0, 0.4)
    assert 0 < pre["free_bytes"] <= shutil.disk_usage(tmp_path).total


def test_preflight_pads_the_vocabulary(tmp_path):
    """vocab 70,000 pads to 70,016 (a multiple of 128); keep_last defaults to 2."""
    cfg = {
        "model": {"num_layers": 3, "hidden_size": 96, "num_attention_heads": 6,
                  "intermediate_size": 200, "make_vocab_size_divisible_by": 128},
        "tokenizer": {"source": "train", "train": {"vocab_size": 70_000}},
        "train": {"train_iters": 1000, "global_batch_size": 16, "seq_length": 128},
    }  # fmt: skip
    pre = size_of(cfg, tmp_path, peak_tflops=312.0, mfu=0.5)
    # layer: 4*96 + (3*96^2 + 3*96) + (96^2 + 96) + (96*200 + 200) + (200*96 + 96) = 76,328;
    # N = 70,016*96 + 3*76,328 + 2*96 + 96*70,016 = 13,672,248
    assert pre["parameters"] == 13_672_248
    assert pre["training_tokens"] == 2_048_000  # 1000 * 16 * 128
    # a token: 3 x [3 x (2 x (4 x 96^2 + 2 x 96 x 200) + 4 x 128 x 96) + 2 x 96 x 70,016]
    #   = 3 x (3 x 199,680 + 13,443,072) = 42,126,336
    assert pre["training_flops"] == 86_274_736_128_000  # 42,126,336 * 2,048,000
    # 8.6274736128e13 / (312e12 * 0.5) s = 0.5530432 s = 1.536231e-4 h
    assert pre["gpu_hours"] == pytest.approx(1.536231e-4, rel=1e-6)
    assert pre["checkpoint_bytes"] == 656_267_904  # 13,672,248 * 16 * 3
    # without a trained tokenizer nor model.vocab_size: GPT-2's 50,257, padded to 50,304
    cfg["tokenizer"] = {}
    n = size_of(cfg, tmp_path, peak_tflops=312.0, mfu=0.5)["parameters"]
    assert n == 2 * 50_304 * 96 + 3 * 76_328 + 2 * 96


def test_shard_bytes_come_from_the_corpus_in_the_token_dtype_of_the_unpadded_vocabulary(
    tmp_path,
):
    """The shards' size from the inputs on disk: 4 bytes of text a token (a .zst's bytes
    3.5 times), in uint16 below 65,500 ids (Megatron's rule, gptflow.data.indexed), else
    int32; an imported Megatron shard counts its .bin; an input not downloaded yet is counted
    apart. The embedding still has the padded rows: a 65,450-token vocabulary pads to 65,536."""
    from gptflow.data.sources import Dataset, Shard
    from gptflow.plan import run_size

    (tmp_path / "a.jsonl").write_bytes(b"x" * 4000)  # 1,000 tokens
    (tmp_path / "b.jsonl.zst").write_bytes(b"x" * 800)  # 2,800 bytes of text: 700 tokens
    (tmp_path / "c.bin").write_bytes(b"x" * 123)
    datasets = {
        "plain": Dataset("plain", "files", (Shard("00000", str(tmp_path / "a.jsonl"), "jsonl"),)),
        "url": Dataset("url", "url", (
            Shard("00000", str(tmp_path / "b.jsonl.zst"), "jsonl.zst"),
            Shard("00001", str(tmp_path / "later.jsonl.zst"), "jsonl.zst"),
        )),
        "made": Dataset("made", "megatron", (Shard("c", str(tmp_path / "c"), "megatron"),)),
    }  # fmt: skip
    assert run_size.token_bytes(datasets, 65_450) == (2 * 1000 + 2 * 700 + 123, 1)
    assert run_size.token_bytes(datasets, 65_500) == (4 * 1000 + 4 * 700 + 123, 1)
    cfg = {
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                  "make_vocab_size_divisible_by": 128},
        "tokenizer": {"source": "train", "train": {"vocab_size": 65_450}},
        "train": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 4, "seq_length": 32},
    }  # fmt: skip
    # 2 x 65,536 x 32 + (4 x 32 + 3 x 32^2 + 3 x 32 + 32^2 + 32 + 32 x 128 + 128 + 128 x 32
    # + 32) + 2 x 32
    assert size_of(cfg, tmp_path, 989.0, 0.4)["parameters"] == 2 * 65_536 * 32 + 12_704 + 64


def test_why_passes_snakemakes_own_planning_error_through(repo, tmp_path, tiny_config):
    """A plan that fails (here a config key of the wrong type) makes `gptflow why` exit 1 with
    Snakemake's own error, from its first error line, not a generic failure."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    cfg = {**tiny_config, "train": {**tiny_config["train"], "lr": "fast"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [str(Path(sys.executable).parent / "gptflow"), "why", "--directory", str(tmp_path), "--",
         "--snakefile", str(repo / "Snakefile"), "--configfile", str(tmp_path / "c.yaml"),
         "--cores", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert (
        lines[0].startswith("gptflow why: error: snakemake -n ")
        and "failed (exit 1); Snakemake said:" in (lines[0])
    ), out.stderr
    assert lines[1].startswith("WorkflowError in file"), out.stderr
    assert "train.lr" in out.stderr and "'fast'" in out.stderr, out.stderr
