"""The jobs after training sized from the model (gptflow.results.sizing): the evaluation's precision and
GPUs for the models we ship layouts for, with the same margin as training's fit check, and what
the preflight prints and warns of. Arithmetic only: no GPU exists here, so the plans are checked
against hand-computed figures, not against a GPU's allocator."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from gptflow import hardware
from gptflow.config.schema import load_yaml
from gptflow.config.settings import ModelConfig
from gptflow.plan import eval_size, gpu_memory, placement
from gptflow.results import sizing
from gptflow.results.harness import task_work

REPO = Path(__file__).parents[3]
GIB = 2**30


def preset(name: str, vocab: int = 50_304) -> ModelConfig:
    values = load_yaml(REPO / "config" / "models" / f"{name}.yaml")
    values.pop("description", None)
    return ModelConfig(**values, vocab_size=vocab)


@pytest.mark.parametrize(
    ("name", "gpu_gib", "dtype", "gpus"),
    [
        ("pythia-1.4b", 80, "fp32", 1),
        ("pythia-12b", 80, "fp32", 1),
        ("pythia-12b", 40, "bf16", 1),
        ("gpt-neox-20b", 80, "bf16", 1),  # 82 GB of fp32 weights: more than the GPU
        ("gpt-neox-20b", 40, "bf16", 2),
        ("megatron-gpt3-145.6b", 80, "bf16", 5),
        ("megatron-gpt3-310.1b", 80, "bf16", 11),  # more than one 8-GPU node
    ],
)
def test_the_evaluation_fits_its_gpus_with_the_training_margin(name, gpu_gib, dtype, gpus):
    """fp32 on one GPU when weights + logits + the margin (2 GiB + 10 %) fit, else bf16 on the
    fewest GPUs whose consecutive blocks of layers (+ embedding or head) fit; one fewer GPU
    would not."""
    m = preset(name)
    plan = sizing.eval_plan(m, 2048, gpu_gib * GIB)
    assert (plan.dtype, plan.gpus) == (dtype, gpus) and plan.fits
    usable = gpu_gib * GIB - sizing.fit_margin(gpu_gib * GIB)
    logits = 3 * 4 * 8 * 2048 * m.vocab_size
    assert plan.device_bytes <= usable
    if dtype == "fp32":
        assert plan.device_bytes == 4 * m.num_parameters() + logits
        return
    assert 4 * m.num_parameters() + logits > usable
    embedding = 2 * m.vocab_size * m.hidden_size
    per_layer = (2 * m.num_parameters() - 2 * embedding) / m.num_layers
    if gpus > 1:
        fewer = math.ceil(m.num_layers / (gpus - 1)) * per_layer + embedding + logits
        assert fewer > usable
    assert sizing.layer_devices(m.num_layers, gpus)[-1] == gpus - 1


def test_the_fit_check_and_the_evaluation_leave_one_margin():
    """One home: the preflight's margin and the evaluation's are gptflow.hardware's."""
    assert gpu_memory.fit_margin is sizing.fit_margin is hardware.fit_margin
    assert sizing.fit_margin(80 * GIB) == 2 * GIB + 8 * GIB


def test_the_preflight_prints_the_jobs_after_training_and_warns_past_one_node():
    m = preset("gpt-neox-20b")
    node = placement.Placement(gres="gpu:8", gpu_mem_mb=40 * 1024)
    eval_cfg = {"max_windows": 256, "prompts": ["a"], "new_tokens": 32}
    lines = eval_size.after_training(m, 2048, node, eval_cfg)
    assert lines[0].startswith("  evaluate: bf16 on 2 GPU(s), about 28.4 GiB on the most loaded;")
    assert lines[1].startswith(f"  export_hf: {sizing.export_mb(m):,} MB,")
    assert len(lines) == 2
    big = eval_size.after_training(preset("megatron-gpt3-310.1b"), 2048, node, eval_cfg)
    assert (
        big[-1].startswith("  WARNING: evaluating 310,906,486,784 ")
        and "32 GPU(s) of 40 GiB" in big[-1]
    )


def test_the_jobs_time_and_memory_grow_with_the_model():
    small, big = preset("pythia-1.4b"), preset("gpt-neox-20b")
    assert sizing.export_mb(small) < sizing.export_mb(big) < 8 * 1024  # tensors, not the model
    assert sizing.export_runtime_min(big) == math.ceil(
        2 * 2 * 4 * big.num_parameters() / 200e6 / 60
    )
    assert sizing.eval_runtime_min(small, 2048, 256, 3, 32) == sizing.MIN_RUNTIME_MIN
    assert sizing.eval_runtime_min(big, 2048, 256, 3, 32) > sizing.MIN_RUNTIME_MIN
    assert sizing.eval_host_mb(big, 2048, on_gpu=True) < sizing.eval_host_mb(big, 2048, False)


def write_task(tmp_path: Path, name: str, rows: list[dict], **keys) -> str:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"task": name, "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(data), "train": "elsewhere.jsonl"}},
            **keys}  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(task))
    return str(path)


def test_the_harness_work_is_counted_from_the_task_files(tmp_path):
    """gptflow.results.harness.task_work at planning, without lm-eval: a task file over local JSONL is
    counted (its evaluated split's documents, their mean stored bytes, a question's choices
    from the list field doc_to_choice names, a generation's max_gen_toks), at most
    eval.harness.limit documents; a harness task name (its data not on disk) is assumed."""
    questions = [{"q": "x" * 36, "choices": ["a", "b", "c"]} for _ in range(5)]
    texts = [{"text": "y" * 1012} for _ in range(3)]  # 1,024 bytes a line: 256 tokens
    cfg = {
        "tasks": [
            write_task(tmp_path, "mc", questions, output_type="multiple_choice",
                       doc_to_choice="choices"),
            write_task(tmp_path, "ppl", texts, output_type="loglikelihood_rolling"),
            write_task(tmp_path, "gen", texts[:1], generation_kwargs={"max_gen_toks": 32}),
            "hellaswag",
        ],
        "limit": None, "num_fewshot": 0, "batch_size": 8, "include": [], "every": None,
    }  # fmt: skip
    mc, ppl, gen, named = task_work(cfg)
    line = len(json.dumps(questions[0]))  # a JSONL line's bytes (its newline not counted)
    assert mc == sizing.TaskWork("mc", "multiple_choice", 5, float(line), 3.0, 0)
    assert (mc.requests(64), mc.tokens(64, 0)) == (15, math.ceil(15 * line / 4))
    assert mc.tokens(16, 0) == 15 * 16  # each request at most the context
    assert ppl.requests(64) == 3 * 4 and ppl.tokens(64, 0) == 3 * 4 * 64  # 256 tokens: 4 windows
    assert gen.output_type == "generate_until" and gen.generated_tokens == 32
    assert gen.tokens(2048, 0) == 256 + 32
    assert named == sizing.TaskWork("hellaswag", "multiple_choice", sizing.ASSUMED_DOCUMENTS,
                                    0.0, sizing.ASSUMED_CHOICES, 0, counted=False)  # fmt: skip
    assert named.tokens(64, 0) == sizing.ASSUMED_DOCUMENTS * sizing.ASSUMED_CHOICES * 64
    limited = task_work({**cfg, "limit": 2})
    assert [w.documents for w in limited] == [2, 2, 1, 2]


def test_a_counted_tasks_few_shot_examples_are_in_its_size(tmp_path, monkeypatch):
    """eval.harness.num_fewshot puts that many examples like the question before it: a counted
    task's request is its document and the examples (at most the context), so at 5-shot the
    job does 6x the tokens and is given ~6x the minutes. Left out, the job would be sized 6x
    short and killed at its time limit on Slurm/PBS. A rolling task has no examples."""
    import types

    from gptflow.results.evaluate import RunConfig, harness_resources

    questions = [{"q": "x" * 400, "choices": ["a", "b", "c", "d"]} for _ in range(2000)]
    cfg = {"tasks": [write_task(tmp_path, "mc", questions, output_type="multiple_choice",
                                doc_to_choice="choices")],
           "limit": None, "num_fewshot": 0, "batch_size": 8, "include": [], "every": None}  # fmt: skip
    (mc,) = task_work(cfg)
    doc = len(json.dumps(questions[0])) / 4  # tokens of one document
    assert mc.tokens(2048, 0) == math.ceil(8000 * doc)
    assert mc.tokens(2048, 5) == math.ceil(8000 * 6 * doc)  # 6 x 103.5 tokens a request
    assert mc.tokens(256, 5) == 8000 * 256  # the examples fill the context at most
    m = preset("pythia-12b")
    many = dataclasses.replace(mc, documents=100_000)  # MMLU-sized and over: past the minimum
    zero, five = (sizing.harness_runtime_min(m, [many], 2048, k, "bf16") for k in (0, 5))
    assert 5.5 < five / zero <= 6, (zero, five)
    ppl = sizing.TaskWork("ppl", "loglikelihood_rolling", 3, 1024.0)
    assert ppl.tokens(64, 5) == ppl.tokens(64, 0)
    # the job's size (rule harness's resources) and the -n line read eval.harness.num_fewshot
    loaded = types.SimpleNamespace(model=m, train=types.SimpleNamespace(seq_length=2048))
    monkeypatch.setattr(RunConfig, "load", lambda path: loaded)
    minutes = [harness_resources("run.yaml", 80 * 1024, True, {**cfg, "num_fewshot": k}, [many])
               ["runtime"] for k in (0, 5)]  # fmt: skip
    assert 5.5 < minutes[1] / minutes[0] <= 6, minutes  # in the placement's dtype (fp32 here)
    lines = [eval_size.harness_line(m, 2048, 80 * 1024, {**cfg, "num_fewshot": k}, [many])
             for k in (0, 5)]  # fmt: skip
    assert [f", {n} min a job" in line for n, line in zip(minutes, lines, strict=True)] == [
        True, True]  # fmt: skip


def test_the_harness_jobs_are_sized_from_their_work_and_printed_at_plan_time():
    """The harness job's minutes grow with its tokens (not evaluate's figure), fp32 placements
    at fp32's throughput; the plan prints the jobs' requests, tokens, placement, memory and
    minutes after evaluate's and export_hf's, saying what was assumed."""
    m = preset("pythia-1.4b")
    small = [sizing.TaskWork("mc", "multiple_choice", 100, 400.0, 4.0, 0)]
    big = [sizing.TaskWork("hellaswag", "multiple_choice", 10_000, 0.0, 4.0, 0, counted=False)]
    assert sizing.harness_runtime_min(m, small, 2048, 0, "bf16") == sizing.MIN_RUNTIME_MIN
    tokens = 10_000 * 4 * 2048
    seconds = 4 * m.num_parameters() / 500e6 + 2 * m.num_parameters() * tokens / (312e12 * 0.2)
    assert sizing.harness_runtime_min(m, big, 2048, 0, "bf16") == math.ceil(2 * seconds / 60)
    assert sizing.harness_runtime_min(m, big, 2048, 0, "fp32") > 10 * math.ceil(2 * seconds / 60)
    assert sizing.harness_runtime_min(m, big, 2048, 5, "bf16") == math.ceil(2 * seconds / 60)
    assert sizing.harness_runtime_min(m, big, 512, 0, "bf16") < math.ceil(2 * seconds / 60)
    node = placement.Placement(gres="gpu:8", gpu_mem_mb=80 * 1024)
    eval_cfg = {"max_windows": 256, "prompts": [], "new_tokens": 32,
                "harness": {"batch_size": 8, "num_fewshot": 0}}  # fmt: skip
    lines = eval_size.after_training(m, 2048, node, eval_cfg, [*small, *big])
    assert lines[2] == (
        f"  harness: 2 task(s), about 40,400 requests, {400 * 100 + tokens:,} tokens of at most "
        "2048 (train.seq_length) (estimated from the task files' documents at 4 bytes a token; "
        "assumed for hellaswag: 10,000 documents (or eval.harness.limit) of 4 requests at the "
        f"full context); fp32 on 1 GPU(s), {sizing.harness_host_mb(m, 2048, 8, sizing.eval_plan(m, 2048, 80 * GIB)):,} "
        f"MB host memory, {sizing.harness_runtime_min(m, [*small, *big], 2048, 0, 'fp32')} min a "
        f"job (harness_step: + the export's {sizing.export_runtime_min(m)} min)"
    )
    assert len(eval_size.after_training(m, 2048, node, eval_cfg)) == 2  # no tasks: no line


def test_the_harness_jobs_host_memory_holds_the_model_in_its_placements_dtype():
    """transformers may build the model in host memory before placing it: the weights in the
    plan's dtype (fp32 on one GPU: 4 bytes a parameter; bf16: 2), on a CPU the fp32 model and
    one batch of logits, each plus the process's overhead."""
    m = preset("pythia-1.4b")
    n, overhead = m.num_parameters(), sizing.HOST_OVERHEAD_BYTES
    fp32, bf16 = sizing.eval_plan(m, 2048, 80 * GIB), sizing.eval_plan(m, 2048, 8 * GIB)
    assert (fp32.dtype, bf16.dtype) == ("fp32", "bf16")
    assert sizing.harness_host_mb(m, 2048, 8, fp32) == math.ceil((4 * n + overhead) / 2**20)
    assert sizing.harness_host_mb(m, 2048, 8, bf16) == math.ceil((2 * n + overhead) / 2**20)
    logits = sizing.logits_bytes(m, 2048, 8)
    assert sizing.harness_host_mb(m, 2048, 8, None) == math.ceil(
        (4 * n + logits + overhead) / 2**20
    )
