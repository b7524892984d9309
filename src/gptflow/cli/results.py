"""``gptflow evaluate``, ``export-hf`` and ``harness``: what is done with a finished run."""

from __future__ import annotations

import argparse


def add_export_hf_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="the run's run.yaml")
    s.add_argument("--out", required=True, help="the directory to write (replaced whole)")


def cmd_export_hf(a: argparse.Namespace) -> int:
    from gptflow.results.export import export_hf

    export_hf(a.config, a.out)
    return 0


def add_evaluate_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="the run's run.yaml")
    s.add_argument("--out", required=True, help="eval.json")
    s.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    s.add_argument("--new-tokens", type=int, default=32)
    s.add_argument(
        "--extra", nargs=2, action="append", default=[], metavar=("NAME", "PREFIX"),
        help="also the perplexity of shard PREFIX, reported as NAME (repeatable)",
    )  # fmt: skip
    s.add_argument("--max-windows", type=int, default=256, help="windows per perplexity")


def cmd_evaluate(a: argparse.Namespace) -> int:
    from gptflow.results.evaluate import evaluate

    extra: dict[str, list[str]] = {}
    for name, prefix in a.extra:
        extra.setdefault(name, []).append(prefix)
    evaluate(
        a.config,
        a.out,
        prompts=a.prompt,
        new_tokens=a.new_tokens,
        extra=extra,
        max_windows=a.max_windows,
    )
    return 0


def add_harness_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="the run's run.yaml (sizes the placement)")
    model = s.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf", help="the Hugging Face export (results/runs/RUN/hf)")
    model.add_argument(
        "--step", type=int,
        help="instead: the run's checkpoint of this step, exported on the fly beside --out",
    )  # fmt: skip
    s.add_argument("--out", required=True, help="harness.json")
    s.add_argument(
        "--task", action="append", required=True, metavar="TASK",
        help="a harness task name or a task YAML file (repeatable)",
    )  # fmt: skip
    s.add_argument(
        "--include", action="append", default=[], metavar="DIR",
        help="a directory of task YAML files (repeatable)",
    )  # fmt: skip
    s.add_argument("--num-fewshot", type=int, default=0, help="few-shot examples per question")
    s.add_argument("--batch-size", type=int, default=8, help="requests per forward pass")
    s.add_argument("--limit", type=int, default=None, help="at most N documents per task")


def cmd_harness(a: argparse.Namespace) -> int:
    import os

    # offline: task data from local files or the datasets cache, never a download (export
    # HF_DATASETS_OFFLINE=0 to let the harness fetch a hub task's data)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pathlib import Path

    from gptflow.results.evaluate import eval_placement
    from gptflow.results.export import exported_step, finished_run
    from gptflow.results.harness import run_harness
    from gptflow.train.run_config import RunConfig

    cfg = RunConfig.load(a.config)
    # as the evaluate job's, a.batch_size sequences a forward pass
    # (gptflow.results.evaluate.harness_resources)
    devices, dtype = eval_placement(cfg.model, cfg.train.seq_length, a.batch_size)
    settings = {
        "include": a.include, "num_fewshot": a.num_fewshot, "batch_size": a.batch_size,
        "limit": a.limit, "out": a.out, "devices": devices, "dtype": dtype,
        "max_length": cfg.train.seq_length,  # the context it trained at, not the export's
    }  # fmt: skip
    if a.step is None:
        step = finished_run(a.config)[1]["final_step"]
        run_harness(a.hf, a.task, step=step, **settings)
        return 0
    out = Path(a.out)
    with exported_step(a.config, a.step, out.parent / f".{out.stem}-hf") as export:
        run_harness(export["dir"], a.task, step=a.step, checkpoint=export["checkpoint"], **settings)
    return 0
