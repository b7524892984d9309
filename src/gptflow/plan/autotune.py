"""Autotune's search space (the config's ``autotune`` section): the layouts of a run worth
timing, each a :class:`Candidate`, admitted or refused by the same checks that admit a run
(:func:`gptflow.plan.preflight.check_run`: the layout over the ranks, the trainer's own
refusals, the memory per GPU where it trains on GPUs). Each admitted candidate is a *trial*: a
run of its own (``{run}.tune.mb{M}.z{Z}.ac{0|1}``, results/runs/{trial}/) of ``autotune.steps``
steps that neither evaluates nor saves (train.autotune_trial), trained by the run's own
``train_gpt`` rule on the run's profile, so that it is a cached job like any other: a search
run again runs only the trials without a DONE.json. What is searched, as DeepSpeed's
autotuner does (the global batch kept, the gradient accumulation recomputed): the micro-batch
size, the ZeRO stage and activation checkpointing. gptflow.results.autotune ranks what the
trials measured.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from gptflow.errors import GptflowError
from gptflow.plan.gpu_memory import human
from gptflow.plan.placement import Placement
from gptflow.plan.preflight import check_run
from gptflow.plan.runs import RunPlan, run_plan

TRIAL_MARK = ".tune."  # in a trial's run name, between the run's and the candidate's


@dataclass(frozen=True)
class Candidate:
    """One layout of the search: its trial's run name, what it sets, and what the preflight
    said of it (`refused` empty: admitted, with its gradient accumulation and memory)."""

    name: str
    micro_batch_size: int
    zero_stage: int
    activation_checkpointing: bool
    grad_accum: int | None = None
    memory: str = "-"  # memory per GPU against the GPU's, where training goes to GPUs
    refused: str = ""

    @property
    def admitted(self) -> bool:
        return not self.refused

    @property
    def settings(self) -> dict:
        """The config keys it sets: what best.yaml holds for the fastest."""
        return {
            "model": {"activation_checkpointing": self.activation_checkpointing},
            "train": {"micro_batch_size": self.micro_batch_size, "zero_stage": self.zero_stage},
        }

    def to_json(self) -> dict:
        return {
            "trial": self.name,
            "micro_batch_size": self.micro_batch_size,
            "zero_stage": self.zero_stage,
            "activation_checkpointing": self.activation_checkpointing,
            "grad_accum": self.grad_accum,
            "memory": self.memory,
            "refused": self.refused,
        }


def trial_name(run: str, micro: int, zero: int, checkpointing: bool) -> str:
    return f"{run}{TRIAL_MARK}mb{micro}.z{zero}.ac{int(checkpointing)}"


def micro_batch_choices(run: RunPlan, ranks: int) -> list[int]:
    """autotune.micro_batch_sizes unset: every power of two that splits the global batch over
    the data-parallel ranks (1 up to the whole share of a rank, no accumulation), and the run's
    own micro-batch size."""
    t = run.train
    per_rank, rest = divmod(t.global_batch_size, t.data_parallel_size(ranks))
    sizes = {t.micro_batch_size}
    if not rest:
        sizes |= {2**k for k in range(per_rank.bit_length()) if per_rank % 2**k == 0}
    return sorted(sizes)


def trial_config(cfg: dict, spec: dict, micro: int, zero: int, checkpointing: bool) -> dict:
    """The config of one trial: the run's, with the candidate's layout, ``autotune.steps`` steps
    logged one by one, the run's learning-rate schedule (its decay length kept), no
    evaluation, no checkpoint, no elastic range (the profile's ranks), nothing but metrics
    logged."""
    train, base = cfg["train"], run_plan(cfg["run"], cfg, None).train
    steps = spec["steps"]
    return {
        **cfg,
        "run": trial_name(cfg["run"], micro, zero, checkpointing),
        "model": {**cfg["model"], "activation_checkpointing": checkpointing},
        "train": {
            **train,
            "micro_batch_size": micro,
            "zero_stage": zero,
            "train_iters": steps,
            "lr_decay_iters": base.decay_iters,
            "log_interval": 1,
            "eval_interval": steps,
            "save_interval": steps,
            "keep_every": None,
            "elastic": None,
            "log_samples": False,
            "tensorboard": False,
            "wandb": {**train.get("wandb", {}), "enabled": False},
            "autotune_trial": True,
        },
    }


def trial_run(run: RunPlan, spec: dict, micro: int, zero: int, checkpointing: bool) -> RunPlan:
    """A trial as planning knows a run (its vocabulary the run's, counted once)."""
    cfg = trial_config(run.config, spec, micro, zero, checkpointing)
    trial = run_plan(cfg["run"], cfg, run.tokenizer_json)
    trial.__dict__["vocabulary"] = run.vocabulary  # its cached_property's value
    return trial


def check_spec(spec: dict, source: str) -> None:
    """What the schema cannot say of the autotune section, in one line."""
    if spec["warmup_steps"] >= spec["steps"]:
        raise GptflowError(
            f"{source}: autotune.warmup_steps {spec['warmup_steps']} leaves no timed step of "
            f"autotune.steps {spec['steps']}: set steps above warmup_steps (a few timed steps "
            f"each: the default is 10 steps, the first 3 not timed)"
        )


def search(run: RunPlan, p: Placement, spec: dict) -> tuple[list[Candidate], dict[str, RunPlan]]:
    """Every layout of the search space (micro-batch size x ZeRO stage x activation
    checkpointing, in that order), each admitted or refused by the preflight's checks on `p`,
    and the admitted ones' runs by trial name (the plan's ``trials``), each built once."""
    micros = spec.get("micro_batch_sizes") or micro_batch_choices(run, p.ranks)
    found, admitted = [], {}
    for micro, zero, checkpointing in itertools.product(
        sorted(set(micros)), sorted(set(spec["zero_stages"])),
        sorted(set(spec["activation_checkpointing"])),
    ):  # fmt: skip
        name = trial_name(run.name, micro, zero, checkpointing)
        try:
            trial = trial_run(run, spec, micro, zero, checkpointing)
            gas, fit = check_run(trial, p)
        except GptflowError as e:
            found.append(Candidate(name, micro, zero, checkpointing, refused=str(e)))
            continue
        memory = f"{human(fit.total)} of {human(fit.gpu_bytes)}" if fit else "-"
        found.append(Candidate(name, micro, zero, checkpointing, gas, memory))
        admitted[name] = trial
    return found, admitted


def plan_lines(cands: list[Candidate], spec: dict, measured: set[str]) -> list[str]:
    """What ``snakemake -n`` prints of the search: its size, each candidate a line (refused ones
    with the reason, in short)."""
    admitted = [c for c in cands if c.admitted]
    lines = [
        f"gptflow autotune: {len(cands)} candidate(s) (micro batch x ZeRO stage x activation "
        f"checkpointing), {len(admitted)} admitted by the preflight, {len(cands) - len(admitted)} "
        f"refused; each a trial of {spec['steps']} steps (the first {spec['warmup_steps']} not "
        f"timed), {len(measured & {c.name for c in admitted})} finished already",
    ]
    for c in cands:
        what = (
            f"grad accum {c.grad_accum}, memory/GPU {c.memory}"
            if c.admitted
            else f"refused: {c.refused}"
        )
        lines.append(f"  {c.name}: {what}")
    return lines
