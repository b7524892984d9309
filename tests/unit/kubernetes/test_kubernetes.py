"""profiles/kubernetes without a cluster: every seed situation (one GPU, all GPUs of a machine,
several machines, RDMA, extra environment, queue and priority, node selector and tolerations)
as a `kubernetes:` config section, rendered by `gptflow kubernetes render` into each kind and
checked against the real schemas (tests/support/crds.py: JobSet v0.12.0, PyTorchJob v1.9.4,
TrainJob v2.3.0 CRDs; built-in kinds with kubernetes-validate --strict at Kubernetes 1.33),
which refuse a misspelt field, a bad enum and a bad quantity; the driver's objects; the
config's errors, one line naming the key; a pod's rendezvous (node rank = completion index)."""

from __future__ import annotations

import copy
import hashlib
import math
import os
import re

import pytest
import yaml

from gptflow.cli import main
from gptflow.errors import GptflowError
from gptflow.kubernetes import manifests, sizing
from gptflow.kubernetes.spec import NAME_MAX, jobset_name
from gptflow.plan.build import build_plan
from gptflow.plan.host_memory import snapshot_fit
from gptflow.plan.profile import Profile
from gptflow.train.distributed import node_rendezvous
from gptflow.train.pods import pod_rendezvous
from tests.support.crds import problems

IMAGE = "registry.example.org/gptflow@sha256:" + "0123456789abcdef" * 4
BASE = {"image": IMAGE, "volume_claim": "gptflow-work"}
# 32 ranks need a global batch of 32: the tiny model, batched for the big layouts
WIDE = {"micro_batch_size": 1, "global_batch_size": 32}
SITUATIONS = {
    "one-gpu": ({"nodes": 1, "gpus_per_node": 1}, {}),
    "one-machine": ({"nodes": 1, "gpus_per_node": 8}, {}),
    "many-machines": ({"nodes": 4, "gpus_per_node": 8}, WIDE),
    "rdma": ({"nodes": 4, "gpus_per_node": 8, "rdma": {"enabled": True, "hca": "mlx5"},
              "env": {"NCCL_P2P_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}}, WIDE),
    "queue-and-placement": ({
        "nodes": 2, "gpus_per_node": 4, "queue": "team-a", "priority_class": "high",
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "image_pull_secret": "registry-login", "namespace": "llm",
    }, {}),
}  # fmt: skip


def write(tmp_path, tiny_config, kubernetes: dict, train: dict | None = None):
    cfg = copy.deepcopy(tiny_config)
    cfg["kubernetes"] = {**BASE, **kubernetes}
    cfg["train"].update(train or {})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def render(capsys, repo, config, *args) -> list[dict]:
    code = main(["kubernetes", "render", "--configfile", str(config), "--replace-workflow-config",
                 "--directory", str(repo), *args])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    return list(yaml.safe_load_all(out.out))


def pod_of(obj: dict) -> dict:
    """The trainer's pod spec in a rendered object of any kind."""
    spec = obj["spec"]
    if obj["kind"] == "JobSet":
        return spec["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    if obj["kind"] == "PyTorchJob":
        return spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    if obj["kind"] == "DeepSpeedJob":
        return spec["worker"]["template"]["spec"]
    raise AssertionError(obj["kind"])


@pytest.mark.parametrize("situation", SITUATIONS)
def test_every_situation_renders_every_kind_valid_against_its_schema(
    situation, capsys, repo, tmp_path, tiny_config
):
    kubernetes, train = SITUATIONS[situation]
    objects = render(capsys, repo, write(tmp_path, tiny_config, kubernetes, train), "--kind", "all")
    assert [o["kind"] for o in objects] == ["JobSet", "PyTorchJob", "TrainJob", "DeepSpeedJob"]
    for obj in objects[:3]:
        assert problems(obj) == [], (obj["kind"], problems(obj))
    assert problems(objects[3]) == [  # no public schema: said, never passed
        "no schema for ('batch.tensorstack.dev/v1beta1', 'DeepSpeedJob'): not validated"
    ]
    jobset, pytorchjob, trainjob, _ = objects
    nodes, gpus = kubernetes["nodes"], kubernetes["gpus_per_node"]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (
        nodes,
        nodes,
        "Indexed",
    )
    pod = pod_of(jobset)
    (c,) = pod["containers"]
    assert c["command"][:4] == ["gptflow", "train", "--config", "results/runs/tiny/run.yaml"]
    assert c["command"][4:8] == ["--nproc-per-node", str(gpus), "--nnodes", str(nodes)]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["resources"]["requests"]["cpu"] == str(8 * gpus)  # cpus_per_rank 8 (default)
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16384Mi"}} in pod[
        "volumes"
    ]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["PET_NNODES"] == str(nodes) and env["PET_MASTER_ADDR"].endswith(
        f"-node-0-0.{jobset['metadata']['name']}"
    )
    assert env["PET_NODE_RANK"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    rdma = kubernetes.get("rdma", {}).get("enabled")
    assert ("securityContext" in c) == bool(rdma)
    if rdma:
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_IB_DISABLE"] == "0"
        assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    if kubernetes.get("queue"):
        for obj in (jobset, pytorchjob, trainjob):
            assert obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
            assert obj["metadata"]["namespace"] == "llm"
        assert pod["priorityClassName"] == "high" and pod["imagePullSecrets"] == [
            {"name": "registry-login"}
        ]
        assert pod["tolerations"] == kubernetes["tolerations"]
    # Trainer v2's runtime sets PET_* itself, and its webhook refuses them from the user
    assert not [e for e in trainjob["spec"]["trainer"]["env"] if e["name"].startswith("PET_")]
    assert trainjob["spec"]["trainer"]["numNodes"] == nodes


def test_the_jobset_restarts_preemptions_free_and_failures_counted(
    capsys, repo, tmp_path, tiny_config
):
    (jobset,) = render(capsys, repo, write(tmp_path, tiny_config, {"max_restarts": 5}))
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 5 and policy["restartStrategy"] == "BlockingRecreate"
    assert policy["rules"] == [
        {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "failed", "action": "RestartJobSet"},
    ]  # fmt: skip
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    # exit 75, and a pod the cluster evicts or Kueue preempts (DisruptionTarget), fail the Job
    # by its pod failure policy: the JobSet's "preempted" rule, not counted
    assert job["backoffLimit"] == 0 and job["podFailurePolicy"]["rules"] == [
        {"action": "FailJob",
         "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}},
        {"action": "FailJob",
         "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]  # fmt: skip
    pod = pod_of(jobset)
    assert pod["restartPolicy"] == "Never"
    # the trainers' save on SIGTERM gets the configured time before the kubelet's SIGKILL
    assert pod["terminationGracePeriodSeconds"] == 600  # kubernetes.termination_grace_seconds
    assert jobset["spec"]["network"] == {
        "enableDNSHostnames": True,
        "publishNotReadyAddresses": True,
    }


@pytest.mark.parametrize(
    "path, value, found",
    [
        (("spec", "replicatedJobs", 0, "template", "spec", "parallelizm"), 2, "'parallelizm' was unexpected"),
        (("spec", "failurePolicy", "restartStrategy"), "Sometimes", "is not one of"),
        (("spec", "failurePolicy", "rules", 0, "action"), "RestartJobSetForever", "is not one of"),
        (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0,
          "resources", "limits", "memory"), "3 GB", "is not a quantity"),
        (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0,
          "resources", "limits", "nvidia.com/gpu"), "eight", "is not a quantity"),
        (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "restartPolicy"),
         "Sometimes", "is not one of"),
        (("spec", "replicatedJobs", 0, "template", "spec", "completions"), "two", "is not of type"),
        (("metadata", "name"), "Gptflow_Tiny", "RFC 1035"),
    ],
)  # fmt: skip
def test_the_schemas_refuse_a_misspelt_field_a_bad_enum_and_a_bad_quantity(
    path, value, found, capsys, repo, tmp_path, tiny_config
):
    (jobset,) = render(capsys, repo, write(tmp_path, tiny_config, {}))
    assert problems(jobset) == []
    bad = set_at(copy.deepcopy(jobset), path, value)
    assert any(found in p for p in problems(bad)), problems(bad)


def set_at(obj: dict, path: tuple, value) -> dict:
    node = obj
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return obj


def test_the_other_kinds_schemas_refuse_them_too(capsys, repo, tmp_path, tiny_config):
    _, pytorchjob, trainjob, _ = render(
        capsys, repo, write(tmp_path, tiny_config, {}), "--kind", "all"
    )
    pod = ("spec", "pytorchReplicaSpecs", "Worker", "template", "spec")
    for path, value, found in [
        (("spec", "pytorchReplicaSpecs", "Worker", "replicaz"), 2, "'replicaz' was unexpected"),
        (("spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"), "Sometimes", "is not one of"),
        ((*pod, "containers", 0, "resources", "limits", "memory"), "3 GB", "is not a quantity"),
    ]:
        bad = set_at(copy.deepcopy(pytorchjob), path, value)
        assert any(found in p for p in problems(bad)), (path, problems(bad))
    trainer = ("spec", "trainer")
    for path, value, found in [
        ((*trainer, "numNode"), 2, "'numNode' was unexpected"),
        ((*trainer, "numNodes"), "two", "is not of type"),
        ((*trainer, "resourcesPerNode", "requests", "cpu"), "eight", "is not a quantity"),
        # v2.3's runtime patch does not take a priority class (the renderer once wrote one)
        (
            (
                "spec",
                "runtimePatches",
                0,
                "trainingRuntimeSpec",
                "template",
                "spec",
                "replicatedJobs",
                0,
                "template",
                "spec",
                "template",
                "spec",
                "priorityClassName",
            ),
            "high",
            "'priorityClassName' was unexpected",
        ),
    ]:
        bad = set_at(copy.deepcopy(trainjob), path, value)
        assert any(found in p for p in problems(bad)), (path, problems(bad))


def test_the_driver_is_a_job_with_a_namespaced_role(capsys, repo, tmp_path, tiny_config):
    write(tmp_path, tiny_config, {"driver": {"cpus": 4, "memory_mb": 16000}})
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(["kubernetes", "driver", "--configfile", "config.yaml",
                     "--replace-workflow-config", "--directory", str(repo), "--target", "train"])  # fmt: skip
    finally:
        os.chdir(here)
    out = capsys.readouterr()
    assert code == 0, out.err
    objects = list(yaml.safe_load_all(out.out))
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding", "Job"]
    for obj in objects:
        assert problems(obj) == [], (obj["kind"], problems(obj))
        assert obj["metadata"]["namespace"] == "default"  # nothing cluster-wide
    assert objects[1]["rules"] == [
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"],
         "verbs": ["create", "get", "list", "watch", "delete"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    ]  # fmt: skip
    pod = objects[3]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["serviceAccountName"] == "gptflow" and c["workingDir"] == "/workspace"
    assert c["command"][:2] == ["sh", "-c"] and "kill -TERM 0" in c["command"][2]
    assert c["command"][4:] == ["snakemake", "train", "--profile", "profiles/kubernetes",
                                "--cores", "4", "--configfile", "config.yaml",
                                "--replace-workflow-config"]  # fmt: skip
    assert c["resources"]["limits"] == {"cpu": "4", "memory": "16000Mi"}
    assert pod["terminationGracePeriodSeconds"] == 600 + 60  # its trainers' save, and its own
    assert {"name": "work", "persistentVolumeClaim": {"claimName": "gptflow-work"}} in pod[
        "volumes"
    ]


def test_the_pod_memory_is_the_preflights_host_memory_plus_shm(repo, tiny_config):
    cfg = copy.deepcopy(tiny_config)
    cfg["kubernetes"] = {**BASE, "nodes": 2, "gpus_per_node": 8, "shm_mb": 4096}
    cfg["train"].update(WIDE)
    profile = Profile(resources={"train_gpt": {"mpi": "kubernetes"}})
    plan = build_plan(cfg, repo=repo, profile=profile, config_files=[], main_process=False)
    p = sizing.plan_pod_set(plan, "tiny")
    fit = snapshot_fit(plan.runs["tiny"].model, plan.runs["tiny"].train, 16, plan.placement)
    assert fit.ranks == 8  # the most loaded node's ranks: one pod's
    # on GPUs train.async_save auto saves in the background: the snapshots are in host memory
    need = fit.process + fit.state + fit.snapshots + fit.clones
    assert fit.snapshots > 0 and p.memory_mb == math.ceil(need / 2**30) * 1024 + 4096
    assert plan.placement.ranks == 16 and plan.placement.gpu_mem_mb == 81920
    cfg["kubernetes"]["memory_mb"] = 200000  # given: kept
    plan = build_plan(cfg, repo=repo, profile=profile, config_files=[], main_process=False)
    assert sizing.plan_pod_set(plan, "tiny").memory_mb == 200000


@pytest.mark.parametrize(
    "section, key",
    [
        ({"nodes": 0}, "kubernetes.nodes"),
        ({"gpus_per_node": "eight"}, "kubernetes.gpus_per_node"),
        ({"image": "gptflow:latest"}, "kubernetes.image"),
        ({"namespace": "My_Team"}, "kubernetes.namespace"),
        ({"rdma": {"enabled": True, "hca": "mlx5\n"}}, "kubernetes.rdma.hca"),
        ({"tolerations": [{"key": "gpu", "effect": "Never"}]}, "kubernetes.tolerations[0].effect"),
        ({"shm_mb": 1}, "kubernetes.shm_mb"),
        ({"gpus": 8}, "kubernetes"),
    ],
)
def test_a_bad_kubernetes_key_is_one_line_naming_it(
    section, key, capsys, repo, tmp_path, tiny_config
):
    cfg = copy.deepcopy(tiny_config)
    cfg["kubernetes"] = {**BASE, **section}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    code = main(["kubernetes", "render", "--configfile", str(config), "--replace-workflow-config",
                 "--directory", str(repo)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and key in err, err


def test_render_refuses_a_config_without_image_or_claim(capsys, repo, tmp_path, tiny_config):
    for missing in ("image", "volume_claim"):
        config = write(tmp_path, tiny_config, {missing: ""})
        code = main(["kubernetes", "render", "--configfile", str(config),
                     "--replace-workflow-config", "--directory", str(repo)])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 1 and f"kubernetes.{missing} is not set" in err, err


def test_a_jobset_name_is_deterministic_short_and_a_dns_label():
    a = jobset_name("tiny", "default", "/workspace")
    assert a == jobset_name("tiny", "default", "/workspace")
    assert a != jobset_name("tiny", "other", "/workspace") != jobset_name("tiny", "default", "/w2")
    long = jobset_name("A_Very.Long-Run_Name_" * 5, "default", "/workspace")
    for name in (a, long):
        assert len(name) <= NAME_MAX and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name


def test_a_pods_rendezvous_is_its_completion_index_at_node_0():
    env = {"PET_NNODES": "4", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "js-node-0-0.js",
           "PET_MASTER_PORT": "12345"}  # fmt: skip
    assert node_rendezvous(4, env) == [
        "--nnodes=4", "--node-rank=2", "--rdzv-backend=static",
        "--master-addr=js-node-0-0.js", "--master-port=12345",
    ]  # fmt: skip
    bare = {"PET_MASTER_ADDR": "js-node-0-0.js", "JOB_COMPLETION_INDEX": "3"}
    assert "--node-rank=3" in pod_rendezvous(4, bare)  # the Job's own variable when no PET_
    assert node_rendezvous(1, {**env, "PET_NNODES": "1"}) == ["--standalone"]
    with pytest.raises(GptflowError, match="PET_NNODES=4"):
        pod_rendezvous(2, env)
    with pytest.raises(GptflowError, match="not a node rank"):
        pod_rendezvous(4, {**env, "PET_NODE_RANK": "4"})


def test_a_job_after_training_is_one_pod_of_one_gpu_or_a_cpu_pod(repo, tiny_config):
    """evaluate, harness and harness_step on profiles/kubernetes (sizing.job_pod_set): one pod,
    one GPU of a GPU section (not its gpus_per_node), none of a CPU section; cpus_per_rank
    CPUs; the rule's own memory plus /dev/shm; success is the rule's output; its own JobSet
    name per run, job and step (none the training's), its manifests apart from the training's;
    the training's image, claim and scheduling, no RDMA."""
    cfg = copy.deepcopy(tiny_config)
    cfg["kubernetes"] = {**BASE, "nodes": 4, "gpus_per_node": 8, "cpus_per_rank": 6,
                         "shm_mb": 2048, "rdma": {"enabled": True}, **SITUATIONS[
                             "queue-and-placement"][0], "max_restarts": 5}  # fmt: skip
    cfg["train"].update(WIDE)
    profile = Profile(resources={"train_gpt": {"mpi": "kubernetes"}})
    plan = build_plan(cfg, repo=repo, profile=profile, config_files=[], main_process=False)
    section = plan.config["kubernetes"]
    train = sizing.plan_pod_set(plan, "tiny")
    done = "results/runs/tiny/eval.json"
    p = sizing.job_pod_set(section, "tiny", "evaluate", done, 3000)
    assert (p.nodes, p.gpus_per_node, p.ranks_per_node, p.cpus) == (1, 1, 1, 6)
    assert p.memory_mb == 3000 + 2048 and p.shm_mb == 2048
    assert p.done == done and p.run == "tiny" and p.rdma == {}
    assert p.manifests_dir == "results/runs/tiny/kubernetes/evaluate" != train.manifests_dir
    for key in ("namespace", "image", "image_pull_secret", "volume_claim", "mount_path",
                "gpu_resource", "env", "node_selector", "tolerations", "queue", "priority_class",
                "max_restarts", "grace_seconds"):  # fmt: skip
        assert getattr(p, key) == getattr(train, key), key
    assert (p.max_restarts, p.queue, p.namespace) == (5, "team-a", "llm")
    names = {sizing.job_pod_set(section, run, job, done, 1).name
             for run in ("tiny", "other") for job in ("evaluate", "harness", "harness-step-30",
                                                      "harness-step-40")}  # fmt: skip
    assert len(names) == 8 and train.name not in names
    for name in (*names, p.name):
        assert len(name) <= NAME_MAX and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
    assert p.name.startswith("gptflow-tiny-evaluate-")
    assert p.name == sizing.job_pod_set(section, "tiny", "evaluate", done, 99).name  # per attempt
    cpu = sizing.job_pod_set({**section, "gpus_per_node": 0}, "tiny", "harness", done, 500)
    assert (cpu.gpus_per_node, cpu.ranks_per_node, cpu.memory_mb) == (0, 1, 500 + 2048)
    assert sizing.job_gpus(section) == 1 and sizing.job_gpus({"gpus_per_node": 0}) == 0
    # a pod asks the cluster for one GPU, not the training node's eight
    pod = manifests.jobset(p, ["gptflow", "evaluate"])["spec"]["replicatedJobs"][0]
    assert pod["replicas"] == 1
    limits = pod["template"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"memory": "5048Mi", "nvidia.com/gpu": 1}, limits
    assert problems(manifests.jobset(p, ["gptflow", "evaluate"])) == []


def test_a_jobs_name_keeps_the_job_and_the_training_name_is_unchanged():
    # the training's name as before jobs had names: a running JobSet is still found
    digest = hashlib.sha256(b"default\0/workspace\0tiny").hexdigest()[:8]
    assert jobset_name("tiny", "default", "/workspace") == f"gptflow-tiny-{digest}"
    long_run = "A_Very.Long-Run_Name_" * 5
    for run in ("tiny", long_run, "---"):
        train = jobset_name(run, "default", "/workspace")
        assert train == jobset_name(run, "default", "/workspace", "")
        for job in ("evaluate", "harness-step-123456789", "x" * 80):
            name = jobset_name(run, "default", "/workspace", job)
            assert name != train and len(name) <= NAME_MAX, name
            assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
    assert "-evaluate-" in jobset_name(long_run, "default", "/workspace", "evaluate")
    # read as written, lower-cased (not its capitals dropped), and a job its own digest too:
    # two jobs whose names clean alike are still two JobSets
    assert jobset_name("Tiny", "default", "/workspace", "Evaluate").startswith(
        "gptflow-tiny-evaluate-"
    )
    assert jobset_name("tiny", "default", "/workspace", "a_b") != jobset_name(
        "tiny", "default", "/workspace", "a-b"
    )


def test_an_autotune_trial_is_a_jobset_of_its_own_layout(repo, tiny_config):
    """On profiles/kubernetes each autotune trial is submitted as a run is: its pod set is
    sized from the trial's own layout, not the run's (a trial is planned, not run, here)."""
    cfg = copy.deepcopy(tiny_config)
    cfg["kubernetes"] = {**BASE, "nodes": 1, "gpus_per_node": 2}
    cfg["train"].update(global_batch_size=16, micro_batch_size=2)
    cfg["autotune"] = {"micro_batch_sizes": [2, 8], "zero_stages": [1],
                       "activation_checkpointing": [False]}  # fmt: skip
    profile = Profile(resources={"train_gpt": {"mpi": "kubernetes"}})
    plan = build_plan(cfg, repo=repo, profile=profile, config_files=[], main_process=False)
    assert set(plan.trials) == {"tiny.tune.mb2.z1.ac0", "tiny.tune.mb8.z1.ac0"}
    run, trial = (
        sizing.plan_pod_set(plan, "tiny"),
        sizing.plan_pod_set(plan, "tiny.tune.mb8.z1.ac0"),
    )
    assert trial.name != run.name and "tune" in trial.name
    assert (trial.nodes, trial.ranks_per_node) == (run.nodes, run.ranks_per_node) == (1, 2)
