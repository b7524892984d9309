"""gptflow why's pieces: config diffs, Snakemake dry-run parsing, the parameter count."""

from __future__ import annotations

from gptflow.config import ModelConfig
from gptflow.model import GPTNeoX
from gptflow.why import config_changes, parameter_count, parse_dry_run

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


def test_parameter_count_equals_the_model():
    for preset in (
        {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512},
        {"num_layers": 3, "hidden_size": 96, "num_attention_heads": 6, "vocab_size": 1024,
         "intermediate_size": 200},
    ):  # fmt: skip
        model = GPTNeoX(ModelConfig(**preset))
        real = sum(p.numel() for p in model.parameters())
        assert parameter_count(preset) == real
