"""The parallel layout against the ranks the profile gives the training rule, checked by a dry
run (-n): a tensor-parallel size that does not divide them stops the plan, not the queued job."""

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
