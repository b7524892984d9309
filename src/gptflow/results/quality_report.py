"""The data-quality page (data.quality): what each recipe keeps, step by step, from the shard
manifests and group counts its jobs write; nothing is counted twice.

It opens with each recipe's funnel (documents and bytes after each step, a figure and a table)
and a warning for every step that removes more than :data:`REMOVAL_WARNING` of what reaches it;
then, per recipe and step, the documents and bytes in and out of each dataset, the removed by
reason with a few of each, and a minhash step's duplicate clusters by size (a chart). The same
summary (data-quality.json) gives a data ablation's study page its funnels. Document text is
escaped everywhere.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

from gptflow.fsutil import atomic_write, write_json
from gptflow.results.figures import inline, new_figure, say, series_id, series_styles, svg_text
from gptflow.results.report import STYLE, Html, _table

# A step that removes more than this share of the documents, or of the bytes, that reach it is
# flagged at the top of the page. Half, because no single stage of the published pipelines
# this stage follows removes that much of web text and keeps it: FineWeb's most destructive
# heuristic (C4's terminal-punctuation rule, ~30 % of tokens) was dropped for it; C4's other
# rules together removed ~7 %; FineWeb's three own filters together ~22 %; Dolma's Gopher rules
# tagged ~15 % of characters; and deduplication passes that removed 71-85 % of a crawl's tokens
# trained worse models (FineWeb, arXiv 2406.17557, sections 3.5-3.6 and appendix E.3). A step
# over it is either a corpus that is mostly repeats or a rule that does not fit the text;
# either way a reader should look at its examples before training on what is left.
REMOVAL_WARNING = 0.5
QUALITY_EXAMPLES = 3  # removed documents shown per reason
COUNTS = ("documents_in", "documents_out", "bytes_in", "bytes_out")


def quality_summary(
    recipes: list[dict],
    manifests: list[str | os.PathLike],
    groups: list[str | os.PathLike] = (),
) -> list[dict]:
    """One entry per recipe and list of steps (the datasets sharing one): its label, runs and
    datasets; per step the documents and bytes in and out of each dataset (summed over its
    shards), the removed by reason with a few examples, a minhash step's duplicate-cluster
    sizes (size -> clusters, over its groups); the funnel (documents and bytes collected, then
    after each step) and the steps removing more than REMOVAL_WARNING.

    `recipes`: ``[{"label", "runs", "datasets": {dataset: its steps ({"name", "kind",
    "describe"})}}]`` (label None: the config's one recipe; a data ablation's recipes name their
    runs; a recipe without steps trains on the collected documents); `manifests`: every step's
    shard manifests; `groups`: the group counts (``results/quality/{step}/groups/{group}.json``)."""
    by_step: dict[tuple[str, str], list[dict]] = {}
    for path in manifests:
        m = _read(path)
        by_step.setdefault((m["step"], m["dataset"]), []).append(m)
    clusters: dict[str, dict[int, int]] = {}
    for path in groups:
        sizes = _read(path).get("cluster_sizes") or {}  # an exact group has none
        step = clusters.setdefault(Path(path).parent.parent.name, {})
        for size, count in sizes.items():
            step[int(size)] = step.get(int(size), 0) + count
    # what each dataset's first step read: the collected documents, whichever recipe it is in
    first = {}
    for recipe in recipes:
        for name, steps in recipe["datasets"].items():
            if steps and name not in first:
                first[name] = _dataset_counts(by_step, steps[0]["name"], name)
    out = []
    for recipe in recipes:
        out += _recipe_entries(recipe, by_step, clusters, first)
    return out


def _read(path) -> dict:
    import json

    return json.loads(Path(path).read_text())


def _dataset_counts(by_step, step: str, dataset: str) -> dict:
    shards = sorted(by_step.get((step, dataset), []), key=lambda m: m["shard"])
    return {"shards": len(shards)} | {k: sum(m[k] for m in shards) for k in COUNTS}


def _recipe_entries(recipe, by_step, clusters, first) -> list[dict]:
    shared: dict[tuple[str, ...], list[str]] = {}
    for name, steps in recipe["datasets"].items():
        shared.setdefault(tuple(s["name"] for s in steps), []).append(name)
    out = []
    for names in shared.values():
        steps = [_step(step, names, by_step, clusters) for step in recipe["datasets"][names[0]]]
        funnel = []
        if steps:  # what its first step read: the collected documents
            rows = steps[0]["datasets"].values()
            funnel.append({"after": "collected", "documents": sum(r["documents_in"] for r in rows),
                           "bytes": sum(r["bytes_in"] for r in rows)})  # fmt: skip
        elif all(n in first for n in names):  # no steps: what another recipe's first step read
            funnel.append({"after": "collected",
                           "documents": sum(first[n]["documents_in"] for n in names),
                           "bytes": sum(first[n]["bytes_in"] for n in names)})  # fmt: skip
        for i, step in enumerate(steps, start=1):
            rows = step["datasets"].values()
            funnel.append({"after": f"{i}. {step['kind']}",
                           "documents": sum(r["documents_out"] for r in rows),
                           "bytes": sum(r["bytes_out"] for r in rows)})  # fmt: skip
        out.append({"label": recipe["label"], "runs": list(recipe.get("runs", [])),
                    "datasets": names, "steps": steps, "funnel": funnel,
                    "warnings": [w for i, s in enumerate(steps, start=1)
                                 for w in removal_warnings(i, s)]})  # fmt: skip
    return out


def _step(step: dict, names: list[str], by_step, clusters) -> dict:
    rows, removed, examples = {}, {}, {}
    for name in names:
        rows[name] = _dataset_counts(by_step, step["name"], name)
        for m in sorted(by_step.get((step["name"], name), []), key=lambda m: m["shard"]):
            for reason, n in m["removed"].items():
                removed[reason] = removed.get(reason, 0) + n
            for reason, texts in m["examples"].items():
                shown = examples.setdefault(reason, [])
                shown += texts[: QUALITY_EXAMPLES - len(shown)]
    entry = {**step, "kind": step.get("kind") or step["name"].split("-")[1], "datasets": rows,
             "removed": dict(sorted(removed.items(), key=lambda kv: (-kv[1], kv[0]))),
             "examples": dict(sorted(examples.items()))}  # fmt: skip
    if clusters.get(step["name"]):
        entry["cluster_sizes"] = dict(sorted(clusters[step["name"]].items()))
    return entry


def removed_share(n_in: int, n_out: int) -> float | None:
    """The share of what reached a step that it removed (None when nothing reached it)."""
    return 1 - n_out / n_in if n_in else None


def removal_warnings(index: int, step: dict) -> list[str]:
    """A line per dataset in which step `index` removes more than REMOVAL_WARNING of the
    documents or of the bytes that reach it."""
    out = []
    for name, r in step["datasets"].items():
        docs = removed_share(r["documents_in"], r["documents_out"])
        size = removed_share(r["bytes_in"], r["bytes_out"])
        if max(docs or 0, size or 0) > REMOVAL_WARNING:
            out.append(
                f"step {index}, {step['kind']} ({step['name']}), removes {docs:.1%} of the "
                f"{r['documents_in']:,} "
                f"documents and {size:.1%} of the {_size(r['bytes_in'])} of {name} that reach it, "
                f"keeping {r['documents_out']:,} documents ({_size(r['bytes_out'])})"
            )
    return out


def _size(n: int) -> str:
    """Bytes as the page shows them: 18.2 MiB, 512 KiB, 900 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def entry_name(entry: dict) -> str:
    """A summary entry as the page names it: its label (the runs cleaning with it) and, when a
    recipe's datasets differ in steps, the datasets."""
    label = entry["label"] or "this config"
    return f"{label}: {', '.join(entry['datasets'])}"


def headline(entry: dict) -> str:
    """What a recipe keeps, in one sentence, and its largest step removal."""
    funnel = entry["funnel"]
    if not funnel:
        return f"{entry_name(entry)}: no manifests yet"
    start, end = funnel[0], funnel[-1]
    if not entry["steps"]:
        return f"no cleaning steps: trains on the {start['documents']:,} collected documents"
    text = (
        f"keeps {end['documents']:,} of {start['documents']:,} documents "
        f"({_share(end['documents'], start['documents'])}) and {_size(end['bytes'])} of "
        f"{_size(start['bytes'])} ({_share(end['bytes'], start['bytes'])})"
    )
    worst = max(range(1, len(funnel)), key=lambda i: removed_share(
        funnel[i - 1]["documents"], funnel[i]["documents"]) or 0)  # fmt: skip
    share = removed_share(funnel[worst - 1]["documents"], funnel[worst]["documents"])
    if share:
        text += (
            f"; step {funnel[worst]['after']} removes the most, {share:.0%} of the "
            f"{funnel[worst - 1]['documents']:,} documents that reach it"
        )
    return text


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def funnel_figure(series: list[tuple[str, object, list[dict]]], figure: str = "funnel") -> str:
    """Documents (left) and bytes (right) collected and after each step: for each
    (name, SeriesStyle, funnel) of `series` a bar at each of its stages, side by side with the
    other recipes' (none where a recipe has fewer steps), topped by its marker and the number.
    The ticks name each position's step (one name where the recipes agree). Returns the SVG."""
    fig, axes = new_figure(1, 2, width=11, height=3.8)
    longest = max((len(f) for _, _, f in series), default=0)
    if not longest:
        say(axes[0, 0], "no manifests yet")
        axes[0, 1].set_axis_off()
        return svg_text(fig)
    ticks = []
    for i in range(longest):
        kinds = dict.fromkeys(f[i]["after"].split(". ")[-1] for _, _, f in series if len(f) > i)
        ticks.append(" / ".join(kinds) if i else "collected")
    width = 0.8 / len(series)
    for ax, key in ((axes[0, 0], "documents"), (axes[0, 1], "bytes")):
        scale = 1 << 20 if key == "bytes" else 1  # bytes in MiB, 3 digits on the bars
        labels = [[f"{p['documents']:,}" if key == "documents" else f"{p['bytes'] / scale:.3g}"
                   for p in f] for _, _, f in series]  # fmt: skip
        upright = len(series) > 3 or max(len(t) for ts in labels for t in ts) > 6
        for j, (name, style, funnel) in enumerate(series):
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(funnel))]
            ys = [p[key] / scale for p in funnel]
            ax.bar(xs, ys, width=0.9 * width, color=style.color, alpha=0.3,
                   edgecolor=style.color)  # fmt: skip
            ax.plot(xs, ys, linestyle="none", marker=style.marker, color=style.color,
                    markersize=6, label=name, gid=series_id(f"{figure}-{key}", name))  # fmt: skip
            for x, y, text in zip(xs, ys, labels[j], strict=True):
                ax.annotate(text, (x, y), xytext=(0, 7), textcoords="offset points",
                            ha="center", fontsize=6, rotation=90 if upright else 0)  # fmt: skip
        top = max(p[key] for _, _, f in series for p in f) / scale
        ax.set_ylim(0, top * (1.45 if upright else 1.2))
        ax.set_xticks(range(longest), ticks, fontsize=8)
        ax.set_ylabel("MiB" if key == "bytes" else "documents")
        ax.set_title(f"{key} collected and after each step", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(fontsize=7, loc="upper right")
    return svg_text(fig)


def cluster_figure(sizes: dict[int, int]) -> str:
    """A minhash step's duplicate clusters: how many of each size (documents in the cluster),
    one bar per size present, its count on it. Returns the SVG text."""
    fig, axes = new_figure(1, 1, width=7, height=2.6)
    ax = axes[0, 0]
    xs = list(range(len(sizes)))
    bars = ax.bar(xs, list(sizes.values()), color="#1f77b4")
    ax.bar_label(bars, [f"{n:,}" for n in sizes.values()], fontsize=8)
    ax.set_xticks(xs, [str(s) for s in sizes])
    ax.set_xlabel("documents in the cluster (the first kept, the others removed)")
    ax.set_ylabel("clusters")
    ax.set_title("duplicate clusters by size", fontsize=10)
    ax.margins(y=0.2)
    return svg_text(fig)


def overview(summary: list[dict]) -> list[str]:
    """The page's opening: each recipe's funnel (a table and the figure) and the warnings."""
    names = [entry_name(e) for e in summary]
    styles = series_styles(names)
    head = ["recipe", "steps", "documents (collected → kept)", "bytes (collected → kept)",
            "what it keeps"]  # fmt: skip
    rows = []
    for name, e in zip(names, summary, strict=True):
        f = e["funnel"]
        steps = " → ".join(p["after"] for p in f[1:]) or "none"
        docs = f"{f[0]['documents']:,} → {f[-1]['documents']:,}" if f else "-"
        size = f"{_size(f[0]['bytes'])} → {_size(f[-1]['bytes'])}" if f else "-"
        rows.append([Html(styles[name].mark(name) + " " + html.escape(name)), steps, docs, size,
                     headline(e)])  # fmt: skip
    warnings: dict[str, list[str]] = {}  # a step two recipes share: one line naming both
    for e in summary:
        for w in e["warnings"]:
            warnings.setdefault(w, []).append(e["label"] or "this config")
    parts = ["<h2>What each recipe keeps</h2>", _table(head, rows)]
    parts.append(f"<div>{inline(funnel_figure([(n, styles[n], e['funnel']) for n, e in zip(names, summary, strict=True)]))}</div>")  # fmt: skip
    parts.append(
        f"<p>A step is flagged when it removes more than {REMOVAL_WARNING:.0%} of the documents "
        "or of the bytes that reach it: more than any single stage of FineWeb's pipeline "
        "removed and kept (C4's terminal-punctuation rule, ~30 % of tokens, was dropped for "
        "it); look at its examples below before training on what is left.</p>"
    )
    if warnings:
        parts.append("<ul class='warnings'>" + "".join(
            f"<li>⚠ {html.escape(w)} ({html.escape('; '.join(labels))})</li>"
            for w, labels in warnings.items()
        ) + "</ul>")  # fmt: skip
    else:
        parts.append(f"<p>No step removes more than {REMOVAL_WARNING:.0%}.</p>")
    return parts


def _quality_step(index: int, step: dict) -> list[str]:
    rows = [
        [name, r["shards"], f"{r['documents_in']:,}", f"{r['documents_out']:,}",
         f"{r['bytes_in']:,}", f"{r['bytes_out']:,}",
         _removed_text(r["documents_in"], r["documents_out"]),
         _removed_text(r["bytes_in"], r["bytes_out"])]
        for name, r in step["datasets"].items()
    ]  # fmt: skip
    head = ["dataset", "shards", "documents in", "documents out", "bytes in", "bytes out",
            "documents removed", "bytes removed"]  # fmt: skip
    parts = [
        f"<h3>{index}. {html.escape(step['describe'])}</h3>",
        f"<p>results/quality/{html.escape(step['name'])}</p>",
        _table(head, rows),
    ]
    if step["removed"]:
        reasons = [
            [reason, f"{n:,}", " | ".join(t.replace("\n", " ") for t in step["examples"].get(reason, []))]
            for reason, n in step["removed"].items()
        ]  # fmt: skip
        parts.append(_table(["removed because", "documents", "examples (shortened)"], reasons))
    else:
        parts.append("<p>removed nothing</p>")
    if step.get("cluster_sizes"):
        parts.append(f"<div>{inline(cluster_figure(step['cluster_sizes']))}</div>")
    return parts


def _removed_text(n_in: int, n_out: int) -> str:
    share = removed_share(n_in, n_out)
    if share is None:
        return "-"
    return f"{share:.1%}" + (" ⚠" if share > REMOVAL_WARNING else "")


def quality_page(summary: list[dict], out: str | os.PathLike) -> None:
    """data-quality.html: the funnels and warnings, then :func:`quality_summary` per recipe
    and step (document text escaped)."""
    parts = ["<h1>Data quality</h1>", *overview(summary)]
    for entry in summary:
        parts.append(f"<h2>{html.escape(entry_name(entry))}</h2>")
        if not entry["steps"]:
            parts.append(f"<p>{html.escape(headline(entry))}</p>")
        for i, step in enumerate(entry["steps"], start=1):
            parts += _quality_step(i, step)
    with atomic_write(out) as f:
        f.write(
            f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>data quality</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n"
        )


def quality_report(
    recipes: list[dict],
    manifests: list[str | os.PathLike],
    groups: list[str | os.PathLike],
    *,
    page: str | os.PathLike,
    summary: str | os.PathLike,
) -> list[dict]:
    """data-quality.html and data-quality.json (the summary, which a data ablation's study
    page reads) of the stage's manifests and group counts."""
    entries = quality_summary(recipes, manifests, groups)
    write_json(summary, {"warn_above": REMOVAL_WARNING, "recipes": entries})
    quality_page(entries, page)
    return entries
