"""What `snakemake --report` shows of a run: metric plots and one HTML run card.

The card is the data card (datasets, their sources and checksums, documents and tokens per
shard, the tokenizer), the evaluation table, the container image when one was used, and the
resolved run config. Everything is escaped: document text never reaches the HTML unescaped.
The harness's page (a run's lm-evaluation-harness scores over its checkpoints) and the data
quality page (data.quality's steps, from their manifests) are made here too.

Over 500 lines: the report's three pages -- the run card, the harness's, data quality's -- with
the HTML helpers they share (tables, escaping, the page around them), each page a few short
functions.
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


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
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


def _data_card(run: dict, datasets: dict) -> list[str]:
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
) -> None:
    """card.html: the run, the model and the software it trained with, where its Hugging Face
    export is, the data card, evaluation, container, resolved run config."""
    import yaml

    run = yaml.safe_load(Path(run_yaml).read_text())
    finished = json.loads(Path(done).read_text())
    parts = [
        *_run(run, finished),
        *_model_and_software(run, finished),
        *_export(hf_export),
        *_data_card(run, datasets),
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
    parts = []
    for name, task in records[-1]["tasks"].items():
        head = ["metric", *(_step_label(r) for r in records)]
        rows = []
        for metric in harness_metric_names(task):
            row = [metric]
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


def plot_harness_curve(records: list[dict], out: str | os.PathLike, run: str) -> None:
    """Each task's metrics against the step of the checkpoint evaluated (one panel per task,
    stderr as error bars where the harness gives one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(records[-1]["tasks"])
    fig, axes = plt.subplots(len(tasks), 1, figsize=(7, 2.6 * len(tasks) + 0.6), dpi=100,
                             squeeze=False)  # fmt: skip
    for ax, name in zip(axes[:, 0], tasks, strict=True):
        for metric in harness_metric_names(records[-1]["tasks"][name]):
            points = []
            for r in records:
                metrics = r["tasks"].get(name, {}).get("metrics", {})
                if isinstance(metrics.get(metric), int | float) and r.get("step") is not None:
                    err = metrics.get(f"{metric}_stderr")
                    points.append((r["step"], metrics[metric],
                                   err if isinstance(err, int | float) else 0.0))  # fmt: skip
            if points:
                xs, ys, errs = zip(*points, strict=True)
                ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=metric)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("training step of the checkpoint")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if len(records) == 1:
        fig.suptitle(f"run {run}: the final checkpoint only (eval.harness.every for a curve)",
                     fontsize=10)  # fmt: skip
    else:
        fig.suptitle(f"run {run}: lm-evaluation-harness over checkpoints", fontsize=10)
    fig.tight_layout()
    with atomic_write(out, "w") as f:
        fig.savefig(f, format="svg")
    plt.close(fig)


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
    settings = {k: last["config"][k] for k in ("num_fewshot", "batch_size", "limit", "dtype")}
    svg = Path(curve).read_text()
    parts = [
        f"<h1>lm-evaluation-harness: run {html.escape(run)}</h1>",
        f"<p>harness {html.escape(str(last['harness_version']))}; "
        f"{html.escape(json.dumps(settings))}; the last column is the Hugging Face export "
        f"({html.escape(str(last['hf']))}), the others checkpoints exported on the fly.</p>",
        *harness_tables(records),
        f"<div>{svg[svg.index('<svg') :]}</div>",
    ]
    with atomic_write(page) as f:
        f.write(
            f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>harness "
            f"{html.escape(run)}</title><style>{STYLE}</style></head><body>{''.join(parts)}"
            f"</body></html>\n"
        )


# ---------------------------------------------------------------------------------------------
# The data-quality page (data.quality): from the manifests and group counts the stages write


def quality_summary(
    recipes: list[tuple[str | None, dict[str, list[dict]]]],
    manifests: list[str | os.PathLike],
    groups: list[str | os.PathLike] = (),
) -> list[dict]:
    """Per recipe and list of steps (the datasets sharing one) and step: documents and bytes
    in and out per dataset (summed over its shards), the removed by reason with a few examples
    each, and for minhash the duplicate-cluster sizes (size -> clusters, over its groups).
    `recipes`: ``[(label, {dataset: its steps ({"name", "describe"})})]`` (label None: the
    config's one recipe; a data ablation's name their runs); `manifests`: every step's shard
    manifests; `groups`: the group counts (``results/quality/{step}/groups/{group}.json``)."""
    by_step: dict[tuple[str, str], list[dict]] = {}
    for path in manifests:
        m = json.loads(Path(path).read_text())
        by_step.setdefault((m["step"], m["dataset"]), []).append(m)
    clusters: dict[str, dict[int, int]] = {}
    for path in groups:
        stats = json.loads(Path(path).read_text())
        sizes = clusters.setdefault(Path(path).parent.parent.name, {})
        for size, count in stats.get("cluster_sizes", {}).items():
            sizes[int(size)] = sizes.get(int(size), 0) + count
    out = []
    for label, recipe in recipes:
        out += _quality_recipe(label, recipe, by_step, clusters)
    return out


def _quality_recipe(label, recipe, by_step, clusters) -> list[dict]:
    shared: dict[tuple[str, ...], list[str]] = {}
    for name, steps in recipe.items():
        shared.setdefault(tuple(s["name"] for s in steps), []).append(name)
    out = []
    for names in shared.values():
        steps = []
        for step in recipe[names[0]]:
            rows, removed, examples = {}, {}, {}
            for name in names:
                shards = sorted(by_step.get((step["name"], name), []), key=lambda m: m["shard"])
                rows[name] = {"shards": len(shards)} | {
                    k: sum(m[k] for m in shards)
                    for k in ("documents_in", "documents_out", "bytes_in", "bytes_out")
                }
                for m in shards:
                    for reason, n in m["removed"].items():
                        removed[reason] = removed.get(reason, 0) + n
                    for reason, texts in m["examples"].items():
                        shown = examples.setdefault(reason, [])
                        shown += texts[: QUALITY_EXAMPLES - len(shown)]
            entry = {**step, "datasets": rows, "removed": dict(sorted(removed.items())),
                     "examples": dict(sorted(examples.items()))}  # fmt: skip
            if step["name"] in clusters:
                entry["cluster_sizes"] = dict(sorted(clusters[step["name"]].items()))
            steps.append(entry)
        out.append({"label": label, "datasets": names, "steps": steps})
    return out


QUALITY_EXAMPLES = 3  # removed documents shown per reason


def _quality_step(index: int, step: dict) -> list[str]:
    rows = [
        [name, r["shards"], f"{r['documents_in']:,}", f"{r['documents_out']:,}",
         f"{r['bytes_in']:,}", f"{r['bytes_out']:,}",
         f"{1 - r['documents_out'] / r['documents_in']:.1%}" if r["documents_in"] else "-"]
        for name, r in step["datasets"].items()
    ]  # fmt: skip
    parts = [
        f"<h3>{index}. {html.escape(step['describe'])}</h3>",
        f"<p>results/quality/{html.escape(step['name'])}</p>",
        _table(
            [
                "dataset",
                "shards",
                "documents in",
                "documents out",
                "bytes in",
                "bytes out",
                "documents removed",
            ],
            rows,
        ),
    ]
    if step["removed"]:
        reasons = [
            [reason, f"{n:,}", " | ".join(t.replace("\n", " ") for t in step["examples"].get(reason, []))]
            for reason, n in step["removed"].items()
        ]  # fmt: skip
        parts.append(_table(["removed because", "documents", "examples (shortened)"], reasons))
    if "cluster_sizes" in step:
        sizes = step["cluster_sizes"]
        most = max(sizes.values(), default=1)
        bars = [[size, f"{n:,}", "#" * max(1, round(40 * n / most))] for size, n in sizes.items()]
        parts.append("<p>duplicate clusters by size (documents in the cluster):</p>")
        parts.append(_table(["cluster size", "clusters", ""], bars))
    return parts


def quality_page(summary: list[dict], out: str | os.PathLike) -> None:
    """data-quality.html: :func:`quality_summary` as tables (document text escaped)."""
    parts = ["<h1>Data quality</h1>"]
    for recipe in summary:
        label = f"{recipe['label']}: " if recipe["label"] else ""
        parts.append(
            f"<h2>{html.escape(label)}datasets {html.escape(', '.join(recipe['datasets']))}</h2>"
        )
        for i, step in enumerate(recipe["steps"], start=1):
            parts += _quality_step(i, step)
    with atomic_write(out) as f:
        f.write(
            f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>data quality</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n"
        )
