"""Bad input stops before any job runs (or at the failing job) with one line that names the key
or file and the fix; nothing is left half-written under a final name."""

import copy
import json

import pytest

from .conftest import REPO


def tiny():
    import yaml

    return yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())


def without(cfg, section):
    cfg = copy.deepcopy(cfg)
    del cfg[section]
    return cfg


def edited(path, value):
    cfg = tiny()
    node = cfg
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return cfg


CASES = {
    "missing key": (without(tiny(), "train"), "missing required key 'train'"),
    # a KeyError traceback before (found writing a plan test): the step's rules are required
    "filters step without rules": (
        edited("data.quality", {"steps": [{"step": "filters"}]}),
        "data.quality.steps[0].rules: a filters step needs its rules",
    ),
    "filters step with empty rules": (
        edited("data.quality", {"steps": [{"step": "filters", "rules": {}}]}),
        "'data.quality.steps[0].rules' must not be empty",
    ),
    "wrong type": (
        edited("tokenizer.train.vocab_size", "big"),
        "'tokenizer.train.vocab_size' is 'big' (a string); expected an integer",
    ),
    "unknown key": (edited("train.warmup", 10), "unknown key 'train.warmup'"),
    "glob matches nothing": (
        edited("datasets.stdlib.include", ["no_such_package/*.py"]),
        "datasets.stdlib.include ['no_such_package/*.py'] matched no files under",
    ),
    "tokenizer path missing": (
        edited("tokenizer", {"name": "t", "source": "file", "path": "nowhere/tokenizer.json"}),
        "tokenizer.path 'nowhere/tokenizer.json' does not exist",
    ),
    # issue 25: these came inside a Snakemake traceback, or as its MissingInputException
    "sqsh on the local profile": (
        edited("container", {"enabled": True, "format": "sqsh"}),
        "container.format sqsh runs through Pyxis (srun --container-image), which needs the "
        "Slurm profile",
    ),
    "dockerfile missing": (
        edited("container", {"enabled": True, "format": "sif", "dockerfile": "envs/NoSuch"}),
        "container.dockerfile is 'envs/NoSuch', but ",
    ),
    "eval.extra prefix missing": (
        edited("eval", {"extra": {"wiki": ["nowhere/wiki/00000"]}}),
        "eval.extra.wiki[0] is 'nowhere/wiki/00000', but nowhere/wiki/00000.bin does not exist",
    ),
    # issue 26: a study run may change only model and train keys (the data is shared)
    "study changes the data": (
        edited("study", {"grid": {"data.split": ["90,9,1", "80,19,1"]}}),
        "'study.grid' has a key 'data.split'; expected model.KEY, train.KEY or tokens",
    ),
    "study run does not fit its model": (
        edited("study", {"runs": {"long": {"train": {"seq_length": 4096}}}}),
        "study run 'long': train.seq_length 4096 exceeds model.max_position_embeddings 2048",
    ),
}


# Through Snakemake: the wrapper (rules/setup.smk) makes each refusal one line, no traceback,
# nothing written; every case's line is checked in-process (tests/unit/plan/test_build_plan.py)
THROUGH_SNAKEMAKE = ("wrong type", "study run does not fit its model")


@pytest.mark.parametrize("case", THROUGH_SNAKEMAKE)
def test_config_errors_stop_before_any_job(case, tmp_path, snakemake, write_config):
    cfg, message = CASES[case]
    config = write_config(tmp_path / "bad.yaml", cfg)
    out = snakemake(tmp_path / "wd", config, "-n")
    assert out.returncode != 0
    lines = [line for line in out.out.splitlines() if line.startswith("gptflow config:")]
    assert len(lines) == 1, out.out
    assert message in lines[0]
    assert str(config) in lines[0]  # names the file to fix
    assert "Traceback" not in out.out and "Exception" not in out.out
    assert not (tmp_path / "wd" / "results").exists()


def test_empty_corpus_stops_before_any_job(tmp_path, snakemake, write_config):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a.py", "b.py"):
        (corpus / name).write_text("")
    cfg = edited("datasets.stdlib", {"type": "local", "root": str(corpus), "include": ["*.py"]})
    out = snakemake(tmp_path / "wd", write_config(tmp_path / "c.yaml", cfg), "-n")
    assert out.returncode != 0
    assert "datasets.stdlib matched 2 files under" in out.out and "all empty" in out.out


def test_a_broken_tokenizer_fails_its_job_and_publishes_no_shard(
    tmp_path, snakemake, write_config, tokenizer_json
):
    # tokenizer.path is parsed when the workflow is planned (issue 25), so the file breaks
    # after it was imported: the copy the jobs read, JSON the preflight counts a vocabulary
    # in but no Hugging Face tokenizer
    cfg = edited("tokenizer", {"name": "broken", "source": "file", "path": str(tokenizer_json)})
    wd = tmp_path / "wd"
    config = write_config(tmp_path / "c.yaml", cfg)
    imported = "results/tokenizers/broken/tokenizer.json"
    assert snakemake(wd, config, imported).returncode == 0
    (wd / imported).write_text('{"model": {"vocab": {"a": 0}}}')
    out = snakemake(wd, config, "data")
    assert out.returncode != 0
    assert "Error in rule tokenize_shard" in out.out
    # Snakemake schedules the shards in no fixed order and stops after the first failure,
    # so only one shard's log may exist.
    logs = sorted((wd / "logs/tokenize_shard/broken/stdlib").glob("*.log"))
    assert logs, "no tokenize_shard log was written"
    log = logs[0].read_text()
    assert log.startswith(
        "gptflow tokenize: error: results/tokenizers/broken/tokenizer.json: not a Hugging Face tokenizer.json"
    )
    tokens = wd / "results/tokens/broken/stdlib"
    assert not list(tokens.glob("*.bin")) and not list(tokens.glob("*.idx"))
    assert not [p for p in tokens.glob("*") if p.suffix == ".json" and json.loads(p.read_text())]
