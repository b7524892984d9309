"""eval.harness through Snakemake: the real lm-evaluation-harness (lm-eval 0.4.13, installed by
the test extra) on the tiny pipeline's Hugging Face export, on the CPU, offline, with two task
files written here over local JSONL (no network, no hub task). Its metrics are checked against
a computation with transformers directly on the export; the stage is cached by the export and
the task list.

The pipeline runs once per session (the `pipeline` fixture of conftest, shared with
test_pipeline); each test that changes anything works on its own copy (`pipeline_copy`)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import yaml

from tests.support.fake_gpus import fake_nvidia_smi, path_with

from .conftest import job_counts, most_at_once

# the stdlib-trained tiny model's kind of text: a question continued by one of its choices
MC_DOCS = [
    {"question": "import", "choices": ["json", "the", "while"], "answer": 0},
    {"question": "def __init__(self", "choices": ["):", "import", "of the"], "answer": 0},
    {"question": "return", "choices": ["None", "class", "]"], "answer": 0},
    {"question": "The message", "choices": ["is", "def", "()"], "answer": 0},
    {"question": "for key in", "choices": ["self.", "return", "is"], "answer": 0},
    {"question": "if not", "choices": ["isinstance(", ":", "The"], "answer": 1},
]
PPL_DOCS = [
    {"text": "def get(self, name):\n    return self._headers.get(name)"},
    {"text": "The logging module defines functions and classes."},
    {"text": "import json\nimport os"},
    # longer than the tiny run's train.seq_length (64) tokens: scored in windows of 64
    {"text": "class Handler(object):\n    def __init__(self, level=0):\n        self.level = "
             "level\n        self.formatter = None\n\n    def format(self, record):\n        "
             "if self.formatter is None:\n            return str(record)\n        return "
             "self.formatter.format(record)\n\n    def emit(self, record):\n        raise "
             "NotImplementedError('emit must be implemented by Handler subclasses')\n"},
]  # fmt: skip


def task_yaml(name: str, data: Path, output_type: str) -> dict:
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": output_type,
        "metadata": {"version": 2.0},
    }
    if output_type == "multiple_choice":
        task |= {
            "doc_to_text": "question",
            "doc_to_choice": "choices",
            "doc_to_target": "answer",
            "metric_list": [
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ],
        }
    else:
        task |= {
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")
            ],
        }
    return task


def write_tasks(root: Path) -> tuple[Path, Path]:
    """The multiple-choice task and the rolling-loglikelihood task, each a YAML over JSONL."""
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for name, docs, output_type in (
        ("gptflow_mc", MC_DOCS, "multiple_choice"),
        ("gptflow_ppl", PPL_DOCS, "loglikelihood_rolling"),
    ):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = root / f"{name}.yaml"
        task.write_text(yaml.safe_dump(task_yaml(name, data, output_type), sort_keys=False))
        files.append(task)
    return files[0], files[1]


def with_tasks(config: Path, tasks: list[Path], every: int | None = None) -> None:
    cfg = yaml.safe_load(config.read_text())
    harness = {"tasks": [str(t) for t in tasks], "batch_size": 4, "every": every}
    cfg.setdefault("eval", {})["harness"] = harness
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))


def check_metrics(record: dict, want: dict) -> None:
    """Every metric of `want` (expected_metrics) in harness record `record`."""
    assert set(record["tasks"]) == set(want)
    for name, task in record["tasks"].items():
        assert task["version"] == 2.0 and task["num_fewshot"] == 0, task
        metrics = task["metrics"]
        print(name, json.dumps(metrics), "independent:", json.dumps(want[name]))
        for metric, value in want[name].items():
            assert math.isclose(metrics[metric], value, rel_tol=1e-5, abs_tol=1e-12), (
                name, metric, metrics[metric], value,
            )  # fmt: skip


def summed_logprob(model, ids: list[int], scored: int) -> float:
    """The sum of log P(token) over the last `scored` tokens of `ids`, each given those before."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(ids[1:])
    picked = logp[torch.arange(len(targets)), targets][-scored:]
    return float(picked.sum())


def rolling_logprob(model, prefix: int, ids: list[int], length: int) -> float:
    """The summed log-likelihood of `ids` after the prefix token, `length` tokens a forward
    pass: disjoint windows of `length` predicted tokens, each given the tokens before it in the
    window, the last a whole window of `length` (lm-eval's rolling windows, context 1)."""
    full = [prefix, *ids]
    total, end = 0.0, 0
    while end < len(ids):
        scored = min(length, len(ids) - end)
        end += scored
        total += summed_logprob(model, full[max(0, end - length) : end + 1], scored)
    return total


def expected_metrics(hf_dir: Path, max_length: int) -> dict:
    """The two tasks' metrics computed with transformers on the export, apart from the harness,
    at the context the run trained at (`max_length`, train.seq_length): a choice is the
    continuation " " + choice, its tokens those of context + continuation after the context's;
    acc takes the largest summed log-likelihood, acc_norm that divided by the choice's length in
    characters. A text is scored after the prefix token (BOS, else EOS) in windows of
    `max_length` (:func:`rolling_logprob`), word perplexity = exp(-sum of log-likelihoods /
    words)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    assert max_length < model.config.max_position_embeddings  # the export's is not the run's

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    acc, acc_norm = [], []
    for doc in MC_DOCS:
        context = encode(doc["question"])
        lls = []
        for choice in doc["choices"]:
            whole = encode(doc["question"] + " " + choice)
            assert len(whole) <= max_length
            lls.append(summed_logprob(model, whole, len(whole) - len(context)))
        norm = [ll / len(c) for ll, c in zip(lls, doc["choices"], strict=True)]
        acc.append(float(max(range(3), key=lls.__getitem__) == doc["answer"]))
        acc_norm.append(float(max(range(3), key=norm.__getitem__) == doc["answer"]))
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    assert prefix is not None
    total_ll = words = nbytes = 0
    windows = []
    for doc in PPL_DOCS:
        ids = encode(doc["text"])
        windows.append(-(-len(ids) // max_length))
        total_ll += rolling_logprob(model, prefix, ids, max_length)
        words += len(re.split(r"\s+", doc["text"]))
        nbytes += len(doc["text"].encode("utf-8"))

    assert max(windows) >= 2, windows  # a text longer than the context: windows differ

    def mean_stderr(xs: list[float]) -> float:
        mu = sum(xs) / len(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1) / len(xs))

    return {
        "gptflow_mc": {
            "acc": sum(acc) / len(acc),
            "acc_stderr": mean_stderr(acc),
            "acc_norm": sum(acc_norm) / len(acc_norm),
            "acc_norm_stderr": mean_stderr(acc_norm),
        },
        "gptflow_ppl": {
            "word_perplexity": math.exp(-total_ll / words),
            "byte_perplexity": math.exp(-total_ll / nbytes),
            "bits_per_byte": -total_ll / nbytes / math.log(2),
        },
    }


def checkpoint_files(run_dir: Path) -> dict[str, int]:
    return {
        str(p.relative_to(run_dir)): p.stat().st_mtime_ns
        for p in (run_dir / "checkpoints").rglob("*")
    }


def planned_requests(seq_length: int) -> int:
    """The harness's requests as planning estimates them from the task files (gptflow.results.sizing.
    TaskWork): a request per choice of each question; a text's windows of seq_length tokens at
    4 bytes a token of its stored JSON line, by the lines' mean."""
    lines = [len(json.dumps(d).encode()) for d in PPL_DOCS]
    windows = math.ceil(sum(lines) / len(lines) / 4 / seq_length)
    return sum(len(d["choices"]) for d in MC_DOCS) + len(PPL_DOCS) * windows


def metric_panels(svg: Path) -> dict[str, tuple[str, str]]:
    """{TASK:METRIC: (its axes' id, its colour)} of a harness curve's series groups
    (gptflow.results.figures.series_id: harness-TASK:METRIC)."""
    import xml.etree.ElementTree as ET

    ns = "{http://www.w3.org/2000/svg}"
    out = {}
    for axes in ET.parse(svg).getroot().iter(f"{ns}g"):
        if re.fullmatch(r"axes_\d+", axes.get("id", "")):
            for g in axes.findall(f"{ns}g"):
                if g.get("id", "").startswith("harness-"):
                    style = "".join(e.get("style", "") for e in g.iter())
                    colour = re.search(r"stroke: ?(#[0-9a-f]{6})", style)[1]
                    out[g.get("id").removeprefix("harness-")] = (axes.get("id"), colour)
    return out


def test_the_harness_on_the_export_and_a_checkpoint_matches_transformers_and_is_cached(
    pipeline_copy,
    snakemake,
    tmp_path,
    monkeypatch,
):
    """`snakemake` with eval.harness.tasks = two local task files and every = 30 (the tiny run
    trains 40 steps, keeping the checkpoints of steps 30 and 40): one harness job on the export
    (reused), one harness_step job on the checkpoint of step 30, exported on the fly, and one
    harness_report job. Each record holds the harness and task versions and every metric, equal
    to the independent computation on that model at the context the run trained at (64 tokens,
    not the export's 2048: a text longer than that is scored in windows of 64) (acc and
    acc_norm exactly, stderr too; perplexities within 1e-5 relative; the perplexities' stderr
    recorded as null: the harness gives none). The step's export is gone afterwards and the
    run's checkpoints are untouched; the report's page tables both steps, and `snakemake
    --report` holds the page and the curve under "Downstream evaluation". A rerun is a no-op;
    dropping a task reruns only the harness jobs and their report.

    The first run plans with a stand-in nvidia-smi showing one 8 GiB GPU (no GPU exists here;
    the jobs still run on the CPU, torch sees none): the plan prints the harness jobs' size
    from the task files' requests, the harness and harness_step jobs each take the machine's
    one `gpu` and so run one after the other, where without a GPU (the later runs) they run
    side by side."""
    from gptflow.results.export import export_hf

    wd, config = pipeline_copy
    run_dir = wd / "results/runs/tiny"
    checkpoints = checkpoint_files(run_dir)
    mc, ppl = write_tasks(tmp_path / "tasks")
    with_tasks(config, [mc, ppl], every=30)
    one_gpu = path_with(fake_nvidia_smi(tmp_path / "bin", [8192]))
    run = snakemake(wd, config, env=one_gpu)
    assert run.returncode == 0, run.out[-5000:]
    assert job_counts(run.out) == {
        "harness": 1, "harness_step": 1, "harness_report": 1, "all": 1,
    }, run.out[-3000:]  # fmt: skip
    planned = next(x for x in run.out.splitlines() if x.startswith("  harness: "))
    requests = f"  harness: 2 task(s), about {planned_requests(64):,} requests, "
    assert planned.startswith(requests), planned
    assert "of at most 64 (train.seq_length) (estimated from the task files' documents" in planned
    assert run.out.count(", gpu=1,") == 2, run.out[-5000:]  # harness, harness_step
    assert most_at_once(run.out, {"harness", "harness_step"}) == 1, run.out[-5000:]
    out = run_dir / "harness.json"
    record = json.loads(out.read_text())
    assert record["harness_version"] == "0.4.13"
    assert record["hf"] == "results/runs/tiny/hf" and record["step"] == 40
    assert record["checkpoint"] is None
    assert record["config"] == {
        "tasks": [str(mc), str(ppl)], "include": [], "num_fewshot": 0, "batch_size": 4,
        "limit": None, "dtype": "float32", "softmax_dtype": "float32", "max_length": 64,
        "devices": ["cpu"],
    }  # fmt: skip
    check_metrics(record, expected_metrics(run_dir / "hf", 64))
    mc_metrics = record["tasks"]["gptflow_mc"]["metrics"]
    assert mc_metrics["acc"] * 6 == round(mc_metrics["acc"] * 6)  # a count out of 6 documents
    ppl_metrics = record["tasks"]["gptflow_ppl"]["metrics"]
    assert ppl_metrics["word_perplexity_stderr"] is None  # the harness has no stderr for it
    assert ppl_metrics["word_perplexity"] > 1.0

    step = json.loads((run_dir / "harness/step30.json").read_text())
    assert step["step"] == 30 and step["hf"] is None
    assert step["checkpoint"].endswith("/step00000030"), step["checkpoint"]
    assert [p.name for p in (run_dir / "harness").iterdir()] == ["step30.json"]  # export gone
    assert checkpoint_files(run_dir) == checkpoints  # the run's checkpoints only read
    monkeypatch.chdir(wd)  # run.yaml's paths are the working directory's
    export_hf(run_dir / "run.yaml", tmp_path / "step30-hf", step=30)
    check_metrics(step, expected_metrics(tmp_path / "step30-hf", 64))
    assert step["tasks"] != record["tasks"]  # another checkpoint, other numbers
    page = (run_dir / "report/harness.html").read_text()
    assert "<th>step 30</th><th>step 40</th>" in page and "gptflow_ppl" in page
    assert (run_dir / "report/harness_curve.svg").read_text().count("<svg") == 1
    # as a reader sees it: the settings a table, not a JSON dict; the perplexity task's
    # metrics (a word perplexity in the thousands, bits per byte a few) each on its own panel,
    # the multiple-choice task's accuracies on one, each metric its own colour
    assert "{&quot;" not in page and "<th>few-shot examples</th>" in page
    panels = metric_panels(run_dir / "report/harness_curve.svg")
    ppl = [panels[f"gptflow_ppl:{m}"][0] for m in ("word_perplexity", "bits_per_byte")]
    accuracies = [panels[f"gptflow_mc:{m}"] for m in ("acc", "acc_norm")]
    (axes, colours) = (set(x) for x in zip(*accuracies, strict=True))
    assert len(set(ppl)) == 2 and len(axes) == 1 and len(colours) == 2, panels
    report = tmp_path / "report.html"
    made = snakemake(wd, config, "--report", str(report))
    assert made.returncode == 0, made.out[-3000:]
    text = report.read_text()
    assert "Downstream evaluation" in text
    assert "harness.html" in text and "harness_curve.svg" in text

    again = snakemake(wd, config)
    assert again.returncode == 0, again.out[-3000:]
    assert "Nothing to be done" in again.out and job_counts(again.out) == {}

    before = out.stat().st_mtime_ns
    with_tasks(config, [mc], every=30)
    fewer = snakemake(wd, config)
    assert fewer.returncode == 0, fewer.out[-3000:]
    assert job_counts(fewer.out) == {
        "harness": 1, "harness_step": 1, "harness_report": 1, "all": 1,
    }, fewer.out[-3000:]  # fmt: skip
    assert "gpu=" not in fewer.out  # no GPU: no resource, the two jobs side by side
    assert most_at_once(fewer.out, {"harness", "harness_step"}) == 2, fewer.out[-5000:]
    assert out.stat().st_mtime_ns != before
    assert set(json.loads(out.read_text())["tasks"]) == {"gptflow_mc"}


def test_planning_refuses_a_task_file_that_is_missing_or_does_not_parse(
    tmp_path, snakemake, write_config, tiny_config
):
    """`snakemake -n` with eval.harness.tasks naming a missing file, then one that does not
    parse: one line naming the config key and the file, before any job."""
    missing = tmp_path / "tasks" / "nope.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: broken\ndoc_to_text: [unclosed\n")
    for task, says in ((missing, "no such task file"), (bad, f"{bad}:3: invalid YAML")):
        cfg = {**tiny_config, "eval": {"harness": {"tasks": ["hellaswag", str(task)]}}}
        config = write_config(tmp_path / "config.yaml", cfg)
        plan = snakemake(tmp_path / "wd", config, "-n")
        assert plan.returncode != 0
        line = next(x for x in plan.out.splitlines() if "eval.harness.tasks[1]" in x)
        assert line.startswith(f"gptflow config: {config}: eval.harness.tasks[1]: {task}"), line
        assert says in line, line
        assert "Traceback" not in plan.out
        assert not (tmp_path / "wd" / "results").exists()


def test_planning_refuses_checkpoints_that_training_does_not_keep(
    tmp_path, snakemake, write_config, tiny_config
):
    """`snakemake -n` with eval.harness.every naming steps the tiny run (40 steps, a checkpoint
    every 10, keep_last 2) never saves (every 15), or deletes (every 10: steps 10 and 20): one
    line naming the run, the steps and what to set; with train.keep_every 10, in a study of
    two runs, it plans one harness_step job per step and run, and the study report reads
    each run's harness.json."""
    mc, _ = write_tasks(tmp_path / "tasks")
    for every, train, says in (
        (15, {}, "training saves no checkpoint at step 15 (train.save_interval 10)"),
        (10, {}, "training deletes the checkpoints of steps 10, 20 (train.keep_last 2, "
                 "train.keep_every None); set train.keep_every: 10"),
    ):  # fmt: skip
        cfg = {**tiny_config, "eval": {"harness": {"tasks": [str(mc)], "every": every}}}
        cfg["train"] = {**cfg["train"], **train}
        config = write_config(tmp_path / "config.yaml", cfg)
        plan = snakemake(tmp_path / "wd", config, "-n")
        assert plan.returncode != 0
        line = next(x for x in plan.out.splitlines() if "eval.harness.every" in x)
        assert line.startswith(
            f"gptflow config: {config}: eval.harness.every {every} (run tiny): {says}"
        ), line
        assert "Traceback" not in plan.out
    cfg = {**tiny_config, "eval": {"harness": {"tasks": [str(mc)], "every": 10}}}
    cfg["train"] = {**cfg["train"], "keep_every": 10}
    cfg["study"] = {"runs": {"a": {}, "b": {"train": {"lr": 1.0e-3}}}}
    plan = snakemake(tmp_path / "wd", write_config(tmp_path / "config.yaml", cfg), "-n")
    assert plan.returncode == 0, plan.out[-3000:]
    counts = job_counts(plan.out)
    assert counts["harness_step"] == 6 and counts["harness_report"] == 2, counts
    assert counts["harness"] == 2 and counts["study_report"] == 1, counts
    # the study's page tables each run's harness.json
    block = plan.out[plan.out.index("rule study_report:") :].split("\n\n")[0]
    assert "results/runs/a/harness.json" in block and "results/runs/b/harness.json" in block
    assert not (tmp_path / "wd" / "results").exists()
