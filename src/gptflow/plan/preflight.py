"""What would fail on the cluster, found on the login node: `snakemake -n` (rules/setup.smk)
and `gptflow why` run these before any job is queued, and print the plan. Each check has its
module:

- :mod:`gptflow.plan.placement` -- the layout against the ranks the profile gives
  ``train_gpt``, how the profile launches training, the profile's placeholders;
- :mod:`gptflow.plan.cluster` -- the profile against the cluster, when ``sinfo`` is on PATH;
- :mod:`gptflow.plan.gpu_memory` -- memory per GPU on the most loaded pipeline stage, against
  the GPU's (Muon's share from :mod:`gptflow.plan.muon`, which also refuses a ZeRO-3 Muon
  update whose traffic would dominate the step);
- :mod:`gptflow.plan.host_memory` -- host memory of background saves, against the node's;
- :mod:`gptflow.plan.eval_size` -- the evaluate, export_hf and harness jobs' sizes;
- :mod:`gptflow.plan.run_size` -- parameters, FLOPs, tokens, GPU-hours, checkpoint and shard
  bytes.

:func:`run` checks one run and returns the lines the plan prints; :func:`study` checks every run
of a study as :func:`run` checks one and prints a line a run under the study's totals.

Planning imports neither torch nor DeepSpeed (it runs at every ``snakemake`` start): the counts
are formulas, checked in tests against the real model split over ranks and against
DeepSpeed's own ZeRO estimators.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.errors import GptflowError
from gptflow.hardware import background_saves
from gptflow.plan.cluster import check_cluster, read_accounts, read_sinfo
from gptflow.plan.eval_size import after_training
from gptflow.plan.gpu_memory import (
    MemoryFit,
    check_memory,
    human,
    margin_text,
    memory_per_gpu,
    planned_precision,
    planned_train,
)
from gptflow.plan.host_memory import check_saves, snapshot_fit
from gptflow.plan.muon import check_traffic
from gptflow.plan.placement import (
    Placement,
    check_elastic,
    check_launch,
    check_layout,
    placeholder_message,
    placeholders,
)
from gptflow.plan.run_size import ASSUMED_MFU, ASSUMED_PEAK_TFLOPS, size, token_bytes
from gptflow.plan.runs import RunPlan
from gptflow.results import sizing


@dataclass
class Report:
    """What the preflight found, for the plan's output and `gptflow why`."""

    lines: list[str] = field(default_factory=list)  # printed at -n
    warnings: list[str] = field(default_factory=list)
    size: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    placement: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def memory_lines(
    rep: Report,
    m: ModelConfig,
    train: TrainConfig,
    ranks: int,
    p: Placement,
    cfg: dict,
    harness_work: list[sizing.TaskWork] | None = None,
) -> list[str]:
    """The GPU memory fit (where training goes to GPUs), the jobs after training, and the
    host memory of asynchronous saves; each refuses what cannot fit."""
    precision, why = planned_precision(train, p)
    lines = [f"  precision: {precision} ({why})"]
    if traffic := check_traffic(m, train, ranks, precision):
        lines.append(traffic)
    if p.trains_on_gpus:  # a cluster's, a gres, or this machine's GPUs (nvidia-smi)
        fit = memory_per_gpu(m, train, ranks, p)
        check_memory(fit)
        rep.memory = {"terms": fit.terms, "total": fit.total, "gpu_bytes": fit.gpu_bytes,
                      "gpu_source": fit.gpu_source, "margin": fit.margin,
                      "stage": fit.stage}  # fmt: skip
        terms = ", ".join(f"{k} {human(v)}" for k, v in fit.terms.items() if v)
        where = f" ({fit.stage})" if fit.stage else ""
        lines.append(
            f"  memory per GPU{where}: about {human(fit.total)} + {margin_text(fit)}, of "
            f"{human(fit.gpu_bytes)} ({terms}; {fit.gpu_source})"
        )
        lines += after_training(m, train.seq_length, p, cfg.get("eval") or {}, harness_work)
    in_background = background_saves(train.async_save, p.trains_on_gpus)[0]
    lines.append(check_saves(train, snapshot_fit(m, train, ranks, p) if in_background else None))
    return lines


def run(
    run: RunPlan,
    p: Placement,
    *,
    datasets: dict | None = None,
    tokenizer: str | None = None,
    config_threads: dict[str, int] | None = None,
    profile_threads: dict[str, int] | None = None,
    runtimes: dict[str, int | None] | None = None,
    harness_work: list[sizing.TaskWork] | None = None,
    sinfo=read_sinfo,
    accounts=read_accounts,
    label: str = "",
) -> Report:
    """Every check above for `run` placed by `p`; raises GptflowError at the first failure
    (the key and the fix named), else returns the lines to print at -n."""
    train, m, vocab = run.train, run.model, run.vocab
    launch_warnings = check_launch(p)  # how the ranks start, then the layout over them
    ranks = p.ranks
    gas = check_layout(train, ranks)
    elastic = check_elastic(train, p.ranks_per_node, p.executor)  # every node count it admits
    planned_train(train, p)  # auto decided as the trainer will, and refused as it would be
    rep = Report(placement=asdict(p))
    if found := placeholders(p):
        rep.lines.append("gptflow: " + placeholder_message(found, p.executor))
    rep.warnings += launch_warnings
    if p.executor == "slurm" and (groups := sinfo()) is not None:
        cpu = dict(p.settings).get("default-resources slurm_partition")
        check_cluster(p, cpu, groups, accounts(), runtimes)
    dp = train.data_parallel_size(ranks)
    split = [f"{n} {kind}" for n, kind in ((train.tensor_parallel, "tensor"),
                                          (train.pipeline_parallel, "pipeline")) if n > 1]  # fmt: skip
    spread = p.mpi and (p.tasks_per_node or (p.nodes and ranks % p.nodes == 0))
    where = f"{p.nodes or 1} node(s) x {p.ranks_per_node} rank(s)" if spread else f"{ranks} rank(s)"
    rep.lines.append(
        f"gptflow preflight{label}: train_gpt on {where} = {' x '.join([*split, f'{dp} data'])} "
        f"parallel; micro batch {train.micro_batch_size} x grad accum {gas} x {dp} = global "
        f"batch {train.global_batch_size}; {m.num_parameters():,} parameters (vocabulary "
        f"{vocab:,}: {run.vocab_source})"
    )
    if elastic:
        rep.lines.append(elastic_line(elastic, p.ranks_per_node, train))
    rep.lines += memory_lines(rep, m, train, ranks, p, run.config, harness_work)
    for rule, n in sorted((profile_threads or {}).items()):
        given = (config_threads or {}).get(rule)
        if given is not None and given != n:
            rep.lines.append(
                f"  {rule} runs {n} thread(s): the profile's set-threads, over the config's "
                f"tokenize.workers {given}"
            )
    if p.threads:
        where = "kubernetes.cpus_per_rank" if p.executor == "kubernetes" else "set-threads"
        rep.lines.append(f"  train_gpt: {p.threads} CPU thread(s) per rank ({where})")
    if p.executor == "local" and not p.mpi:
        how = "one per visible GPU" if p.gpus else "one: no GPU visible"
        if p.nproc_per_node is not None:
            how = "set-resources train_gpt nproc_per_node"
        rep.lines.append(
            f"  train_gpt: {ranks} rank(s) on this machine ({how}; {p.gpus or 0} GPU(s): "
            f"{p.gpus_source or 'not counted'}), the job's cores shared among them"
        )
    rep.lines += [f"  WARNING: {w}" for w in rep.warnings]
    if datasets is not None:
        made, missing = token_bytes(datasets, vocab, tokenizer)
        rep.size = {"parameters": m.num_parameters(), "vocab": vocab,
                    "vocab_source": run.vocab_source, "shard_bytes": made,
                    "inputs_not_on_disk": missing}  # fmt: skip
    return rep


def check_run(run: RunPlan, p: Placement) -> tuple[int, MemoryFit | None]:
    """What refuses a run placed by `p` in one line, as :func:`run` checks it, without the
    report: its layout over the ranks (and every node count train.elastic admits), the
    trainer's own refusals, the memory per GPU where it trains on GPUs, ZeRO-3 Muon's traffic.
    Returns (gradient accumulation, the memory fit or None). A study's runs and autotune's
    candidates (gptflow.plan.autotune) are admitted by it."""
    train, m = run.train, run.model
    gas = check_layout(train, p.ranks)
    check_elastic(train, p.ranks_per_node, p.executor)
    planned_train(train, p)
    fit = memory_per_gpu(m, train, p.ranks, p) if p.trains_on_gpus else None
    if fit is not None:
        check_memory(fit)
    check_traffic(m, train, p.ranks, planned_precision(train, p)[0])
    return gas, fit


def elastic_line(accumulations: dict[int, int], ranks_per_node: int, train) -> str:
    """The elastic range at -n: each node count's gradient accumulation, one global batch."""
    each = ", ".join(
        f"{n} node(s): grad accum {gas} x {train.data_parallel_size(n * ranks_per_node)} dp"
        for n, gas in accumulations.items()
    )
    return (
        f"  train_gpt elastic ({ranks_per_node} rank(s) per node): {each}; global batch "
        f"{train.global_batch_size} and sample order kept across restarts"
    )


def study(
    runs: dict[str, RunPlan],
    p: Placement,
    *,
    indexes: int,
    trained: set[str],
    peak_tflops: float = ASSUMED_PEAK_TFLOPS,
    mfu: float = ASSUMED_MFU,
) -> list[str]:
    """A study's plan, one line a run (parameters, tokens, batch split, memory per GPU where
    the run goes to GPUs, GPU-hours, finished or not) under the study's totals. Every run's
    layout and memory are checked as a single run's are (the error names the run)."""
    rows, total_flops, total_hours = [], 0.0, 0.0
    for name, run in runs.items():
        train, m = run.train, run.model
        try:
            gas, fit = check_run(run, p)
        except GptflowError as e:
            raise GptflowError(f"study run '{name}': {e}") from None
        s = size(m, train, 0, 0, peak_tflops, mfu)
        total_flops += s["training_flops"]
        total_hours += s["gpu_hours"]
        memory = f"{human(fit.total)} of {human(fit.gpu_bytes)}" if fit else "-"
        split = f"{train.micro_batch_size} x {gas} x {train.data_parallel_size(p.ranks)}"
        state = "finished" if name in trained else "to train"
        rows.append((name, f"{s['parameters']:,}", f"{s['training_tokens']:,}", split, memory,
                     f"{s['gpu_hours']:.3g}", state))  # fmt: skip
    header = ("run", "parameters", "tokens", "micro x accum x dp", "memory/GPU", "GPU-hours", "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    table = [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    return [
        f"gptflow study: {len(runs)} run(s), {len(trained)} finished (a DONE.json; one whose "
        f"settings changed trains again); {indexes} data index(es) shared by them; {total_flops:.3g} training FLOPs = {total_hours:.3g} GPU-hours at "
        f"{mfu:.0%} MFU of {peak_tflops:g} TFLOP/s",
        *table,
    ]
