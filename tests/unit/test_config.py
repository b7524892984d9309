"""The config tree: schema errors name the key and the fix; derived numbers; the run identity."""

import dataclasses

import pytest

from gptflow.config import RunConfig, TrainConfig, load_workflow_config, render_run_config
from gptflow.errors import GptflowError


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
    from gptflow.config import write_run_config

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
        for p in __import__("gptflow.model", fromlist=["GPTNeoX"]).GPTNeoX(run.model).parameters()
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
