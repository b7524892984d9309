"""The report's run card and plots from hand-made run files (no training needed)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

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


SVG = "{http://www.w3.org/2000/svg}"


def plotted_points(svg) -> list[list[tuple[float, float]]]:
    """The points of each data line of a matplotlib SVG, in plot order, in pixels: the markers
    (<use x= y=>) of the line2d groups directly inside the axes (the tick and legend lines sit
    deeper, in xtick_N / legend_1 groups)."""
    axes = ET.parse(svg).getroot().find(f".//{SVG}g[@id='axes_1']")
    return [
        [(float(u.get("x")), float(u.get("y"))) for u in g.iter(f"{SVG}use")]
        for g in axes.findall(f"{SVG}g")
        if g.get("id", "").startswith("line2d_")
    ]


def assert_affine(pairs: list[tuple[float, float]], what: str) -> None:
    """Every (data value, pixel) pair lies on one line pixel = a * value + b, a != 0: the
    pixels are these data values through the axis scale and nothing else."""
    lo, hi = min(pairs), max(pairs)
    if lo[0] == hi[0]:  # one data value: one pixel
        assert {round(px, 3) for _, px in pairs} == {round(lo[1], 3)}, (what, pairs)
        return
    a = (hi[1] - lo[1]) / (hi[0] - lo[0])
    assert abs(a) > 1e-6, (what, pairs)
    for value, px in pairs:
        assert abs(lo[1] + a * (value - lo[0]) - px) < 1e-3, (what, value, px, pairs)


def assert_plot_shows(svg, lines: list[list[tuple[float, float]]]) -> None:
    """The SVG plots exactly these lines of (step, value) points, in order, each point once."""
    drawn = plotted_points(svg)
    assert [len(points) for points in drawn] == [len(points) for points in lines], (svg, drawn)
    pairs = [
        (want, got)
        for want_line, got_line in zip(lines, drawn, strict=True)
        for want, got in zip(want_line, got_line, strict=True)
    ]
    assert_affine([(want[0], got[0]) for want, got in pairs], f"{svg} x")
    assert_affine([(want[1], got[1]) for want, got in pairs], f"{svg} y")


def test_plots_of_one_series(tmp_path):
    """Only series s is plotted: the record of series "old" (loss 9, lr 1, 1 token/s at step 1)
    and the torn last line are not."""
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"series": "old", "kind": "train", "step": 1, "loss": 9, "lr": 1, "tokens_per_s": 1}]
    lines += [
        {"series": "s", "kind": "train", "step": i, "loss": 5 - i / 10, "lr": 1e-3,
         "tokens_per_s": 1000 + 10 * i * i}
        for i in range(1, 6)
    ]  # fmt: skip
    lines += [{"series": "s", "kind": "eval", "step": 5, "val_loss": 4.6}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"series": "s", "ki')
    paths = plot_metrics(metrics, "s", tmp_path / "plots")
    plots = tmp_path / "plots"
    assert paths == {name: str(plots / f"{name}.svg") for name in ("loss", "lr", "throughput")}
    loss = (plots / "loss.svg").read_text()
    assert loss.startswith("<?xml") and "validation loss" in loss and "series s" in loss
    steps = range(1, 6)
    assert_plot_shows(plots / "loss.svg", [[(i, 5 - i / 10) for i in steps], [(5, 4.6)]])
    assert_plot_shows(plots / "lr.svg", [[(i, 1e-3) for i in steps]])
    assert_plot_shows(plots / "throughput.svg", [[(i, 1000 + 10 * i * i) for i in steps]])
