"""The report's run card and plots from hand-made run files (no training needed)."""

from __future__ import annotations

import json

import yaml

from gptflow.report import plot_metrics, run_card


def test_run_card_has_data_eval_container_and_config_and_escapes_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prefix = "results/tokens/bpe/web/00000"
    (tmp_path / "results/tokens/bpe/web").mkdir(parents=True)
    (tmp_path / f"{prefix}.json").write_text(
        json.dumps({"sources": [{"path": "resources/raw/web/a.jsonl.zst", "sha256": "ab" * 32}]})
    )
    run = {
        "run": "r1",
        "tokenizer": {"path": "t.json", "vocab_size": 512, "eod_token": "<|endoftext|>",
                      "eod_id": 0, "sha256": "cd" * 32},
        "data": {"split": "90,9,1", "datasets": [{"name": "web", "weight": 1.0, "shards": [
            {"prefix": prefix, "documents": 1234, "tokens": 567890, "bin_sha256": "ef" * 32}]}]},
        "train": {"lr": 0.001},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    (tmp_path / "DONE.json").write_text(json.dumps({
        "final_step": 40, "tokens": 20480, "train_loss": 4.9, "initial_val_loss": 6.4,
        "final_val_loss": 5.2, "checkpoint": "ckpt/step40", "checkpoint_sha256": "12" * 32,
    }))  # fmt: skip
    (tmp_path / "eval.json").write_text(json.dumps({
        "test": {"web": {"loss": 3.0, "perplexity": 20.25, "tokens": 4096}},
        "extra": {},
        "generations": [{"prompt": "<script>", "text": "</table><b>x"}],
    }))  # fmt: skip
    (tmp_path / "img.json").write_text(json.dumps({
        "tag": "localhost/gptflow:abc", "image_id": "sha256:feed", "builder": "docker",
        "base_image": "nvcr.io/nvidia/pytorch:25.01-py3", "size_bytes": 2e9,
    }))  # fmt: skip
    run_card(
        run_yaml="run.yaml", done="DONE.json", evaluation="eval.json",
        datasets={"web": {"type": "url", "urls": ["https://example.org/a.jsonl.zst"]}},
        container="img.json", out="card.html",
    )  # fmt: skip
    card = (tmp_path / "card.html").read_text()
    for want in ("https://example.org/a.jsonl.zst", "abababababababab", "1,234", "567,890",
                 "20.250", "sha256:feed", "nvcr.io/nvidia/pytorch:25.01-py3", "lr: 0.001",
                 "&lt;script&gt;", "&lt;/table&gt;&lt;b&gt;x"):  # fmt: skip
        assert want in card, want
    assert "<script>" not in card


def test_plots_of_one_series(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"series": "old", "kind": "train", "step": 1, "loss": 9, "lr": 1, "tokens_per_s": 1}]
    lines += [
        {"series": "s", "kind": "train", "step": i, "loss": 5 - i / 10, "lr": 1e-3,
         "tokens_per_s": 1000 + i}
        for i in range(1, 6)
    ]  # fmt: skip
    lines += [{"series": "s", "kind": "eval", "step": 5, "val_loss": 4.6}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"series": "s", "ki')
    paths = plot_metrics(metrics, "s", tmp_path / "plots")
    assert sorted(paths) == ["loss", "lr", "throughput"]
    loss = (tmp_path / "plots/loss.svg").read_text()
    assert loss.startswith("<?xml") and "validation loss" in loss and "series s" in loss
