"""A study in the workflow config: its runs (named, and the grid's combinations), what each
overrides, what is refused, the data index its runs share, and its plan (the preflight)."""

import copy
import itertools
import re
from pathlib import Path

import pytest

from gptflow.config.settings import TrainConfig
from gptflow.data.dataset import split_samples
from gptflow.errors import GptflowError
from gptflow.plan import preflight, run_size
from gptflow.plan.runs import run_plan
from gptflow.plan.workflow_config import run_configs
from gptflow.train.run_config import data_index_name, data_index_settings
from tests.unit.config.test_config import load

from .test_preflight import SLURM


@pytest.fixture
def study(tiny_config):
    def make(**study) -> dict:
        cfg = copy.deepcopy(tiny_config)
        cfg["run"] = "sweep"
        cfg["study"] = study
        return cfg

    return make


def test_a_grid_expands_into_named_runs_with_their_overrides(repo, study):
    cfg = load(repo, study(grid={"model.preset": ["tiny", "small"], "train.lr": [1e-3, 3e-3]}))
    runs = run_configs(cfg)
    assert list(runs) == ["tiny-lr0.001", "tiny-lr0.003", "small-lr0.001", "small-lr0.003"]
    small = runs["small-lr0.003"]
    assert (small["run"], small["model"]["num_layers"], small["train"]["lr"]) == (
        "small-lr0.003", 4, 3e-3)  # fmt: skip
    assert runs["tiny-lr0.001"]["model"]["num_layers"] == 2
    # the rest is shared, not copied; the other train keys are the base's
    assert small["datasets"] is cfg["datasets"] and small["data"] is cfg["data"]
    assert small["train"]["train_iters"] == cfg["train"]["train_iters"] == 40
    assert cfg["train"]["lr"] == 3.0e-3 and cfg["model"]["preset"] == "tiny"  # the base as it was


def test_named_runs_tokens_and_the_base_model_keys(repo, study):
    cfg = load(repo, study(runs={
        "base": {},
        "long": {"tokens": 1e5},  # 8 x 64 tokens a step: ceil(1e5 / 512) = 196 steps
        "big": {"model": {"preset": "small", "hidden_dropout": 0.2}},
    }))  # fmt: skip
    runs = run_configs(cfg)
    assert runs["long"]["train"]["train_iters"] == 196
    assert runs["base"]["model"] == cfg["model"] and runs["base"]["train"] == cfg["train"]
    assert (
        runs["big"]["model"]["hidden_size"] == 128 and runs["big"]["model"]["hidden_dropout"] == 0.2
    )
    # a grid and named runs together; a grid of tokens labels its numbers
    cfg = load(repo, study(runs={"x": {}}, grid={"tokens": [1e5, 2e5]}))
    assert list(run_configs(cfg)) == ["x", "tokens100000", "tokens200000"]


def test_each_runs_overrides_apply_to_that_run_only(repo, study, tiny_config):
    """Runs listed after one with model or train overrides get none of them: each run's model
    and train equal those of a config of its own (no study) with only its overrides, whatever
    runs came before it (the base's sections, and the preset files read once, stay as read)."""
    overrides = {
        "small-drop": {"model": {"preset": "small", "hidden_dropout": 0.2}},
        "plain": {},
        "deep": {"model": {"num_layers": 3}},
        "slow": {"train": {"lr": 1e-3, "clip_grad": 0.5}},
        "tiny-again": {"model": {"preset": "tiny"}},
        "plain-again": {},
    }
    runs = run_configs(load(repo, study(runs=copy.deepcopy(overrides))))
    assert list(runs) == list(overrides)
    for name, o in overrides.items():
        alone = copy.deepcopy(tiny_config)
        alone["model"].update(o.get("model", {}))
        alone["train"].update(o.get("train", {}))
        want = load(repo, alone)
        assert runs[name]["model"] == want["model"], name
        assert runs[name]["train"] == want["train"], name
    assert (
        runs["plain-again"]["model"] == runs["plain"]["model"] == load(repo, tiny_config)["model"]
    )


def test_a_config_without_a_study_is_one_run(repo, tiny_config):
    cfg = load(repo, copy.deepcopy(tiny_config))
    assert run_configs(cfg) == {"tiny": cfg} and "runs" not in cfg


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"grid": {"data.split": ["90,9,1"]}},
         "'study.grid' has a key 'data.split'; expected model.KEY, train.KEY or tokens (a "
         "study's runs share the datasets, tokenizer and data settings"),
        ({"runs": {"x": {"tokenizer": {"name": "other"}}}}, "study.runs.x"),
        ({"runs": {"x": {"train": {"lr": "fast"}}}},
         "study run 'x': 'lr' is 'fast' (a string); expected a number"),
        ({"runs": {"x": {"model": {"preset": "nope"}}}},
         "study run 'x': model.preset is 'nope', but"),
        ({"runs": {"x": {"tokens": 1e5, "train": {"train_iters": 3}}}},
         "study run 'x' sets both tokens and train.train_iters; keep one"),
        ({"runs": {"tiny": {}}, "grid": {"model.preset": ["tiny"]}},
         "study run 'tiny' is named twice"),
        ({"grid": {"model.preset": ["-x"]}}, "makes the run name '-x'"),
        ({}, "study has no runs: give study.runs or study.grid"),
        ({"runs": {"x": {"train": {"tensor_parallel": 3}}}}, "study run 'x'"),
        ({"runs": {"x": {"data": {"split": "80,19,1"}}}},
         "study run 'x' sets data.split; a study run may set only data.quality (its cleaning "
         "recipe): the blend, split and datasets are the study's"),
        ({"runs": {"x": {"data": {"quality": {"steps": [{"step": "exact", "scop": "blend"}]}}}}},
         "study run 'x': unknown key 'steps[0].scop'"),
    ],
)  # fmt: skip
def test_what_a_study_refuses(repo, study, section, message):
    with pytest.raises(GptflowError) as e:
        load(repo, study(**section))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def trainer_reads(run: dict) -> tuple:
    """What a run's trainer reads its samples by (gptflow.data.dataset.run_split_datasets):
    the tokenizer's shards of the blend, the split, the samples per split, seq_length, seed."""
    t = TrainConfig(**run["train"])
    return (run["tokenizer"]["name"], run["data"]["blend"], run["data"]["split"],
            split_samples(t), t.seq_length, t.seed)  # fmt: skip


def test_runs_share_a_data_index_exactly_when_their_trainers_read_the_same_samples(repo, study):
    """Every setting the samples depend on, changed alone in one run, gives that run its own
    index (seq_length, seed, the steps, the batch, eval_iters, tokens); settings they do not
    depend on (lr, clip_grad, the model, micro batch, intervals) share the base's. Over every
    pair of runs: the same index name if and only if their trainers read the same samples.
    Between configs, the shared sections count too: the split, the tokenizer."""
    own = {"seq": {"seq_length": 32}, "seed": {"seed": 7}, "iters": {"train_iters": 41},
           "batch": {"global_batch_size": 16}, "evals": {"eval_iters": 3}}  # fmt: skip
    shared = {"lr": {"lr": 1e-3}, "clip": {"clip_grad": 0.5}, "micro": {"micro_batch_size": 2},
              "every": {"eval_interval": 10, "save_interval": 5, "log_interval": 2}}  # fmt: skip
    cfg = load(repo, study(runs={
        "base": {}, "small": {"model": {"preset": "small"}}, "tokens": {"tokens": 1e5},
        **{name: {"train": t} for name, t in {**own, **shared}.items()},
    }))  # fmt: skip
    runs = run_configs(cfg)
    names = {n: data_index_name(data_index_settings(r)) for n, r in runs.items()}
    assert {n for n in names if names[n] == names["base"]} == {"base", "small", *shared}
    assert len({names[n] for n in ["base", "tokens", *own]}) == len(own) + 2
    for a, b in itertools.combinations(runs, 2):
        same_samples = trainer_reads(runs[a]) == trainer_reads(runs[b])
        assert (names[a] == names[b]) == same_samples, (a, b)

    base = load(repo, study(runs={"base": {}}))
    for change in ({"data": {**base["data"], "split": "80,19,1"}},
                   {"tokenizer": {**base["tokenizer"], "name": "other-bpe"}}):  # fmt: skip
        changed = {**run_configs(base)["base"], **change}
        assert data_index_name(data_index_settings(changed)) != names["base"], change


def test_runs_that_read_the_same_samples_share_a_data_index(repo, study):
    cfg = load(repo, study(runs={
        "a": {"model": {"preset": "small"}}, "b": {"train": {"lr": 1e-3, "clip_grad": 0.5}},
        "c": {"train": {"seed": 7}}, "d": {"tokens": 1e5}, "e": {},
    }))  # fmt: skip
    names = {n: data_index_name(data_index_settings(r)) for n, r in run_configs(cfg).items()}
    assert names["a"] == names["b"] == names["e"]
    assert len({names["a"], names["c"], names["d"]}) == 3  # another order, more samples
    assert re.fullmatch(r"[0-9a-f]{12}", names["a"])


def test_the_plan_lists_every_run_and_names_the_one_that_does_not_fit(repo, study):
    cfg = study(grid={"model.preset": ["tiny", "small"]})
    cfg["train"].update(micro_batch_size=1, global_batch_size=16)  # 1 x 2 x 8 ranks
    runs = run_configs(load(repo, cfg))
    plans = {name: run_plan(name, c, None) for name, c in runs.items()}
    lines = preflight.study(plans, SLURM, indexes=1, trained={"tiny"})
    assert lines[0].startswith(
        "gptflow study: 2 run(s), 1 finished (a DONE.json; one whose settings changed trains again); 1 data index(es) shared"
    )
    assert "GPU-hours at 40% MFU of 989 TFLOP/s" in lines[0]
    header, tiny, small = lines[1:]
    assert header.split() == ["run", "parameters", "tokens", "micro", "x", "accum", "x", "dp",
                              "memory/GPU", "GPU-hours"]  # fmt: skip
    assert tiny.split()[0] == "tiny" and tiny.endswith("finished")
    vocab = run_size.vocab_size(runs["small"], None)[0]
    parameters = run_size.model_config(runs["small"], vocab).num_parameters()
    assert small.split()[:2] == ["small", f"{parameters:,}"]
    assert small.endswith("to train") and "1 x 2 x 8" in small
    tight = {**runs, "small": {**runs["small"], "train": {**runs["small"]["train"],
                                                          "micro_batch_size": 4}}}  # fmt: skip
    with pytest.raises(GptflowError, match=r"\Astudy run 'small': .*global_batch_size"):
        preflight.study(
            {name: run_plan(name, c, Path("none")) for name, c in tight.items()},
            SLURM,
            indexes=1,
            trained=set(),
        )


def test_a_data_ablation_run_has_its_own_recipe_and_index_and_the_base_held_out(repo, study):
    """study.runs.NAME.data.quality (schema defaults filled) is the run's recipe; the rest of
    data is the study's. Its data index is named by its recipe's shards (the variants) and the
    base's held-out ones: equal recipes share one, another recipe has its own, and a run
    cleaning as the base does keeps the index name it had before data ablations."""
    exact = {"data": {"quality": {"steps": [{"step": "exact"}]}}}
    cfg = load(repo, study(runs={"raw": {}, "exact": exact, "again": copy.deepcopy(exact)}))
    runs = run_configs(cfg)
    assert runs["raw"]["data"] is cfg["data"] and "quality" not in cfg["data"]
    assert runs["exact"]["data"]["quality"] == {"steps": [{"step": "exact", "scope": "blend"}]}
    assert runs["exact"]["data"]["blend"] == cfg["data"]["blend"]
    base = {"stdlib": "raw"}
    cleaned = {"stdlib": "01-exact-0123456789ab"}
    names = {
        "raw": data_index_name(data_index_settings(runs["raw"], base, base)),
        "exact": data_index_name(data_index_settings(runs["exact"], cleaned, base)),
        "again": data_index_name(data_index_settings(runs["again"], cleaned, base)),
    }
    assert names["raw"] == data_index_name(data_index_settings(runs["raw"]))
    assert names["exact"] == names["again"] != names["raw"]

    cfg = study(runs={"exact": exact})
    cfg["tokenize"] = {**cfg["tokenize"], "documents_per_shard": 100}
    with pytest.raises(GptflowError, match=r"set tokenize\.documents_per_shard 0"):
        load(repo, cfg)
