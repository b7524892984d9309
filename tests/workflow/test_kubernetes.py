"""profiles/kubernetes against a cluster on loopback (tests/support/kube_cluster.py: the real
`kubernetes` client over HTTP, a JobSet and a Job controller, pods run as local processes with
the completion index, their hostnames and the headless Service's names resolving to
127.0.0.1): the tiny workflow trains through the JobSet path to DONE.json on 1 pod and on 2
pods x gloo, and its evaluate job as a JobSet of one pod; then the faults, on that run's
data: a pod exiting 75 (a restart not counted), a pod killed (counted), Kueue suspending and resuming the JobSet, in one training whose losses
equal the uninterrupted 2-pod run's at every step; a JobSet failing after its restarts; a
fast pod exiting 75 seen though the submitter's pod watch starts late; a
second submission of a running run refused and the JobSet deleted by someone else; the driver
stopped mid-run, its JobSet deleted. Not a real cluster: no scheduler, images, GPUs or RDMA."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

import pytest
import yaml

from gptflow.kubernetes import sizing
from gptflow.kubernetes.spec import PodSet, jobset_name
from gptflow.plan.build import build_plan
from gptflow.plan.profile import Profile
from tests.support.crds import problems
from tests.support.kube_cluster import ATTEMPT, INDEX, Cluster, condition, unshare_works

from .conftest import BIN, REPO

IMAGE = "registry.example.org/gptflow@sha256:" + "ab" * 32
# the workflow directory as a clone on the claim holds it: the driver's command runs as written
LINKED = ("Snakefile", "rules", "workflow", "config", "profiles", "envs")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unshare_works()
    if why:
        pytest.skip(f"the loopback kubelet runs each pod in a mount and UTS namespace: {why}")
    work = tmp_path_factory.mktemp("claim")
    for name in LINKED:
        (work / name).symlink_to(REPO / name)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    c = Cluster({"work": work}, tmp_path_factory.mktemp("pods"), env=env)
    c.env = {**env, "KUBECONFIG": str(c.kubeconfig(tmp_path_factory.mktemp("kube") / "config"))}
    c.work = work
    yield c
    c.close()


def configure(cluster, tiny_config, **kubernetes) -> dict:
    cfg = copy.deepcopy(tiny_config)
    cfg["kubernetes"] = {"image": IMAGE, "volume_claim": "work", "mount_path": str(cluster.work),
                         "gpus_per_node": 0, "cpus_per_rank": 1, "shm_mb": 256,
                         "termination_grace_seconds": 30, "driver": {"cpus": 2}, **kubernetes}  # fmt: skip
    (cluster.work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def snakemake(cluster, *args, timeout=600):
    cmd = ["timeout", "-k", "30", str(timeout), str(BIN / "snakemake"), "--profile",
           "profiles/kubernetes", "--configfile", "config.yaml", "--cores", "2", *args]  # fmt: skip
    out = subprocess.run(cmd, cwd=cluster.work, env=cluster.env, capture_output=True, text=True)
    out.out = out.stdout + out.stderr
    return out


def forget_training(work):
    """The run's training undone (its data and index kept): train_gpt runs again from step 0."""
    run = work / "results/runs/tiny"
    for name in ("DONE.json", "metrics.jsonl", "train.log"):
        (run / name).unlink(missing_ok=True)
    subprocess.run(["rm", "-rf", str(run / "checkpoints"), str(run / "kubernetes")], check=True)


def losses(work) -> dict:
    """{(kind, step): loss} of the run's metrics (the last record of a step: after a resume)."""
    out = {}
    for line in (work / "results/runs/tiny/metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") in ("train", "eval"):
            out[(r["kind"], r["step"])] = r.get("loss", r.get("val_loss"))
    return out


@pytest.fixture(scope="module")
def trained(cluster, tiny_config):
    """The tiny workflow through the JobSet path on 1 pod, then again on 2 pods (training
    only); the 2-pod run's losses are the faults' reference."""
    configure(cluster, tiny_config, nodes=1)
    plan = snakemake(cluster, "-n", "-p", "train", timeout=120)
    assert plan.returncode == 0, plan.out[-4000:]
    one = snakemake(cluster, "train")
    assert one.returncode == 0, one.out[-6000:]
    one_log = (cluster.work / "logs/train_gpt/tiny.log").read_text()
    manifests = sorted(p.name for p in (cluster.work / "results/runs/tiny/kubernetes").iterdir())
    jobset = yaml.safe_load((cluster.work / "results/runs/tiny/kubernetes/jobset.yaml").read_text())
    forget_training(cluster.work)
    configure(cluster, tiny_config, nodes=2)
    two_plan = snakemake(cluster, "-n", "-p", "train", timeout=120)
    two = snakemake(cluster, "train")
    assert two.returncode == 0, two.out[-6000:]
    return {"plan": plan.out, "one_log": one_log, "manifests": manifests, "jobset": jobset,
            "two_plan": two_plan.out, "two_log": (cluster.work / "logs/train_gpt/tiny.log").read_text(),
            "losses": losses(cluster.work)}  # fmt: skip


def test_the_workflow_trains_through_a_jobset_on_one_pod_then_two(trained, cluster):
    assert "kubernetes: JobSet default/gptflow-tiny-" in trained["plan"]
    assert "1 pod(s) x no GPU (1 CPU rank), 1 CPU(s)" in trained["plan"]
    assert f"image {IMAGE}; claim work at {cluster.work}" in trained["plan"]
    assert "Shell command: gptflow kubernetes submit --spec '{" in trained["plan"]
    assert "train_gpt on 2 node(s) x 1 rank(s) = 2 data parallel" in trained["two_plan"]
    one, two = trained["one_log"], trained["two_log"]
    assert "[node 0 attempt 0]" in one and "starting at step 0" in one
    assert "completed: results/runs/tiny/DONE.json" in one
    assert trained["manifests"] == ["deepspeedjob.yaml", "jobset.yaml", "pytorchjob.yaml",
                                    "trainjob.yaml"]  # fmt: skip
    assert problems(trained["jobset"]) == []  # what the submitting job wrote, valid
    # two pods, one gloo rank each, meeting at node 0 through the headless Service's name
    assert "2 ranks (torchrun)" in two and "(node 1 attempt 0) exited 0: done" in two, two[-3000:]
    done = json.loads((cluster.work / "results/runs/tiny/DONE.json").read_text())
    assert done["final_step"] == 40
    assert cluster.jobsets()[0]["status"]["terminalState"] == "Completed"


def test_evaluate_runs_as_its_own_one_pod_jobset_after_training(trained, cluster):
    """The trained run's evaluate job (profiles/kubernetes): the rule's command is the
    submitter's before `gptflow evaluate`; its JobSet (its own name, one pod, no GPU here: a
    CPU section) completes with the rule's output, in the rule's log. Off Kubernetes
    (profiles/local) the same job's command is `gptflow evaluate` alone. harness and
    harness_step take the same path (tests/unit/kubernetes/test_rule_jobs.py): the tiny config
    has no harness tasks."""
    target = "results/runs/tiny/eval.json"
    plan = snakemake(cluster, "-n", "-p", target, timeout=120)
    assert plan.returncode == 0, plan.out[-4000:]
    assert re.search(r"gptflow kubernetes submit --spec '\{[^']*' -- gptflow evaluate --config",
                     plan.out), plan.out[-4000:]  # fmt: skip
    assert "train_gpt" not in plan.out.split("Job stats:")[-1]  # training is not redone
    # (the training's changed launcher would rerun it here: only evaluate's command is shown)
    cmd = [str(BIN / "snakemake"), "--profile", "profiles/local", "--configfile", "config.yaml",
           "--cores", "1", "--rerun-triggers", "mtime", "-n", "-p", "-f", target]  # fmt: skip
    local = subprocess.run(cmd, cwd=cluster.work, env=cluster.env, capture_output=True, text=True)
    said = local.stdout + local.stderr
    assert local.returncode == 0, said[-4000:]
    assert "kubernetes submit" not in said, said[-4000:]
    command = r"Shell command: +gptflow evaluate --config results/runs/tiny/run.yaml"
    assert re.search(command, said), said
    start = time.monotonic()
    run = snakemake(cluster, target, timeout=300)
    assert run.returncode == 0, run.out[-6000:]
    print(f"evaluate as a JobSet: {time.monotonic() - start:.1f} s")
    record = json.loads((cluster.work / target).read_text())
    assert record, record
    (js,) = [j for j in cluster.jobsets() if "-evaluate-" in j["metadata"]["name"]]
    name = js["metadata"]["name"]
    assert name.startswith("gptflow-tiny-evaluate-") and name != jobset_name(
        "tiny", "default", str(cluster.work)
    )
    (replicated,) = js["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1 and replicated["template"]["spec"]["parallelism"] == 1
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][:2] == ["gptflow", "evaluate"]
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]  # a CPU section
    assert js["status"]["terminalState"] == "Completed"
    assert len(cluster.pod_objects(jobset=name)) == 1
    log = (cluster.work / "logs/evaluate/tiny.log").read_text()
    assert f"JobSet {name} completed: {target}" in log and "[node 0 attempt 0]" in log, log[-3000:]
    assert (cluster.work / "results/runs/tiny/kubernetes/evaluate/jobset.yaml").is_file()
    # the tests below read the training's JobSet as the cluster's only one
    cluster.delete(("jobset.x-k8s.io", "v1alpha2", "jobsets", "default", name), "Background")
    cluster.wait(lambda: not cluster.pod_objects(jobset=name), 60, f"JobSet {name}'s pod gone")


def pod_running(cluster, name: str, attempt: int, index: int) -> str | None:
    for pod in cluster.pod_objects(jobset=name):
        meta = pod["metadata"]
        if (meta["labels"][ATTEMPT], meta["labels"][INDEX]) == (str(attempt), str(index)) and (
            pod["status"].get("phase") == "Running" and not meta.get("deletionTimestamp")
        ):
            return meta["name"]
    return None


def patch_suspend(cluster, name: str, value: bool) -> None:
    """What Kueue does to preempt (true) and to admit again (false)."""
    url = f"{cluster.url}/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/{name}"
    req = urllib.request.Request(url, data=json.dumps({"spec": {"suspend": value}}).encode(),
                                 method="PATCH",
                                 headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
    urllib.request.urlopen(req, timeout=10).read()


def pod_set(cluster, tiny_config, **kubernetes) -> PodSet:
    cfg = configure(cluster, tiny_config, **kubernetes)
    profile = Profile(resources={"train_gpt": {"mpi": "kubernetes"}})
    plan = build_plan(cfg, repo=REPO, profile=profile, config_files=[], main_process=False)
    return sizing.plan_pod_set(plan, "tiny")


def submit(cluster, p: PodSet, command: list[str], **kwargs):
    cmd = [str(BIN / "gptflow"), "kubernetes", "submit", "--spec", p.to_json(), "--", *command]
    env = {**cluster.env, "PYTHONFAULTHANDLER": "1"}  # an abort says where
    return subprocess.Popen(cmd, cwd=cluster.work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)  # fmt: skip


def test_preemption_failure_and_suspension_resume_to_the_uninterrupted_losses(
    trained, cluster, tiny_config
):
    """Attempt 0 saves at step 20 and exits 75 (--exit-interval: a preemption's exit code):
    restart 1, not counted. Attempt 1 loses node 1 to SIGKILL: restart 2, counted. Attempt 2
    is suspended by a patch (Kueue) and resumed. The run then finishes from step 20 with the
    losses of the uninterrupted 2-pod run, every pod's log of every attempt in the output."""
    forget_training(cluster.work)
    p = pod_set(cluster, tiny_config, nodes=2)
    faults = []

    def inject():
        pod = cluster.wait(lambda: pod_running(cluster, p.name, 1, 1), 240, "attempt 1's node 1")
        faults.append(("kill", pod, cluster.kill(pod, signal.SIGKILL)))
        cluster.wait(lambda: pod_running(cluster, p.name, 2, 0), 240, "attempt 2's node 0")
        patch_suspend(cluster, p.name, True)
        cluster.wait(lambda: condition(cluster.jobsets()[0], "Suspended")
                     and not cluster.pod_objects(jobset=p.name), 120, "the suspension")  # fmt: skip
        time.sleep(1)  # suspended a while: the submitter says so
        patch_suspend(cluster, p.name, False)
        faults.append(("resumed",))

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    command = ["gptflow", "train", "--config", "results/runs/tiny/run.yaml",
               "--nproc-per-node", "1", "--nnodes", "2", "--threads", "1", "--wait-for-lock",
               "--exit-interval", "20"]  # fmt: skip
    proc = submit(cluster, p, command)
    out, _ = proc.communicate(timeout=600)
    injector.join(5)
    assert proc.returncode == 0, out[-6000:]
    assert faults and faults[0][2] and faults[-1] == ("resumed",), faults
    status = cluster.jobsets()[0]["status"]
    assert (status["restarts"], status["restartsCountTowardsMax"]) == (2, 1), status
    # the first pod to exit 75 fails the Job; the other may be stopped as it exits
    assert re.search(r"\(node \d attempt 0\) exited 75: saved and stopped", out), out[-6000:]
    for said in ("restart 1, not counted: a preemption",
                 "(node 1 attempt 1) exited 137", "restart 2, counted; 1 of 3 counted",
                 "is suspended (SuspendedJobs", "is resumed", "[node 0 attempt 0]",
                 "[node 0 attempt 2]", "completed: results/runs/tiny/DONE.json"):  # fmt: skip
        assert said in out, (said, out[-6000:])
    assert "resuming from step 20" in out
    assert losses(cluster.work) == trained["losses"]


def test_a_jobset_fails_after_its_counted_restarts_with_the_pods_last_lines(cluster, tiny_config):
    p = pod_set(cluster, tiny_config, nodes=2, max_restarts=1)
    p = PodSet(**{**p.__dict__, "name": "gptflow-fails-1", "run": "fails"})
    proc = submit(cluster, p, ["sh", "-c", "echo boom on node $JOB_COMPLETION_INDEX; exit 3"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "restart 1, counted; 1 of 1 counted" in out
    assert "failed (ReachedMaxRestarts" in out and "exited 3; its last lines:" in out
    assert "  boom on node " in out


@pytest.mark.parametrize("watch", ["late", "never"])
def test_a_fast_preempted_pod_is_seen_though_the_watch_starts_late(
    cluster, tiny_config, tmp_path, monkeypatch, watch
):
    """Attempt 0's pod exits 75 at once and is gone (the JobSet restarted, uncounted) before
    the submitter's pod watch starts (a slow API, a busy driver): the watch begins at the
    JobSet's creation, so that pod's end is still said, and attempt 1 completes the run.
    `never`: the watch lags behind the end (it never starts here): the last read of the
    pods' changes from the creation says every pod's end all the same."""
    from gptflow.kubernetes import submit as submitter

    p = pod_set(cluster, tiny_config, nodes=1)
    p = PodSet(**{**p.__dict__, "name": "gptflow-quick-1", "run": "quick",
                  "done": "quick-DONE.json", "manifests_dir": str(tmp_path)})  # fmt: skip
    start = submitter.PodLogs.start

    def late(self, version):
        cluster.wait(lambda: condition(cluster.store.get(key) or {}, "Completed"), 60, "the end")
        if watch == "late":
            start(self, version)
        else:
            self.version = version

    key = ("jobset.x-k8s.io", "v1alpha2", "jobsets", "default", p.name)
    monkeypatch.setattr(submitter.PodLogs, "start", late)
    monkeypatch.setenv("KUBECONFIG", cluster.env["KUBECONFIG"])
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.chdir(cluster.work)
    script = "if [ -e quick-75 ]; then touch quick-DONE.json; exit 0; fi; touch quick-75; exit 75"
    out = io.StringIO()
    try:
        code = submitter.submit(p, ["sh", "-c", script], out=out)
    finally:
        for name in ("quick-75", "quick-DONE.json"):
            (cluster.work / name).unlink(missing_ok=True)
    said = out.getvalue()
    assert code == 0, said
    assert re.search(r"pod gptflow-quick-1-node-0-0-\w+ \(node 0 attempt 0\) exited 75", said), said
    assert "restart 1, not counted: a preemption (exit 75)" in said, said
    assert "(node 0 attempt 1) exited 0: done" in said, said
    status = cluster.store.get(key)["status"]
    assert (status["restarts"], status["restartsCountTowardsMax"]) == (1, 0), status


def test_one_trainer_per_run_and_a_jobset_deleted_by_someone_else(cluster, tiny_config):
    p = pod_set(cluster, tiny_config, nodes=1)
    p = PodSet(**{**p.__dict__, "name": "gptflow-hold-1", "run": "hold", "grace_seconds": 5})
    hold = ["sh", "-c", "trap 'echo saved; exit 75' TERM; echo up; while :; do sleep 0.1; done"]
    first = submit(cluster, p, hold)
    cluster.wait(lambda: pod_running(cluster, p.name, 0, 0), 60, "the first submission's pod")
    second = submit(cluster, p, hold)
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 1 and "is already running" in out and "one trainer per run" in out
    assert pod_running(cluster, p.name, 0, 0)  # the first one untouched
    url = f"{cluster.url}/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/{p.name}"
    urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=10).read()
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 1, out
    assert f"JobSet default/{p.name} was deleted while it ran, not by gptflow" in out


def test_no_thread_of_the_submitter_writes_once_it_has_returned(cluster, tiny_config, monkeypatch):
    """Python aborts at exit (SIGABRT: "could not acquire lock for <stdout> at interpreter
    shutdown") when a daemon thread writes to stdout while the interpreter exits: CI saw the
    submitter exit -6 instead of 1. Its pod watch and log followers must be silent once submit
    has returned or raised, also when the JobSet was deleted by someone else (in process here,
    to look at the threads' writer; the deletion from a thread of the test)."""
    from gptflow.errors import GptflowError
    from gptflow.kubernetes import submit as submitter

    p = pod_set(cluster, tiny_config, nodes=1)
    p = PodSet(**{**p.__dict__, "name": "gptflow-mute-1", "run": "mute", "grace_seconds": 5})
    hold = ["sh", "-c", "trap 'echo saved; exit 75' TERM; echo up; while :; do sleep 0.1; done"]
    made: list = []
    start = submitter.PodLogs.start
    monkeypatch.setattr(submitter.PodLogs, "start", lambda s, v: (made.append(s), start(s, v)))
    monkeypatch.setenv("KUBECONFIG", cluster.env["KUBECONFIG"])
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.chdir(cluster.work)
    url = f"{cluster.url}/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/{p.name}"

    def delete():
        cluster.wait(lambda: pod_running(cluster, p.name, 0, 0), 60, "the pod")
        urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=10).read()

    deleter = threading.Thread(target=delete)
    deleter.start()
    out = io.StringIO()
    with pytest.raises(GptflowError, match="was deleted while it ran"):
        submitter.submit(p, hold, out=out)
    deleter.join()
    assert "gptflow kubernetes: created JobSet" in out.getvalue()
    (logs,) = made
    said = out.getvalue()
    logs.say("gptflow kubernetes: a line after submit returned")
    assert out.getvalue() == said, "a thread of the submitter wrote after it returned"


def test_the_driver_stopped_mid_run_deletes_its_jobset(trained, cluster, tiny_config, capsys):
    """The driver Job's own command (gptflow kubernetes driver), run in the claim's directory
    and stopped as the kubelet stops it (SIGTERM to its first process) while the trainers run:
    the submitter deletes the JobSet, its pods save on SIGTERM, nothing is left training."""
    from gptflow.cli import main

    forget_training(cluster.work)
    configure(cluster, tiny_config, nodes=2)
    here = os.getcwd()
    os.chdir(cluster.work)
    try:
        assert (
            main(["kubernetes", "driver", "--configfile", "config.yaml", "--target", "train"]) == 0
        )
    finally:
        os.chdir(here)
    job = list(yaml.safe_load_all(capsys.readouterr().out))[-1]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    for old in cluster.jobsets():  # the earlier tests' finished JobSets
        cluster.delete(("jobset.x-k8s.io", "v1alpha2", "jobsets", "default",
                        old["metadata"]["name"]), "Background")  # fmt: skip
    output = cluster.work / "driver.out"
    with open(output, "w") as sink:
        driver = subprocess.Popen(command, cwd=cluster.work, env=cluster.env, stdout=sink,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    log = cluster.work / "results/runs/tiny/train.log"
    try:
        cluster.wait(
            lambda: (
                driver.poll() is not None
                or (log.is_file() and "starting at step 0" in log.read_text())
            ),
            300,
            "the trainers",
        )
        assert driver.poll() is None
    except AssertionError:
        driver.kill()
        raise AssertionError(output.read_text()[-4000:]) from None
    (js,) = cluster.jobsets()
    name = js["metadata"]["name"]
    os.kill(driver.pid, signal.SIGTERM)
    driver.wait(timeout=120)
    out = output.read_text()
    assert driver.returncode != 0
    cluster.wait(lambda: not cluster.jobsets() and not cluster.pod_objects(jobset=name), 60,
                 f"JobSet {name} and its pods to be gone: {out[-3000:]}")  # fmt: skip
    submitted = (cluster.work / "logs/train_gpt/tiny.log").read_text()
    assert f"stopped by signal 15: deleting JobSet {name}" in submitted, submitted[-3000:]
    assert "exited 75: saved and stopped" in submitted  # the trainers saved on SIGTERM
    time.sleep(2)  # Snakemake does not submit it again
    assert not [j for j in cluster.jobsets() if j["metadata"]["name"] == name], out[-3000:]
