"""``gptflow kubernetes submit``: one train_gpt job's JobSet (or one evaluate, harness or
harness_step job's, of one pod: gptflow.kubernetes.sizing.job_pod_set), created, watched and
mapped to an exit code -- the Kubernetes twin of srun in the Slurm profile's rule.

Through the official ``kubernetes`` Python client (the Kubernetes project's own; in-cluster
ServiceAccount tokens and every kubeconfig auth plugin; its generic CustomObjectsApi for JobSet
and its watch helper; gptflow's own loop does the waiting, the client has no wait helper):

- the manifests of every renderer are written to ``results/runs/RUN/kubernetes/`` first;
- a JobSet of the same (deterministic) name that is still running is refused: one trainer per
  run. One that has finished (a failed earlier attempt) is deleted, then created anew;
- the JobSet is watched through the watch API (resumed from its resourceVersion when the
  stream ends), every pod of every attempt has its log followed into this process's standard
  output (the rule's log), each line prefixed with its node and attempt;
- ``Completed`` with the spec's ``done`` file (the run's DONE.json; the job's output) is exit 0;
  ``Failed`` is exit 1 with the condition's message and the last lines of each failed pod;
  ``Suspended`` (Kueue's preemption, or not yet admitted) is waited out and said; a restart is
  said with whether it counted (exit code 75: not); the JobSet deleted by someone else is
  exit 1 and says so;
- SIGTERM/SIGINT (Snakemake stopped) deletes the JobSet (foreground: its pods get SIGTERM,
  save and exit) before this process exits 128 + the signal: no orphan trains on.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write
from gptflow.kubernetes import manifests
from gptflow.kubernetes.manifests import JOBSET_API
from gptflow.kubernetes.spec import CONTAINER, EXIT_PREEMPTED, PodSet

JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX = "batch.kubernetes.io/job-completion-index"
ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
TAIL = 40  # lines of a failed pod repeated at the end
WATCH_SECONDS = 60  # one watch request; then it is resumed from the last resourceVersion
REPLAY_SECONDS = 1  # the last read of the pods' changes, as the JobSet has ended


class Stopped(Exception):
    """A signal asked this process to stop."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def write_manifests(p: PodSet, command: list[str]) -> Path:
    """Every renderer's manifest of `p` in its manifests_dir (for review and for checks)."""
    out = Path(p.manifests_dir)
    out.mkdir(parents=True, exist_ok=True)
    for kind, render in manifests.RENDERERS.items():
        with atomic_write(out / f"{kind}.yaml") as f:
            f.write(manifests.dump_all([render(p, command)]))
    return out


def load_client():
    """The API client: in a pod, its ServiceAccount; else the kubeconfig ($KUBECONFIG or
    ~/.kube/config)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise GptflowError(
            "the kubernetes Python client is not installed: pip install kubernetes==37.0.2 "
            "(a dependency of gptflow; the training image has it)"
        ) from None
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
            config.load_incluster_config()
        else:
            config.load_kube_config()
    except Exception as e:  # the client's ConfigException, a missing file
        raise GptflowError(
            f"no Kubernetes API to submit to ({e}): run inside the cluster (gptflow kubernetes "
            "driver) or point KUBECONFIG at a kubeconfig"
        ) from None
    return client


def condition(obj: dict, kind: str) -> dict | None:
    """The JobSet's condition `kind` when it is True."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return c
    return None


class PodLogs:
    """Every pod of the JobSet (each attempt's), its log followed into `out` as it runs, each
    line prefixed ``[node I attempt A]``; its last lines kept; its end said (exit code)."""

    def __init__(self, client, p: PodSet, out: TextIO):
        self.core = client.CoreV1Api()
        self.client = client
        self.p = p
        self.out = out
        self.lock = threading.Lock()
        self.followed: dict[str, threading.Thread] = {}
        self.tails: dict[str, collections.deque] = {}
        self.ended: dict[str, int] = {}  # pod -> exit code
        self.labels: dict[str, str] = {}
        self.stop = threading.Event()
        self.seen_lock = threading.Lock()  # _seen runs in the watch and in finish()
        self.version: str | None = None  # the JobSet's creation: where the watch begins
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def say(self, line: str) -> None:
        """One line into `out`; none once finish() returned: a follower or the watch still
        blocked on the API writes nothing after the submission's last word."""
        with self.lock:
            if self.stop.is_set():
                return
            self.out.write(line + "\n")
            self.out.flush()

    def start(self, version: str | None) -> None:
        """Watch the pods from resourceVersion `version` (the JobSet's creation): every pod
        of every attempt is seen, also one that ended and was deleted before the watch began."""
        self.version = version
        self.thread.start()

    def _watch(self) -> None:
        from kubernetes import watch

        selector = f"{JOBSET_LABEL}={self.p.name}"
        version = self.version
        while not self.stop.is_set():
            try:
                for event in watch.Watch().stream(
                    self.core.list_namespaced_pod, self.p.namespace, label_selector=selector,
                    resource_version=version, timeout_seconds=WATCH_SECONDS,
                ):  # fmt: skip
                    pod = event["object"]
                    version = pod.metadata.resource_version
                    self._seen(pod)
                    if self.stop.is_set():
                        return
            except Exception as e:  # a dropped stream, a 410: list again
                if self.stop.is_set():
                    return
                version = None
                self.say(f"gptflow kubernetes: watching the pods again ({type(e).__name__}: {e})")
                time.sleep(1)

    def _seen(self, pod) -> None:
        with self.seen_lock:
            self._seen_locked(pod)

    def _seen_locked(self, pod) -> None:
        name = pod.metadata.name
        meta = pod.metadata.annotations or {}
        label = f"node {meta.get(JOB_INDEX, '?')} attempt {meta.get(ATTEMPT, '0')}"
        self.labels[name] = label
        statuses = (pod.status.container_statuses if pod.status else None) or []
        state = next((s.state for s in statuses if s.name == CONTAINER), None)
        started = state is not None and (state.running or state.terminated)
        if started and name not in self.followed:
            t = threading.Thread(target=self._follow, args=(name, label), daemon=True)
            t.start()  # then kept: finish() joins what it finds there
            self.followed[name] = t
        if state is not None and state.terminated and name not in self.ended:
            code = state.terminated.exit_code
            self.ended[name] = code
            what = {0: "done", EXIT_PREEMPTED: "saved and stopped (preempted): the JobSet "
                    "restarts without counting it"}.get(code, "failed")  # fmt: skip
            self.say(f"gptflow kubernetes: pod {name} ({label}) exited {code}: {what}")

    def _follow(self, name: str, label: str) -> None:
        tail = self.tails.setdefault(name, collections.deque(maxlen=TAIL))
        try:
            resp = self.core.read_namespaced_pod_log(
                name, self.p.namespace, container=CONTAINER, follow=True, _preload_content=False
            )
            pending = b""
            for chunk in resp.stream(4096):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    tail.append(line)
                    self.say(f"[{label}] {line}")
            if pending:
                tail.append(pending.decode(errors="replace"))
                self.say(f"[{label}] {tail[-1]}")
        except Exception as e:  # the pod deleted before its log was read
            why = f"{e.status} {e.reason}" if hasattr(e, "status") else str(e)  # ApiException
            self.say(f"gptflow kubernetes: the log of pod {name} ({label}) ends: {why}".strip())

    def finish(self, timeout: float = 10.0) -> None:
        """Read the pods' changes once more from the JobSet's creation (the watch may lag: a
        pod that ended fast and was deleted at a restart is still seen; a plain list would
        miss it), wait for the followed logs to end (the pods have), then stop watching."""
        from kubernetes import watch

        deadline = time.monotonic() + timeout
        selector = f"{JOBSET_LABEL}={self.p.name}"
        with contextlib.suppress(Exception):  # the logs are a courtesy; the result stands
            for event in watch.Watch().stream(
                self.core.list_namespaced_pod, self.p.namespace, label_selector=selector,
                resource_version=self.version, timeout_seconds=REPLAY_SECONDS,
            ):  # fmt: skip
                self._seen(event["object"])
        with contextlib.suppress(Exception):  # a replay refused (410: compacted): what is left
            pods = self.core.list_namespaced_pod(self.p.namespace, label_selector=selector)
            for pod in sorted(pods.items, key=lambda pod: pod.metadata.name):
                self._seen(pod)
        for t in list(self.followed.values()):
            t.join(max(0.0, deadline - time.monotonic()))
        with self.lock:  # from here on nothing of ours writes to `out`
            self.stop.set()

    def failures(self) -> list[str]:
        """The failed pods' last lines, as they end the rule's log."""
        out = []
        for name, code in self.ended.items():
            if code in (0, EXIT_PREEMPTED):
                continue
            out.append(f"gptflow kubernetes: pod {name} ({self.labels.get(name)}) exited {code}; "
                       f"its last lines:")  # fmt: skip
            out += [f"  {line}" for line in self.tails.get(name, [])]
        return out


class Submission:
    """One JobSet of `p` running `command`, through the client's APIs."""

    def __init__(self, client, p: PodSet, command: list[str], out: TextIO):
        self.client = client
        self.api = client.CustomObjectsApi()
        self.p = p
        self.command = command
        self.out = out
        self.where = (JOBSET_API[0], JOBSET_API[1], p.namespace, JOBSET_API[2])

    def say(self, line: str) -> None:
        self.out.write(f"gptflow kubernetes: {line}\n")
        self.out.flush()

    def get(self) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.api.get_namespaced_custom_object(*self.where, self.p.name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def delete(self) -> None:
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            self.api.delete_namespaced_custom_object(
                *self.where, self.p.name, propagation_policy="Foreground"
            )

    def wait_gone(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.get() is None:
                return True
            time.sleep(0.5)
        return False

    def create(self) -> dict:
        """Create the JobSet; an earlier one of the same name: refused while it runs (one
        trainer per run), deleted first when it has finished."""
        earlier = self.get()
        if earlier is not None:
            if not (condition(earlier, "Completed") or condition(earlier, "Failed")):
                created = (earlier.get("metadata") or {}).get("creationTimestamp", "?")
                raise GptflowError(
                    f"JobSet {self.p.namespace}/{self.p.name} of run {self.p.run} is already "
                    f"running (created {created}): one trainer per run. Wait for it, or stop it "
                    f"with `kubectl delete jobset -n {self.p.namespace} {self.p.name}` (its "
                    "pods save on SIGTERM) and run the workflow again"
                )
            self.say(f"deleting the finished JobSet {self.p.name} of an earlier attempt")
            self.delete()
            if not self.wait_gone(self.p.grace_seconds + 60):
                raise GptflowError(f"JobSet {self.p.name} of an earlier attempt is not deleted")
        body = manifests.jobset(self.p, self.command)
        made = self.api.create_namespaced_custom_object(*self.where, body)
        self.say(f"created JobSet {self.p.namespace}/{self.p.name}")
        return made

    def watch(self, made: dict) -> tuple[str, dict]:
        """Watch the JobSet until it has Completed or Failed: (the condition, the object).
        Raises GptflowError when someone else deletes it."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        version = made["metadata"].get("resourceVersion")
        seen = {"restarts": 0, "counted": 0, "suspended": False}
        obj = made
        while True:
            try:
                for event in watch.Watch().stream(
                    self.api.list_namespaced_custom_object, *self.where,
                    field_selector=f"metadata.name={self.p.name}", resource_version=version,
                    timeout_seconds=WATCH_SECONDS,
                ):  # fmt: skip
                    obj = event["object"]
                    version = obj["metadata"].get("resourceVersion", version)
                    if event["type"] == "DELETED":
                        raise self.deleted()
                    if done := self.observe(obj, seen):
                        return done, obj
            except ApiException as e:
                if e.status != 410:
                    raise
                version = None  # too old: read the object again
            obj = self.get()
            if obj is None:
                raise self.deleted()
            version = obj["metadata"].get("resourceVersion")
            if done := self.observe(obj, seen):
                return done, obj

    def deleted(self) -> GptflowError:
        return GptflowError(
            f"JobSet {self.p.namespace}/{self.p.name} was deleted while it ran, not by gptflow "
            f"(kubectl get events -n {self.p.namespace}); its pods saved on SIGTERM: run the "
            "workflow again to resume from the last checkpoint"
        )

    def observe(self, obj: dict, seen: dict) -> str | None:
        """Say what changed (restarts, suspension); 'Completed' or 'Failed' when it ended."""
        status = obj.get("status") or {}
        restarts, counted = status.get("restarts") or 0, status.get("restartsCountTowardsMax") or 0
        if restarts > seen["restarts"]:
            how = ("counted" if counted > seen["counted"] else
                   f"not counted: a preemption (exit {EXIT_PREEMPTED})")  # fmt: skip
            self.say(
                f"JobSet {self.p.name} restarted (restart {restarts}, {how}; {counted} of "
                f"{self.p.max_restarts} counted): every pod starts again and resumes from the "
                "last checkpoint"
            )
            seen["restarts"], seen["counted"] = restarts, counted
        suspended = condition(obj, "Suspended")
        if suspended and not seen["suspended"]:
            self.say(
                f"JobSet {self.p.name} is suspended ({suspended.get('reason') or 'suspend'}: "
                "Kueue preempted it or has not admitted it yet); its pods are deleted and save "
                "on SIGTERM; waiting for it to be resumed"
            )
        elif seen["suspended"] and not suspended:
            self.say(f"JobSet {self.p.name} is resumed: its pods start again")
        seen["suspended"] = bool(suspended)
        for kind in ("Completed", "Failed"):
            if condition(obj, kind):
                return kind
        return None


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


def submit(p: PodSet, command: list[str], out: TextIO | None = None) -> int:
    """Run `command` in every pod of the JobSet of `p` and wait for it; the exit code."""
    out = out or sys.stdout
    if not command:
        raise GptflowError("no command after --: the pods run the command after it")
    write_manifests(p, command)
    out.write(manifests.summary(p).strip() + "\n")
    client = load_client()
    job = Submission(client, p, command, out)
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGINT)}
    logs = None
    try:
        made = job.create()
        logs = PodLogs(client, p, out)
        job.out = _Locked(out, logs.lock)
        logs.start(made["metadata"].get("resourceVersion"))
        kind, obj = job.watch(made)
    except Stopped as s:
        for sig in previous:  # a second signal does not interrupt the deletion
            signal.signal(sig, signal.SIG_IGN)
        job.say(f"stopped by signal {s.signum}: deleting JobSet {p.name} (its pods save and exit)")
        job.delete()
        gone = job.wait_gone(p.grace_seconds + 30)
        job.say(f"JobSet {p.name} {'deleted' if gone else 'is being deleted'}")
        return 128 + s.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if logs is not None:  # on every way out (also the JobSet deleted by someone else):
            logs.finish()  # after it, no thread of ours writes to `out`
    if kind == "Failed":
        c = condition(obj, "Failed") or {}
        for line in logs.failures():
            job.out.write(line + "\n")
        job.say(
            f"JobSet {p.name} failed ({c.get('reason', '?')}: {c.get('message', '')}); "
            f"{(obj.get('status') or {}).get('restartsCountTowardsMax', 0)} counted restart(s) of "
            f"{p.max_restarts}; the run resumes from its last checkpoint when run again"
        )
        return 1
    if not Path(p.done).is_file():
        job.say(f"JobSet {p.name} completed, but {p.done} is missing: the job did not write it")
        return 1
    job.say(f"JobSet {p.name} completed: {p.done}")
    return 0


class _Locked:
    """`out` written under the log followers' lock (one line at a time in the rule's log)."""

    def __init__(self, out: TextIO, lock: threading.Lock):
        self._out, self._lock = out, lock

    def write(self, text: str) -> None:
        with self._lock:
            self._out.write(text)

    def flush(self) -> None:
        with self._lock:
            self._out.flush()
