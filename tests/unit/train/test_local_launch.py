"""`gptflow train --nproc-per-node N`: N real gloo ranks on this machine through PyTorch's
elastic launcher, exiting 75 -- not torchrun's 1 -- when every rank saved and stopped, so a
retry resumes; any other failure exits non-zero and not 75."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from gptflow.cli import build_parser
from gptflow.cli.train import rank_args
from gptflow.train.launch import exit_code
from gptflow.watch.status import RunFiles, live_trainer

from .test_train import BIN, records, wait_for


def local_train(run_dir, *extra: str) -> list[str]:
    return [
        str(BIN / "gptflow"), "train", "--nproc-per-node", "2", "--config",
        str(run_dir / "run.yaml"), "--threads", "1", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_two_local_ranks_exit_75_after_a_signal_and_at_the_exit_interval(
    make_run, tmp_path, signum
):
    """SIGUSR1 (or SIGTERM, which torch's agent would otherwise handle by stopping the ranks)
    to the launcher reaches both ranks (each in a session of its own): they save the step
    (each rank its ZeRO-1 partition) and exit 75, and so does the launch. The rerun resumes
    from that step, stops at --exit-interval, and exits 75 again."""
    run_dir = make_run("local", zero_stage=1, train_iters=400, log_interval=1, save_interval=1000)
    log = tmp_path / "local.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(local_train(run_dir), stdout=out, stderr=out)
    try:
        wait_for(lambda: len(records(run_dir, "train")) >= 3, proc, log, timeout=180, poll=0.01)
        proc.send_signal(signum)
        proc.wait(timeout=180)
    finally:
        proc.kill()
        proc.wait()
    err = log.read_text()
    assert proc.returncode == 75, err[-3000:]
    assert f"received signal {int(signum)}" in err
    assert "the 2 ranks saved and stopped; exiting 75: run the same command again" in err
    saved = int(err.split("saved step ")[1].split(";")[0])
    assert saved < 400
    (series,) = (run_dir / "checkpoints").iterdir()
    step = series / f"step{saved:08d}"
    assert (series / "latest").read_text() == step.name
    assert {p.name for p in step.glob("zero_pp_rank_*_optim_states.pt")} == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    }  # fmt: skip
    assert live_trainer(RunFiles(run_dir)) is None  # released, or its holder gone
    if signum == signal.SIGTERM:
        return  # the rerun is the same as after SIGUSR1

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rerun = subprocess.run(
        local_train(run_dir, "--exit-interval", str(saved + 2)), capture_output=True, text=True,
        timeout=600, env=env,
    )  # fmt: skip
    assert rerun.returncode == 75, rerun.stderr[-3000:]
    assert f"resuming from step {saved};" in rerun.stderr
    assert "2 ranks (torchrun)" in rerun.stderr
    assert f"exit interval {saved + 2}: saved step {saved + 2};" in rerun.stderr
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, saved + 3))


def test_a_failing_launch_exits_non_zero_and_not_75(tmp_path):
    """Both ranks fail (a run config that does not exist): the launch exits 1, as they do."""
    missing = tmp_path / "missing"
    out = subprocess.run(
        local_train(missing), capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "rank 0 failed first (exit code 1)" in out.stderr or (
        "rank 1 failed first (exit code 1)" in out.stderr
    )


def test_exit_code_of_failed_ranks():
    """75 when the first failed rank exited 75 and the others did too or were stopped by the
    agent (SIGTERM after the first exit); else the first other failure, a signal as 128 + N
    (torch's own ProcessFailure records, ordered by their time)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failures(*codes: int) -> dict:
        out = {}
        for rank, code in enumerate(codes):
            out[rank] = ProcessFailure(rank, 1000 + rank, code, "<N/A>")
            out[rank].timestamp = rank  # rank 0 first
        return out

    assert exit_code(failures(75, 75)) == 75
    assert exit_code(failures(75)) == 75
    assert exit_code(failures(75, 1)) == 1
    assert exit_code(failures(2, 75)) == 2
    assert exit_code(failures(75, -int(signal.SIGTERM))) == 75  # stopped by the agent
    assert exit_code(failures(-int(signal.SIGTERM), 75)) == 143  # killed before any stop
    assert exit_code(failures(75, -int(signal.SIGKILL))) == 137
    assert exit_code(failures(1, -int(signal.SIGTERM))) == 1


def test_the_ranks_get_every_train_option_but_nproc_per_node():
    """... and --nnodes: both are the launcher's (the ranks run inside it)."""
    argv = ["train", "--config", "r.yaml", "--threads", "3", "--exit-interval", "7",
            "--wait-for-lock", "12", "--nproc-per-node", "2", "--nnodes", "1"]  # fmt: skip
    a = build_parser().parse_args(argv)
    assert rank_args(a) == argv[:-4]
    ranks = build_parser().parse_args(rank_args(a))
    assert ranks.nproc_per_node is None and ranks.nnodes is None
    # an option added to `train` later must be passed on too
    (train,) = [
        parser
        for action in build_parser()._subparsers._group_actions
        for name, parser in action.choices.items()
        if name == "train"
    ]
    options = {o for action in train._actions for o in action.option_strings}
    assert options == {"-h", "--help", *(x for x in argv if x[:2] == "--")}


def test_nproc_per_node_is_refused_inside_a_launcher(tmp_path):
    """Under torchrun (or srun) the process is already a rank: it would start ranks of ranks."""
    out = subprocess.run(
        local_train(tmp_path), capture_output=True, text=True, timeout=120,
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"},
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "gptflow train: error: --nproc-per-node 2: this process is already rank 0 of 2 "
        "(started by torchrun); drop --nproc-per-node, the launcher that started it starts "
        "the ranks"
    ]


@pytest.mark.parametrize(
    ("value", "count"),
    [("0,1,2,3", 4), ("", 0), ("-1", 0), ("0,1,-1,2", 2), ("GPU-8f2a,GPU-11bc", 2),
     ("MIG-4c1e", 1), ("3", 1), ("NoDevFiles", 0)],
)  # fmt: skip
def test_cuda_visible_devices_counted_as_cuda_reads_it(value, count):
    from gptflow.hardware import cuda_visible_count

    assert cuda_visible_count(value) == count


def test_the_gpus_planning_counts_without_torch(tmp_path, monkeypatch):
    """One rank per GPU this machine shows: `nvidia-smi -L`'s GPU lines (MIG lines not
    counted), no more than CUDA_VISIBLE_DEVICES lets through; none without nvidia-smi. The
    nvidia-smi here is a stand-in printing what a 4-GPU node's prints: no GPU exists here."""
    from gptflow.hardware import visible_gpus

    monkeypatch.setenv("PATH", str(tmp_path))
    assert visible_gpus({}) == (0, "no nvidia-smi on PATH")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == (2, "CUDA_VISIBLE_DEVICES='0,1'")
    smi = tmp_path / "nvidia-smi"
    lines = [f"GPU {i}: NVIDIA A100-SXM4-80GB (UUID: GPU-{i}f2a)" for i in range(4)]
    lines.insert(1, "  MIG 3g.40gb     Device  0: (UUID: MIG-4c1e)")
    smi.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in lines))
    smi.chmod(0o755)
    assert visible_gpus({}) == (4, "nvidia-smi -L")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})[0] == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})[0] == 4
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert visible_gpus({}) == (0, "nvidia-smi -L exited 9")


def test_the_gpus_memory_planning_reads_without_torch(tmp_path, monkeypatch):
    """The memory the local profile's fit check plans against: the smallest GPU that
    `nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits` lists (MiB); none
    without nvidia-smi, or when it fails. The nvidia-smi here is a stand-in
    (tests/support/fake_gpus.py): no GPU exists here."""
    from gptflow.hardware import gpu_memory_mib, visible_gpus
    from tests.support.fake_gpus import fake_nvidia_smi

    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_memory_mib() == (None, "no nvidia-smi on PATH")
    fake_nvidia_smi(tmp_path, [81920, 40960, 81920])
    assert gpu_memory_mib() == (40960, "nvidia-smi: the smallest of 3 GPU(s), 40,960 MiB")
    assert visible_gpus({}) == (3, "nvidia-smi -L")
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\n")
    assert gpu_memory_mib() == (None, "nvidia-smi --query-gpu=memory.total printed no MiB figures")
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    assert gpu_memory_mib() == (None, "nvidia-smi --query-gpu=memory.total exited 9")
