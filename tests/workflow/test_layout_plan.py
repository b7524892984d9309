"""The parallel layout against the ranks the profile gives the training rule, checked by a dry
run (-n): a tensor-parallel size that does not divide them stops the plan, not the queued job."""

import re
import subprocess
import sys

import pytest

from gptflow.plan.placement import Placement

from .conftest import snakemake_cmd


@pytest.mark.parametrize(
    ("resources", "refused"),
    [
        (["train_gpt:mpi='srun'", "train_gpt:nodes=2", "train_gpt:tasks_per_node=4"], None),
        (["train_gpt:mpi='srun'", "train_gpt:tasks=4"], None),
        (["train_gpt:mpi='srun'", "train_gpt:tasks=6"], "does not divide the 6 training ranks"),
        ([], "does not divide the 1 training ranks"),  # one machine: one process
    ],
)
def test_tensor_parallel_must_divide_the_training_ranks(
    tmp_path, snakemake, write_config, tiny_config, resources, refused
):
    cfg = {**tiny_config, "train": {**tiny_config["train"], "tensor_parallel": 4, "zero_stage": 1}}
    config = write_config(tmp_path / "tp4.yaml", cfg)
    args = ["--set-resources", *resources] if resources else []
    out = snakemake(tmp_path, config, "-n", *args)
    if refused is None:
        assert out.returncode == 0, out.out[-3000:]
        assert "train_gpt" in out.out
    else:
        assert out.returncode != 0
        assert f"train.tensor_parallel 4 {refused}" in out.out, out.out[-3000:]
        assert "change train.tensor_parallel" in out.out
        assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    ("resources", "refused"),
    [
        (["train_gpt:nproc_per_node=2", "train_gpt:socket_ifname=lo"], None),
        (["train_gpt:nproc_per_node=3"], "train.tensor_parallel 2 does not divide the 3 training "
         "ranks; give the training rule a multiple of 2 ranks (the profile's nodes x "
         "tasks_per_node, or nproc_per_node on one machine)"),
        (["train_gpt:nproc_per_node=two"], "set-resources train_gpt nproc_per_node is 'two'; "
         "expected the number of training ranks"),
    ],
)  # fmt: skip
def test_tensor_parallel_on_the_ranks_of_one_machine(
    tmp_path, snakemake, write_config, tiny_config, resources, refused
):
    """profiles/local with --set-resources train_gpt:nproc_per_node=N (no GPU here: N CPU
    ranks): the plan counts N ranks, tensor parallel 2 over 2 of them plans, and train_gpt's
    command starts them with `gptflow train --nproc-per-node 2`, the job's 2 cores shared
    and the rendezvous interface in each rank's environment; 3 ranks, or a count that is no
    number, are refused before any job."""
    cfg = {**tiny_config, "train": {**tiny_config["train"], "tensor_parallel": 2, "zero_stage": 1}}
    config = write_config(tmp_path / "tp2.yaml", cfg)
    out = snakemake(tmp_path, config, "-n", "train", "--set-resources", *resources)
    if refused is not None:
        assert out.returncode != 0
        assert refused in out.out, out.out[-3000:]
        assert not (tmp_path / "results").exists()
        return
    assert out.returncode == 0, out.out[-3000:]
    assert (
        "gptflow preflight: train_gpt on 2 rank(s) = 2 tensor x 1 data parallel; micro batch 4 "
        "x grad accum 2 x 1 = global batch 8; " in out.out
    ), out.out[-3000:]
    assert re.search(
        r"\n  train_gpt: 2 rank\(s\) on this machine \(set-resources train_gpt nproc_per_node; "
        r"0 GPU\(s\): [^)]+\), the job's cores shared among them\n",
        out.out,
    ), out.out[-3000:]
    assert (
        " env GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo gptflow train --config "
        "results/runs/tiny/run.yaml --nproc-per-node 2 --threads 1 --wait-for-lock >> "
        "logs/train_gpt/tiny.log 2>&1" in out.out
    ), out.out[-3000:]


OFFERED = """
import atexit, sys
import snakemake.api  # first: snakemake.workflow imports it back
import snakemake.workflow
made = []
init = snakemake.workflow.Workflow.__init__
def keep(self, *args, **kwargs):
    init(self, *args, **kwargs)
    made.append(self)
snakemake.workflow.Workflow.__init__ = keep
atexit.register(lambda: print("offered:", {k: getattr(v, "value", v) for w in made
                                           for k, v in w.global_resources.items() if k == "gpu"}))
from snakemake.cli import main
sys.argv = ["snakemake", *sys.argv[1:]]
sys.exit(main())
"""


def test_the_local_profile_checks_the_model_against_this_machines_gpus(
    repo, tmp_path, snakemake, write_config, tiny_config
):
    """profiles/local on a machine whose nvidia-smi lists GPUs of 4 and 3 GiB (a stand-in
        script, tests/support/fake_gpus.py: no GPU exists here): the plan reads their memory and
        checks the model against the smallest as the Slurm profile does. pythia-160m is refused
        before any job with the Slurm check's line for GPUs of that size, only where the memory
        comes from differing; the tiny model plans, one rank per GPU, and its GPU jobs (train_gpt,
        evaluate) each take both GPUs (`gpu=2`, the machine's count), and the workflow offers 2 (so
    they run one at a time)."""
    from gptflow.errors import GptflowError
    from gptflow.plan import preflight
    from gptflow.plan.runs import run_plan
    from gptflow.plan.workflow_config import load_workflow_config, run_configs
    from tests.support.fake_gpus import fake_nvidia_smi, path_with

    gpus = path_with(fake_nvidia_smi(tmp_path / "bin", [4096, 3072]))
    source = "nvidia-smi: the smallest of 2 GPU(s), 3,072 MiB"
    cfg = {**tiny_config, "model": {"preset": "pythia-160m"}}
    config = write_config(tmp_path / "big.yaml", cfg)
    plan = snakemake(tmp_path / "wd", config, "-n", env=gpus)
    assert plan.returncode != 0
    (line,) = [x for x in plan.out.splitlines() if "does not fit in a GPU" in x]
    run = next(iter(run_configs(load_workflow_config(
        cfg, schema_path=repo / "config/schema/config.schema.yaml",
        models_dir=repo / "config/models", source=str(config),
    )).values()))  # fmt: skip
    slurm = Placement(executor="slurm", nodes=1, tasks_per_node=2, gres="gpu:2", mpi="srun",
                      gpu_mem_mb=3072)  # fmt: skip
    with pytest.raises(GptflowError) as refused:
        preflight.run(run_plan("tiny", run, None), slurm, sinfo=lambda: None)
    said = str(refused.value)
    assert "(set-resources train_gpt gpu_mem_mb)" in said
    assert line == (
        f"gptflow preflight ({config} and the profile): "
        + said.replace("(set-resources train_gpt gpu_mem_mb)", f"({source})")
    )
    assert "Traceback" not in plan.out and not (tmp_path / "wd" / "results").exists()

    # what the workflow offers, as Snakemake holds it (an undeclared resource is unlimited:
    # two trainers would start on the same GPUs), printed by the Snakemake process at its end
    cmd = [sys.executable, "-c", OFFERED, *snakemake_cmd(
        tmp_path / "wd", write_config(tmp_path / "tiny.yaml", tiny_config), "-n")[1:]]  # fmt: skip
    plan = subprocess.run(cmd, capture_output=True, text=True, env=gpus, timeout=600)
    plan.out = plan.stdout + plan.stderr
    assert plan.returncode == 0, plan.out[-3000:]
    assert "offered: {'gpu': 2}" in plan.out.splitlines(), plan.out[-2000:]
    fits = rf"\n  memory per GPU: about .* of 3\.0 GiB \(.*; {re.escape(source)}\)\n"
    assert re.search(fits, plan.out), plan.out[:3000]
    ranks = "train_gpt: 2 rank(s) on this machine (one per visible GPU; 2 GPU(s): nvidia-smi -L)"
    assert ranks in plan.out
    resources = [x.strip() for x in plan.out.splitlines() if x.strip().startswith("resources:")]
    assert [r for r in resources if "gpu=2" in r] == [
        "resources: tmpdir=/tmp, mpi=, nproc_per_node=2, gpu=2",
        "resources: tmpdir=/tmp, gres=<TBD>, runtime=<TBD>, gpu=2, mem_mb=<TBD>, mem=<TBD>, "
        "mem_mib=<TBD>",
    ], resources
