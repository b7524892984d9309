"""Where a run is and what it has made, from its files alone: ``gptflow status`` and
``gptflow summary``.

No daemon is asked. The stage is which of the run's files exist; the progress is the last
records of ``metrics.jsonl``, read while the trainer appends to it; whether a trainer is
alive is its lock file, read and never taken (:class:`gptflow.train.checkpoint.RunLock`). Slurm's
queue is asked only when ``squeue`` is on PATH (:func:`slurm_jobs`), and only to add the
run's queued and running jobs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from gptflow import paths
from gptflow.errors import GptflowError
from gptflow.progress import human_bytes
from gptflow.results.report import summary_line
from gptflow.train.checkpoint import RunLock, tag_for

RUNS_DIR = str(Path(paths.RUN_DIR).parent)  # results/runs

# How far a run has come, in the order the workflow gets there. "indexing": run.yaml is
# rendered (every shard is tokenized), the data indices are not built yet.
STAGES = (
    "tokenizing", "indexing", "indices built", "training", "trained", "evaluated", "exported",
    "report made",
)  # fmt: skip


@dataclass(frozen=True)
class RunFiles:
    """The files of a run directory (``results/runs/{run}/``) that tell its stage: the
    patterns of :mod:`gptflow.paths`, put in `dir`."""

    dir: Path

    @property
    def run(self) -> str:
        return self.dir.name

    def _in_dir(self, pattern: str) -> Path:
        return paths.in_run_dir(pattern, self.dir)

    @property
    def run_yaml(self) -> Path:
        return self._in_dir(paths.RUN_YAML)

    @property
    def workdir(self) -> Path:
        """The workflow's directory: the one holding ``results/runs/{run}``."""
        return self.dir.parents[len(Path(paths.RUN_DIR).parts) - 1]

    @property
    def data_index(self) -> Path:
        """The data index summary run.yaml names (gptflow.paths.DATA_INDEX, shared by the
        runs that read the same samples); the run's own before indices were shared."""
        try:
            named = yaml.safe_load(self.run_yaml.read_text()).get("data_index")
        except (OSError, yaml.YAMLError, AttributeError):
            named = None
        return self.workdir / named if named else self._in_dir(paths.RUN_DATA_INDEX)

    @property
    def checkpoints(self) -> Path:
        return self._in_dir(paths.CHECKPOINTS)

    @property
    def metrics(self) -> Path:
        return self._in_dir(paths.METRICS)

    @property
    def train_log(self) -> Path:
        return self._in_dir(paths.TRAIN_LOG)

    @property
    def lock(self) -> Path:
        return self._in_dir(paths.TRAIN_LOCK)

    @property
    def done(self) -> Path:
        return self._in_dir(paths.DONE)

    @property
    def eval(self) -> Path:
        return self._in_dir(paths.EVAL)

    @property
    def hf(self) -> Path:
        return self._in_dir(paths.HF_EXPORT)

    @property
    def report_card(self) -> Path:
        return self._in_dir(paths.REPORT_CARD)

    @property
    def harness(self) -> Path:
        return self._in_dir(paths.HARNESS)

    @property
    def harness_page(self) -> Path:
        return self._in_dir(paths.HARNESS_PAGE)

    def harness_steps(self) -> list[Path]:
        """The harness records of intermediate checkpoints (eval.harness.every)."""
        step = self._in_dir(paths.HARNESS_STEP)
        return sorted(step.parent.glob(step.name.format(step="*")))

    def job_log(self, rule: str) -> Path:
        """The Snakemake job log of `rule` for this run (gptflow.paths.log) in the workflow's
        directory: the one holding ``results/runs/{run}``."""
        return self.workdir / paths.log(rule, self.run)


def stage(files: RunFiles, trainer_alive: bool = False) -> str:
    """The run's stage (one of :data:`STAGES`): the furthest one whose file exists. A file
    after training counts only when it is not older than DONE.json: a rerun of training
    leaves the evaluation, export and report of the run before it until their jobs rerun."""
    if trainer_alive:
        return "training"
    if files.done.is_file():
        trained = files.done.stat().st_mtime
        for name, path in (
            ("report made", files.report_card),
            ("exported", files.hf),
            ("evaluated", files.eval),
        ):
            if path.exists() and path.stat().st_mtime >= trained:
                return name
        return "trained"
    if files.metrics.is_file() or files.checkpoints.is_dir():
        return "training"
    if files.data_index.is_file():
        return "indices built"
    return "indexing" if files.run_yaml.is_file() else "tokenizing"


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, also while the trainer appends to it: a last line
    without its newline yet is left out unless it is a whole record. A damaged line before
    it is an error naming the line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    *lines, tail = data.split(b"\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            raise GptflowError(
                f"{path}:{number}: not a JSON record ({line[:60]!r}); delete that line (the "
                f"trainer writes whole lines only; it was damaged outside gptflow)"
            ) from None
    with contextlib.suppress(ValueError):  # empty, or a record the trainer is writing
        records.append(json.loads(tail))
    return records


def seconds_per_step(trains: list[dict], window: int = 20) -> float | None:
    """Wall-clock seconds per step from the train records' times and steps: the median over
    the last `window` intervals between consecutive records. Evaluations and saves are in
    it, as they are in the time left; the interval across a restart (the queue wait, the
    steps the stopped attempt did after its last checkpoint) is one of many, which the
    median leaves out. None before two records."""
    recent = trains[-window - 1 :]
    rates = [
        (b["time"] - a["time"]) / (b["step"] - a["step"])
        for a, b in itertools.pairwise(recent)
        if b["step"] > a["step"] and b["time"] > a["time"]
    ]
    return statistics.median(rates) if rates else None


def eta_seconds(trains: list[dict], total: int, now: float) -> float | None:
    """Seconds from `now` until step `total`: the steps left after the last record at
    :func:`seconds_per_step`, less the time since that record (0 when overdue)."""
    per_step = seconds_per_step(trains)
    if per_step is None:
        return None
    last = trains[-1]
    return max(0.0, last["time"] + per_step * (total - last["step"]) - now)


def live_trainer(files: RunFiles) -> dict | None:
    """The trainer that holds the run's lock, if it is alive (host, pid, Slurm job, seconds
    since its heartbeat); None without a lock or when its holder is gone
    (:meth:`RunLock.stale_reason`: the process, the Slurm job, or the heartbeat). The lock
    is read, never taken."""
    lock = RunLock(files.lock)
    info = lock.holder()
    if info is None:
        return None
    try:
        if lock.stale_reason(info) is not None:
            return None
        heartbeat = time.time() - files.lock.stat().st_mtime
    except FileNotFoundError:  # released meanwhile
        return None
    return {
        "host": info.get("host"),
        "pid": info.get("pid"),
        "slurm_job_id": info.get("slurm_job_id"),
        "heartbeat_s": round(heartbeat, 1),
    }


def train_iters(files: RunFiles) -> int | None:
    """The run's total steps (run.yaml's train.train_iters); None before run.yaml exists."""
    return run_yaml_facts(files)[0]


def run_yaml_facts(files: RunFiles) -> tuple[int | None, str | None]:
    """(total steps, study) from run.yaml: train.train_iters and the study the run is part of
    (None for a run of its own); (None, None) before run.yaml exists."""
    try:
        text = files.run_yaml.read_text()
    except FileNotFoundError:
        return None, None
    try:
        data = yaml.safe_load(text)
        return int(data["train"]["train_iters"]), data.get("study") or None
    except (yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError):
        raise GptflowError(
            f"{files.run_yaml}: no train.train_iters; not a gptflow run config. Re-render it "
            f"(delete it and rerun the workflow: rule render_run_config)"
        ) from None


def run_status(run_dir: str | Path, now: float | None = None, jobs: list | None = None) -> dict:
    """Everything `gptflow status` says about one run, as plain data (the CLI prints it;
    ``--json`` dumps it): stage, state (running / stopped / finished / not started), step
    of total, last loss and validation loss, tokens/s, MFU (None on a CPU), seconds left or
    since the last record, the live trainer and the run's Slurm jobs (None: not asked)."""
    files = RunFiles(Path(run_dir))
    now = time.time() if now is None else now
    records = read_records(files.metrics)
    trains = [r for r in records if r.get("kind") == "train" and "time" in r]
    evals = [r for r in records if r.get("kind") == "eval"]
    trainer = live_trainer(files)
    total, study = run_yaml_facts(files)
    last = trains[-1] if trains else None
    step = last["step"] if last else 0
    if files.done.is_file():  # also when metrics.jsonl is gone
        step = max(step, json.loads(files.done.read_text()).get("final_step", 0))
    if trainer is not None:
        state = "running"
    elif files.done.is_file():
        state = "finished"
    elif trains or files.checkpoints.is_dir():
        state = "stopped"
    else:
        state = "not started"
    since = now - last["time"] if last else None
    return {
        "run": files.run,
        "study": study,
        "dir": str(files.dir),
        "exists": files.dir.is_dir(),
        "stage": stage(files, trainer is not None),
        "state": state,
        "step": step,
        "total": total,
        "loss": last["loss"] if last else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_step": evals[-1]["step"] if evals else None,
        "tokens_per_s": last["tokens_per_s"] if last else None,
        "mfu": last["mfu"] if last else None,
        "seconds_per_step": seconds_per_step(trains),
        "eta_s": eta_seconds(trains, total, now) if state == "running" and total else None,
        "last_record_s": round(since, 1) if since is not None else None,
        "trainer": trainer,
        "slurm_jobs": jobs,
    }


def run_dirs(runs_dir: str | Path = RUNS_DIR, runs: list[str] | None = None) -> list[Path]:
    """The run directories to report: `runs` (names under `runs_dir`, or paths), else every
    directory under `runs_dir`."""
    root = Path(runs_dir)
    if runs:
        return [Path(r) if "/" in r else root / r for r in runs]
    found = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not found:
        raise GptflowError(
            f"no runs under {root}/; start one (`make run`, or snakemake with your profile) "
            f"or pass --runs-dir DIR"
        )
    return found


# ----------------------------------------------------------------------------- Slurm (optional)

SQUEUE = ["squeue", "--me", "--noheader", "--format=%i|%T|%M|%k"]
NO_SQUEUE = "squeue is not on PATH"  # not a Slurm machine: nothing to say
# the Slurm executor plugin's job comment: rule_<rule>_wildcards_<values joined by _>
COMMENT = re.compile(r"rule_(?P<rule>.+?)_wildcards_(?P<wildcards>.+)")


def slurm_jobs(runs: list[str]) -> tuple[dict[str, list[dict]], str | None]:
    """Your queued and running Slurm jobs of each run ({run: [{job_id, state, elapsed,
    rule}]}), from the comment the Slurm executor plugin gives every job; and why the queue
    was not read (None when it was): ``squeue`` not on PATH, or failing. A rule of a run has
    the run as its only wildcard, so the comment ends with ``_wildcards_<run>``."""
    if shutil.which(SQUEUE[0]) is None:
        return {}, NO_SQUEUE
    try:
        out = subprocess.run(SQUEUE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {}, f"squeue failed: {e}"
    if out.returncode != 0:
        reason = (out.stderr or out.stdout).strip().splitlines()
        return {}, f"squeue failed (exit {out.returncode}): {reason[0] if reason else ''}"
    wanted = set(runs)
    found: dict[str, list[dict]] = {run: [] for run in runs}
    for line in out.stdout.splitlines():
        fields = line.strip().split("|", 3)
        if len(fields) != 4:
            continue
        job_id, state, elapsed, comment = fields
        m = COMMENT.fullmatch(comment.strip())
        if m and m["wildcards"] in wanted:
            found[m["wildcards"]].append(
                {"job_id": job_id, "state": state, "elapsed": elapsed, "rule": m["rule"]}
            )
    return found, None


def statuses(
    runs_dir: str | Path = RUNS_DIR, runs: list[str] | None = None, now: float | None = None
) -> dict:
    """``gptflow status``: {"runs": [run_status ...], "slurm": why the queue was not read,
    or None}."""
    dirs = run_dirs(runs_dir, runs)
    jobs, slurm = slurm_jobs([d.name for d in dirs])
    now = time.time() if now is None else now
    return {
        "runs": [run_status(d, now, None if slurm else jobs.get(d.name, [])) for d in dirs],
        "slurm": slurm,
    }


# ----------------------------------------------------------------------------- outputs


def by_study(items: list[dict]) -> list[tuple[str | None, list[dict]]]:
    """`items` (each with a "study": its name or None) grouped: every study's in the order
    they come, then the runs of no study (None) last."""
    groups: dict[str | None, list[dict]] = {}
    for item in items:
        groups.setdefault(item.get("study"), []).append(item)
    return sorted(groups.items(), key=lambda g: g[0] is None)


def finished_runs(results: str | Path = "results") -> list[Path]:
    """The run directories under `results`/runs/ with a DONE.json, by name."""
    done = sorted(Path(results).glob("runs/*/DONE.json"))
    if not done:
        raise GptflowError(f"no finished runs under {results}/runs/ (no DONE.json); run `make run`")
    return [p.parent for p in done]


def outputs(run_dir: str | Path) -> dict:
    """Every output of a finished run, in the order the workflow makes them: {"run", "done"
    (DONE.json), "outputs": [{"what", "path", "present", "detail", "absent", "made_by"}]}.
    `detail` says what a present output holds (the checkpoint's step, the test perplexity),
    `absent` how an absent one is missing (not made yet, or gone), `made_by` what makes it."""
    files = RunFiles(Path(run_dir))
    done = json.loads(files.done.read_text())
    step = done["final_step"]
    # the checkpoint under this run directory (DONE.json's path is relative to the
    # directory training ran in)
    ckpt = files.checkpoints / done["series"] / tag_for(step)
    sha = done.get("checkpoint_sha256") or ""
    records = read_records(files.metrics)
    trains = sum(r.get("kind") == "train" for r in records)
    evals = sum(r.get("kind") == "eval" for r in records)
    hf_files = [p for p in files.hf.iterdir() if p.is_file()] if files.hf.is_dir() else []
    hf_bytes = sum(p.stat().st_size for p in hf_files)
    items = [
        ("run config", files.run_yaml, "", "missing", "rule render_run_config"),
        ("checkpoint", ckpt, f"step {step}, sha256 {sha[:16]}", "missing (pruned or moved?)",
         "rule train_gpt"),
        ("metrics", files.metrics, f"{trains} train records, {evals} evaluations", "missing",
         "the trainer"),
        ("train log", files.train_log, "every attempt", "missing", "the trainer"),
        ("job log", files.job_log("train_gpt"), "the last attempt", "missing",
         "Snakemake's rule train_gpt"),
        ("evaluation", files.eval, perplexity_line(files.eval), "not made yet",
         "rule evaluate; snakemake target all"),
        ("HF export", files.hf, f"{len(hf_files)} files, {human_bytes(hf_bytes)}",
         "not made yet", "rule export_hf; snakemake target export or all"),
        ("report card", files.report_card, "", "not made yet",
         "rule report_assets; snakemake target all"),
    ]  # fmt: skip
    if files.harness.exists() or files.harness_steps():  # the run has used eval.harness
        steps = len(files.harness_steps())
        items += [
            ("harness", files.harness, harness_line(files.harness), "not made yet",
             "rule harness; snakemake target all"),
            ("harness page", files.harness_page, f"{steps} checkpoint(s) before the export",
             "not made yet", "rule harness_report; snakemake target all"),
        ]  # fmt: skip
    _, study = run_yaml_facts(files) if files.run_yaml.is_file() else (None, None)
    return {
        "run": files.run,
        "study": study,
        "done": done,
        "outputs": [
            {
                "what": what,
                "path": str(path),
                "present": path.exists(),
                "detail": detail if path.exists() else None,
                "absent": None if path.exists() else absent,
                "made_by": made_by,
            }
            for what, path, detail, absent, made_by in items
        ],
    }


def harness_line(harness_json: Path) -> str:
    """harness.json's tasks in one line (gptflow.results.report.summary_line), or ''."""
    try:
        return summary_line(json.loads(harness_json.read_text()))
    except FileNotFoundError:
        return ""


def perplexity_line(eval_json: Path) -> str:
    """``test perplexity 123.4 (stdlib)`` per dataset with a test split, from eval.json;
    else its note (e.g. an empty test split)."""
    try:
        tests = json.loads(eval_json.read_text()).get("test", {})
    except FileNotFoundError:
        return ""
    shown = [f"{r['perplexity']:.4g} ({name})" for name, r in tests.items() if "perplexity" in r]
    if shown:
        return "test perplexity " + ", ".join(shown)
    notes = [r["note"] for r in tests.values() if "note" in r]
    return f"no test perplexity: {notes[0]}" if notes else "no test perplexity"
