"""The data-quality page (gptflow.results.quality_report) from hand-made shard manifests, as the
data-quality stage writes them: the funnel, the warnings, the per-step tables and charts."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from gptflow.results.figures import series_styles
from gptflow.results.quality_report import (
    REMOVAL_WARNING,
    quality_page,
    quality_report,
    quality_summary,
)
from tests.unit.results.test_report import SVG, assert_affine


def manifest(root: Path, step, dataset, shard, n_in, n_out, reason, *, size=10, bytes_out=None):
    """One shard's manifest of a step: `size` bytes a document unless `bytes_out` says what
    the kept documents weigh."""
    m = {"step": step, "dataset": dataset, "shard": shard, "documents_in": n_in,
         "documents_out": n_out, "bytes_in": size * n_in,
         "bytes_out": size * n_out if bytes_out is None else bytes_out,
         "removed": {reason: n_in - n_out} if n_in > n_out else {},
         "examples": {reason: ["<b>gone</b>"]} if n_in > n_out else {}}  # fmt: skip
    path = root / f"{step}-{dataset}-{shard}.json"
    path.write_text(json.dumps(m))
    return path


def step(name: str) -> dict:
    kind = name.split("-")[1]
    return {"name": name, "kind": kind, "describe": f"{kind} <{name}>"}


def test_the_data_quality_page_shows_each_ablation_recipe_under_its_runs(tmp_path):
    """A data ablation's page (rule report_data_quality): each recipe once, headed by the runs
    cleaning with it; a step two recipes share counted under both from its one set of
    manifests; a step's figures are the sums of its shards' manifests, not another step's."""
    manifests = [
        manifest(tmp_path, "01-exact-x", "a", "00000", 10, 7, "exact"),
        manifest(tmp_path, "01-exact-x", "a", "00001", 5, 5, "exact"),
        manifest(tmp_path, "02-filters-y", "a", "00000", 7, 2, "gopher_repetition"),
        manifest(tmp_path, "02-filters-y", "a", "00001", 5, 4, "c4"),
    ]
    exact, filters = step("01-exact-x"), step("02-filters-y")
    recipes = [{"label": "study runs exact", "runs": ["exact"], "datasets": {"a": [exact]}},
               {"label": "study runs clean, clean-lr", "runs": ["clean", "clean-lr"],
                "datasets": {"a": [exact, filters]}}]  # fmt: skip
    summary = quality_summary(recipes, manifests)
    assert [(r["label"], r["datasets"], [s["name"] for s in r["steps"]]) for r in summary] == [
        ("study runs exact", ["a"], ["01-exact-x"]),
        ("study runs clean, clean-lr", ["a"], ["01-exact-x", "02-filters-y"]),
    ]
    shared = {"shards": 2, "documents_in": 15, "documents_out": 12, "bytes_in": 150, "bytes_out": 120}  # fmt: skip
    assert summary[0]["steps"][0]["datasets"]["a"] == shared == summary[1]["steps"][0]["datasets"]["a"]  # fmt: skip
    assert summary[1]["steps"][1]["datasets"]["a"]["documents_out"] == 6
    assert summary[1]["steps"][1]["removed"] == {"gopher_repetition": 5, "c4": 1}
    # the funnel: collected, then after each step, documents and bytes
    assert summary[1]["funnel"] == [
        {"after": "collected", "documents": 15, "bytes": 150},
        {"after": "1. exact", "documents": 12, "bytes": 120},
        {"after": "2. filters", "documents": 6, "bytes": 60},
    ]
    quality_page(summary, tmp_path / "page.html")
    text = (tmp_path / "page.html").read_text()
    assert "<h2>study runs exact: a</h2>" in text
    assert "<h2>study runs clean, clean-lr: a</h2>" in text
    assert "&lt;02-filters-y&gt;" in text and "&lt;b&gt;gone&lt;/b&gt;" in text
    assert "<b>gone" not in text
    # the config's one recipe (label None)
    one = [{"label": None, "runs": ["r"], "datasets": {"a": [exact]}}]
    quality_page(quality_summary(one, manifests), tmp_path / "one.html")
    assert "<h2>this config: a</h2>" in (tmp_path / "one.html").read_text()


def test_the_funnel_figure_is_the_manifests_counts_one_colour_per_recipe(tmp_path):
    """The page opens with the funnel: per recipe a series of documents (left) and bytes
    (right, MiB) collected and after each step, each recipe its own colour and marker, its
    points the manifests' sums; the table beside it says what each keeps."""
    manifests = [
        manifest(tmp_path, "01-exact-x", "a", "00000", 789, 339, "exact", size=1 << 12),
        manifest(tmp_path, "02-filters-y", "a", "00000", 339, 24, "c4", size=1 << 12),
    ]
    exact, filters = step("01-exact-x"), step("02-filters-y")
    recipes = [{"label": "study runs raw", "runs": ["raw"], "datasets": {"a": []}},
               {"label": "study runs exact", "runs": ["exact"], "datasets": {"a": [exact]}},
               {"label": "study runs clean", "runs": ["clean"],
                "datasets": {"a": [exact, filters]}}]  # fmt: skip
    page, out = tmp_path / "q.html", tmp_path / "q.json"
    summary = quality_report(recipes, manifests, [], page=page, summary=out)
    assert json.loads(out.read_text()) == {"warn_above": REMOVAL_WARNING, "recipes": summary}
    text = page.read_text()
    # what a reader wants first: the filters recipe keeps 24 of 789, 93 % removed by a step
    assert "keeps 24 of 789 documents (3.0%)" in text
    assert "step 2. filters removes the most, 93% of the 339 documents that reach it" in text
    assert text.index("What each recipe keeps") < text.index("<h3>")  # before the steps
    svg = text[text.index("<svg") :]
    (tmp_path / "funnel.svg").write_text(svg[: svg.index("</svg>") + 6])
    root = ET.parse(tmp_path / "funnel.svg").getroot()
    names = ["study runs raw: a", "study runs exact: a", "study runs clean: a"]
    styles = series_styles(names)
    want = {names[0]: [789], names[1]: [789, 339], names[2]: [789, 339, 24]}
    colours = set()
    for axes_id, key, scale in (("axes_1", "documents", 1), ("axes_2", "bytes", 4096 / (1 << 20))):
        axes = root.find(f".//{SVG}g[@id='{axes_id}']")
        groups = {g.get("id").split(":", 1)[1]: g for g in axes.findall(f"{SVG}g")
                  if g.get("id", "").startswith(f"funnel-{key}:")}  # fmt: skip
        assert list(groups) == names
        pairs = []
        for name, g in groups.items():
            ys = [float(u.get("y")) for u in g.iter(f"{SVG}use")]
            assert len(ys) == len(want[name]), (key, name)
            pairs += [(n * scale, y) for n, y in zip(want[name], ys, strict=True)]
            style = "".join(e.get("style", "") for e in g.iter())
            assert styles[name].color in style, (key, name)
            colours.add(styles[name].color)
        assert_affine(pairs, f"funnel {key}")
    assert len(colours) == 3
    # the bytes panel's numbers and axis are MiB of the manifests' bytes (2^20, not 10^6)
    drawn = re.findall(r"<!-- (.*?) -->", svg[: svg.index("</svg>")])
    mib = [f"{n * 4096 / (1 << 20):.3g}" for n in (789, 339, 24)]
    assert mib == ["3.08", "1.32", "0.0938"] and set(mib) <= set(drawn) and "MiB" in drawn
    # the table leads each recipe with its mark, in the figure's colour
    for name in names:
        assert f"style='color:{styles[name].color}'" in text


def test_a_step_is_flagged_when_it_removes_more_than_the_threshold_of_documents_or_bytes(
    tmp_path,
):
    """REMOVAL_WARNING is a share of what reaches the step: exactly at it is not flagged, one
    document over is; a step keeping most documents but few of their bytes is flagged too."""
    n = 100
    at = round(n * (1 - REMOVAL_WARNING))  # keeps exactly 1 - threshold
    manifests = [
        manifest(tmp_path, "01-exact-at", "a", "00000", n, at, "exact"),
        manifest(tmp_path, "01-exact-over", "b", "00000", n, at - 1, "exact"),
        manifest(tmp_path, "01-filters-bytes", "c", "00000", n, n - 1, "c4", size=100,
                 bytes_out=100 * n // 4),  # a quarter of the bytes kept
    ]  # fmt: skip
    recipes = [{"label": None, "runs": ["r"],
                "datasets": {"a": [step("01-exact-at")], "b": [step("01-exact-over")],
                             "c": [step("01-filters-bytes")]}}]  # fmt: skip
    summary = quality_summary(recipes, manifests)
    warnings = [w for e in summary for w in e["warnings"]]
    assert len(warnings) == 2, warnings
    assert "(01-exact-over), removes 51.0% of the 100 documents" in warnings[0]
    assert "keeping 49 documents" in warnings[0]
    assert "(01-filters-bytes), removes 1.0% of the 100 documents and 75.0% of the" in warnings[1]
    quality_page(summary, tmp_path / "page.html")
    text = (tmp_path / "page.html").read_text()
    flagged = re.findall(r"<li>⚠ (.*?)</li>", text)
    assert len(flagged) == 2 and "01-exact-at" not in " ".join(flagged)
    assert f"more than {REMOVAL_WARNING:.0%}" in text


def test_minhash_clusters_are_a_chart_and_no_step_prints_an_empty_table(tmp_path):
    """A minhash step's duplicate clusters are a bar chart of the group counts' sizes (the
    counts summed over groups), an exact step has no cluster section at all, and a step
    removing nothing says so in a line instead of an empty reasons table."""
    manifests = [
        manifest(tmp_path, "01-exact-x", "a", "00000", 10, 10, "exact"),
        manifest(tmp_path, "02-minhash-y", "a", "00000", 10, 6, "minhash"),
    ]
    groups = []
    for i, sizes in enumerate(({"2": 3, "3": 1}, {"2": 4})):
        path = tmp_path / f"results/quality/02-minhash-y/groups/{i}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cluster_sizes": sizes}))
        groups.append(path)
    exact_group = tmp_path / "results/quality/01-exact-x/groups/0.json"
    exact_group.parent.mkdir(parents=True)
    exact_group.write_text(json.dumps({}))
    recipes = [{"label": None, "runs": ["r"],
                "datasets": {"a": [step("01-exact-x"), step("02-minhash-y")]}}]  # fmt: skip
    summary = quality_summary(recipes, manifests, [*groups, exact_group])
    assert "cluster_sizes" not in summary[0]["steps"][0]
    assert summary[0]["steps"][1]["cluster_sizes"] == {2: 7, 3: 1}
    quality_page(summary, tmp_path / "page.html")
    text = (tmp_path / "page.html").read_text()
    exact_part = text[text.index("<h3>1.") : text.index("<h3>2.")]
    minhash_part = text[text.index("<h3>2.") :]
    assert "removed nothing" in exact_part and "removed because" not in exact_part
    assert "clusters" not in exact_part and "#" * 3 not in text
    svg = minhash_part[minhash_part.index("<svg") :]
    drawn = re.findall(r"<!-- (.*?) -->", svg[: svg.index("</svg>")])
    assert "duplicate clusters by size" in drawn and {"7", "1"} <= set(drawn)
    assert "<table><thead><tr><th>cluster size" not in text
