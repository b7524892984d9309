"""The parallel layout against the ranks the profile gives the training rule, checked by a dry
run (-n): a tensor-parallel size that does not divide them stops the plan, not the queued job."""

import re

import pytest


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
