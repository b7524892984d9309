"""What `snakemake --report` shows of a run: metric plots and one HTML run card.

The card is the data card (datasets, their sources and checksums, documents and tokens per
shard, the tokenizer), the evaluation table, the container image when one was used, and the
resolved run config. Everything is escaped: document text never reaches the HTML unescaped.
The harness's page (a run's lm-evaluation-harness scores over its checkpoints) is made here too;
the data-quality page is gptflow.results.quality_report's, which the card links to.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

from gptflow.fsutil import atomic_write


def _records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        if line.endswith("}"):
            out.append(json.loads(line))
    return out


# what a plot says instead of points when every record holds null
NO_MFU = (
    "MFU was not measured: it is null in every record, because the device's peak TFLOP/s\n"
    "is unknown (a CPU, or a GPU not in gptflow.hardware's table). Set train.peak_tflops."
)
NO_GRAD_NORM = "No gradient norm was reported: it is null in every record."


def _present(records: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
    """(steps, values) of the records where `key` is not null."""
    kept = [r for r in records if r.get(key) is not None]
    return [r["step"] for r in kept], [scale * r[key] for r in kept]


def plot_metrics(metrics: str | os.PathLike, series: str, out_dir: str | os.PathLike) -> dict:
    """loss.svg (train and validation loss), lr.svg, throughput.svg, mfu.svg (in percent) and
    grad_norm.svg of one run's series. A plot whose values are null in every record (MFU on
    a CPU) says so in place of points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in _records(Path(metrics)) if r.get("series") == series]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "loss": [
            ("train loss", [r["step"] for r in train], [r["loss"] for r in train]),
            ("validation loss", [r["step"] for r in evals], [r["val_loss"] for r in evals]),
        ],
        "lr": [("learning rate", [r["step"] for r in train], [r["lr"] for r in train])],
        "throughput": [("tokens/s", *_present(train, "tokens_per_s"))],
        "mfu": [("MFU (%)", *_present(train, "mfu", 100.0))],
        "grad_norm": [("gradient norm", *_present(train, "grad_norm"))],
    }
    empty = {"mfu": NO_MFU, "grad_norm": NO_GRAD_NORM}
    paths = {}
    for name, lines in figures.items():
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        for label, xs, ys in lines:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        if name in empty and not lines[0][1]:
            ax.text(0.5, 0.5, empty[name], ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])  # no scale to show
            ax.set_yticks([])
        ax.set_xlabel("step")
        ax.set_ylabel(lines[0][0] if len(lines) == 1 else "loss")
        ax.set_title(f"{name} (series {series})")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()
        fig.tight_layout()
        path = out / f"{name}.svg"
        with atomic_write(path, "w") as f:
            fig.savefig(f, format="svg")
        plt.close(fig)
        paths[name] = str(path)
    return paths


class Html(str):
    """A table cell's markup, written as it is (a series' mark); any other cell is escaped."""


def _cell(c) -> str:
    return c if isinstance(c, Html) else html.escape(str(c))


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _model_and_software(run: dict, finished: dict) -> list[str]:
    """The parameter count (ModelConfig's, the trainer's number) and the versions training
    ran with (recorded in DONE.json; else this environment's, said so)."""
    from gptflow.config.settings import ModelConfig
    from gptflow.environment import versions

    m = ModelConfig(**run["model"])
    shape = (
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
        f"vocabulary {m.vocab_size}"
    )
    parts = ["<h2>Model and software</h2>"]
    parts.append(_table(["parameters", "architecture"], [[f"{m.num_parameters():,}", shape]]))
    recorded = finished.get("versions")
    names = {
        "deepspeed": "DeepSpeed", "cuda": "CUDA", "python": "Python", "snakemake": "Snakemake",
        "snakemake-executor-plugin-slurm": "Slurm executor plugin",
    }  # fmt: skip
    shown = recorded or versions()
    parts.append(_table([names.get(k, k) for k in shown], [list(shown.values())]))
    if not recorded:
        parts.append(
            "<p>versions of the environment that made this report: the trainer that wrote "
            "DONE.json did not record its own</p>"
        )
    return parts


def _export(hf_export: str | os.PathLike | None) -> list[str]:
    """Where the Hugging Face export is, and its files."""
    parts = ["<h2>Hugging Face export</h2>"]
    if hf_export is None or not Path(hf_export).is_dir():
        return [*parts, "<p>not exported</p>"]
    path = Path(hf_export)
    # not Snakemake's .snakemake_timestamp marker of a directory() output
    files = sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
    listing = ", ".join(f"{f.name} ({f.stat().st_size / 1e6:.1f} MB)" for f in files)
    load = f"transformers.AutoModelForCausalLM.from_pretrained({str(path)!r})"
    parts.append(
        _table(["directory", "absolute path", "files", "load with"],
               [[str(path), str(path.resolve()), listing, load]])
    )  # fmt: skip
    return parts


def _run(run: dict, finished: dict) -> list[str]:
    row = [
        finished["final_step"],
        f"{finished['tokens']:,}",
        finished["train_loss"],
        f"{finished['initial_val_loss']} → {finished['final_val_loss']}",
        f"{finished['checkpoint']} (sha256 {finished['checkpoint_sha256'][:16]}…)",
    ]
    head = ["final step", "tokens", "train loss", "validation loss (first → last)", "checkpoint"]
    parts = [f"<h2>Run {html.escape(run['run'])}</h2>", _table(head, [row])]
    saves = finished.get("saves")  # absent from a DONE.json of before train.async_save
    if saves and saves["count"]:
        how = {"async": "in the background (train.async_save)", "sync": "synchronous"}
        parts.append(_table(
            ["checkpoint saves", "training blocked per save (median / max)", "blocked in all"],
            [[f"{saves['count']}, {how.get(saves['mode'], saves['mode'])}",
              f"{saves['blocked_s_median']:.2f} s / {saves['blocked_s_max']:.2f} s",
              f"{saves['blocked_s_total']:.1f} s"]],
        ))  # fmt: skip
    return parts


def _origin(spec: dict) -> str:
    """Where a dataset comes from, as its config entry says."""
    origin = spec.get("type", "")
    if origin == "hf":  # the Hub name (or directory), its configuration, split and revision
        given = [spec["path"], spec.get("name"), spec.get("split"), spec.get("revision")]
        return origin + ": " + " ".join(str(v) for v in given if v)
    if spec.get("urls") or spec.get("url"):
        return origin + ": " + ", ".join(spec.get("urls") or [spec["url"]])
    if spec.get("root"):
        return origin + f": {spec['root']}"
    if spec.get("name"):
        return origin + f": {spec['name']}"
    return origin


def _data_card(run: dict, datasets: dict, quality_link: str | None = None) -> list[str]:
    """The tokenizer, and each shard with its counts and sources (from its manifest)."""
    tok = run["tokenizer"]
    tokenizer = [tok["path"], tok["vocab_size"], f"{tok['eod_token']} ({tok['eod_id']})",
                 tok["sha256"]]  # fmt: skip
    rows = []
    for d in run["data"]["datasets"]:
        origin = _origin(datasets.get(d["name"], {}))
        for shard in d["shards"]:
            manifest_path = Path(f"{shard['prefix']}.json")
            manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
            sources = "; ".join(
                f"{s['path']} (sha256 {s['sha256'][:16]}…)" for s in manifest.get("sources", [])
            )
            rows.append([
                d["name"], d["weight"], origin, shard["prefix"], f"{shard['documents']:,}",
                f"{shard['tokens']:,}", sources, shard["bin_sha256"][:16] + "…",
            ])  # fmt: skip
    head = ["dataset", "weight", "origin", "shard", "documents", "tokens", "sources", ".bin sha256"]
    return [
        "<h2>Data card</h2>",
        _table(["tokenizer", "vocabulary", "EOD", "sha256"], [tokenizer]),
        _table(head, rows),
        f"<p>split (train, valid, test): {html.escape(str(run['data']['split']))}</p>",
        *_quality_link(run, quality_link),
    ]


def recipe_text(recipe: dict[str, str] | None) -> str:
    """A run's data.quality in a few words: one recipe for every dataset, else per dataset."""
    if not recipe:
        return "raw"
    labels = set(recipe.values())
    if len(labels) == 1:
        return labels.pop()
    return "; ".join(f"{name}: {text}" for name, text in recipe.items())


def _quality_link(run: dict, link: str | None) -> list[str]:
    """With data.quality: the run's recipe and where the data-quality page shows what it keeps."""
    if not link:
        return []
    recipe = (run.get("derived") or {}).get("data_quality")
    return [
        f"<p>data.quality recipe: {html.escape(recipe_text(recipe))}. What each recipe keeps, "
        f"step by step: <a href='{html.escape(link)}'>the data-quality page</a>.</p>"
    ]


def _evaluation(ev: dict) -> list[str]:
    rows = []
    for kind in ("test", "extra"):
        for name, r in ev.get(kind, {}).items():
            rows.append([
                kind, name, r.get("tokens", "—"),
                f"{r['loss']:.4f}" if "loss" in r else r.get("note", ""),
                f"{r['perplexity']:.3f}" if "perplexity" in r else "—",
            ])  # fmt: skip
    generations = [[g["prompt"], g["text"]] for g in ev.get("generations", [])]
    return [
        "<h2>Evaluation</h2>",
        _table(["split", "name", "tokens", "loss", "perplexity"], rows),
        _table(["prompt", "greedy continuation"], generations),
    ]


def _container(container: str | os.PathLike | None) -> list[str]:
    if not container:
        return ["<h2>Container</h2>", "<p>none: training ran in the workflow's own environment</p>"]
    rec = json.loads(Path(container).read_text())
    row = [rec["tag"], rec["image_id"], rec["builder"], rec["base_image"],
           f"{(rec.get('size_bytes') or 0) / 1e6:.1f} MB"]  # fmt: skip
    return [
        "<h2>Container</h2>",
        _table(["tag", "image id", "builder", "base image", "size"], [row]),
    ]


STYLE = (
    "body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;margin:.5em 0}"
    "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;font-size:13px}"
    "pre{background:#f6f6f6;padding:.5em;font-size:12px}"
    ".mark{font-size:15px}ul.warnings li{color:#9a3a00}p.answer{font-size:15px}"
)


def run_card(
    *,
    run_yaml: str | os.PathLike,
    done: str | os.PathLike,
    evaluation: str | os.PathLike,
    datasets: dict,
    container: str | os.PathLike | None,
    out: str | os.PathLike,
    hf_export: str | os.PathLike | None = None,
    quality_page: str | os.PathLike | None = None,
) -> None:
    """card.html: the run, the model and the software it trained with, where its Hugging Face
    export is, the data card (with data.quality, a link to `quality_page`), evaluation,
    container, resolved run config."""
    import yaml

    run = yaml.safe_load(Path(run_yaml).read_text())
    finished = json.loads(Path(done).read_text())
    parts = [
        *_run(run, finished),
        *_model_and_software(run, finished),
        *_export(hf_export),
        *_data_card(run, datasets, _relative(quality_page, out)),
        *_evaluation(json.loads(Path(evaluation).read_text())),
        *_container(container),
        "<h2>Resolved run config</h2>",
        f"<pre>{html.escape(yaml.safe_dump(run, sort_keys=False))}</pre>",
    ]
    page = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>run card</title>"
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n"
    )
    with atomic_write(out) as f:
        f.write(page)


def _relative(target: str | os.PathLike | None, page: str | os.PathLike) -> str | None:
    """`target` as a link from the page written to `page` (None stays None)."""
    return os.path.relpath(target, Path(page).parent) if target else None


# --------------------------------------------------------------------------- harness


def harness_metric_names(task: dict) -> list[str]:
    """A task record's metrics (harness.json's tasks.NAME), not their stderrs, in the
    harness's order."""
    return [m for m in task["metrics"] if not m.endswith("_stderr")]


def metric_text(task: dict, metric: str) -> str:
    """Metric `metric` of task record `task` as reports show it: ``0.3333 ± 0.21``, the value
    bare where the harness gives no stderr, '—' where the task lacks it."""
    metrics = task.get("metrics", {})
    value, err = metrics.get(metric), metrics.get(f"{metric}_stderr")
    if not isinstance(value, int | float):
        return "—"
    return f"{value:.4g}" + (f" ± {err:.2g}" if isinstance(err, int | float) else "")


def summary_line(record: dict) -> str:
    """harness.json in one line: each task's first metric (``mc acc 0.3333 ± 0.21``)."""
    shown = [
        f"{name} {names[0]} {metric_text(task, names[0])}"
        for name, task in record["tasks"].items()
        if (names := harness_metric_names(task))
    ]
    return ", ".join(shown) or "no metrics"


def _harness_records(final: str | os.PathLike, steps: list[str | os.PathLike]) -> list[dict]:
    """The harness records (harness.json of the export, harness/stepN.json of checkpoints)
    in step order, the export's last."""
    records = [json.loads(Path(p).read_text()) for p in steps]
    records.sort(key=lambda r: r["step"])
    return [*records, json.loads(Path(final).read_text())]


def _step_label(record: dict) -> str:
    # a harness.json of gptflow before 2026-11 has no step
    return "final" if record.get("step") is None else f"step {record['step']}"


def harness_tables(records: list[dict]) -> list[str]:
    """Per task: each metric ± its stderr at every evaluated step (the export's last)."""
    from gptflow.results.figures import series_styles

    parts = []
    for name, task in records[-1]["tasks"].items():
        head = ["metric", *(_step_label(r) for r in records)]
        rows = []
        styles = series_styles(harness_metric_names(task))  # the figure's
        for metric in harness_metric_names(task):
            row = [Html(f"{styles[metric].mark(metric)} {html.escape(metric)}")]
            for r in records:
                row.append(metric_text(r["tasks"].get(name, {}), metric))
            rows.append(row)
        facts = (
            f"version {task['version']}, {task['num_fewshot']}-shot, "
            f"{(task.get('samples') or {}).get('effective', '?')} documents"
        )
        parts += [f"<h3>{html.escape(name)}</h3>", f"<p>{html.escape(facts)}</p>",
                  _table(head, rows)]  # fmt: skip
    return parts


def _is_fraction(name: str, values: list[float]) -> bool:
    """A metric read on a 0-1 axis (accuracy, exact match, ...): every value within it, and not
    a perplexity or bits per byte, whose scales are their own."""
    own = ("perplexity", "bits_per_byte")
    return not any(o in name for o in own) and all(0.0 <= v <= 1.0 for v in values)


def harness_panels(records: list[dict]) -> list[tuple[str, list[str]]]:
    """(task, its metrics on one axis) per panel: a task's 0-1 metrics (acc, acc_norm, ...)
    share one, each other metric has its own, so bits per byte (~1) is never read on the axis
    of a word perplexity (~1e5)."""
    panels = []
    for name, task in records[-1]["tasks"].items():
        fractions, own = [], []
        for metric in harness_metric_names(task):
            values = [r["tasks"].get(name, {}).get("metrics", {}).get(metric) for r in records]
            values = [v for v in values if isinstance(v, int | float)]
            (fractions if _is_fraction(metric, values) else own).append(metric)
        panels += [(name, fractions)] if fractions else []
        panels += [(name, [metric]) for metric in own]
    return panels


def plot_harness_curve(records: list[dict], out: str | os.PathLike, run: str) -> None:
    """Each task's metrics against the step of the checkpoint evaluated: a panel per task and
    scale (:func:`harness_panels`; a perplexity on a log axis), stderr as error bars where the
    harness gives one, each metric its own colour and marker."""
    from gptflow.results.figures import new_figure, series_id, series_styles, write_svg

    panels = harness_panels(records)
    cols = 2 if len(panels) > 1 else 1
    rows = -(-len(panels) // cols)
    fig, axes = new_figure(rows, cols, width=5.2 * cols, height=2.6 * rows + 0.6)
    for ax in axes.flat[len(panels) :]:
        ax.set_axis_off()
    for ax, (name, metrics) in zip(axes.flat, panels, strict=False):
        styles = series_styles(harness_metric_names(records[-1]["tasks"][name]))
        for metric in metrics:
            points = []
            for r in records:
                values = r["tasks"].get(name, {}).get("metrics", {})
                if isinstance(values.get(metric), int | float) and r.get("step") is not None:
                    err = values.get(f"{metric}_stderr")
                    points.append((r["step"], values[metric],
                                   err if isinstance(err, int | float) else 0.0))  # fmt: skip
            if points:
                xs, ys, errs = zip(*points, strict=True)
                ax.errorbar(xs, ys, yerr=errs, capsize=3, label=metric, markersize=5,
                            gid=series_id(f"harness-{name}", metric),
                            **styles[metric].kwargs())  # fmt: skip
        if any("perplexity" in m for m in metrics):
            ax.set_yscale("log")
        ax.set_title(f"{name}: {', '.join(metrics)}", fontsize=9)
        ax.set_xlabel("training step of the checkpoint", fontsize=8)
        ax.grid(alpha=0.3)
        if len(metrics) > 1:
            ax.legend(fontsize=7)
    if len(records) == 1:
        fig.suptitle(f"run {run}: the final checkpoint only (eval.harness.every for a curve)",
                     fontsize=10)  # fmt: skip
    else:
        fig.suptitle(f"run {run}: lm-evaluation-harness over checkpoints", fontsize=10)
    write_svg(fig, out)


HARNESS_SETTINGS = {  # harness.json's config key -> what the page calls it
    "num_fewshot": "few-shot examples", "batch_size": "batch size",
    "limit": "documents per task (limit)", "dtype": "precision",
    "softmax_dtype": "log-softmax precision", "max_length": "context (tokens)",
    "devices": "devices",
}  # fmt: skip


def _settings_table(record: dict) -> str:
    """The harness's version and settings (harness.json's config) as a table."""
    config = record.get("config", {})
    shown = {k: v for k, v in HARNESS_SETTINGS.items() if k in config}
    cells = [str(record.get("harness_version"))]
    cells += ["all" if k == "limit" and config[k] is None else
              ", ".join(map(str, config[k])) if isinstance(config[k], list) else str(config[k])
              for k in shown]  # fmt: skip
    return _table(["lm-evaluation-harness", *shown.values()], [cells])


def harness_report(
    run: str,
    final: str | os.PathLike,
    steps: list[str | os.PathLike],
    *,
    page: str | os.PathLike,
    curve: str | os.PathLike,
) -> None:
    """harness.html (the tables, the harness version and settings, the curve inline) and
    harness_curve.svg of one run, from its harness records."""
    records = _harness_records(final, steps)
    plot_harness_curve(records, curve, run)
    last = records[-1]
    svg = Path(curve).read_text()
    parts = [
        f"<h1>lm-evaluation-harness: run {html.escape(run)}</h1>",
        _settings_table(last),
        f"<p>The last column is the Hugging Face export ({html.escape(str(last['hf']))}), the "
        "others checkpoints exported on the fly. The figure draws a task's 0-1 metrics on one "
        "axis and each other metric (a perplexity on a log axis) on its own.</p>",
        *harness_tables(records),
        f"<div>{svg[svg.index('<svg') :]}</div>",
    ]
    with atomic_write(page) as f:
        f.write(
            f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>harness "
            f"{html.escape(run)}</title><style>{STYLE}</style></head><body>{''.join(parts)}"
            f"</body></html>\n"
        )
