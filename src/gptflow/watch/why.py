"""`gptflow why`: before a run, which stages will rerun and the concrete reason for each.

Snakemake's dry run says which jobs run and its reason ("Params have changed", "Updated input
files", "Missing output files"). This adds what it cannot say: which config keys changed, from
what to what. The workflow records its validated config after every successful run
(.snakemake/gptflow/last-config.yaml, written by the Snakefile's onsuccess); the dry run dumps
the config it would use now; the difference is attributed to each job whose stored params
(Snakemake's .snakemake/metadata) contain the key. A preflight adds the run's size: tokens,
parameters, training FLOPs (Megatron's formula), GPU-hours at a stated MFU, and disk needed against free.
What the workflow records and dumps for it is :mod:`gptflow.plan.records`.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gptflow.errors import GptflowError
from gptflow.plan.records import DUMP_ENV, DUMP_PREFLIGHT_ENV, RECORD


@dataclass
class Job:
    rule: str
    outputs: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    wildcards: str = ""
    keys: list[tuple[str, object, object]] = field(default_factory=list)


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values."""
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def config_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key path, old value, new value) for every key that differs (added or removed too)."""
    a, b = flatten(old), flatten(new)
    missing = "(unset)"
    return [
        (k, a.get(k, missing), b.get(k, missing))
        for k in sorted(set(a) | set(b))
        if a.get(k, missing) != b.get(k, missing)
    ]


def parse_dry_run(text: str) -> list[Job]:
    jobs: list[Job] = []
    current: Job | None = None
    for line in text.splitlines():
        m = re.match(r"^(?:local)?(?:rule|checkpoint) (\w+):$", line)
        if m:
            current = Job(m[1])
            jobs.append(current)
            continue
        if current is None or not line.startswith("    "):
            if line and not line.startswith(" "):
                current = None
            continue
        key, _, value = line.strip().partition(": ")
        if key == "output":
            current.outputs = [v.strip() for v in value.split(",") if v.strip()]
        elif key == "reason":
            current.reasons = [r.strip() for r in value.split(";") if r.strip()]
        elif key == "wildcards":
            current.wildcards = value
    return jobs


def recorded_params(workdir: Path, output: str) -> list[object]:
    """The params Snakemake stored for the job that made `output` (literal values only)."""
    root = workdir / ".snakemake" / "metadata"
    for encode in (base64.urlsafe_b64encode, base64.b64encode):
        path = root / encode(output.encode()).decode()
        if path.is_file():
            values = []
            for text in json.loads(path.read_text()).get("params") or []:
                try:
                    values.append(ast.literal_eval(text))
                except (ValueError, SyntaxError):
                    values.append(text)
            return values
    return []


def attribute(job: Job, workdir: Path, changes: list[tuple[str, object, object]]) -> None:
    """The changed config keys whose old value is among the job's stored params."""
    if not job.outputs:
        return
    stored: dict[str, object] = {}
    for value in recorded_params(workdir, job.outputs[0]):
        if isinstance(value, dict):
            stored.update(flatten(value))
    run = re.search(r"\brun=([^,\s]+)", job.wildcards)
    for key, old, new in changes:
        # a job's params hold config sections (e.g. train_gpt: {model, train, data}) whose
        # keys are the config's own paths; a study run's are under runs.<run>.
        own = key.removeprefix(f"runs.{run[1]}.") if run else key
        if own in stored and not (own == key and key.startswith("runs.")):
            job.keys.append((key, old, new))


# --------------------------------------------------------------------------- preflight


def size(cfg: dict, plan: dict, workdir: Path, peak_tflops, mfu) -> dict:
    """The run's size (gptflow.plan.run_size.size) from the plan's own preflight: its parameter
    count with the tokenizer's real vocabulary, and the token shards' bytes; GPU-hours at
    the preflight's assumed peak and MFU unless given."""
    from gptflow.config.settings import TrainConfig
    from gptflow.plan.run_size import ASSUMED_MFU, ASSUMED_PEAK_TFLOPS, model_config, size

    peak_tflops, mfu = peak_tflops or ASSUMED_PEAK_TFLOPS, mfu or ASSUMED_MFU

    found = plan.get("size") or {}
    model = model_config(cfg, found.get("vocab") or 0) if found.get("vocab") else None
    if model is None:
        return {}
    out = size(model, TrainConfig(**cfg["train"]), found.get("shard_bytes", 0),
               shutil.disk_usage(workdir).free, peak_tflops, mfu)  # fmt: skip
    out["vocab_source"] = found.get("vocab_source")
    out["inputs_not_on_disk"] = found.get("inputs_not_on_disk", 0)
    return out


# --------------------------------------------------------------------------- the command


def why(
    snakemake_args: list[str],
    *,
    workdir: str | os.PathLike = ".",
    peak_tflops: float | None = None,
    mfu: float | None = None,
    out=sys.stdout,
) -> dict:
    workdir = Path(workdir)
    snakemake = Path(sys.executable).parent / "snakemake"
    exe = str(snakemake) if snakemake.exists() else "snakemake"
    with tempfile.TemporaryDirectory(prefix="gptflow-why-") as tmp:
        dump, plan_file = Path(tmp) / "config.yaml", Path(tmp) / "preflight.json"
        proc = subprocess.run(
            [exe, "-n", "--directory", str(workdir), *snakemake_args],
            capture_output=True, text=True,
            env={**os.environ, DUMP_ENV: str(dump), DUMP_PREFLIGHT_ENV: str(plan_file)},
        )  # fmt: skip
        if proc.returncode != 0:
            raise GptflowError(
                f"snakemake -n {' '.join(snakemake_args)} failed (exit {proc.returncode}); "
                f"Snakemake said:\n{planning_error(proc.stdout + proc.stderr)}"
            )
        current = yaml.safe_load(dump.read_text()) if dump.is_file() else {}
        plan = json.loads(plan_file.read_text()) if plan_file.is_file() else {}
    record = workdir / RECORD
    recorded = yaml.safe_load(record.read_text()) if record.is_file() else None
    changes = config_changes(recorded["config"], current) if recorded else []
    jobs = [j for j in parse_dry_run(proc.stdout + proc.stderr) if j.outputs or j.reasons]
    for job in jobs:
        attribute(job, workdir, changes)
    real = [j for j in jobs if j.outputs]  # target rules (all, train) have no outputs
    p = out.write
    if not real:
        p("Nothing will rerun: every output is up to date.\n")
    else:
        p(f"{len(real)} job(s) will run:\n")
        for job in real:
            where = f" [{job.wildcards}]" if job.wildcards else ""
            p(f"  {job.rule}{where} -> {job.outputs[0]}\n")
            for reason in job.reasons:
                if reason.startswith("Params have changed"):  # its dicts follow: keys below
                    reason = "Params have changed since last execution"
                p(f"      because: {reason}\n")
            for key, old, new in job.keys:
                p(f"      config {key}: {old!r} -> {new!r}\n")
    if recorded is None:
        p(f"No config recorded yet ({record}): the first successful run records it.\n")
    elif changes:
        p(f"Config changes since the last successful run ({recorded['time']}):\n")
        for key, old, new in changes:
            p(f"  {key}: {old!r} -> {new!r}\n")
    else:
        p(f"Config unchanged since the last successful run ({recorded['time']}).\n")
    for line in plan.get("lines", []):
        p(f"{line.removeprefix('gptflow ')}\n")
    # a study: the preflight lines hold every run's size and the total (not the base config's)
    study = bool(current.get("study")) if current else True
    pre = size(current, plan, workdir, peak_tflops, mfu) if not study else {}
    p("".join(size_lines(pre)))
    return {
        "jobs": [
            {"rule": j.rule, "outputs": j.outputs, "reasons": j.reasons, "keys": j.keys}
            for j in real
        ],
        "changes": changes,
        "preflight": {**plan, "size": pre},
    }


def size_lines(pre: dict) -> list[str]:
    """The run's size (:func:`size`) as `why` prints it, with a warning when the disk is short;
    nothing without one."""
    if not pre:
        return []
    shards = f"shards about {pre['shard_bytes'] / 1e9:.3g} GB"
    if pre["inputs_not_on_disk"]:
        shards += f" (+ {pre['inputs_not_on_disk']} input(s) not on disk yet)"
    lines = [
        f"Size: {pre['parameters']:,} parameters, {pre['training_tokens']:,} training "
        f"tokens, {pre['training_flops']:.3g} FLOPs = {pre['gpu_hours']:.3g} "
        f"GPU-hours at {pre['mfu']:.0%} MFU of {pre['peak_tflops']:g} TFLOP/s; disk: "
        f"checkpoints about {pre['checkpoint_bytes'] / 1e9:.3g} GB, {shards}, "
        f"{pre['free_bytes'] / 1e9:.1f} GB free here\n"
    ]
    if pre["checkpoint_bytes"] + pre["shard_bytes"] > pre["free_bytes"]:
        lines.append("  WARNING: not enough free disk for the checkpoints and shards\n")
    return lines


def planning_error(output: str, lines: int = 40) -> str:
    """The error part of a failed `snakemake -n`: from its first error line on (Snakemake
    prints its plan and warnings before), else the last lines."""
    text = output.strip().splitlines()
    start = next(
        (i for i, line in enumerate(text) if re.search(r"Error|error:|Exception", line)), None
    )
    picked = text[start : start + lines] if start is not None else text[-lines:]
    return "\n".join(picked)
