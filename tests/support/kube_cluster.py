"""A Kubernetes cluster on loopback for the tests: an API server speaking enough of the real
protocol for the official Python client, with a JobSet controller, a Job controller and a
"kubelet" that runs each pod as a local process. 127.0.0.1 only; one per test module.

What it implements, as Kubernetes does:

- HTTP JSON on ``/api/v1`` and ``/apis/GROUP/VERSION``: create (POST), get, list (label and
  ``metadata.name`` field selectors), watch (``?watch=true``: chunked ``{"type", "object"}``
  lines from a ``resourceVersion``, or the current objects as ADDED first; ``timeoutSeconds``),
  merge-patch (PATCH), delete (``propagationPolicy`` Foreground, Background or Orphan) of any
  namespaced kind; every change bumps one ``resourceVersion`` counter; ``/version``; errors as
  ``Status``. The garbage collector deletes the pods of a JobSet that is gone (not orphaned).
- Pod logs (``.../pods/NAME/log``: ``container``, ``follow``, ``tailLines``), gone with the pod.
- JobSet (jobset.x-k8s.io/v1alpha2): one Indexed Job per replicatedJob replica; pods named
  ``<jobset>-<rjob>-<job>-<index>-<suffix>``, hostname ``<jobset>-<rjob>-<job>-<index>`` in
  the subdomain (default: the JobSet's name), labels and annotations ``jobset.sigs.k8s.io/*``
  (``restart-attempt``) and ``batch.kubernetes.io/job-completion-index``; ``JOB_COMPLETION_INDEX``
  added to each container's env. ``spec.suspend`` (Kueue): pods deleted, condition Suspended;
  resumed: Suspended False, pods created again. ``failurePolicy`` rules (reasons, message
  patterns, target replicatedJobs) with RestartJobSet / RestartJobSetAndIgnoreMaxRestarts /
  FailJobSet, ``maxRestarts`` against ``status.restartsCountTowardsMax``, ``status.restarts``;
  a restart deletes every pod and, once they are gone, creates the next attempt's
  (``restartStrategy`` BlockingRecreate's order). successPolicy All; conditions Completed and
  Failed (``terminalState``).
- Job: ``backoffLimit`` and ``podFailurePolicy`` (onExitCodes In/NotIn, onPodConditions;
  FailJob, Ignore, Count), the failure reasons ``PodFailurePolicy`` (with Kubernetes' message)
  and ``BackoffLimitExceeded``; a failed Job's other pods are deleted.
- The kubelet: each pod's container runs as ``command + args`` in ``workingDir`` with the env
  Kubernetes would give it (``value``, ``fieldRef`` to the pod's name, namespace, labels and
  annotations, ``$(VAR)``), ``HOSTNAME`` and ``KUBERNETES_SERVICE_*``, in a mount and UTS
  namespace of its own (``unshare``): its hostname, an ``/etc/hosts`` in which every pod of its
  subdomain resolves to 127.0.0.1 (the headless Service, as cluster DNS would answer), and a
  tmpfs of the emptyDir's sizeLimit on ``/dev/shm``. Deleting a pod sends SIGTERM to its
  process, SIGKILL after ``terminationGracePeriodSeconds``; its exit code becomes the
  container's ``terminated.exitCode``.

What it does not: no scheduler (requests, GPUs, node selectors, tolerations, priority are
ignored), no admission (schemas are checked elsewhere, against the real CRDs), no RBAC, no
images (the container runs in the tests' own environment: PATH, PYTHONPATH, HOME of this
process), no pod network (every pod is 127.0.0.1), no Services or DNS beyond /etc/hosts, no
events, no finalizers but foreground deletion's. A PersistentVolumeClaim is a host directory
given to the cluster, mounted at its own path only (a container's workingDir must be it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import yaml

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
POD = ("", "v1", "pods")
KINDS = {"jobsets": "JobSet", "pods": "Pod", "jobs": "Job", "serviceaccounts": "ServiceAccount",
         "roles": "Role", "rolebindings": "RoleBinding"}  # fmt: skip
PATH = re.compile(
    r"^/(?:api/(?P<v1>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/namespaces/(?P<ns>[^/]+)"
    r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>log|status))?$"
)
ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
INDEX = "batch.kubernetes.io/job-completion-index"


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def matches(obj: dict, labels: dict, name: str | None) -> bool:
    meta = obj["metadata"]
    have = meta.get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items()) and (
        name is None or meta["name"] == name
    )


def condition(obj: dict, kind: str) -> dict | None:
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind and c["status"] == "True":
            return c
    return None


class Store:
    """Objects by (group, version, plural, namespace, name), one resourceVersion counter and
    the log of every change (watches replay it from a resourceVersion)."""

    def __init__(self):
        self.changed = threading.Condition()
        self.objects: dict[tuple, dict] = {}
        self.events: list[tuple[int, str, tuple, dict]] = []
        self.version = 0

    def put(self, key: tuple, obj: dict, kind: str = "MODIFIED") -> dict:
        with self.changed:
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.objects.pop(key, None)
            else:
                self.objects[key] = obj
            self.events.append((self.version, kind, key, copy.deepcopy(obj)))
            self.changed.notify_all()
            return copy.deepcopy(obj)

    def get(self, key: tuple) -> dict | None:
        with self.changed:
            obj = self.objects.get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def update(self, key: tuple, change) -> dict | None:
        """Apply `change(obj)` to the stored object (under the lock) and record it."""
        with self.changed:
            obj = self.objects.get(key)
            if obj is None:
                return None
            change(obj)
            return self.put(key, obj)

    def list(self, kind: tuple, ns: str) -> list[tuple[tuple, dict]]:
        with self.changed:
            return [(k, copy.deepcopy(o)) for k, o in self.objects.items() if k[:4] == (*kind, ns)]


class Pod:
    """A pod's process, its log file and its /etc/hosts."""

    def __init__(self, proc: subprocess.Popen | None, log: Path):
        self.proc = proc
        self.log = log
        self.done = threading.Event()
        self.killer: threading.Timer | None = None


class Cluster:
    """The API server, the controllers and the kubelet; `claims` maps a claim name to the host
    directory it holds."""

    def __init__(self, claims: dict[str, Path], workdir: Path, env: dict | None = None):
        self.image_env = {k: v for k, v in (env or os.environ).items()
                          if k in ("PATH", "PYTHONPATH", "HOME", "LANG", "TMPDIR")}  # fmt: skip
        self.store = Store()
        self.claims = {k: str(Path(v).resolve()) for k, v in claims.items()}
        self.workdir = Path(workdir)
        self.pods: dict[str, Pod] = {}  # pod name -> its process
        self.orphaned: set[tuple] = set()  # JobSets deleted with propagationPolicy Orphan
        self.stopping = threading.Event()
        self.lock = threading.RLock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.threads = [threading.Thread(target=self.server.serve_forever, daemon=True),
                        threading.Thread(target=self.reconcile_forever, daemon=True)]  # fmt: skip
        for t in self.threads:
            t.start()

    # ----------------------------------------------------------------------------- clients
    def kubeconfig(self, path: Path) -> Path:
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "loopback",
            "clusters": [{"name": "loopback", "cluster": {"server": self.url}}],
            "users": [{"name": "tests", "user": {"token": "loopback"}}],
            "contexts": [{"name": "loopback",
                          "context": {"cluster": "loopback", "user": "tests", "namespace": "default"}}],
        }  # fmt: skip
        path.write_text(yaml.safe_dump(cfg))
        return path

    def close(self) -> None:
        self.stopping.set()
        with self.store.changed:
            self.store.changed.notify_all()
        for name in list(self.pods):
            self.kill(name, signal.SIGKILL)
        self.server.shutdown()
        self.server.server_close()

    def jobsets(self, ns: str = "default") -> list[dict]:
        return [o for _, o in self.store.list(JOBSET, ns)]

    def pod_objects(self, ns: str = "default", jobset: str | None = None) -> list[dict]:
        sel = {"jobset.sigs.k8s.io/jobset-name": jobset} if jobset else {}
        return [o for _, o in self.store.list(POD, ns) if matches(o, sel, None)]

    def kill(self, pod: str, sig: int) -> bool:
        """Send `sig` to pod `pod`'s process (a fault: an OOM kill, a crash, SIGTERM)."""
        p = self.pods.get(pod)
        if p is None or p.proc is None or p.proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.proc.pid, sig)
            if sig == signal.SIGKILL:  # the container's other processes go with it
                os.killpg(p.proc.pid, signal.SIGKILL)
        return True

    def wait(self, predicate, timeout: float, what: str):
        """Until `predicate()` is truthy (checked at every change), its value; else fails."""
        deadline = time.monotonic() + timeout
        with self.store.changed:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"loopback cluster: timed out waiting for {what}")
                self.store.changed.wait(min(left, 0.5))

    # ----------------------------------------------------------------------------- HTTP
    def handler(self):
        cluster = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}") if n else {}

            def route(self):
                url = urlparse(self.path)
                m = PATH.match(url.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                return url, m, query

            def do_GET(self):
                url, m, q = self.route()
                if url.path == "/version":
                    return self.send(200, {"major": "1", "minor": "33",
                                           "gitVersion": "v1.33.0-loopback"})  # fmt: skip
                if not m:
                    return self.send(404, status(404, "NotFound", f"no route {url.path}"))
                kind, ns, name = cluster.kind_of(m), m["ns"], m["name"]
                if m["sub"] == "log":
                    return cluster.serve_log(self, ns, name, q)
                if name:
                    obj = cluster.store.get((*kind, ns, name))
                    if obj is None:
                        return self.send(404, status(404, "NotFound",
                                                     f'{kind[2]} "{name}" not found'))  # fmt: skip
                    return self.send(200, obj)
                labels = dict(p.split("=", 1) for p in q.get("labelSelector", "").split(",") if p)
                field = q.get("fieldSelector", "")
                only = field.split("=", 1)[1] if field.startswith("metadata.name=") else None
                if q.get("watch") in ("true", "True", "1"):
                    return cluster.serve_watch(self, kind, ns, labels, only, q)
                with cluster.store.changed:
                    items = [o for _, o in cluster.store.list(kind, ns) if matches(o, labels, only)]
                    version = cluster.store.version
                self.send(200, {"kind": f"{KINDS.get(kind[2], 'Object')}List",
                                "apiVersion": "/".join(x for x in kind[:2] if x),
                                "metadata": {"resourceVersion": str(version)}, "items": items})  # fmt: skip

            def do_POST(self):
                _, m, _ = self.route()
                if not m or m["name"]:
                    return self.send(405, status(405, "MethodNotAllowed", self.path))
                code, obj = cluster.create(cluster.kind_of(m), m["ns"], self.body())
                self.send(code, obj)

            def do_PATCH(self):
                _, m, _ = self.route()
                key = (*cluster.kind_of(m), m["ns"], m["name"])
                patch = self.body()

                def change(obj):
                    obj.update(merge_patch(obj, patch))
                    obj["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1

                obj = cluster.store.update(key, change)
                if obj is None:
                    return self.send(404, status(404, "NotFound", f'"{m["name"]}" not found'))
                self.send(200, obj)

            def do_DELETE(self):
                _, m, q = self.route()
                body = self.body()
                policy = body.get("propagationPolicy") or q.get("propagationPolicy", "Background")
                obj = cluster.delete((*cluster.kind_of(m), m["ns"], m["name"]), policy)
                if obj is None:
                    return self.send(404, status(404, "NotFound", f'"{m["name"]}" not found'))
                self.send(200, obj)

        return Handler

    def kind_of(self, m) -> tuple:
        return ("", "v1", m["plural"]) if m["v1"] else (m["group"], m["version"], m["plural"])

    def create(self, kind: tuple, ns: str, obj: dict) -> tuple[int, dict]:
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            return 422, status(422, "Invalid", "metadata.name: Required value")
        key = (*kind, ns, name)
        with self.store.changed:
            if key in self.store.objects:
                return 409, status(409, "AlreadyExists", f'{kind[2]} "{name}" already exists')
            meta.update(namespace=ns, uid=secrets.token_hex(16), creationTimestamp=now(),
                        generation=1)  # fmt: skip
            return 201, self.store.put(key, obj, "ADDED")

    def delete(self, key: tuple, policy: str) -> dict | None:
        obj = self.store.get(key)
        if obj is None:
            return None
        if key[2] == "pods":
            self.store.update(key, lambda o: o["metadata"].setdefault("deletionTimestamp", now()))
            self.terminate(key)
            return self.store.get(key) or obj
        if key[:3] == JOBSET and policy == "Foreground":  # gone once its pods are

            def mark(o):
                o["metadata"].setdefault("deletionTimestamp", now())
                o["metadata"]["finalizers"] = ["foregroundDeletion"]

            return self.store.update(key, mark)
        if key[:3] == JOBSET and policy == "Orphan":
            self.orphaned.add(key)
        self.store.put(key, obj, "DELETED")  # its pods: collect_garbage
        return obj

    def serve_watch(self, h, kind, ns, labels, only, q) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        deadline = time.monotonic() + float(q.get("timeoutSeconds") or 300)

        def chunk(data: bytes) -> None:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        store = self.store
        with store.changed:
            if q.get("resourceVersion"):
                since = int(q["resourceVersion"])
                initial = []
            else:  # the current objects first, as ADDED
                since = store.version
                initial = [o for _, o in store.list(kind, ns) if matches(o, labels, only)]
        try:
            for obj in initial:
                chunk(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            while not self.stopping.is_set():
                with store.changed:
                    pending = [e for e in store.events if e[0] > since]
                    if not pending:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        store.changed.wait(min(left, 1.0))
                        continue
                since = pending[-1][0]
                for _, event, key, obj in pending:
                    if key[:4] == (*kind, ns) and matches(obj, labels, only):
                        chunk(json.dumps({"type": event, "object": obj}).encode() + b"\n")
            chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            pass
        h.close_connection = True

    def serve_log(self, h, ns: str, name: str, q: dict) -> None:
        pod = self.store.get((*POD, ns, name))
        running = self.pods.get(name)
        if pod is None or running is None:
            return h.send(404, status(404, "NotFound", f'pods "{name}" not found'))
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        follow = q.get("follow") in ("true", "True", "1")
        try:
            with open(running.log, "rb") as f:
                if q.get("tailLines"):
                    lines = f.read().splitlines(keepends=True)[-int(q["tailLines"]) :]
                    data = b"".join(lines)
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if data else b"")
                while True:
                    data = f.read(65536)
                    if data:
                        h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        h.wfile.flush()
                        continue
                    if not follow or running.done.is_set() or self.stopping.is_set():
                        if not f.read(1):
                            break
                        f.seek(-1, os.SEEK_CUR)
                        continue
                    time.sleep(0.1)
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        h.close_connection = True

    # ----------------------------------------------------------------------------- controllers
    def reconcile_forever(self) -> None:
        while not self.stopping.is_set():
            with self.store.changed:
                self.store.changed.wait(0.2)
            with self.lock:
                for key, js in self.all_jobsets():
                    try:
                        self.reconcile(key, js)
                    except Exception as e:  # a controller bug must show, not hang the tests
                        print(f"loopback cluster: reconciling {key[-1]} failed: {e!r}")
                self.collect_garbage()

    def collect_garbage(self) -> None:
        """The garbage collector: the pods of a JobSet that is gone are deleted (a JobSet
        deleted with propagationPolicy Orphan leaves its pods running, as Kubernetes does)."""
        for pkey, pod in self.all_pods():
            meta = pod["metadata"]
            owner = (meta.get("labels") or {}).get("jobset.sigs.k8s.io/jobset-name")
            if owner is None or meta.get("deletionTimestamp"):
                continue
            if (*JOBSET, meta["namespace"], owner) in self.orphaned:
                continue
            if self.store.get((*JOBSET, meta["namespace"], owner)) is None:
                self.delete(pkey, "Background")

    def all_pods(self):
        with self.store.changed:
            return [(k, copy.deepcopy(o)) for k, o in self.store.objects.items() if k[:3] == POD]

    def all_jobsets(self):
        with self.store.changed:
            return [(k, copy.deepcopy(o)) for k, o in self.store.objects.items() if k[:3] == JOBSET]

    def jobset_pods(self, js: dict) -> list[tuple[tuple, dict]]:
        ns, name = js["metadata"]["namespace"], js["metadata"]["name"]
        sel = {"jobset.sigs.k8s.io/jobset-name": name}
        return [(k, o) for k, o in self.store.list(POD, ns) if matches(o, sel, None)]

    def set_status(self, key: tuple, **fields) -> None:
        def change(o):
            o.setdefault("status", {}).update(fields)

        self.store.update(key, change)

    def set_condition(self, key: tuple, kind: str, value: bool, reason: str, message: str) -> None:
        def change(o):
            conds = o.setdefault("status", {}).setdefault("conditions", [])
            old = next((c for c in conds if c["type"] == kind), None)
            new = {"type": kind, "status": "True" if value else "False", "reason": reason,
                   "message": message, "lastTransitionTime": now()}  # fmt: skip
            if old is None:
                conds.append(new)
            elif old["status"] != new["status"]:
                old.update(new)

        self.store.update(key, change)

    def reconcile(self, key: tuple, js: dict) -> None:
        pods = self.jobset_pods(js)
        st = js.get("status") or {}
        if js["metadata"].get("deletionTimestamp"):  # foreground deletion: pods first
            for pkey, _ in pods:
                self.delete(pkey, "Background")
            if not pods:
                self.store.put(key, js, "DELETED")
            return
        if condition(js, "Completed") or condition(js, "Failed"):
            for pkey, pod in pods:
                if pod.get("status", {}).get("phase") in ("Pending", "Running"):
                    self.delete(pkey, "Background")
            return
        attempt = st.get("restarts", 0)
        if js["spec"].get("suspend"):
            for pkey, _ in pods:
                self.delete(pkey, "Background")
            if not condition(js, "Suspended"):
                self.set_condition(key, "Suspended", True, "SuspendedJobs", "jobset is suspended")
            return
        if condition(js, "Suspended"):
            self.set_condition(key, "Suspended", False, "ResumeJobs", "jobset is resumed")
        old = [(k, p) for k, p in pods if int(p["metadata"]["labels"][ATTEMPT]) != attempt]
        if old:  # an earlier attempt's pods: the next one starts when they are gone
            for pkey, _ in old:
                self.delete(pkey, "Background")
            return
        jobs = self.jobs(js, pods)
        failed = [(job, why) for job, why in jobs if why not in ("complete", "active")]
        if failed:
            return self.job_failed(key, js, *failed[0], pods)
        if jobs and all(why == "complete" for _, why in jobs):
            self.set_condition(
                key, "Completed", True, "AllJobsCompleted", "jobset completed successfully"
            )
            self.set_status(key, terminalState="Completed")

    def jobs(self, js: dict, pods) -> list[tuple[str, object]]:
        """Each child Job's state: complete, active or (reason, message) of its failure; pods
        it lacks are created (the Job controller), its other pods deleted when it failed."""
        out = []
        attempt = (js.get("status") or {}).get("restarts", 0)
        for rjob in js["spec"]["replicatedJobs"]:
            for j in range(rjob.get("replicas", 1)):
                spec = rjob["template"]["spec"]
                job = f"{js['metadata']['name']}-{rjob['name']}-{j}"
                mine = [(k, p) for k, p in pods if p["metadata"]["labels"].get(
                    "batch.kubernetes.io/job-name") == job]  # fmt: skip
                why = self.job_state(spec, mine)
                if why == "active":  # a terminating pod is replaced once it has ended
                    have = {p["metadata"]["annotations"][INDEX] for _, p in mine
                            if p["metadata"].get("deletionTimestamp")
                            or p["status"].get("phase") != "Failed"}  # fmt: skip
                    for index in range(spec.get("completions", 1)):
                        if str(index) not in have:
                            self.create_pod(js, rjob, j, index, attempt)
                elif why != "complete":
                    for pkey, p in mine:
                        if p["status"].get("phase") in ("Pending", "Running"):
                            self.delete(pkey, "Background")
                out.append((job, why))
        return out

    def job_state(self, spec: dict, pods) -> object:
        counted = 0
        for _, pod in sorted(pods, key=lambda kp: kp[1]["status"].get("finishedAt", "")):
            # a pod deleted (suspended, restarted, its Job failed) is no failure of its own
            if pod["status"].get("phase") != "Failed" or pod["metadata"].get("deletionTimestamp"):
                continue
            action, message = self.pod_failure_policy(spec, pod)
            if action == "FailJob":
                return ("PodFailurePolicy", message)
            if action != "Ignore":
                counted += 1
        if counted > spec.get("backoffLimit", 6):
            return ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
        done = {p["metadata"]["annotations"][INDEX] for _, p in pods
                if p["status"].get("phase") == "Succeeded"}  # fmt: skip
        return "complete" if len(done) >= spec.get("completions", 1) else "active"

    def pod_failure_policy(self, spec: dict, pod: dict) -> tuple[str, str]:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        statuses = pod["status"].get("containerStatuses") or []
        for i, rule in enumerate((spec.get("podFailurePolicy") or {}).get("rules", [])):
            codes = rule.get("onExitCodes")
            if codes:
                for c in statuses:
                    if codes.get("containerName") not in (None, c["name"]):
                        continue
                    code = c["state"].get("terminated", {}).get("exitCode")
                    if code is None or code == 0:
                        continue
                    hit = code in codes["values"]
                    if hit == (codes["operator"] == "In"):
                        return rule["action"], (
                            f"Container {c['name']} for pod {ns}/{name} failed with exit code "
                            f"{code} matching {rule['action']} rule at index {i}"
                        )
            for want in rule.get("onPodConditions") or []:
                for c in pod["status"].get("conditions") or []:
                    if c["type"] == want["type"] and c["status"] == want.get("status", "True"):
                        return rule["action"], (
                            f"Pod {ns}/{name} has condition {c['type']} matching "
                            f"{rule['action']} rule at index {i}"
                        )
        return "Count", ""

    def job_failed(self, key: tuple, js: dict, job: str, why: tuple, pods) -> None:
        reason, message = why
        policy = js["spec"].get("failurePolicy")
        st = js.get("status") or {}
        rjob = job[len(js["metadata"]["name"]) + 1 :].rsplit("-", 1)[0]
        action = "FailJobSet"
        if policy is not None:
            action = "RestartJobSet"  # no rule matched: the default
            for rule in policy.get("rules") or []:
                if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
                    continue
                patterns = rule.get("onJobFailureMessagePatterns")
                if patterns and not any(re.search(p, message) for p in patterns):
                    continue
                if rule.get("targetReplicatedJobs") and rjob not in rule["targetReplicatedJobs"]:
                    continue
                action = rule["action"]
                break
        counted = st.get("restartsCountTowardsMax", 0)
        if action == "RestartJobSet" and counted >= (policy or {}).get("maxRestarts", 0):
            self.set_condition(key, "Failed", True, "ReachedMaxRestarts",
                               "jobset failed due to reaching max number of restarts")  # fmt: skip
            self.set_status(key, terminalState="Failed")
            return
        if action == "FailJobSet":
            self.set_condition(key, "Failed", True, "FailedJobs",
                               f"jobset failed due to one or more job failures: {message}")  # fmt: skip
            self.set_status(key, terminalState="Failed")
            return
        self.set_status(key, restarts=st.get("restarts", 0) + 1,
                        restartsCountTowardsMax=counted + (action == "RestartJobSet"))  # fmt: skip

    # ----------------------------------------------------------------------------- kubelet
    def create_pod(self, js: dict, rjob: dict, j: int, index: int, attempt: int) -> None:
        name = js["metadata"]["name"]
        ns = js["metadata"]["namespace"]
        template = copy.deepcopy(rjob["template"]["spec"]["template"])
        host = f"{name}-{rjob['name']}-{j}-{index}"
        subdomain = (js["spec"].get("network") or {}).get("subdomain") or name
        labels = {**(template.get("metadata", {}).get("labels") or {}),
                  "jobset.sigs.k8s.io/jobset-name": name,
                  "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                  "jobset.sigs.k8s.io/job-index": str(j), ATTEMPT: str(attempt),
                  "batch.kubernetes.io/job-name": f"{name}-{rjob['name']}-{j}",
                  INDEX: str(index)}  # fmt: skip
        annotations = {**(template.get("metadata", {}).get("annotations") or {}), **labels}
        spec = template["spec"]
        for c in spec["containers"]:  # the Job controller's, for an Indexed Job
            c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}}})  # fmt: skip
        spec.update(hostname=host, subdomain=subdomain, nodeName="loopback")
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{host}-{secrets.token_hex(3)[:5]}", "labels": labels,
                            "annotations": annotations},
               "spec": spec, "status": {"phase": "Pending"}}  # fmt: skip
        code, made = self.create(POD, ns, pod)
        assert code == 201, made
        self.start(made, js)

    def start(self, pod: dict, js: dict) -> None:
        """Run the pod's one container as a local process (see the module's docstring)."""
        meta, spec = pod["metadata"], pod["spec"]
        key = (*POD, meta["namespace"], meta["name"])
        (c,) = spec["containers"]
        root = Path(tempfile.mkdtemp(prefix=f"{meta['name']}-", dir=self.workdir))
        log = root / "container.log"
        env = dict(self.image_env)  # the "image's" environment: the tests' own
        env.update(HOSTNAME=spec["hostname"], KUBERNETES_SERVICE_HOST="127.0.0.1",
                   KUBERNETES_SERVICE_PORT=str(self.port))  # fmt: skip
        for var in c.get("env") or []:
            env[var["name"]] = self.env_value(var, pod, env)
        problem = self.check_mounts(spec, c)
        hosts = root / "hosts"
        names = [f"{h}.{spec['subdomain']} {h}" for h in self.hostnames(js)]
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {n}\n" for n in names))
        shm = next((v["emptyDir"].get("sizeLimit", "64Mi") for v in spec.get("volumes", [])
                    if "emptyDir" in v for m in c.get("volumeMounts", [])
                    if m["name"] == v["name"] and m["mountPath"] == "/dev/shm"), "64Mi")  # fmt: skip
        size = shm.replace("Mi", "m").replace("Gi", "g")
        setup = (f'mount --bind {shlex.quote(str(hosts))} /etc/hosts && hostname '
                 f'{shlex.quote(spec["hostname"])} && mount -t tmpfs -o size={size} tmpfs '
                 '/dev/shm && exec "$@"')  # fmt: skip
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        argv = ["unshare", *user, "--mount", "--uts", "--", "sh", "-c", setup, "pod",
                *c.get("command", []), *c.get("args", [])]  # fmt: skip
        proc = None
        with open(log, "wb") as out:
            if problem is None:
                try:
                    proc = subprocess.Popen(argv, cwd=c["workingDir"], env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
                except OSError as e:
                    problem = f"cannot start: {e}"
            else:
                out.write(f"loopback kubelet: {problem}\n".encode())
        self.pods[meta["name"]] = Pod(proc, log)
        started = now()
        image = c.get("image", "")

        def running(o):
            o["status"] = {"phase": "Running", "podIP": "127.0.0.1", "startTime": started,
                           "containerStatuses": [{"name": c["name"], "ready": True,
                                                  "restartCount": 0, "image": image,
                                                  "imageID": image, "started": True,
                                                  "state": {"running": {"startedAt": started}}}]}  # fmt: skip

        self.store.update(key, running)
        threading.Thread(target=self.wait_pod, args=(key, c, image, started), daemon=True).start()

    def wait_pod(self, key: tuple, c: dict, image: str, started: str) -> None:
        p = self.pods[key[-1]]
        code = p.proc.wait() if p.proc is not None else 128
        with contextlib.suppress(ProcessLookupError):  # the container's other processes
            os.killpg(p.proc.pid, signal.SIGKILL) if p.proc is not None else None
        if p.killer:
            p.killer.cancel()
        code = code if code >= 0 else 128 - code  # a signal N: 128 + N, as a runtime reports
        finished = now()

        def terminated(o):
            o["status"].update(phase="Succeeded" if code == 0 else "Failed", finishedAt=finished)
            o["status"]["containerStatuses"] = [{
                "name": c["name"], "ready": False, "restartCount": 0, "image": image,
                "imageID": image, "started": False,
                "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0
                                         else "Error", "startedAt": started,
                                         "finishedAt": finished}}}]  # fmt: skip

        self.store.update(key, terminated)
        p.done.set()
        obj = self.store.get(key)
        if obj is not None and obj["metadata"].get("deletionTimestamp"):
            self.store.put(key, obj, "DELETED")

    def terminate(self, key: tuple) -> None:
        """A deleted pod: SIGTERM to its process, SIGKILL after its grace period; the pod is
        removed once it has ended."""
        p = self.pods.get(key[-1])
        obj = self.store.get(key)
        if p is None or obj is None:
            return
        if p.done.is_set():
            self.store.put(key, obj, "DELETED")
            return
        if p.killer is None:
            grace = obj["spec"].get("terminationGracePeriodSeconds", 30)
            self.kill(key[-1], signal.SIGTERM)
            p.killer = threading.Timer(grace, self.kill, (key[-1], signal.SIGKILL))
            p.killer.daemon = True
            p.killer.start()

    def hostnames(self, js: dict) -> list[str]:
        name = js["metadata"]["name"]
        return [f"{name}-{r['name']}-{j}-{i}" for r in js["spec"]["replicatedJobs"]
                for j in range(r.get("replicas", 1))
                for i in range(r["template"]["spec"].get("completions", 1))]  # fmt: skip

    def check_mounts(self, spec: dict, c: dict) -> str | None:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}  # fmt: skip
        for m in c.get("volumeMounts", []):
            if m["name"] in claims:
                claim = claims[m["name"]]
                if claim not in self.claims:
                    return f"FailedMount: persistentvolumeclaim {claim!r} not found"
                if self.claims[claim] != str(Path(m["mountPath"]).resolve()):
                    return (
                        f"FailedMount: claim {claim} holds {self.claims[claim]}; the loopback "
                        f"kubelet mounts a claim at its own path only, not {m['mountPath']}"
                    )
        wd = c.get("workingDir")
        if not wd or not any(str(Path(wd).resolve()).startswith(self.claims[claims[m["name"]]])
                             for m in c.get("volumeMounts", []) if m["name"] in claims):  # fmt: skip
            return f"workingDir {wd!r} is not on a mounted claim"
        return None

    @staticmethod
    def env_value(var: dict, pod: dict, env: dict) -> str:
        if "valueFrom" in var:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if m:
                return (pod["metadata"].get(m[1]) or {}).get(m[2], "")
            return {"metadata.name": pod["metadata"]["name"],
                    "metadata.namespace": pod["metadata"]["namespace"],
                    "status.podIP": "127.0.0.1"}[path]  # fmt: skip
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                      lambda m: env.get(m[1], m[0]), var.get("value", ""))  # fmt: skip


def unshare_works() -> str | None:
    """Why pods cannot run here (None when they can): each needs a mount and UTS namespace."""
    if not shutil.which("unshare"):
        return "no unshare command (util-linux)"
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    out = subprocess.run(["unshare", *user, "--mount", "--uts", "true"], capture_output=True,
                         text=True)  # fmt: skip
    return None if out.returncode == 0 else f"unshare --mount --uts fails: {out.stderr.strip()}"
