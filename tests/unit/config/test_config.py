"""The config tree: schema errors name the key and the fix; derived numbers; the run identity."""

import copy
import dataclasses
import re

import pytest

from gptflow.config.settings import TrainConfig
from gptflow.errors import GptflowError
from gptflow.plan.workflow_config import load_workflow_config
from gptflow.train.run_config import RunConfig, render_run_config


def load(repo, cfg):
    return load_workflow_config(
        cfg,
        schema_path=repo / "config/schema/config.schema.yaml",
        models_dir=repo / "config/models",
        source="my.yaml",
    )


def test_default_and_test_configs_are_valid(repo, tiny_config):
    import yaml

    default = yaml.safe_load((repo / "config/config.yaml").read_text())
    cfg = load(repo, default)
    assert cfg["model"]["preset"] == "small" and cfg["model"]["num_layers"] >= 1
    tiny = load(repo, tiny_config)
    assert tiny["model"]["hidden_size"] == 64  # the preset was resolved
    assert tiny["tokenize"]["workers"] == 1


def test_wrong_type_names_key_value_and_expected_type(repo, edit_config):
    with pytest.raises(GptflowError) as e:
        load(repo, edit_config(train={"lr": "fast"}))
    msg = str(e.value)
    assert "'train.lr' is 'fast' (a string); expected a number" in msg
    assert msg.endswith("Fix my.yaml.") and "\n" not in msg


def test_unknown_key_is_named_with_a_suggestion(repo, edit_config):
    with pytest.raises(
        GptflowError, match=r"unknown key 'train\.lrr' \(did you mean 'train\.lr'\?\)"
    ):
        load(repo, edit_config(train={"lrr": 0.1}))
    with pytest.raises(
        GptflowError, match=r"unknown key 'model\.num_layer' \(did you mean 'model\.num_layers'\?\)"
    ):
        load(repo, edit_config(model={"num_layer": 3}))


def test_missing_key_is_named(repo, tiny_config):
    cfg = dict(tiny_config)
    cfg["train"] = {k: v for k, v in cfg["train"].items() if k != "train_iters"}
    with pytest.raises(GptflowError, match=r"missing required key 'train\.train_iters'"):
        load(repo, cfg)


def test_cross_references_are_checked(repo, edit_config):
    with pytest.raises(
        GptflowError,
        match=r"data\.blend\[0\]\.dataset is 'wiki', which is not in datasets \(stdlib\)",
    ):
        load(repo, edit_config(data={"blend": [{"dataset": "wiki"}]}))
    with pytest.raises(GptflowError, match=r"model\.preset is 'huge', .*presets: .*tiny"):
        load(repo, edit_config(model={"preset": "huge"}))
    with pytest.raises(
        GptflowError, match=r"tokenizer\.path 'missing/tokenizer\.json' does not exist"
    ):
        load(
            repo,
            edit_config(
                tokenizer={"name": "x", "source": "file", "path": "missing/tokenizer.json"}
            ),
        )
    with pytest.raises(
        GptflowError, match=r"global_batch_size 10 is not a multiple of train\.micro_batch_size 4"
    ):
        load(repo, edit_config(train={"global_batch_size": 10}))
    with pytest.raises(GptflowError, match=r"not a multiple of model\.num_attention_heads 5"):
        load(repo, edit_config(model={"num_attention_heads": 5}))


def test_enum_and_range_errors(repo, edit_config):
    with pytest.raises(
        GptflowError,
        match=r"'train\.precision' is 'fp8'; expected one of \['auto', 'fp32', 'bf16', 'fp16'\]",
    ):
        load(repo, edit_config(train={"precision": "fp8"}))
    with pytest.raises(GptflowError, match=r"'train\.micro_batch_size' is 0; it must be >= 1"):
        load(repo, edit_config(train={"micro_batch_size": 0}))


def test_lr_schedule():
    t = TrainConfig(train_iters=100, lr=1.0, min_lr=0.1, lr_warmup_iters=10)
    assert t.lr_at(0) == pytest.approx(0.1) and t.lr_at(9) == pytest.approx(1.0)
    assert t.lr_at(10) == pytest.approx(1.0)
    assert t.lr_at(55) == pytest.approx(0.55)  # halfway through the cosine
    assert t.lr_at(100) == pytest.approx(0.1) and t.lr_at(500) == pytest.approx(0.1)
    lin = dataclasses.replace(t, lr_decay_style="linear")
    assert lin.lr_at(55) == pytest.approx(0.55)
    assert lin.lr_at(32.5) == pytest.approx(0.775)


def test_grad_accum_derivation():
    t = TrainConfig(train_iters=1, micro_batch_size=4, global_batch_size=32)
    assert t.grad_accum_steps(1) == 8 and t.grad_accum_steps(2) == 4 and t.grad_accum_steps(8) == 1
    with pytest.raises(GptflowError, match=r"4 x 3 ranks = 12"):
        t.grad_accum_steps(3)


def test_run_identity_covers_the_trajectory_only(repo, tiny_config, tokenizer_json, shards):
    base = load(repo, tiny_config)

    def series(**train):
        cfg = {**base, "train": {**base["train"], **train}}
        run = render_run_config(
            cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards}, run_dir="r"
        )
        return run.series

    s0 = series()
    assert (
        series(log_interval=1, eval_interval=7, save_interval=3, keep_last=9, micro_batch_size=2)
        == s0
    )
    assert series(lr=1e-3) != s0
    assert series(seed=7) != s0
    assert series(train_iters=80) != s0  # the cosine horizon follows train_iters...
    assert series(lr_decay_iters=40) == series(lr_decay_iters=40, train_iters=80)  # ...unless fixed


def test_run_config_round_trip(repo, tiny_config, tokenizer_json, shards, tmp_path):
    from gptflow.train.run_config import write_run_config

    cfg = load(repo, tiny_config)
    run = render_run_config(
        cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards}, run_dir="r"
    )
    write_run_config(run, tmp_path / "run.yaml")
    again = RunConfig.load(tmp_path / "run.yaml")
    assert again == run and again.series == run.series
    assert run.model.vocab_size == 512  # 512 BPE ids padded to a multiple of 128
    assert run.extra["parameters"] == sum(
        p.numel()
        for p in __import__("gptflow.train.model", fromlist=["GPTNeoX"])
        .GPTNeoX(run.model)
        .parameters()
    )


def test_shards_of_another_tokenizer_are_refused(repo, tiny_config, shards, tmp_path, corpus_jsonl):
    from gptflow.data.tokenizer import sample_texts, train_bpe

    other = tmp_path / "other.json"
    train_bpe(
        sample_texts([str(corpus_jsonl[0])], "text", 100_000),
        other,
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
    )
    cfg = load(repo, tiny_config)
    with pytest.raises(
        GptflowError, match=r"shard was tokenized with tokenizer .*delete the shard"
    ):
        render_run_config(cfg, tokenizer_path=str(other), shards={"stdlib": shards}, run_dir="r")


# --------------------------------------------------------------------------- untrusted input


def test_a_key_given_twice_is_an_error_naming_file_line_and_key(tmp_path):
    from gptflow.config.schema import load_yaml

    path = tmp_path / "run.yaml"
    path.write_text("run: a\ntrain:\n  lr: 1.0\n  seed: 2\n  lr: 3.0\n")
    with pytest.raises(GptflowError) as e:
        load_yaml(path)
    assert str(e.value) == (
        f"{path}:5: key 'train.lr' is given twice (first on line 3); only the last would "
        f"count. Remove one of them from {path}."
    )
    path.write_text("blend:\n  - {dataset: a, weight: 1, dataset: b}\n")
    with pytest.raises(GptflowError, match=r":2: key 'blend\[0\]\.dataset' is given twice"):
        load_yaml(path)
    # a key merged in with << may be overridden: that is what YAML merge keys are for
    path.write_text("base: &b {lr: 1, seed: 2}\ntrain:\n  <<: *b\n  lr: 3\n")
    assert load_yaml(path)["train"] == {"lr": 3, "seed": 2}


def test_config_files_are_reread_for_keys_given_twice(repo, tiny_config, tmp_path):
    import json

    def load_from(path):
        return load_workflow_config(
            tiny_config,
            schema_path=repo / "config/schema/config.schema.yaml",
            models_dir=repo / "config/models",
            source=str(path),
            config_files=[str(path)],
        )

    yml = tmp_path / "c.yaml"
    yml.write_text("run: tiny\nrun: other\n")
    with pytest.raises(GptflowError) as e:
        load_from(yml)
    assert str(e.value).startswith(f"{yml}:2: key 'run' is given twice (first on line 1)")
    js = tmp_path / "c.json"
    js.write_text(
        json.dumps({"train": {"lr": 1}}, indent=1).replace('"lr": 1', '"lr": 1,\n"lr": 2')
    )
    with pytest.raises(GptflowError) as e:
        load_from(js)
    assert str(e.value).startswith(f"{js}:4: key 'train.lr' is given twice (first on line 3)")
    js.write_text(json.dumps(tiny_config))  # once each: fine
    load_from(js)


@pytest.mark.parametrize(
    "suffix, text",
    [
        (".json", '{"train": {"lr": NaN}}'),
        (".json", '{"train": {"lr": -Infinity}}'),
        (".yaml", "train: {lr: .nan}"),
        (".yaml", "train:\n  lr: .inf\n"),
    ],
)
def test_nan_and_infinity_from_snakemakes_own_reader_are_refused(
    repo, tiny_config, tmp_path, suffix, text
):
    from snakemake.common.configfile import load_configfile
    from snakemake.utils import update_config

    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    cfg = copy.deepcopy(tiny_config)
    update_config(cfg, load_configfile(str(path)))  # as Snakemake merges a --configfile
    with pytest.raises(GptflowError) as e:
        load(repo, cfg)
    assert re.fullmatch(
        r"my\.yaml: 'train\.lr' is -?(nan|inf); numbers must be finite \(no \.nan/\.inf in "
        r"YAML, NaN/Infinity in JSON\)\. Fix my\.yaml\.",
        str(e.value),
    ), str(e.value)


NAME_KEYS = {
    "run": lambda cfg, v: cfg.update(run=v),
    "tokenizer.name": lambda cfg, v: cfg["tokenizer"].update(name=v),
    "model.preset": lambda cfg, v: cfg["model"].update(preset=v),
    "datasets": lambda cfg, v: cfg["datasets"].update({v: cfg["datasets"]["stdlib"]}),
    "data.blend[0].dataset": lambda cfg, v: cfg["data"]["blend"][0].update(dataset=v),
    "tokenizer.train.datasets[0]": lambda cfg, v: cfg["tokenizer"]["train"].update(datasets=[v]),
    "eval.extra": lambda cfg, v: cfg.update(eval={"extra": {v: ["x/00000"]}}),
}


@pytest.mark.parametrize("bad", ["..", ".hidden", "-rf", "a/b", "tiny\n", "a b", "", "ü"])
@pytest.mark.parametrize("key", sorted(NAME_KEYS))
def test_names_that_become_paths_are_strict(repo, tiny_config, key, bad):
    cfg = copy.deepcopy(tiny_config)
    NAME_KEYS[key](cfg, bad)
    with pytest.raises(GptflowError) as e:
        load(repo, cfg)
    msg = str(e.value)
    assert f"'{key}'" in msg and repr(bad) in msg and "\n" not in msg, msg
    assert "that starts with a letter or digit" in msg and msg.endswith("Fix my.yaml."), msg


def test_good_names_pass(repo, edit_config):
    cfg = edit_config(run="gpt-2.small_v1", tokenizer={"name": "bpe.8k"})
    assert load(repo, cfg)["run"] == "gpt-2.small_v1"


@pytest.mark.parametrize(
    "split, eval_iters, message",
    [
        ("0,0,0", 2, "data.split '0,0,0' must be 1-3 non-negative numbers with a positive sum"),
        ("0,1,0", 0, "data.split '0,1,0' gives the train split nothing"),
        ("100,0,0", 2, "data.split '100,0,0' gives the validation split nothing, but "
         "train.eval_iters is 2; give its second number a share (e.g. '969,30,1') or set "
         "train.eval_iters 0. Fix my.yaml."),
        ("1.2.3", 2, "'data.split' is '1.2.3'; expected 1 to 3 numbers separated by ',' or '/'"),
        ("969,30,1,0", 2, "'data.split' is '969,30,1,0'; expected 1 to 3 numbers"),
    ],
)  # fmt: skip
def test_split_rules_at_load(repo, edit_config, split, eval_iters, message):
    cfg = edit_config(data={"split": split}, train={"eval_iters": eval_iters})
    with pytest.raises(GptflowError) as e:
        load(repo, cfg)
    assert message in str(e.value) and str(e.value).startswith("my.yaml: ")


def test_what_is_fine_stays_fine(repo, edit_config):
    # no validation share and no evaluation; intervals past train_iters (the last step logs,
    # evaluates and saves anyway); a '/' separated split
    cfg = edit_config(
        data={"split": "100/0/0"},
        train={"eval_iters": 0, "log_interval": 1000, "eval_interval": 1000, "save_interval": 999},
    )
    assert load(repo, cfg)["train"]["save_interval"] == 999
    cfg = edit_config(eval={"prompts": ["line one\nline two"]})  # free text
    assert load(repo, cfg)["eval"]["prompts"] == ["line one\nline two"]


def test_dataclass_rules_name_the_file(repo, edit_config):
    with pytest.raises(GptflowError) as e:
        load(repo, edit_config(train={"min_lr": 1.0}))
    assert (
        str(e.value) == "my.yaml: train.min_lr 1.0 is above train.lr 0.003; lower it. Fix my.yaml."
    )


def test_a_json_config_loads_as_plain_data_and_is_recorded(repo, tiny_config, tmp_path):
    import collections
    import json

    from gptflow.plan.records import RECORD, record_config

    ordered = json.loads(json.dumps(tiny_config), object_pairs_hook=collections.OrderedDict)
    cfg = load(repo, ordered)  # as Snakemake reads a JSON --configfile
    assert type(cfg["data"]["blend"][0]) is dict and type(cfg["train"]) is dict
    record_config(ordered, tmp_path)  # the raw OrderedDicts too
    import yaml

    assert yaml.safe_load((tmp_path / RECORD).read_text())["config"]["run"] == "tiny"


# --------------------------------------------------------------------------- bad input, issue 25


def plan(repo, cfg):
    """What rules/setup.smk does with a config before any job: load it, resolve its datasets."""
    from gptflow.config.schema import load_yaml
    from gptflow.data import sources

    loaded = load(repo, cfg)
    schema = load_yaml(repo / "config/schema/config.schema.yaml")
    return sources.resolve_datasets(
        loaded,
        sources.needed_datasets(loaded),
        catalog_path=repo / "config/datasets.yaml",
        schema=schema,
        source="my.yaml",
    )


def _local(**spec):
    return lambda cfg, tmp_path: cfg["datasets"]["stdlib"].update(spec)


def _train(**spec):
    return lambda cfg, tmp_path: cfg["train"].update(spec)


def _tokenizer(**spec):
    return lambda cfg, tmp_path: cfg["tokenizer"].update(spec)


def _catalog(**spec):
    def edit(cfg, tmp_path):
        cfg["datasets"]["stdlib"] = {"type": "catalog", **spec}
        cfg["tokenizer"] = {
            "name": "gpt2",
            "source": "gpt2",
            "vocab": {"url": "https://example.org/vocab.json"},
            "merges": {"url": "https://example.org/merges.txt"},
        }

    return edit


def _not_a_tokenizer(cfg, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": ')
    cfg["tokenizer"] = {"name": "t", "source": "file", "path": str(path)}


BAD_INPUT = {
    # globs pathlib refuses
    "absolute include": (
        _local(include=["/usr/lib/*.py"]),
        "'datasets.stdlib.include[0]' is '/usr/lib/*.py'; expected a glob relative to "
        "datasets.*.root (not empty, not starting with '/')",
    ),
    "empty include": (_local(include=[""]), "'datasets.stdlib.include[0]' is ''; expected a glob"),
    "empty exclude": (_local(exclude=[""]), "'datasets.stdlib.exclude[0]' is ''; expected a glob"),
    "'**' inside a component": (
        _local(include=["json/**.py"]),
        "datasets.stdlib.include[0] is 'json/**.py', a glob pathlib refuses",
    ),
    # a float where an integer is meant, a key that is not a name
    "shards 2.0": (_local(shards=2.0), "'datasets.stdlib.shards' is 2.0 (a number); expected an"),
    "seq_length 64.0": (_train(seq_length=64.0), "'train.seq_length' is 64.0 (a number); expected"),
    "a number as a vars key": (
        _catalog(name="oscar", vars={5: "de"}),
        "'datasets.stdlib.vars' has a key 5 (an integer); keys are names: quote it ('5':)",
    ),
    # the catalog: parts within the entry's, vars a template uses
    "parts beyond the entry's": (
        _catalog(name="pile", parts=[0, 40]),
        "datasets.stdlib.parts is [0, 40], but catalog entry 'pile' has parts [0, 29]",
    ),
    "vars without a template": (
        _catalog(name="enwik8", vars={"lang": "de"}),
        "datasets.stdlib.vars sets ['lang'], which catalog entry 'enwik8' has no URL template",
    ),
    "vars the template does not use": (
        _catalog(name="pile", vars={"lang": "de"}),
        "datasets.stdlib.vars sets ['lang'], which catalog entry 'pile' does not use",
    ),
    # the tokenizer
    "vocabulary smaller than the special tokens": (
        _tokenizer(
            special_tokens=["<|endoftext|>", *(f"<|s{i}|>" for i in range(9))],
            train={"datasets": ["stdlib"], "vocab_size": 260},
        ),
        "tokenizer.train.vocab_size 260 is below the 10 tokenizer.special_tokens + 256 byte "
        "tokens a ByteLevel BPE starts with; set it to 266 or more",
    ),
    "empty eod_token": (
        _tokenizer(eod_token="", special_tokens=["", "<|padding|>"]),
        "'tokenizer.eod_token' must not be empty",
    ),
    "empty special token": (
        _tokenizer(special_tokens=["<|endoftext|>", ""]),
        "'tokenizer.special_tokens[1]' must not be empty",
    ),
    "tokenizer.path not a tokenizer": (
        _not_a_tokenizer,
        "tokenizer.json: not a Hugging Face tokenizer.json (",
    ),
    # numbers beyond what their consumer takes
    "seed past numpy's RandomState": (
        _train(seed=2**32),
        "'train.seed' is 4294967296; it must be <= 4294967295",
    ),
    "a global batch no split could give": (
        _train(global_batch_size=2**62),
        "the train split would have to give 184,467,440,737,095,516,160 samples",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_naming_the_key(repo, tiny_config, tmp_path, case):
    """Each class of bad input the adversarial suite found (issue 25) is refused before any
    job, in one line naming the key and the fix (before: a traceback, or accepted)."""
    edit, message = BAD_INPUT[case]
    cfg = copy.deepcopy(tiny_config)
    edit(cfg, tmp_path)
    with pytest.raises(GptflowError) as e:
        plan(repo, cfg)
    msg = str(e.value)
    assert message in msg and "\n" not in msg, msg
    assert msg.startswith("my.yaml: ") and "Fix " in msg and "my.yaml" in msg.split("Fix ")[-1]


def test_what_the_bad_input_rules_leave_alone(repo, tiny_config, tmp_path):
    # parts within the entry's; OSCAR's parts are not bounded (their number differs by lang)
    pile = {"name": "pile", "parts": [0, 29]}
    oscar = {"name": "oscar", "vars": {"lang": "de"}, "parts": [1, 9]}
    for spec in (pile, oscar):
        cfg = copy.deepcopy(tiny_config)
        _catalog(**spec)(cfg, tmp_path)
        assert len(plan(repo, cfg)["stdlib"].shards) == spec["parts"][1] - spec["parts"][0] + 1
    cfg = copy.deepcopy(tiny_config)
    _train(seed=2**32 - 1)(cfg, tmp_path)  # the largest seed numpy's RandomState takes
    _tokenizer(special_tokens=["<|endoftext|>", "a", "b", "c"])(cfg, tmp_path)
    cfg["tokenizer"]["train"]["vocab_size"] = 260  # = 256 bytes + 4 special tokens
    plan(repo, cfg)


def test_a_study_reads_each_preset_file_once(repo, edit_config, monkeypatch):
    """A study's runs share their presets: each file is read and checked once per config, not
    once per run (a 100-run study read tiny.yaml 101 times while planning: bench/plan.py
    --study). Each run still gets its own preset's keys. (load_yaml is wrapped, not replaced:
    the files are read for real.)"""
    import gptflow.plan.workflow_config as workflow_config

    reads, real = [], workflow_config.load_yaml
    monkeypatch.setattr(
        workflow_config, "load_yaml", lambda path: reads.append(path.name) or real(path)
    )
    grid = {"model.preset": ["tiny", "small"], "train.lr": [1.0e-3, 2.0e-3, 3.0e-3]}
    cfg = load(repo, edit_config(run="sweep", study={"grid": grid}))
    assert sorted(reads) == ["config.schema.yaml", "small.yaml", "tiny.yaml"]
    widths = {name: run["model"]["hidden_size"] for name, run in cfg["runs"].items()}
    assert widths == {
        f"{p}-lr{lr:g}": {"tiny": 64, "small": 128}[p]
        for p in grid["model.preset"]
        for lr in grid["train.lr"]
    }


def test_checkpoints_kept_for_good():
    """keep_every: the multiples of it outlive keep_last (kept_steps: what is on disk after the
    run; checkpoints_on_disk: the most at once, which the preflight's disk check counts); it
    must be a multiple of save_interval (a step never saved cannot be kept)."""
    t = TrainConfig(train_iters=95, save_interval=10, keep_last=2, keep_every=30)
    assert t.saved_steps() == [10, 20, 30, 40, 50, 60, 70, 80, 90, 95]
    assert t.kept_steps() == [30, 60, 90, 95]
    assert t.checkpoints_on_disk() == 2 + 1 + 2  # keep_last, the one written, 30 and 60
    plain = TrainConfig(train_iters=95, save_interval=10, keep_last=2)
    assert plain.kept_steps() == [90, 95] and plain.checkpoints_on_disk() == 3
    assert not plain.kept_for_good(90)
    with pytest.raises(GptflowError, match=r"keep_every 25 is not a multiple of train\.save_int"):
        TrainConfig(train_iters=95, save_interval=10, keep_every=25)
