"""The evaluation stage's jobs sized at ``-n`` (the jobs after training): the evaluate,
export_hf and harness jobs as the rules size them (:mod:`gptflow.results.sizing`), and a warning
when the evaluation needs more GPUs than one node has.
"""

from __future__ import annotations

from gptflow.config.settings import ModelConfig
from gptflow.plan.gpu_memory import DEFAULT_GPU_MEMORY_MB, human
from gptflow.plan.placement import Placement
from gptflow.results import sizing


def after_training(
    m: ModelConfig,
    seq_length: int,
    p: Placement,
    eval_cfg: dict,
    harness_work: list[sizing.TaskWork] | None = None,
) -> list[str]:
    """The evaluate, export_hf and harness jobs as the rules size them (gptflow.results.sizing), and
    a warning when the evaluation needs more GPUs than one node (or this machine) has.
    `harness_work`: eval.harness's tasks (gptflow.results.harness.task_work), when it has any."""
    gpu_mb = p.gpu_mem_mb or DEFAULT_GPU_MEMORY_MB
    plan = sizing.eval_plan(m, seq_length, gpu_mb * 2**20)
    node = p.gpus_per_node if p.on_cluster or p.gres else p.gpus
    where = "a node of train_gpt's partition" if p.on_cluster or p.gres else "this machine"
    lines = []
    if not plan.fits or (node is not None and plan.gpus > node):
        lines.append(
            f"  WARNING: evaluating {m.num_parameters():,} parameters needs {plan.gpus} GPU(s) "
            f"of {gpu_mb / 1024:.0f} GiB in bf16 on one node, {where} has {node}; evaluation "
            "across nodes is not supported, so the evaluate job will not run (Slurm refuses "
            "its GPUs): build the train and export targets (snakemake ... train export) and "
            "evaluate the export on a machine that holds it"
        )
    windows, prompts = eval_cfg.get("max_windows", 256), len(eval_cfg.get("prompts", []))
    minutes = sizing.eval_runtime_min(
        m, seq_length, windows, prompts, eval_cfg.get("new_tokens", 32), plan.dtype
    )
    lines[:0] = [
        f"  evaluate: {plan.dtype} on {plan.gpus} GPU(s), about {human(plan.device_bytes)} on "
        f"the most loaded; {sizing.eval_host_mb(m, seq_length, True):,} MB host memory, "
        f"{minutes} min",
        f"  export_hf: {sizing.export_mb(m):,} MB, {sizing.export_runtime_min(m)} min "
        f"(one tensor at a time: the largest is {human(4 * m.largest_tensor_numel())} in fp32)",
    ]
    if harness_work:
        lines.insert(2, harness_line(m, seq_length, gpu_mb, eval_cfg.get("harness") or {},
                                     harness_work))  # fmt: skip
    return lines


def harness_line(
    m: ModelConfig, seq_length: int, gpu_mb: int, harness_cfg: dict, work: list[sizing.TaskWork]
) -> str:
    """The harness jobs' size at -n: requests and tokens (counted from the task files, or
    assumed: said which), the placement, host memory and minutes (gptflow.results.sizing)."""
    batch, fewshot = harness_cfg.get("batch_size", 8), harness_cfg.get("num_fewshot", 0)
    plan = sizing.eval_plan(m, seq_length, gpu_mb * 2**20, batch)
    requests = sum(w.requests(seq_length) for w in work)
    tokens = sum(w.tokens(seq_length, fewshot) for w in work)
    assumed = [w.name for w in work if not w.counted]
    how = (
        f"estimated from the task files' documents at {sizing.BYTES_PER_TOKEN_OF_TEXT:g} bytes "
        f"a token"
    )
    if assumed:
        how += (
            f"; assumed for {', '.join(assumed)}: {sizing.ASSUMED_DOCUMENTS:,} documents (or "
            f"eval.harness.limit) of {sizing.ASSUMED_CHOICES} requests at the full context"
        )
    minutes = sizing.harness_runtime_min(m, work, seq_length, fewshot, plan.dtype)
    return (
        f"  harness: {len(work)} task(s), about {requests:,} requests, {tokens:,} tokens of at "
        f"most {seq_length} (train.seq_length) ({how}); {plan.dtype} on {plan.gpus} GPU(s), "
        f"{sizing.harness_host_mb(m, seq_length, batch, plan):,} MB host memory, {minutes} min "
        f"a job (harness_step: + the export's {sizing.export_runtime_min(m)} min)"
    )
