"""The report's run card and plots from hand-made run files (no training needed)."""

from __future__ import annotations

import dataclasses
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from gptflow.config.settings import ModelConfig
from gptflow.results.report import plot_metrics, run_card

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512}
# by hand: embedding and output head 2 x 512 x 64, final norm 2 x 64, and per layer
# norms 4 x 64, QKV 3 x 64 x 64 + 3 x 64, dense 64 x 64 + 64, MLP 64 x 256 + 256 + 256 x 64 + 64
PARAMETERS = 2 * 512 * 64 + 2 * 64 + 2 * (4 * 64 + 3 * 64 * 64 + 3 * 64 + 64 * 64 + 64
                                          + 64 * 256 + 256 + 256 * 64 + 64)  # fmt: skip
TRAINED_WITH = {"gptflow": "0.1.0", "python": "3.11.7", "torch": "2.6.0a0+ecf3bae40a.nv25.01",
                "deepspeed": "0.19.8", "cuda": "12.8"}  # fmt: skip


def write_run_files(tmp_path, done_extra: dict) -> None:
    """run.yaml, DONE.json (with `done_extra`), eval.json, an image record and a shard
    manifest, as a finished run leaves them."""
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
        "model": dataclasses.asdict(ModelConfig(**MODEL)),
        "train": {"lr": 0.001},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    (tmp_path / "DONE.json").write_text(json.dumps({
        "final_step": 40, "tokens": 20480, "train_loss": 4.9, "initial_val_loss": 6.4,
        "final_val_loss": 5.2, "checkpoint": "ckpt/step40", "checkpoint_sha256": "12" * 32,
        **done_extra,
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


def make_card(hf_export=None) -> str:
    run_card(
        run_yaml="run.yaml", done="DONE.json", evaluation="eval.json",
        datasets={"web": {"type": "url", "urls": ["https://example.org/a.jsonl.zst"]}},
        container="img.json", out="card.html", hf_export=hf_export,
    )  # fmt: skip
    return Path("card.html").read_text()


def test_run_card_has_data_eval_container_and_config_and_escapes_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_run_files(tmp_path, {"versions": TRAINED_WITH})
    card = make_card()
    for want in ("https://example.org/a.jsonl.zst", "abababababababab", "1,234", "567,890",
                 "20.250", "sha256:feed", "nvcr.io/nvidia/pytorch:25.01-py3", "lr: 0.001",
                 "&lt;script&gt;", "&lt;/table&gt;&lt;b&gt;x"):  # fmt: skip
        assert want in card, want
    assert "<script>" not in card


def cells(card: str, heading: str) -> list[list[str]]:
    """The rows (header row first) of the first table after `heading` in a card."""
    table = card.split(f"<h2>{heading}</h2>", 1)[1].split("</table>", 1)[0]
    return [
        re.findall(r"<t[hd]>(.*?)</t[hd]>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)
    ]


def test_run_card_has_parameters_versions_it_trained_with_and_the_export(tmp_path, monkeypatch):
    """The parameter count is ModelConfig's (the trainer's number; checked against a count
    by hand), the versions are those DONE.json recorded, and the export is located."""
    monkeypatch.chdir(tmp_path)
    write_run_files(tmp_path, {"versions": TRAINED_WITH})
    hf = tmp_path / "results/runs/r1/hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"\0" * 2_500_000)
    (hf / ".snakemake_timestamp").touch()  # Snakemake's marker of a directory() output
    card = make_card("results/runs/r1/hf")
    assert PARAMETERS == ModelConfig(**MODEL).num_parameters() == 165_632
    assert cells(card, "Model and software")[1] == [
        "165,632", "2 layers, hidden 64, 4 heads, vocabulary 512"
    ]  # fmt: skip
    versions = card.split("<h2>Model and software</h2>", 1)[1].split("</table>", 2)[1]
    assert re.findall(r"<th>(.*?)</th>", versions) == [
        "gptflow", "Python", "torch", "DeepSpeed", "CUDA"
    ]  # fmt: skip
    assert re.findall(r"<td>(.*?)</td>", versions) == list(TRAINED_WITH.values())
    assert "environment that made this report" not in card
    (row,) = cells(card, "Hugging Face export")[1:]
    assert row[:2] == ["results/runs/r1/hf", str(hf.resolve())]
    assert row[2] == "config.json (0.0 MB), model.safetensors (2.5 MB)"
    assert (
        row[3]
        == "transformers.AutoModelForCausalLM.from_pretrained(&#x27;results/runs/r1/hf&#x27;)"
    )


def test_run_card_without_recorded_versions_shows_this_environment_and_says_so(
    tmp_path, monkeypatch
):
    """A DONE.json from before the trainer recorded versions: the card shows the versions of
    the environment making the report, labelled as such; no export yet."""
    from gptflow.environment import versions

    monkeypatch.chdir(tmp_path)
    write_run_files(tmp_path, {})
    card = make_card()
    shown = card.split("<h2>Model and software</h2>", 1)[1].split("</table>", 2)[1]
    assert re.findall(r"<td>(.*?)</td>", shown) == list(versions().values())
    assert "versions of the environment that made this report" in card
    assert "<h2>Hugging Face export</h2><p>not exported</p>" in card


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
         "tokens_per_s": 1000 + 10 * i * i, "mfu": 0.3 + 0.01 * i, "grad_norm": GRAD_NORMS[i]}
        for i in range(1, 6)
    ]  # fmt: skip
    lines += [{"series": "s", "kind": "eval", "step": 5, "val_loss": 4.6}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"series": "s", "ki')
    paths = plot_metrics(metrics, "s", tmp_path / "plots")
    plots = tmp_path / "plots"
    names = ("loss", "lr", "throughput", "mfu", "grad_norm")
    assert paths == {name: str(plots / f"{name}.svg") for name in names}
    loss = (plots / "loss.svg").read_text()
    assert loss.startswith("<?xml") and "validation loss" in loss and "series s" in loss
    steps = range(1, 6)
    assert_plot_shows(plots / "loss.svg", [[(i, 5 - i / 10) for i in steps], [(5, 4.6)]])
    assert_plot_shows(plots / "lr.svg", [[(i, 1e-3) for i in steps]])
    assert_plot_shows(plots / "throughput.svg", [[(i, 1000 + 10 * i * i) for i in steps]])
    assert_plot_shows(plots / "mfu.svg", [[(i, 100 * (0.3 + 0.01 * i)) for i in steps]])  # in %
    assert_plot_shows(plots / "grad_norm.svg", [[(i, GRAD_NORMS[i]) for i in steps]])
    assert texts(plots / "mfu.svg")[-2:] == ["MFU (%)", "mfu (series s)"]  # y label, title
    assert texts(plots / "grad_norm.svg")[-2:] == ["gradient norm", "grad_norm (series s)"]


GRAD_NORMS = {1: 2.5, 2: 0.75, 3: 1.25, 4: 3.0, 5: 0.5}  # not monotonic: order is checked


def texts(svg) -> list[str]:
    """The texts of a matplotlib SVG, in drawing order (each drawn as paths after a comment
    holding it)."""
    return re.findall(r"<!-- (.*?) -->", Path(svg).read_text())


def test_null_mfu_everywhere_is_said_not_plotted_and_null_grad_norms_are_left_out(tmp_path):
    """On a CPU every record's MFU is null: the plot has no point and says why. A grad norm
    missing from some records (null) leaves those steps out."""
    metrics = tmp_path / "metrics.jsonl"
    norms = {1: 1.5, 2: None, 3: 0.25, 4: None, 5: 2.0}
    metrics.write_text("".join(
        json.dumps({"series": "s", "kind": "train", "step": i, "loss": 3.0, "lr": 1e-3,
                    "tokens_per_s": 100.0, "mfu": None, "grad_norm": norms[i]}) + "\n"
        for i in range(1, 6)
    ))  # fmt: skip
    plot_metrics(metrics, "s", tmp_path)
    assert plotted_points(tmp_path / "mfu.svg") == [[]]
    said = " ".join(texts(tmp_path / "mfu.svg"))
    assert "MFU was not measured: it is null in every record" in said
    assert "Set train.peak_tflops." in said
    assert_plot_shows(tmp_path / "grad_norm.svg", [[(1, 1.5), (3, 0.25), (5, 2.0)]])
    assert "null in every record" not in " ".join(texts(tmp_path / "grad_norm.svg"))


def test_run_card_shows_how_long_checkpoint_saves_held_training(tmp_path, monkeypatch):
    """DONE.json's save summary (train.async_save) is a table under the run's; a DONE.json
    from before it shows none."""
    from gptflow.train.loop import save_summary

    monkeypatch.chdir(tmp_path)
    saves = [
        {"kind": "save", "step": s, "blocked_s": b} for s, b in ((2, 0.5), (4, 0.25), (6, 2.0))
    ]
    write_run_files(tmp_path, {"saves": save_summary(saves, "async")})
    table = make_card().split("</table>", 1)[1].split("</table>", 1)[0]
    assert "3, in the background (train.async_save)" in table
    assert "0.50 s / 2.00 s" in table and "2.8 s" in table
    write_run_files_again = json.loads((tmp_path / "DONE.json").read_text())
    write_run_files_again.pop("saves")
    (tmp_path / "DONE.json").write_text(json.dumps(write_run_files_again))
    assert "checkpoint saves" not in make_card()


def test_the_data_quality_page_shows_each_ablation_recipe_under_its_runs(tmp_path):
    """A data ablation's page (rule report_data_quality): each recipe once, headed by the runs
    cleaning with it; a step two recipes share counted under both from its one set of
    manifests; a step's figures are the sums of its shards' manifests, not another step's."""
    from gptflow.results.report import quality_page, quality_summary

    def manifest(step, dataset, shard, n_in, n_out, reason):
        m = {"step": step, "dataset": dataset, "shard": shard, "documents_in": n_in,
             "documents_out": n_out, "bytes_in": 10 * n_in, "bytes_out": 10 * n_out,
             "removed": {reason: n_in - n_out}, "examples": {reason: ["<b>gone</b>"]}}  # fmt: skip
        path = tmp_path / f"{step}-{dataset}-{shard}.json"
        path.write_text(json.dumps(m))
        return path

    manifests = [
        manifest("01-exact-x", "a", "00000", 10, 7, "exact"),
        manifest("01-exact-x", "a", "00001", 5, 5, "exact"),
        manifest("02-filters-y", "a", "00000", 7, 2, "gopher_repetition"),
        manifest("02-filters-y", "a", "00001", 5, 4, "c4"),
    ]
    exact = {"name": "01-exact-x", "describe": "exact"}
    filters = {"name": "02-filters-y", "describe": "filters <c4>"}
    recipes = [("study runs exact", {"a": [exact]}), ("study runs clean, clean-lr", {"a": [exact, filters]})]  # fmt: skip
    summary = quality_summary(recipes, manifests)
    assert [(r["label"], r["datasets"], [s["name"] for s in r["steps"]]) for r in summary] == [
        ("study runs exact", ["a"], ["01-exact-x"]),
        ("study runs clean, clean-lr", ["a"], ["01-exact-x", "02-filters-y"]),
    ]
    shared = {"shards": 2, "documents_in": 15, "documents_out": 12, "bytes_in": 150, "bytes_out": 120}  # fmt: skip
    assert summary[0]["steps"][0]["datasets"]["a"] == shared == summary[1]["steps"][0]["datasets"]["a"]  # fmt: skip
    assert summary[1]["steps"][1]["datasets"]["a"]["documents_out"] == 6
    assert summary[1]["steps"][1]["removed"] == {"c4": 1, "gopher_repetition": 5}
    quality_page(summary, tmp_path / "page.html")
    text = (tmp_path / "page.html").read_text()
    assert "<h2>study runs exact: datasets a</h2>" in text
    assert "<h2>study runs clean, clean-lr: datasets a</h2>" in text
    assert (
        "filters &lt;c4&gt;" in text and "&lt;b&gt;gone&lt;/b&gt;" in text and "<b>gone" not in text
    )
    # the config's one recipe (label None): headed by its datasets alone
    quality_page(quality_summary([(None, {"a": [exact]})], manifests), tmp_path / "one.html")
    assert "<h2>datasets a</h2>" in (tmp_path / "one.html").read_text()
