"""`gptflow why`: before a run, which stages will rerun and the concrete reason for each.

Snakemake's dry run says which jobs run and its reason ("Params have changed", "Updated input
files", "Missing output files"). This adds what it cannot say: which config keys changed, from
what to what. The workflow records its validated config after every successful run
(.snakemake/gptflow/last-config.yaml, written by the Snakefile's onsuccess); the dry run dumps
the config it would use now; the difference is attributed to each job whose stored params
(Snakemake's .snakemake/metadata) contain the key. A preflight adds the run's size: tokens,
parameters, training FLOPs (Megatron's formula), GPU-hours at a stated MFU, and disk needed against free.
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

RECORD = Path(".snakemake") / "gptflow" / "last-config.yaml"
DUMP_ENV = "GPTFLOW_DUMP_CONFIG"


def dump_config(cfg: dict) -> None:
    """Write `cfg` where the environment variable DUMP_ENV says (set by `why`'s dry run)."""
    from gptflow.fsutil import atomic_write

    path = os.environ.get(DUMP_ENV)
    if path:
        with atomic_write(path) as f:
            yaml.safe_dump(cfg, f, sort_keys=False)


def record_config(cfg: dict, workdir: str | os.PathLike = ".") -> None:
    """After a successful run (the Snakefile's onsuccess): the config `why` compares against.

    Plain dicts and lists are written: Snakemake reads a JSON config file into OrderedDicts,
    which yaml.safe_dump refuses (every run with a JSON --configfile failed here)."""
    import time

    from gptflow.config import plain
    from gptflow.fsutil import atomic_write

    path = Path(workdir) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": plain(cfg)}
        yaml.safe_dump(record, f, sort_keys=False)


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
    for key, old, new in changes:
        # a job's params hold config sections (e.g. train_gpt: {model, train, data}) whose
        # keys are the config's own paths
        if key in stored:
            job.keys.append((key, old, new))


# --------------------------------------------------------------------------- preflight


def preflight(cfg: dict, workdir: Path, peak_tflops: float, mfu: float) -> dict:
    from gptflow.config import ModelConfig, architecture, padded_vocab_size
    from gptflow.data.indexed import dtype_for_vocab

    model = architecture(cfg["model"])
    tok = cfg.get("tokenizer", {})
    vocab = model.get("vocab_size") or (tok.get("train") or {}).get("vocab_size") or 50257
    model["vocab_size"] = padded_vocab_size(vocab, model.get("make_vocab_size_divisible_by", 128))
    # the trainer's and the report's numbers: one home, ModelConfig
    model_cfg = ModelConfig(**model)
    n = model_cfg.num_parameters()
    t = cfg["train"]
    tokens = t["train_iters"] * t["global_batch_size"] * t["seq_length"]
    flops = model_cfg.flops_per_token(t["seq_length"]) * tokens
    gpu_hours = flops / (peak_tflops * 1e12 * mfu) / 3600
    keep = t.get("keep_last", 2)
    # a checkpoint: fp32 weights + Adam moments (+ bf16/fp16 master copy counted as fp32)
    checkpoint_bytes = n * 16 * (keep + 1)
    free = shutil.disk_usage(workdir).free
    # shards hold at least the training tokens, in the dtype tokenization picks for the
    # tokenizer's own (unpadded) vocabulary: 2 bytes below 65,500 ids (Megatron's rule), else 4
    shard_bytes = tokens * dtype_for_vocab(vocab).itemsize
    return {
        "parameters": n,
        "training_tokens": tokens,
        "training_flops": flops,
        "gpu_hours": gpu_hours,
        "peak_tflops": peak_tflops,
        "mfu": mfu,
        "checkpoint_bytes": checkpoint_bytes,
        "shard_bytes": shard_bytes,
        "free_bytes": free,
    }


# --------------------------------------------------------------------------- the command


def why(
    snakemake_args: list[str],
    *,
    workdir: str | os.PathLike = ".",
    peak_tflops: float = 989.0,
    mfu: float = 0.4,
    out=sys.stdout,
) -> dict:
    workdir = Path(workdir)
    snakemake = Path(sys.executable).parent / "snakemake"
    exe = str(snakemake) if snakemake.exists() else "snakemake"
    with tempfile.TemporaryDirectory(prefix="gptflow-why-") as tmp:
        dump = Path(tmp) / "config.yaml"
        proc = subprocess.run(
            [exe, "-n", "--directory", str(workdir), *snakemake_args],
            capture_output=True, text=True, env={**os.environ, DUMP_ENV: str(dump)},
        )  # fmt: skip
        if proc.returncode != 0:
            raise GptflowError(
                f"snakemake -n {' '.join(snakemake_args)} failed:\n{proc.stderr.strip()[-2000:]}"
            )
        current = yaml.safe_load(dump.read_text()) if dump.is_file() else {}
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
    pre = preflight(current, workdir, peak_tflops, mfu) if current else None
    if pre:
        p(
            f"Preflight: {pre['parameters']:,} parameters, {pre['training_tokens']:,} training "
            f"tokens, {pre['training_flops']:.3g} FLOPs = {pre['gpu_hours']:.3g} "
            f"GPU-hours at {pre['mfu']:.0%} MFU of {pre['peak_tflops']:g} TFLOP/s; disk: "
            f"checkpoints about {pre['checkpoint_bytes'] / 1e9:.3g} GB, shards at least "
            f"{pre['shard_bytes'] / 1e9:.3g} GB, {pre['free_bytes'] / 1e9:.1f} GB free here\n"
        )
        if pre["checkpoint_bytes"] + pre["shard_bytes"] > pre["free_bytes"]:
            p("  WARNING: not enough free disk for the checkpoints\n")
    return {
        "jobs": [
            {"rule": j.rule, "outputs": j.outputs, "reasons": j.reasons, "keys": j.keys}
            for j in real
        ],
        "changes": changes,
        "preflight": pre,
    }
