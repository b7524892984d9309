"""eval.harness at plan time (gptflow.results.harness.check_planned): what cannot run is one line naming
the key and the fix, before any job. No network and no mock: a missing harness is made real by
an `lm_eval` package that raises ImportError, first on sys.path of a subprocess. (The harness
itself runs on a real export in tests/workflow/test_harness.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gptflow.errors import GptflowError
from gptflow.plan.workflow_config import load_workflow_config
from gptflow.results.harness import (
    check_planned,
    hf_model_settings,
    input_files,
    is_task_file,
    task_name,
)
from gptflow.results.harness_registry import max_gen_toks

MC_TASK = """\
task: my_mc
dataset_path: json
dataset_kwargs:
  data_files: {test: DATA}
test_split: test
output_type: multiple_choice
process_docs: !function utils.process_docs
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""


def harness(**keys) -> dict:
    return {"tasks": [], "num_fewshot": 0, "batch_size": 8, "limit": None, "include": [],
            "every": None, **keys}  # fmt: skip


def refusal(cfg: dict) -> str:
    with pytest.raises(GptflowError) as e:
        check_planned(cfg, "my.yaml")
    message = str(e.value)
    assert "\n" not in message
    return message


def test_defaults_are_no_harness(repo, tiny_config):
    cfg = load_workflow_config(
        tiny_config,
        schema_path=repo / "config/schema/config.schema.yaml",
        models_dir=repo / "config/models",
        source="my.yaml",
    )
    assert cfg["eval"]["harness"] == harness()
    check_planned(cfg["eval"]["harness"], "my.yaml")  # nothing to check


def test_a_task_file_and_its_data_are_the_jobs_inputs(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text('{"question": "?", "choices": ["a", "b"], "answer": 0}\n')
    task = tmp_path / "mc.yaml"
    task.write_text(MC_TASK.replace("DATA", str(data)))  # with the harness's !function tag
    cfg = harness(tasks=["lambada_openai", str(task)], include=[str(tmp_path)])
    check_planned(cfg, "my.yaml")
    assert input_files(cfg) == [str(task), str(data)]
    assert task_name(str(task), "k") == "my_mc"
    assert task_name("lambada_openai", "k") == "lambada_openai"
    assert [is_task_file(t) for t in ("hellaswag", "t.yaml", "tasks/x", "a.yml")] == [
        False, True, True, True,
    ]  # fmt: skip


def test_a_missing_task_file_is_one_line_naming_the_file_and_the_key(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert refusal(harness(tasks=["hellaswag", str(missing)])) == (
        f"my.yaml: eval.harness.tasks[1]: {missing}: no such task file (a task is a harness "
        f"task name, or the path of a task YAML file)"
    )


def test_an_unparsable_task_file_names_the_file_the_line_and_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: my_task\ndoc_to_text: [unclosed\n")
    message = refusal(harness(tasks=[str(bad)]))
    assert message.startswith(f"my.yaml: eval.harness.tasks[0]: {bad}:3: invalid YAML"), message
    twice = tmp_path / "twice.yaml"
    twice.write_text("task: a\ntask: b\n")
    message = refusal(harness(tasks=[str(twice)]))
    assert message.startswith(f"my.yaml: eval.harness.tasks[0]: {twice}:2: key 'task'"), message


def test_a_task_file_without_a_task_name_is_refused(tmp_path):
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text("dataset_path: json\n")
    assert refusal(harness(tasks=[str(nameless)])) == (
        f"my.yaml: eval.harness.tasks[0]: {nameless}: a task YAML file needs a `task: NAME` key "
        f"(the name the harness knows it by)"
    )


def test_a_missing_include_directory_is_refused(tmp_path):
    assert refusal(harness(tasks=["hellaswag"], include=[str(tmp_path / "tasks")])) == (
        f"my.yaml: eval.harness.include[0]: {tmp_path / 'tasks'}: no such directory (of task "
        f"YAML files)"
    )


def test_every_metric_keeps_its_filter_and_its_stderr():
    """A gsm8k-like task's two answer filters, scored by lm-eval's own aggregation (its
    `_compute_task_aggregations`, with a stand-in task object giving the aggregations):
    harness.json keeps exact_match under each filter, each with its own stderr, and drops only
    the "none" filter's name (word_perplexity: no stderr, "N/A" to null); the reports
    (gptflow.results.report) show two metrics, each ± its stderr, and no stderr as a metric."""
    from types import SimpleNamespace

    from lm_eval.api.metrics import mean, weighted_perplexity
    from lm_eval.evaluator_utils import _compute_task_aggregations

    from gptflow.results.harness import _metrics
    from gptflow.results.report import harness_metric_names, metric_text

    task = SimpleNamespace(
        task_name="gsm8k_like",
        aggregation=lambda: {"exact_match": mean, "word_perplexity": weighted_perplexity},
    )
    raw = {
        ("exact_match", "strict-match"): [1.0, 0.0, 0.0, 1.0],
        ("exact_match", "flexible-extract"): [1.0, 1.0, 0.0, 1.0],
        ("word_perplexity", "none"): [(-2.0, 2), (-2.0, 2)],  # (loglikelihood, words)
    }
    results, _ = _compute_task_aggregations(task, raw, bootstrap_iters=100)
    metrics = _metrics({"alias": "gsm8k_like", **results})
    assert metrics == pytest.approx({
        "exact_match,strict-match": 0.5, "exact_match,strict-match_stderr": 0.5 / 3**0.5,
        "exact_match,flexible-extract": 0.75, "exact_match,flexible-extract_stderr": 0.25,
        "word_perplexity": 2.718281828459045, "word_perplexity_stderr": None,
    })  # fmt: skip
    record = {"metrics": metrics}
    assert harness_metric_names(record) == [
        "exact_match,strict-match", "exact_match,flexible-extract", "word_perplexity"
    ]  # fmt: skip
    assert [metric_text(record, m) for m in harness_metric_names(record)] == [
        "0.5 ± 0.29", "0.75 ± 0.25", "2.718"
    ]  # fmt: skip


def test_without_the_harness_planning_names_the_install_command(tmp_path):
    """A Python in which `import lm_eval` fails (an lm_eval package raising ImportError, first
    on sys.path): tasks set -> one line naming pip install 'gptflow[eval]'; no tasks -> fine."""
    broken = tmp_path / "shadow" / "lm_eval"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('lm_eval is not installed here')\n")
    script = textwrap.dedent(
        """
        from gptflow.errors import GptflowError
        from gptflow.results.harness import check_planned
        cfg = {"tasks": [], "num_fewshot": 0, "batch_size": 8, "limit": None, "include": []}
        check_planned(cfg, "my.yaml")
        print("no tasks: ok")
        try:
            check_planned({**cfg, "tasks": ["hellaswag"]}, "my.yaml")
        except GptflowError as e:
            print(e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(tmp_path / "shadow"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "no tasks: ok",
        f"my.yaml: eval.harness.tasks is set, but lm-evaluation-harness cannot be imported in "
        f"{sys.prefix} (lm_eval is not installed here); install it with pip install "
        f"'gptflow[eval]' (or set eval.harness.tasks: [])",
    ]


def test_model_args_follow_the_evaluate_jobs_placement():
    """The harness's hf model on evaluate's placement (gptflow.results.evaluate.eval_placement): fp32 on
    the CPU or one GPU, bf16 spread by the harness's own `parallelize` over several GPUs (the
    GPU cases are arguments only: no GPU here); in every placement the context the model
    trained at (`max_length`, not the export's max_position_embeddings) and log-softmax in
    fp32 (`softmax_dtype`: under bf16 it would be the model's dtype). The names are HFLM's own
    keyword arguments in the installed lm-eval."""
    import inspect

    from lm_eval.models.huggingface import HFLM

    assert hf_model_settings("hf", ["cpu"], "fp32", 64) == {
        "pretrained": "hf", "dtype": "float32", "max_length": 64, "softmax_dtype": "float32",
        "device": "cpu",
    }  # fmt: skip
    assert hf_model_settings("hf", ["cuda:0"], "fp32", 64)["device"] == "cuda:0"
    assert hf_model_settings("hf", ["cuda:0", "cuda:1"], "bf16", 2048) == {
        "pretrained": "hf", "dtype": "bfloat16", "max_length": 2048, "softmax_dtype": "float32",
        "parallelize": True,
    }  # fmt: skip
    accepted = inspect.signature(HFLM.__init__).parameters
    for devices, dtype in ((["cpu"], "fp32"), (["cuda:0"], "bf16"), (["cuda:0", "cuda:1"], "bf16")):
        assert set(hf_model_settings("hf", devices, dtype, 64)) <= set(accepted)


def test_the_checkpoints_of_a_curve_must_be_saved_and_kept():
    """eval.harness.every's steps are below train_iters (the final one is the export's); each
    must be a saved step that training keeps, else one line naming the steps and the fix."""
    from gptflow.config.settings import TrainConfig
    from gptflow.results.harness import check_steps, checkpoint_steps

    t = TrainConfig(train_iters=100, save_interval=10, keep_last=2, keep_every=20)
    assert checkpoint_steps(t, None) == []
    assert check_steps(t, 40, "r", "c.yaml") == [40, 80]
    assert check_steps(t, 90, "r", "c.yaml") == [90]  # among the last keep_last
    with pytest.raises(GptflowError) as e:
        check_steps(t, 10, "r", "c.yaml")
    assert str(e.value) == (
        "c.yaml: eval.harness.every 10 (run r): training deletes the checkpoints of steps 10, "
        "30, 50, 70 (train.keep_last 2, train.keep_every 20); set train.keep_every: 10 (before "
        "training: a deleted checkpoint is gone)"
    )
    with pytest.raises(GptflowError, match=r"saves no checkpoint at step 25 \(train.save_inter"):
        check_steps(t, 25, "r", "c.yaml")


def test_the_harness_page_escapes_and_tables_every_step(tmp_path):
    """harness_report: one column per evaluated step (the export's last), metric ± stderr, a
    metric without stderr bare, a task name with markup escaped; the curve inline."""
    import json

    from gptflow.results.report import harness_report

    def record(step, acc, hf=None):
        task = {"version": 1.0, "num_fewshot": 0, "samples": {"effective": 6},
                "metrics": {"acc": acc, "acc_stderr": 0.2, "word_perplexity": 9.5,
                            "word_perplexity_stderr": None}}  # fmt: skip
        return {
            "harness_version": "0.4.13", "step": step, "hf": hf,
            "tasks": {"<b>mc</b>": task},
            "config": {"num_fewshot": 0, "batch_size": 4, "limit": None, "dtype": "float32"},
        }  # fmt: skip

    files = []
    for step, acc in ((20, 0.25), (10, 0.125)):
        files.append(tmp_path / f"step{step}.json")
        files[-1].write_text(json.dumps(record(step, acc)))
    final = tmp_path / "harness.json"
    final.write_text(json.dumps(record(30, 0.5, hf="results/runs/r/hf")))
    page, curve = tmp_path / "harness.html", tmp_path / "curve.svg"
    harness_report("r", final, files, page=page, curve=curve)
    text = page.read_text()
    assert "<b>mc</b>" not in text and "&lt;b&gt;mc&lt;/b&gt;" in text
    assert "<th>step 10</th><th>step 20</th><th>step 30</th>" in text
    assert "<td>acc</td><td>0.125 ± 0.2</td><td>0.25 ± 0.2</td><td>0.5 ± 0.2</td>" in text
    assert "<td>word_perplexity</td><td>9.5</td>" in text
    assert text.count("<svg") == 1 and curve.read_text().count("<svg") == 1


def test_a_generation_longer_than_the_trained_context_is_refused_at_planning(tmp_path):
    """The harness's context is train.seq_length, and lm-eval asserts that a generation's
    max_gen_toks is below it when the job runs: a generate_until task file asking for as many
    (lm-eval's default 256, at the default seq_length 256) is one line at -n; 32 plans."""
    from gptflow.results import sizing
    from gptflow.results.harness import check_context, task_work

    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "2 + 2 =", "answer": "4"}\n')
    task = tmp_path / "qa.yaml"
    spec = {"task": "qa", "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}"}  # fmt: skip
    task.write_text(json.dumps(spec))  # JSON is YAML
    work = task_work(harness(tasks=[str(task)]))
    assert work == [sizing.TaskWork("qa", "generate_until", 1, 38.0, 1.0, 256)]
    with pytest.raises(GptflowError) as e:
        check_context(work, 256, "r", "c.yaml")
    assert str(e.value) == (
        "c.yaml: eval.harness.tasks: task 'qa' generates up to 256 tokens "
        "(generation_kwargs.max_gen_toks; lm-eval's default 256), but the harness's context is "
        "run r's train.seq_length 256 and lm-eval needs fewer; set "
        "generation_kwargs.max_gen_toks below 256 in the task file"
    )
    task.write_text(json.dumps({**spec, "generation_kwargs": {"max_gen_toks": 32}}))
    check_context(task_work(harness(tasks=[str(task)])), 256, "r", "c.yaml")
    # its generation set in the file it includes (the including file's keys win)
    (tmp_path / "base.yaml").write_text(json.dumps({"generation_kwargs": {"max_new_tokens": 300}}))
    task.write_text(json.dumps({**spec, "include": "base.yaml"}))
    assert task_work(harness(tasks=[str(task)]))[0].generated_tokens == 300


def test_a_generation_of_a_task_lm_evals_registry_names_is_checked_at_planning():
    """A task *name* is read from the installed lm-evaluation-harness's own task files (no
    network, not imported): gsm8k generates up to lm-eval's default 256 tokens, which a
    train.seq_length of 256 cannot hold -- it passed -n and failed in the job (lm-eval's
    assert) -- and the group bbh_cot_fewshot's 27 tasks 1024 each (their template's
    max_gen_toks, through include:), which 1024 cannot hold; the refusal names the task, its
    file and the ways on. hellaswag (multiple-choice) and a name the registry lacks plan."""
    from gptflow.results.harness import check_context, task_work

    work = task_work(harness(tasks=["gsm8k", "bbh_cot_fewshot", "hellaswag", "no_such_task"]))
    assert [(w.name, w.output_type, w.generated_tokens) for w in work] == [
        ("gsm8k", "generate_until", 256), ("bbh_cot_fewshot", "generate_until", 1024),
        ("hellaswag", "multiple_choice", 0), ("no_such_task", "multiple_choice", 0)]  # fmt: skip
    with pytest.raises(GptflowError) as e:
        check_context(work, 256, "r", "c.yaml")
    assert str(e.value) == (
        "c.yaml: eval.harness.tasks: task 'gsm8k' generates up to 256 tokens (lm-eval's "
        "lm_eval/tasks/gsm8k/gsm8k.yaml: no generation_kwargs.max_gen_toks: lm-eval's default "
        "256), but the harness's context is run r's train.seq_length 256 and lm-eval needs "
        "fewer; raise train.seq_length above 256, or give eval.harness.tasks a copy of that "
        "task's YAML file with generation_kwargs.max_gen_toks below 256, or drop the task"
    )
    with pytest.raises(GptflowError, match=r"task 'bbh_cot_fewshot' generates up to 1024 tokens "
                       r"\(its task bbh_cot_fewshot_\w+, lm-eval's lm_eval/tasks/bbh/cot_fewshot/"
                       r"\w+\.yaml: generation_kwargs\.max_gen_toks\).* train\.seq_length 1024"):  # fmt: skip
        check_context(work, 1024, "r", "c.yaml")
    check_context(work, 2048, "r", "c.yaml")


TEMPLATE = """dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
doc_to_text: "{{q}}"
doc_to_target: "{{a}}"
output_type: generate_until
generation_kwargs: {max_gen_toks: 100, until: ["Q:"]}
tag: [short_generations]
"""
GROUP_FILES = {
    "_template": TEMPLATE,  # an include target, not a task file (no .yaml): its tag inherited
    "a.yaml": "task: my_a\ninclude: _template\n",
    "b.yaml": '"task": "my_b"\n"include": "_template"\n"tag": "other"\n',
    "c.yaml": "task: my_c\ninclude: _template\n",
    "d.yaml": "task: my_d\ninclude: _template\ngeneration_kwargs: {max_new_tokens: 40}\n",
    "mc.yaml": "task: my_mc\ninclude: _template\noutput_type: multiple_choice\n"
               "doc_to_choice: ['1', '2']\ndoc_to_target: 1\ngeneration_kwargs: null\n",
    "group.yaml": "group: my_group\ngeneration_kwargs: {max_gen_toks: 900, until: ['Q:']}\n"
                  "task:\n  - task: my_c\n    generation_kwargs: {max_gen_toks: 50}\n  - my_a\n"
                  "  - group: inner\n    task: [my_b]\n    generation_kwargs: {max_gen_toks: 700}\n"
                  "  - group: other_group\n    generation_kwargs: {max_gen_toks: 300}\n",
    "other.yaml": "group: other_group\ntask: [my_d, my_mc]\n",
    "py.yaml": "group: ignored\ntask: my_py\nclass: !function task.Mine\n",  # a Python task
}  # fmt: skip


def test_the_registry_reads_groups_tags_includes_and_overrides_as_the_harness(
    tmp_path, monkeypatch
):
    """Task files in eval.harness.include read as the harness reads them, checked against the
    harness itself (its TaskManager over these files alone, building the tasks offline from a
    local JSONL): a task's keys over its include: (quoted keys too), a tag inherited through
    it, a group's generation_kwargs over its members, a member's own over the group's, an
    inline group's under its parent's, a referenced group's under the reference's. The longest
    generation of a group is its size and its check. A `class:` file is a Python task, not a
    group; the index equals the harness's own (lm_eval.tasks._index.TaskIndex) on these files
    and on four directories of the installed harness."""
    import logging

    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind, TaskIndex

    from gptflow.results.harness import named_work
    from gptflow.results.harness_registry import _index, harness_tasks_dir, registry_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the data is a local file: no network
    data = tmp_path / "data.jsonl"
    data.write_text('{"q": "1 + 1 =", "a": "2"}\n')
    files = tmp_path / "tasks"
    files.mkdir()
    for name, text in GROUP_FILES.items():
        (files / name).write_text(text.replace("DATA", str(data)))
    include = [str(files)]
    manager = TaskManager(include_path=str(files), include_defaults=False)
    for name in ("my_group", "short_generations", "other", "my_a", "my_mc"):
        ours = {t.name: (t.output_type, max_gen_toks(t.spec)[0]) for t in
                registry_tasks(name, include)}  # fmt: skip
        theirs = {t: (task.config.output_type, max_gen_toks(vars(task.config))[0])
                  for t, task in manager.load([name])["tasks"].items()}  # fmt: skip
        assert ours == theirs, name
    assert ours == {"my_mc": ("multiple_choice", 256)}  # its generation is never asked for
    assert {t.name: max_gen_toks(t.spec)[0] for t in registry_tasks("my_group", include)} == {
        "my_a": 900, "my_c": 50, "my_b": 900, "my_d": 300, "my_mc": 300}  # fmt: skip
    work = named_work("my_group", include, None)  # the longest, not the first (my_c's 50)
    assert (work.output_type, work.generated_tokens) == ("generate_until", 900)
    assert work.generated_by.startswith("its task my_a, lm-eval's ")
    assert [t.output_type for t in registry_tasks("my_py", include)] == [None]  # its class says
    assert registry_tasks("ignored", include) == registry_tasks("nothing", include) == []
    root = harness_tasks_dir().resolve()
    logging.disable(logging.WARNING)  # the harness warns of duplicate names across its files
    try:
        for dirs in ([files.resolve()], [root / d for d in ("bbh", "gsm8k", "mmlu", "scrolls")]):
            theirs = TaskIndex.build(dirs)
            ours = _index(tuple(str(d) for d in dirs))
            kinds = {Kind.TASK: ours.tasks, Kind.PY_TASK: ours.tasks, Kind.GROUP: ours.groups}
            for name, entry in theirs.items():
                if entry.kind == Kind.TAG:
                    assert sorted(entry.tags) == sorted(ours.tags[name]), name
                else:
                    assert kinds[entry.kind][name] == entry.yaml_path, name
            assert len(theirs) == len({*ours.tasks, *ours.groups, *ours.tags})
    finally:
        logging.disable(logging.NOTSET)
