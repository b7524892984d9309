"""The manifests of a :class:`~gptflow.kubernetes.spec.PodSet`, as plain dicts: the JobSet
gptflow submits (:func:`jobset`), the same training for clusters that run an operator instead
(:func:`pytorchjob`, Kubeflow Training Operator v1; :func:`trainjob`, Kubeflow Trainer v2;
:func:`deepspeedjob`, T9k's, unvalidated: no public schema), and the driver that runs Snakemake
in the cluster (:func:`driver`: its ServiceAccount, Role, RoleBinding and Job).

Every pod runs the rule's command (``gptflow train --config RUN.yaml --nproc-per-node G
--nnodes N ...``): one launch per pod, its ranks meeting node 0's through torchrun's ``PET_*``
variables (gptflow.train.pods), which the Trainer v2 runtime sets itself and the JobSet here
sets from the Job completion index and the headless Service. Preemption (exit code 75, a
DisruptionTarget) fails the child Job by its pod failure policy, and the JobSet restarts
without counting it; any other failure is a counted restart, up to ``max_restarts``.
"""

from __future__ import annotations

import yaml

from gptflow.kubernetes.spec import CONTAINER, EXIT_PREEMPTED, REPLICATED_JOB, PodSet

JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # the Job controller's annotation
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PREEMPTED_RULE = "preempted"  # JobSet failure policy rule names, read back by the submitter
FAILED_RULE = "failed"


def labels(p: PodSet, component: str = "train") -> dict:
    out = {
        "app.kubernetes.io/name": "gptflow",
        "app.kubernetes.io/component": component,
        "gptflow/run": p.run[:63].strip("-_.") or "run",
    }
    if p.queue:
        out[QUEUE_LABEL] = p.queue
    return out


def env_list(p: PodSet, rendezvous: bool = True, index_field: str | None = None) -> list[dict]:
    """The trainer's environment: torchrun's PET_* rendezvous (node rank from `index_field`,
    a fieldRef), unbuffered output for the logs, RDMA's NCCL variables, the config's own."""
    env: list[dict] = []
    if rendezvous:
        env += [
            {"name": "PET_NNODES", "value": str(p.nodes)},
            {"name": "PET_NPROC_PER_NODE", "value": str(p.ranks_per_node)},
            {"name": "PET_NODE_RANK",
             "valueFrom": {"fieldRef": {"fieldPath": index_field
                                        or f"metadata.annotations['{COMPLETION_INDEX}']"}}},
            {"name": "PET_MASTER_ADDR", "value": p.master},
            {"name": "PET_MASTER_PORT", "value": str(p.port)},
        ]  # fmt: skip
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    if p.rdma.get("enabled"):
        env.append({"name": "NCCL_IB_DISABLE", "value": "0"})
        if p.rdma.get("hca"):
            env.append({"name": "NCCL_IB_HCA", "value": p.rdma["hca"]})
    env += [{"name": k, "value": v} for k, v in sorted(p.env.items())]
    return env


def resources(p: PodSet) -> dict:
    """Requests and limits of one pod: CPUs, memory (request = limit: the memory the
    preflight sized, /dev/shm included), its GPUs and RDMA devices (extended resources are
    requested as limits)."""
    memory = f"{p.memory_mb}Mi"
    limits: dict = {"memory": memory}
    if p.gpus_per_node:
        limits[p.gpu_resource] = p.gpus_per_node
    if p.rdma.get("enabled"):
        limits[p.rdma["resource"]] = p.rdma.get("count", 1)
    return {"requests": {"cpu": str(p.cpus), "memory": memory}, "limits": limits}


def container(p: PodSet, command: list[str], name: str = CONTAINER, **env_args) -> dict:
    c = {
        "name": name,
        "image": p.image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(command),
        "workingDir": p.mount_path,
        "env": env_list(p, **env_args),
        "resources": resources(p),
        "volumeMounts": [
            {"name": "work", "mountPath": p.mount_path},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if p.rdma.get("enabled"):  # pinned memory for the HCA (ibv_reg_mr)
        c["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return c


def pod_spec(p: PodSet, command: list[str], name: str = CONTAINER, **env_args) -> dict:
    """The training pod: never restarted in place (the JobSet recreates the gang), the grace
    period the checkpoint save needs, no API token (the trainer needs none), /dev/shm in
    memory, the claim at the working directory, the config's scheduling constraints."""
    spec: dict = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": p.grace_seconds,
        "automountServiceAccountToken": False,
        "containers": [container(p, command, name, **env_args)],
        "volumes": [
            {"name": "work", "persistentVolumeClaim": {"claimName": p.volume_claim}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{p.shm_mb}Mi"}},
        ],
    }
    if p.priority_class:
        spec["priorityClassName"] = p.priority_class
    if p.node_selector:
        spec["nodeSelector"] = dict(p.node_selector)
    if p.tolerations:
        spec["tolerations"] = [toleration(t) for t in p.tolerations]
    if p.image_pull_secret:
        spec["imagePullSecrets"] = [{"name": p.image_pull_secret}]
    return spec


def toleration(t: dict) -> dict:
    out = {"key": t["key"], "operator": t.get("operator", "Exists")}
    if out["operator"] == "Equal":
        out["value"] = t.get("value", "")
    if t.get("effect"):
        out["effect"] = t["effect"]
    return out


def pod_template(p: PodSet, command: list[str], **kwargs) -> dict:
    # Istio's sidecar breaks the ranks' connections and keeps a finished pod running
    return {
        "metadata": {"labels": labels(p), "annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": pod_spec(p, command, **kwargs),
    }


def jobset(p: PodSet, command: list[str]) -> dict:
    """The JobSet: one Indexed Job of `nodes` pods (node rank = completion index) behind a
    headless Service published before the pods are ready (rank 0's name resolves while the
    others start). A pod exiting 75 or disrupted fails its Job by the pod failure policy
    (reason PodFailurePolicy), which restarts the JobSet without counting; any other failure
    (BackoffLimitExceeded) restarts it counted, up to max_restarts, then fails it."""
    job = {
        "parallelism": p.nodes,
        "completions": p.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": CONTAINER,
                        "operator": "In",
                        "values": [EXIT_PREEMPTED],
                    },
                },
                {
                    "action": "FailJob",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
            ]
        },
        "template": pod_template(p, command),
    }
    return {
        "apiVersion": f"{JOBSET_API[0]}/{JOBSET_API[1]}",
        "kind": "JobSet",
        "metadata": {"name": p.name, "namespace": p.namespace, "labels": labels(p)},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All"},
            "failurePolicy": {
                "maxRestarts": p.max_restarts,
                "restartStrategy": "BlockingRecreate",
                "rules": [
                    {
                        "name": PREEMPTED_RULE,
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    },
                    {"name": FAILED_RULE, "action": "RestartJobSet"},
                ],
            },
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


def pytorchjob(p: PodSet, command: list[str]) -> dict:
    """Kubeflow Training Operator v1 (kubeflow.org/v1, release 1.9): Worker replicas only (a
    Master would get a per-pod RANK that is not a process's), each pod's node rank its replica
    index, rank 0's Service as the rendezvous. Preemption and failures restart pods under
    runPolicy.backoffLimit (v1 cannot tell exit code 75 apart). Its elasticPolicy (torchrun's
    --nnodes MIN:MAX) is where elastic training would go."""
    name = p.name
    master = f"{name}-worker-0"
    template = pod_template(p, command, name="pytorch",
                            index_field="metadata.labels['training.kubeflow.org/replica-index']")  # fmt: skip
    env = template["spec"]["containers"][0]["env"]
    for var in env:
        if var["name"] == "PET_MASTER_ADDR":
            var["value"] = master
    template["spec"]["containers"][0]["env"] = [v for v in env if v["name"] not in
                                               ("PET_NNODES", "PET_NPROC_PER_NODE")]  # fmt: skip
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": p.namespace, "labels": labels(p)},
        "spec": {
            "nprocPerNode": str(p.ranks_per_node),
            "runPolicy": {
                "backoffLimit": p.max_restarts,
                "cleanPodPolicy": "All",
                **({"schedulingPolicy": {"queue": p.queue}} if p.queue else {}),
            },
            "pytorchReplicaSpecs": {
                "Worker": {"replicas": p.nodes, "restartPolicy": "Never", "template": template}
            },
        },
    }


def trainjob(p: PodSet, command: list[str]) -> dict:
    """Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1, v2.3): the ``torch-distributed``
    ClusterTrainingRuntime sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT
    itself (its webhook refuses them from the user); the pod's volumes, /dev/shm and scheduling
    go in as a runtime patch of its JobSet's ``node`` job."""
    spec = pod_spec(p, command, name="node", rendezvous=False)
    (c,) = spec.pop("containers")
    # v2.3's runtime patch takes these of the pod (not priorityClassName: the runtime's)
    kept = ("volumes", "nodeSelector", "tolerations", "imagePullSecrets",
            "terminationGracePeriodSeconds")  # fmt: skip
    patch_pod = {k: v for k, v in spec.items() if k in kept}
    patch_pod["containers"] = [{"name": "node", "volumeMounts": c["volumeMounts"],
                                **({"securityContext": c["securityContext"]}
                                   if "securityContext" in c else {})}]  # fmt: skip
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": p.name, "namespace": p.namespace, "labels": labels(p)},
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": "ClusterTrainingRuntime",
                "name": "torch-distributed",
            },
            "trainer": {
                "image": p.image,
                "command": list(command),
                "numNodes": p.nodes,
                "numProcPerNode": p.ranks_per_node,
                "resourcesPerNode": c["resources"],
                "env": c["env"],
            },
            "runtimePatches": [
                {
                    "manager": "gptflow",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "name": "node",
                                        "template": {"spec": {"template": {"spec": patch_pod}}},
                                    }
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def deepspeedjob(p: PodSet, command: list[str]) -> dict:
    """T9k's DeepSpeedJob (batch.tensorstack.dev/v1beta1), on paper: no public schema exists
    and T9k's documents disagree on spellings, so this is not validated. Each worker runs the
    same per-pod launch (its node rank from its replica index); T9k's own controller starts
    DeepSpeed's pdsh launcher on worker 0, which gptflow does not use."""
    template = pod_template(p, command, name="worker",
                            index_field="metadata.labels['batch.tensorstack.dev/replica-index']")  # fmt: skip
    for var in template["spec"]["containers"][0]["env"]:
        if var["name"] == "PET_MASTER_ADDR":
            var["value"] = f"{p.name}-worker-0"
    return {
        "apiVersion": "batch.tensorstack.dev/v1beta1",
        "kind": "DeepSpeedJob",
        "metadata": {
            "name": p.name,
            "namespace": p.namespace,
            "labels": labels(p),
            "annotations": {"gptflow/validated": "false: no public schema"},
        },
        "spec": {
            "config": {"slotsPerWorker": p.ranks_per_node},
            "runPolicy": {"backoffLimit": p.max_restarts},
            "worker": {"replicas": p.nodes, "template": template},
        },
    }


RENDERERS = {"jobset": jobset, "pytorchjob": pytorchjob, "trainjob": trainjob,
             "deepspeedjob": deepspeedjob}  # fmt: skip


# The driver's PID 1. Snakemake meets SIGTERM by waiting for its running jobs (a graceful stop)
# and still retries a job that fails meanwhile; the kubelet's SIGKILL after the grace period
# would then leave every JobSet training. So on SIGTERM (or SIGINT) the shell sends SIGTERM to
# its whole process group -- Snakemake and every submitter, which deletes its JobSet -- once a
# second until Snakemake has ended and for 10 s after it (a retry Snakemake starts as it stops
# is stopped too: before it creates its JobSet, or after, when it deletes it).
DRIVER_SHELL = (
    'trap \'trap "" TERM INT; (trap "" TERM; while :; do kill -TERM 0; sleep 1; done) & '
    "ticker=$!' TERM INT; "
    '"$@" & child=$!; '
    "while :; do wait $child; status=$?; kill -0 $child 2>/dev/null || break; done; "
    '[ -z "$ticker" ] || { sleep 10; kill -KILL $ticker; }; exit $status'
)


def driver(
    p: PodSet, config_files: list[str], target: str, cpus: int, memory_mb: int,
    service_account: str, replace: bool = False,
) -> list[dict]:  # fmt: skip
    """The driver: a ServiceAccount with a Role limited to the namespace's JobSets, pods and
    pod logs, and a Job of one pod running ``snakemake --profile profiles/kubernetes TARGET``
    in the working directory on the claim (its CPU stages use the pod's cores and memory; each
    train_gpt is a JobSet it submits). Its grace period covers the trainers' save: stopped, its
    submitter deletes the JobSets, whose pods save on SIGTERM."""
    meta = {"namespace": p.namespace, "labels": labels(p, "driver")}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": service_account, **meta},
        "rules": [
            {"apiGroups": [JOBSET_API[0]], "resources": ["jobsets"],
             "verbs": ["create", "get", "list", "watch", "delete"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        ],
    }  # fmt: skip
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": service_account, **meta},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": service_account},
        "subjects": [{"kind": "ServiceAccount", "name": service_account,
                      "namespace": p.namespace}],
    }  # fmt: skip
    # the target first: --configfile takes every word after it
    command = ["snakemake", target, "--profile", "profiles/kubernetes", "--cores", str(cpus)]
    for f in config_files:
        command += ["--configfile", f]
    command += ["--replace-workflow-config"] if replace else []
    memory = f"{memory_mb}Mi"
    pod = {
        "serviceAccountName": service_account,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": p.grace_seconds + 60,
        "containers": [{
            "name": "driver",
            "image": p.image,
            "command": ["sh", "-c", DRIVER_SHELL, "driver", *command],
            "workingDir": p.mount_path,
            "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
            "resources": {"requests": {"cpu": str(cpus), "memory": memory},
                          "limits": {"cpu": str(cpus), "memory": memory}},
            "volumeMounts": [{"name": "work", "mountPath": p.mount_path}],
        }],
        "volumes": [{"name": "work", "persistentVolumeClaim": {"claimName": p.volume_claim}}],
    }  # fmt: skip
    if p.image_pull_secret:
        pod["imagePullSecrets"] = [{"name": p.image_pull_secret}]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{p.name.replace('gptflow-', 'gptflow-driver-', 1)}"[:63], **meta},
        "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": labels(p, "driver")},
                                                  "spec": pod}},
    }  # fmt: skip
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": service_account, **meta}}  # fmt: skip
    return [account, role, binding, job]


def dump_all(objects: list[dict]) -> str:
    """Multi-document YAML, keys in the order written."""
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


def summary(p: PodSet) -> str:
    """The plan's line for the JobSet a train_gpt job submits, in the preflight's style."""
    gpus = (f"{p.gpus_per_node} x {p.gpu_resource}" if p.gpus_per_node
            else "no GPU (1 CPU rank)")  # fmt: skip
    extra = [f"queue {p.queue}"] if p.queue else []
    extra += [f"priority {p.priority_class}"] if p.priority_class else []
    extra += [f"RDMA {p.rdma['count']} x {p.rdma['resource']}"] if p.rdma.get("enabled") else []
    return (
        f"  kubernetes: JobSet {p.namespace}/{p.name}: {p.nodes} pod(s) x {gpus}, "
        f"{p.cpus} CPU(s), {p.memory_mb:,} MiB memory (/dev/shm {p.shm_mb:,} MiB) a pod; image "
        f"{p.image or '(kubernetes.image not set)'}; claim "
        f"{p.volume_claim or '(kubernetes.volume_claim not set)'} at {p.mount_path}; "
        f"{p.max_restarts} counted restart(s), preemptions (exit {EXIT_PREEMPTED}) free"
        + "".join(f"; {e}" for e in extra)
    )
