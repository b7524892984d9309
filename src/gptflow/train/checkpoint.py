"""Checkpoints that survive anything, and a lock so that one run has one live trainer.

Layout of a run directory::

    results/runs/{run}/
      train.lock                   held by the live trainer (host, pid, Slurm job, heartbeat)
      checkpoints/{series}/        one series per trajectory fingerprint (RunConfig.series)
        fingerprint.json           what the series is (checked on every resume)
        step00000100/              DeepSpeed's files for one step, + COMPLETE written last
          universal/               the step in DeepSpeed's universal format, made when a run
                                   resumes in another layout (ranks or ZeRO stage changed)
        latest                     name of the newest complete step, replaced atomically

DeepSpeed writes its own ``latest`` with a plain ``open().write()`` before the other ranks
have finished: we save with ``save_latest=False``, wait for every rank, mark the step
``COMPLETE`` and only then point ``latest`` at it (temp file, fsync, rename). Resume trusts
nothing else: a step directory without ``COMPLETE`` is an interrupted save and is ignored.

Over 500 lines: the series (save, resume, retention, universal checkpoints across layouts)
and the run lock a resume takes before it reads the series; the two are tested together
(requeues, kills, stale locks).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write, fsync_dir, publish, sha256_file, temp_dir, write_json

TAG_RE = re.compile(r"^step(\d{8})$")
COMPLETE = "COMPLETE"
UNIVERSAL = "universal"
UNIVERSAL_WAIT_S = 4 * 3600  # the other ranks' wait for rank 0's conversion of a checkpoint


log = logging.getLogger("gptflow.train")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


class CheckpointSeries:
    """Checkpoints of one trajectory fingerprint inside a run directory."""

    def __init__(
        self,
        directory: str | os.PathLike,
        fingerprint: dict,
        keep_last: int,
        kept_for_good: Callable[[int], bool] = lambda step: False,
    ) -> None:
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.keep_last = keep_last
        self.kept_for_good = kept_for_good  # TrainConfig.kept_for_good: train.keep_every

    # -- reading -------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        steps = []
        for p in self.dir.iterdir():
            m = TAG_RE.match(p.name)
            if m and (p / COMPLETE).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """Newest complete step: the ``latest`` pointer if it is sound, else a scan."""
        pointer = self.dir / "latest"
        if pointer.is_file():
            m = TAG_RE.match(pointer.read_text().strip())
            if m and (self.dir / m.group(0) / COMPLETE).is_file():
                return int(m.group(1))
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def check_fingerprint(self) -> None:
        path = self.dir / "fingerprint.json"
        if not path.is_file():
            return
        with open(path) as f:
            saved = json.load(f)
        if saved != self.fingerprint:
            changed = sorted(_diff_keys(saved, self.fingerprint))
            raise GptflowError(
                f"{path}: these checkpoints belong to another configuration (differs in "
                f"{', '.join(changed) or 'unknown keys'}); they were copied or edited by hand. "
                f"Move {self.dir} away or pick a new run name"
            )

    def saved_layout(self, step: int) -> dict | None:
        """The layout (ranks, ZeRO stage, precision) a complete step was saved in."""
        return json.loads((self.dir / tag_for(step) / COMPLETE).read_text()).get("layout")

    def universal_tag(self, step: int, rank: int, convert, num_layers: int) -> str:
        """The tag of `step` in DeepSpeed's universal format, converted once and kept with the
        step (``stepN/universal``). Rank 0 converts, into a temporary directory renamed when
        done; the other ranks wait for that directory on the file system, not in a collective,
        so a long conversion cannot trip NCCL's watchdog."""
        step_dir = self.dir / tag_for(step)
        out = step_dir / UNIVERSAL
        if rank == 0:
            universal_dir(step_dir, convert, num_layers)
        deadline = time.monotonic() + UNIVERSAL_WAIT_S
        while not out.is_dir():
            if time.monotonic() > deadline:
                raise GptflowError(
                    f"{out}: rank 0 did not finish converting {step_dir} within "
                    f"{UNIVERSAL_WAIT_S // 3600} h; see rank 0's log"
                )
            time.sleep(1.0)
        return f"{tag_for(step)}/{UNIVERSAL}"

    # -- writing (call on every rank; rank 0 does the bookkeeping) ------------------
    def prepare(self, step: int, rank: int, barrier) -> Path:
        """Rank 0 makes the series directory and clears the debris of an interrupted save of
        `step`; every rank then meets it at a barrier. Returns the step's directory."""
        path = self.dir / tag_for(step)
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not (self.dir / "fingerprint.json").is_file():
                write_json(self.dir / "fingerprint.json", self.fingerprint)
            if path.exists() and not (path / COMPLETE).is_file():
                shutil.rmtree(path)  # debris of an interrupted save of the same step
        barrier()
        return path

    def save(
        self, engine, step: int, client_state: dict, rank: int, barrier, layout: dict | None = None
    ) -> Path:
        """Save `step` on every rank, synchronously; returns its directory.

        Nothing slow runs on one rank while the others wait in a collective (a multi-GB
        checkpoint would outlast NCCL's watchdog): each rank fsyncs the files it wrote itself,
        rank 0's bookkeeping between the barriers is two small files, and pruning older steps
        runs in a background thread after the last barrier (:meth:`finish_pruning`).
        `layout` (ranks, ZeRO stage, precision) goes into COMPLETE, so that a resume can check
        it before DeepSpeed reads a shard.
        """
        path = self.prepare(step, rank, barrier)
        for f in _saved_files(engine, str(self.dir), tag_for(step), client_state):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        barrier()  # every rank's shards are on disk
        if rank == 0:
            self.mark_complete(step, layout)
        barrier()
        if rank == 0:
            self.start_pruning(step)
        return path

    def mark_complete(self, step: int, layout: dict | None) -> None:
        """Rank 0, once every rank's files of `step` are on disk: COMPLETE, then ``latest``."""
        path = self.dir / tag_for(step)
        write_json(path / COMPLETE, {"step": step, "layout": layout})
        fsync_dir(path)
        with atomic_write(self.dir / "latest") as f:
            f.write(tag_for(step))

    def start_pruning(self, step: int) -> None:
        """Rank 0: prune older steps in a background thread (after `step` is complete)."""
        self.finish_pruning()
        self._pruner = threading.Thread(
            target=self.prune, args=(step,), daemon=True, name="checkpoint-prune"
        )
        self._pruner.start()

    _pruner: threading.Thread | None = None

    def finish_pruning(self) -> None:
        """Wait for the background pruning of the last save (before exiting, or saving again)."""
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def prune(self, keep: int) -> None:
        """Delete all but the newest `keep_last` complete steps and those kept for good
        (train.keep_every), and incomplete debris."""
        steps = self.complete_steps()
        doomed = [s for s in steps[: -self.keep_last] if s != keep and not self.kept_for_good(s)]
        for p in self.dir.iterdir():
            m = TAG_RE.match(p.name)
            if m and int(m.group(1)) < keep and not (p / COMPLETE).is_file():
                doomed.append(int(m.group(1)))
            elif p.name.startswith(".deleting-"):  # a pruning cut short by the job's end
                shutil.rmtree(p, ignore_errors=True)
        for s in doomed:
            # renamed first, so that no half-deleted step ever looks like a checkpoint
            trash = self.dir / f".deleting-{tag_for(s)}"
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.dir / tag_for(s), trash)
            shutil.rmtree(trash, ignore_errors=True)


def universal_dir(step_dir: Path, convert, num_layers: int) -> Path:
    """``stepN/universal``: the step in DeepSpeed's universal format (one file per parameter
    and optimizer state, tensor-parallel slices and pipeline stages merged), converted by
    `convert` the first time into a temporary directory renamed when done, its parameters
    named both ways (:func:`name_both_ways`). One process at a time (rank 0, the export)."""
    out = step_dir / UNIVERSAL
    if not out.is_dir():
        tmp = temp_dir(out)  # and a conversion cut short by a kill is cleared
        started = time.monotonic()
        # converted one level down: ds_to_universal writes its pointer `latest_universal`
        # beside its output folder, naming that folder (a temporary name: host, pid, random);
        # written into the step, it would make identical steps differ (checkpoint_digest)
        (tmp / UNIVERSAL).mkdir()
        convert(step_dir, tmp / UNIVERSAL)
        name_both_ways(tmp / UNIVERSAL / "zero", num_layers)
        publish(tmp / UNIVERSAL, out)
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("converted %s to DeepSpeed's universal format in %.1f s", step_dir,
                 time.monotonic() - started)  # fmt: skip
    return out


def name_both_ways(zero: Path, num_layers: int) -> None:
    """Each parameter's directory of a universal checkpoint under the model's name, with a
    relative symlink under the pipeline's (``3.layer.attention...``): DeepSpeed loads a
    universal checkpoint by the engine's parameter names, which differ between a plain model
    and a pipeline of any number of stages (gptflow.train.model.hf_name)."""
    from gptflow.train.model import hf_name, pipeline_name

    for entry in list(zero.iterdir()):
        if not entry.is_dir() or entry.is_symlink():
            continue
        if entry.name[0].isdigit():  # saved by a pipeline
            model_name = hf_name(entry.name, num_layers)
            entry.rename(zero / model_name)
            (zero / entry.name).symlink_to(model_name)
        else:
            (zero / pipeline_name(entry.name, num_layers)).symlink_to(entry.name)


def _through_engine(engine, save_dir: str, tag: str, client_state: dict, save_file) -> None:
    """``engine.save_checkpoint`` with every file DeepSpeed writes handed to
    ``save_file(state_dict, path)`` (DeepSpeed writes each through its checkpoint engine's
    ``save``: model, ZeRO partitions, pipeline layers)."""
    writer = engine.checkpoint_engine
    writer.save = lambda state_dict, path, *a, **kw: save_file(state_dict, str(path))
    try:
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    finally:
        del writer.save  # the class's method again


def _saved_files(engine, save_dir: str, tag: str, client_state: dict) -> list[str]:
    """``engine.save_checkpoint``, returning the paths this rank wrote."""
    from gptflow.train.async_save import free_space

    written: list[str] = []
    plain_save = engine.checkpoint_engine.save  # before _through_engine replaces it

    def save_and_record(state_dict, path):
        try:
            plain_save(state_dict, path)
        except (OSError, RuntimeError) as e:  # torch.save's zip writer raises RuntimeError
            raise GptflowError(
                f"{path}: writing this checkpoint file failed: {e}"
                f"{free_space(Path(path).parent)}; its step is not complete, a resume reads "
                f"the one before. Training stopped: fix the cause (free space, permissions) "
                f"and run again"
            ) from e
        written.append(path)

    _through_engine(engine, save_dir, tag, client_state, save_and_record)
    return written


def _snapshots(engine, save_dir: str, tag: str, client_state: dict, pool) -> list:
    """``engine.save_checkpoint`` with each file DeepSpeed would write taken as a snapshot
    (:func:`gptflow.train.async_save.take`) instead; returns them, to be written in the
    background."""
    from gptflow.train.async_save import take

    taken: list = []
    _through_engine(engine, save_dir, tag, client_state,
                    lambda state_dict, path: taken.append(take(state_dict, path, pool)))  # fmt: skip
    return taken


def _diff_keys(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


# What a step directory may hold besides the files its save wrote: derived from them later,
# not the run's state. The universal conversion (made by a resume in another layout, or by
# the export of a tensor- or pipeline-parallel run) and DeepSpeed's pointer to a conversion,
# whose content is the conversion's temporary directory name (host, pid, random suffix).
DERIVED = frozenset({UNIVERSAL, "latest_universal"})


def checkpoint_digest(path: str | os.PathLike) -> str:
    """sha256 of a saved step, for DONE.json: each file its save wrote (every rank's DeepSpeed
    files and COMPLETE), by relative name and sha256, in sorted order. Not hashed: what is
    derived later inside the step (:data:`DERIVED`) and temporary files (names starting
    with "."). So identical runs record the same digest, and it still holds after the export
    or a resume in another layout has added ``universal/``.

    The files themselves are byte-identical for identical states (measured, ZeRO 0-3, one
    and two ranks, fp32 and bf16, straight and resumed): torch.save dates its zip entries
    1980-00-00 and numbers storages in order, and no path, time or pid is pickled. A layout
    (ranks, ZeRO stage) is part of a checkpoint as saved: the same trajectory saved in
    another layout has other files and another digest."""
    import hashlib

    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root)
        if rel.parts[0] in DERIVED or any(part.startswith(".") for part in rel.parts):
            continue
        h.update(rel.as_posix().encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_start(pid: int) -> str | None:
    """Kernel start time of a process (guards against a recycled pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _restart_count() -> int:
    """How often Slurm has requeued this job (0 outside Slurm or on its first run).

    SLURM_RESTART_COUNT when the environment has it; Snakemake's Slurm jobstep drops it from
    the batch step (and so from the srun tasks), so otherwise Slurm is asked (`scontrol show
    job`: Restarts=N)."""
    if os.environ.get("SLURM_RESTART_COUNT", "").isdigit():
        return int(os.environ["SLURM_RESTART_COUNT"])
    job = os.environ.get("SLURM_JOB_ID")
    return _slurm_restarts(job) if job else 0


@functools.cache
def _slurm_restarts(job: str) -> int:
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    m = re.search(r"\bRestarts=(\d+)", out)
    return int(m.group(1)) if m else 0


def _slurm_job_running(job_id: str) -> bool | None:
    """True/False from squeue, or None when Slurm cannot be asked."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    return out.stdout.strip() in {"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "CONFIGURING"}


# How long a new trainer waits for a live one of the same run (`gptflow train --wait-for-lock`):
# well below a training job's time limit, so a job never spends its allocation waiting.
LOCK_WAIT_S = 30 * 60


class RunLock:
    """An exclusive, self-describing lock file for the live trainer of a run.

    Created with O_EXCL; it records host, pid, process start time and Slurm job id, and a
    background thread refreshes its mtime every `heartbeat_s`. A lock is stale -- and is taken
    over with a log line -- when its process is gone (same host), its Slurm job is no longer
    running, or its heartbeat is older than `stale_s` (other host, no Slurm).
    """

    def __init__(self, path: str | os.PathLike, heartbeat_s: float = 30.0, stale_s: float = 300.0):
        self.path = Path(path)
        self.heartbeat_s = heartbeat_s
        self.stale_s = stale_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: dict | None = None

    def _record(self) -> dict:
        pid = os.getpid()
        return {
            "host": socket.gethostname(),
            "pid": pid,
            "proc_start": _proc_start(pid),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": _restart_count(),
            "started": time.time(),
        }

    def holder(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:
            return {}

    def stale_reason(self, info: dict) -> str | None:
        """Why the recorded holder is dead, or None if it may be alive."""
        if not info:
            age = time.time() - self.path.stat().st_mtime
            return "unreadable lock file" if age > 10 else None
        job = info.get("slurm_job_id")
        # A requeued job keeps its id: squeue shows it running -- as this very process. Its
        # earlier run (a lower restart count) is what wrote the lock, and is over.
        earlier = info.get("slurm_restart_count") or 0
        if job and str(job) == os.environ.get("SLURM_JOB_ID") and earlier < _restart_count():
            return (
                f"Slurm job {job} was requeued (restart {_restart_count()}); the lock is its "
                f"run {earlier}'s"
            )
        if info.get("host") == socket.gethostname() and info.get("pid"):
            pid = int(info["pid"])
            if not _pid_alive(pid):
                return f"process {pid} on {info['host']} is gone"
            if info.get("proc_start") and _proc_start(pid) != info["proc_start"]:
                return f"pid {pid} was reused by another process"
            return None
        if job:
            running = _slurm_job_running(str(job))
            if running is False:
                return f"Slurm job {info['slurm_job_id']} is no longer running"
            if running is True:
                return None
        age = time.time() - self.path.stat().st_mtime
        if age > self.stale_s:
            return f"no heartbeat for {age:.0f} s"
        return None

    def wait_while_held(self, timeout_s: float, poll_s: float = 5.0) -> None:
        """Block (read-only) while a live trainer holds the lock, at most `timeout_s`.

        For a retried or resubmitted job whose predecessor still runs, e.g. after the
        Snakemake process was killed and started again while its Slurm job went on: the new
        job waits for the old one instead of failing, and then resumes from its checkpoint.
        """
        deadline = time.monotonic() + timeout_s
        announced = False
        while time.monotonic() < deadline:
            info = self.holder()
            if info is None or self.stale_reason(info) is not None:
                return
            if not announced:
                log.warning(
                    "%s: another trainer is running this run (host %s, pid %s, Slurm job %s); "
                    "waiting up to %.0f s for it to finish",
                    self.path,
                    info.get("host"),
                    info.get("pid"),
                    info.get("slurm_job_id") or "-",
                    timeout_s,
                )
                announced = True
            time.sleep(poll_s)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.holder()
                if info is None:
                    continue
                reason = self.stale_reason(info)
                if reason is None:
                    raise GptflowError(
                        f"{self.path}: another trainer is running this run (host "
                        f"{info.get('host')}, pid {info.get('pid')}, Slurm job "
                        f"{info.get('slurm_job_id') or '-'}); wait for it or stop it. If it is "
                        f"certainly dead, delete {self.path}"
                    ) from None
                self.took_over = {**info, "reason": reason}
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
                f.flush()
                os.fsync(f.fileno())
            self._thread = threading.Thread(target=self._beat, daemon=True, name="lock-heartbeat")
            self._thread.start()
            return
        raise GptflowError(f"{self.path}: could not take the run lock (contended); retry")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        info = self.holder()
        if info and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def resume_mode(saved: dict | None, now: dict, path: Path) -> str:
    """How a step saved in layout `saved` loads into layout `now` (gptflow.train.loop.layout_of:
    {world_size, zero_stage, precision, tensor_parallel, pipeline_parallel, optimizer}):
    "native" (DeepSpeed's own files, as saved) or "universal" (converted, for a change of the
    number of ranks, of the tensor- or pipeline-parallel size or of the ZeRO stage among 1-3).
    A change DeepSpeed cannot carry the optimizer state across is an error naming the way on.
    The optimizer is the run's own (a series' fingerprint holds it), read from `now`: a layout
    saved before it was recorded has none."""
    if not saved:
        return "native"  # saved before layouts were recorded: DeepSpeed checks what it can
    was_zero, now_zero = saved.get("zero_stage", 0), now["zero_stage"]
    was_world, now_world = saved.get("world_size"), now["world_size"]
    was_tp, now_tp = saved.get("tensor_parallel", 1), now.get("tensor_parallel", 1)
    where = (
        f"saved at ZeRO stage {was_zero} on {was_world} ranks (tensor parallel {was_tp}), now "
        f"ZeRO stage {now_zero} on {now_world} ranks (tensor parallel {now_tp})"
    )
    was_pp, now_pp = saved.get("pipeline_parallel", 1), now.get("pipeline_parallel", 1)
    same_split = was_tp == now_tp and was_pp == now_pp
    if was_zero == now_zero and same_split and (now_zero == 0 or was_world == now_world):
        return "native"  # ZeRO 0 keeps whole optimizer states: any number of ranks reads them
    if was_zero == 0 or now_zero == 0:
        raise GptflowError(
            f"{path}: {where}: DeepSpeed moves optimizer states between layouts only among ZeRO "
            f"stages 1-3. Set train.zero_stage {was_zero} and train.tensor_parallel {was_tp} to "
            f"continue this run"
            + (" (on any number of ranks)" if was_tp == 1 and was_zero == 0 else "")
        )
    if 3 in (was_zero, now_zero):
        raise GptflowError(
            f"{path}: {where}: DeepSpeed's universal checkpoint does not carry ZeRO-3's "
            f"optimizer state exactly (measured with DeepSpeed 0.19: the losses leave the "
            f"unmoved run's from the second step after the move). Continue at ZeRO stage "
            f"{was_zero} on {was_world} ranks; layouts move freely among ZeRO stages 1 and 2"
        )
    if now["optimizer"] == "muon":
        raise GptflowError(
            f"{path}: {where}: DeepSpeed's universal checkpoint carries Adam's moments, not "
            f"Muon's momentum (ds_to_universal knows fp32, exp_avg and exp_avg_sq), so this "
            f"train.optimizer muon run cannot move layouts. Continue at ZeRO stage {was_zero} "
            f"on {was_world} ranks (tensor parallel {was_tp}, pipeline parallel {was_pp})"
        )
    return "universal"
