"""The GPU jobs after training (evaluate, harness, harness_step) on and off profiles/kubernetes,
as their rules' functions (rules/evaluate_functions.smk, loaded with runpy over a real plan and
stubbed sizers) hand them to the commands: off Kubernetes no launcher word and the job's memory
and GPUs held here, as before; on it the submitter of the job's own one-pod JobSet, whose memory
is the rule's figure plus /dev/shm and whose success is the rule's output, and the driver holds
only the submitter's memory and no GPU. The commands themselves: tests/workflow/test_kubernetes.py
and tests/unit/test_rules_quoting.py."""

from __future__ import annotations

import copy
import runpy
from types import SimpleNamespace

import pytest

from gptflow.kubernetes import sizing
from gptflow.kubernetes.spec import PodSet
from gptflow.plan.build import build_plan
from gptflow.plan.profile import Profile
from tests.conftest import REPO

IMAGE = "registry.example.org/gptflow@sha256:" + "0123456789abcdef" * 4
MEM = {"evaluate": 3000, "harness": 5000, "export": 7000}  # the stubbed sizers' host MiB
LOCAL_GPUS = 2


def functions(plan, run_yaml) -> dict:
    """rules/evaluate_functions.smk's functions over `plan`, the package's sizers stubbed: each
    gives its MEM figure, +1 MiB on a GPU (what the rule asks Slurm for)."""

    def sized(kind):
        return lambda config, *rest: {"mem_mb": MEM[kind] + (1 if rest and rest[1] else 0),
                                      "gres": "gpu:1", "runtime": 10}  # fmt: skip

    return runpy.run_path(
        str(REPO / "rules" / "evaluate_functions.smk"),
        init_globals={
            "PLAN": plan,
            "kube_sizing": sizing,
            "run_eval_resources": sized("evaluate"),
            "run_harness_resources": lambda config, gpu_mem, on_gpu, cfg, work: sized("harness")(
                config, gpu_mem, on_gpu
            ),
            "run_export_resources": lambda config: {"mem_mb": MEM["export"], "runtime": 5},
            "harness_work": lambda: [],
            "gpu_memory": SimpleNamespace(DEFAULT_GPU_MEMORY_MB=81920),
            "get_local_gpus": lambda wildcards: LOCAL_GPUS,
        },
    )


@pytest.fixture
def plans(tiny_config, tmp_path):
    def make(kubernetes: bool, gpus: int = 4):
        cfg = copy.deepcopy(tiny_config)
        cfg["kubernetes"] = {"image": IMAGE, "volume_claim": "work", "gpus_per_node": gpus,
                             "shm_mb": 512, "cpus_per_rank": 3}  # fmt: skip
        resources = {"train_gpt": {"mpi": "kubernetes"}} if kubernetes else {}
        plan = build_plan(cfg, repo=REPO, profile=Profile(resources=resources), config_files=[],
                          main_process=False)  # fmt: skip
        run_yaml = tmp_path / "run.yaml"
        run_yaml.write_text("{}")
        return functions(plan, str(run_yaml)), str(run_yaml)

    return make


def call(f, name, step=None, config=""):
    wildcards = SimpleNamespace(run="tiny", step=step)
    out = {"evaluate": "results/runs/tiny/eval.json", "harness": "results/runs/tiny/harness.json",
           "harness_step": f"results/runs/tiny/harness/step{step}.json"}  # fmt: skip
    name, rule = {"evaluate": "eval"}.get(name, name), name
    launcher = f[f"get_{name}_launcher"](wildcards, SimpleNamespace(config=config),
                                         [out[rule]])  # fmt: skip
    mem = f[f"get_{name}_mem_mb"](wildcards, SimpleNamespace(config=config))
    return launcher, mem, out[rule]


@pytest.mark.parametrize("name", ["evaluate", "harness", "harness_step"])
def test_off_kubernetes_a_job_runs_here_with_its_memory_and_gpus(plans, name, monkeypatch):
    monkeypatch.setattr("gptflow.plan.build.Plan.local_gpus", LOCAL_GPUS)
    f, run_yaml = plans(kubernetes=False)
    launcher, mem, _ = call(f, name, step="30", config=run_yaml)
    assert launcher == []  # the command is `gptflow ...` as before: `{params.launcher:q}` is ''
    want = {"evaluate": 3001, "harness": 5001, "harness_step": 7000}[name]
    assert mem == want  # its own memory (on this machine's GPUs: the GPU figure)
    assert f["get_job_gpu"](None) == LOCAL_GPUS


@pytest.mark.parametrize("name", ["evaluate", "harness", "harness_step"])
@pytest.mark.parametrize("gpus", [4, 0])
def test_on_kubernetes_a_job_is_submitted_as_its_own_one_pod_jobset(plans, name, gpus):
    f, run_yaml = plans(kubernetes=True, gpus=gpus)
    launcher, mem, output = call(f, name, step="30", config=run_yaml)
    assert launcher[:4] == ["gptflow", "kubernetes", "submit", "--spec"] and launcher[5] == "--"
    p = PodSet.from_json(launcher[4])
    assert (p.nodes, p.gpus_per_node, p.cpus) == (1, 1 if gpus else 0, 3)
    job = {"evaluate": "evaluate", "harness": "harness", "harness_step": "harness-step-30"}[name]
    on_gpu = 1 if gpus else 0  # sized for the pod's GPU, or for a CPU pod
    rule_mb = {"evaluate": 3000 + on_gpu, "harness": 5000 + on_gpu, "harness_step": 7000}[name]
    assert p.memory_mb == rule_mb + 512 and p.done == output
    assert p.name.startswith(f"gptflow-tiny-{job}-")
    assert p.manifests_dir == f"results/runs/tiny/kubernetes/{job}"
    # the driver holds the submitter only: the job's memory and GPU are the pod's
    assert mem == sizing.SUBMITTER_MEM_MB
    assert f["get_job_gpu"](None) is None


def test_on_kubernetes_every_job_and_step_has_its_own_jobset(plans):
    f, run_yaml = plans(kubernetes=True)
    names = {
        PodSet.from_json(call(f, name, step=step, config=run_yaml)[0][4]).name
        for name, step in (
            ("evaluate", None),
            ("harness", None),
            ("harness_step", "30"),
            ("harness_step", "40"),
        )
    }
    assert len(names) == 4, names
