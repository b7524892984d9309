"""Rank, world size and master address from srun, torchrun, or a plain process."""

import pytest

from gptflow.distributed import first_host, resolve
from gptflow.errors import GptflowError


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node001", "node001"),
        ("gpu[07-09,12]", "gpu07"),
        ("gpu[12,07-09]", "gpu12"),
        ("a100-[3-4],cpu1", "a100-3"),
        ("n1,n2", "n1"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_srun_task_of_a_two_node_job():
    env = {
        "SLURM_PROCID": "11",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "3",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
    }
    d = resolve(env)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size) == (11, 16, 3, 8)
    assert d.master_addr == "gpu07" and d.launcher == "slurm"
    assert d.master_port == 20000 + 123456 % 20000  # the same on every task of the job


def test_torchrun_wins_and_single_process_default():
    d = resolve(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1234",
        }
    )
    assert (d.rank, d.world_size, d.master_addr, d.master_port, d.launcher) == (
        1,
        2,
        "h",
        1234,
        "torchrun",
    )
    d = resolve({})
    assert (d.rank, d.world_size, d.launcher) == (0, 1, "single") and d.master_port > 0


def test_bad_values_are_named():
    with pytest.raises(GptflowError, match=r"SLURM_PROCID='x' is not an integer"):
        resolve({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})
