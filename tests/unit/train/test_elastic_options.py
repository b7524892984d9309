"""train.elastic without a process: its config (refused in one line naming the key), the
gradient accumulation on every node count it admits, torchrun's options on each profile, the
Slurm and local launch words, the preflight line, the run lock of an earlier round, the sample
record. The real launch is tests/unit/train/test_elastic.py."""

from __future__ import annotations

import json

import pytest

from gptflow.config.settings import ElasticConfig, TrainConfig
from gptflow.errors import GptflowError
from gptflow.plan.placement import check_elastic
from gptflow.train import distributed
from gptflow.train.checkpoint import ELASTIC_RUN_VAR, RunLock
from gptflow.train.distributed import (
    elastic_rendezvous,
    job_port,
    rank_options,
    run_port,
    torchrun_options,
    train_launcher,
)
from gptflow.train.elastic import SampleLog, consumed

ONE_TO_TWO = ElasticConfig(min_nodes=1, max_nodes=2, join_timeout_s=60, last_call_s=5)


def train(**kw) -> TrainConfig:
    return TrainConfig(train_iters=10, micro_batch_size=4, global_batch_size=16, **kw)


def test_the_accumulation_is_recomputed_for_every_node_count_with_one_global_batch():
    t = train(elastic={"min_nodes": 1, "max_nodes": 4})
    assert t.elastic == ElasticConfig(min_nodes=1, max_nodes=4)  # from run.yaml's dict
    with pytest.raises(GptflowError, match="admits 3 node"):  # 16 / (4 x 3)
        check_elastic(t, 1)
    assert check_elastic(train(elastic={"min_nodes": 1, "max_nodes": 2}), 1) == {1: 4, 2: 2}
    assert check_elastic(train(elastic={"min_nodes": 1, "max_nodes": 2}), 2) == {1: 2, 2: 1}
    assert check_elastic(train(elastic={"min_nodes": 4, "max_nodes": 4}), 1) == {4: 1}
    assert check_elastic(train(), 8) == {}  # not elastic
    # a JobSet has a fixed number of pods: refused on profiles/kubernetes, in one line
    with pytest.raises(GptflowError, match="not built for profiles/kubernetes") as e:
        check_elastic(train(elastic={"min_nodes": 1, "max_nodes": 2}), 1, "kubernetes")
    assert "\n" not in str(e.value)
    assert check_elastic(train(), 1, "kubernetes") == {}


def test_a_node_count_without_a_whole_accumulation_is_refused_in_one_line():
    t = train(elastic={"min_nodes": 2, "max_nodes": 3})
    with pytest.raises(GptflowError) as e:
        check_elastic(t, 1)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("train.elastic (min_nodes 2, max_nodes 3) admits 3 node(s) x 1 rank(s)")
    assert "train.global_batch_size 16 is not a multiple of train.micro_batch_size 4 x 3" in msg


def test_min_above_max_is_refused_naming_both_keys():
    with pytest.raises(GptflowError, match=r"train.elastic.min_nodes 3 is above "
                       r"train.elastic.max_nodes 2; swap them"):  # fmt: skip
        check_elastic(train(elastic={"min_nodes": 3, "max_nodes": 2}), 1)


def test_the_schema_refuses_what_the_dataclass_would_not_see(repo, tiny_config):
    """Types, bounds and unknown keys of train.elastic fail at -n with the key named."""
    from gptflow.plan.workflow_config import load_workflow_config

    def load(elastic):
        return load_workflow_config(
            {**tiny_config, "train": {**tiny_config["train"], "elastic": elastic}},
            schema_path=repo / "config/schema/config.schema.yaml",
            models_dir=repo / "config/models", source="test",
        )  # fmt: skip

    cfg = load({"min_nodes": 1, "max_nodes": 2})
    assert cfg["train"]["elastic"] == {"min_nodes": 1, "max_nodes": 2, "max_restarts": 3,
                                       "join_timeout_s": 600, "last_call_s": 30,
                                       "keep_alive_s": 5}  # fmt: skip
    assert load(None)["train"]["elastic"] is None
    for bad, key in [({"min_nodes": 0, "max_nodes": 2}, "min_nodes"),
                     ({"min_nodes": 1, "max_node": 2}, "max_node"),
                     ({"min_nodes": 1, "max_nodes": 2, "last_call_s": 0.5}, "last_call_s")]:  # fmt: skip
        with pytest.raises(GptflowError, match=key) as e:
            load(bad)
        assert "\n" not in str(e.value)


def test_local_elastic_options_meet_on_loopback_at_a_port_of_the_run():
    opts = torchrun_options(2, elastic=ONE_TO_TWO, run_id="/x/results/runs/tiny", env={})
    port = run_port("/x/results/runs/tiny")
    assert opts == [
        "--nnodes=1:2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=tiny", "--rdzv-conf=join_timeout=60,last_call_timeout=5,keep_alive_interval=5",
        "--nproc-per-node=2", "--max-restarts=3", "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
    ]  # fmt: skip
    assert run_port("/y/results/runs/tiny") != port  # two runs' agents do not meet
    given = elastic_rendezvous(ONE_TO_TWO, "tiny", "10.0.0.5:29400", env={})
    assert "--rdzv-endpoint=10.0.0.5:29400" in given
    assert distributed.elastic_run(opts) == f"--rdzv-endpoint=127.0.0.1:{port} --rdzv-id=tiny"


def test_a_fixed_launch_keeps_its_options():
    assert torchrun_options(2) == ["--standalone", "--nproc-per-node=2", "--max-restarts=0",
                                   "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"]  # fmt: skip


def test_slurm_and_pbs_elastic_meet_at_the_jobs_first_node(tmp_path):
    slurm = {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "4242"}
    opts = elastic_rendezvous(ElasticConfig(min_nodes=2, max_nodes=3), "/r/tiny", env=slurm)
    assert opts[:4] == ["--nnodes=2:3", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=gpu07:{job_port(4242)}", "--rdzv-id=4242"]  # fmt: skip
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn1\nn2\n")
    pbs = {"PBS_NODEFILE": str(nodefile), "PBS_JOBID": "77.server"}
    opts = elastic_rendezvous(ONE_TO_TWO, "/r/tiny", env=pbs)
    assert opts[2:4] == [f"--rdzv-endpoint=n1:{job_port(77)}", "--rdzv-id=77.server"]


def test_elastic_launch_words_on_each_profile():
    """Slurm: one srun task per node (an agent for the node's tasks_per_node ranks, its CPUs
    theirs), a failed one not killing the rest; local: an agent even for one rank."""
    res = {"mpi": "srun", "nodes": 2, "tasks_per_node": 4}
    assert train_launcher(res, 8, elastic={"min_nodes": 1, "max_nodes": 2}) == [
        "srun", "--kill-on-bad-exit=0", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=32",
    ]  # fmt: skip
    assert train_launcher(res, 8)[:2] == ["srun", "--kill-on-bad-exit=1"]  # not elastic
    assert rank_options(res, 8, elastic={"min_nodes": 1}) == [
        "--nproc-per-node", "4", "--threads", "8"]  # fmt: skip
    assert rank_options({"mpi": "", "nproc_per_node": 1}, 2, elastic={"min_nodes": 1}) == [
        "--nproc-per-node", "1", "--threads", "2"]  # fmt: skip
    assert rank_options({"mpi": "", "nproc_per_node": 2}, 4, elastic={"min_nodes": 1}) == [
        "--nproc-per-node", "2", "--threads", "2"]  # fmt: skip
    pbs = {"mpi": "mpiexec", "nodes": 2, "tasks_per_node": 4}
    assert rank_options(pbs, 6, elastic={"min_nodes": 1}) == [
        "--nproc-per-node",
        "4",
        "--threads",
        "6",
    ]  # fmt: skip  (no --nnodes: the config's)
    assert rank_options({"mpi": "", "nproc_per_node": 1}, 2) == ["--threads", "2"]


def test_the_cli_refuses_nnodes_with_elastic_and_an_endpoint_without(tmp_path, monkeypatch):
    from gptflow.cli import build_parser
    from gptflow.cli import train as cli_train

    monkeypatch.setattr(cli_train, "elastic_of", lambda config: (ONE_TO_TWO, "/r/tiny"))
    a = build_parser().parse_args(["train", "--config", "x.yaml", "--nproc-per-node", "1",
                                   "--nnodes", "2"])  # fmt: skip
    with pytest.raises(GptflowError, match=r"--nnodes 2: x\.yaml sets train\.elastic"):
        cli_train.cmd_train(a)
    monkeypatch.setattr(cli_train, "elastic_of", lambda config: (None, ""))
    a = build_parser().parse_args(["train", "--config", "x.yaml", "--nproc-per-node", "1",
                                   "--rdzv-endpoint", "h:1"])  # fmt: skip
    with pytest.raises(GptflowError, match=r"--rdzv-endpoint: x\.yaml sets no train\.elastic"):
        cli_train.cmd_train(a)


def test_an_earlier_rounds_lock_is_stale_and_only_within_the_same_elastic_run(
    tmp_path, monkeypatch
):
    """Its rank 0 may be on a lost node of a job still running: neither the pid nor Slurm can
    tell; the rendezvous can."""
    lock = RunLock(tmp_path / "train.lock")
    other = {"host": "node-gone", "pid": 1234, "elastic_run": "--rdzv-endpoint=h:1 --rdzv-id=7",
             "slurm_job_id": None}  # fmt: skip
    lock.path.write_text(json.dumps(other))
    monkeypatch.setenv(ELASTIC_RUN_VAR, "--rdzv-endpoint=h:1 --rdzv-id=7")
    assert "earlier round's of elastic run" in lock.stale_reason(other)
    monkeypatch.setenv(ELASTIC_RUN_VAR, "--rdzv-endpoint=h:2 --rdzv-id=8")
    assert lock.stale_reason(other) is None  # another run's live lock, heartbeat fresh
    monkeypatch.delenv(ELASTIC_RUN_VAR)
    assert lock.stale_reason(other) is None


def test_the_sample_record_keeps_each_steps_latest_attempt(tmp_path):
    import numpy as np

    path = tmp_path / "samples.jsonl"
    rows = np.arange(12, dtype=np.int32).reshape(3, 4)
    for rank in (0, 1):  # two ranks, steps 1-3; the second attempt redoes step 3 on one rank
        log = SampleLog(path, rank, 2, 0)
        for step in (1, 2, 3):
            log.add(step * 10 + rank * 2, rows[:2])
            log.write(step)
    again = SampleLog(path, 0, 1, 2)
    again.add(30, rows)
    again.write(3)
    got = consumed(path)
    assert sorted(got) == [1, 2, 3]
    assert [i for i, _ in got[1]] == [10, 11, 12, 13]
    assert [i for i, _ in got[3]] == [30, 31, 32]  # the resumed attempt's only
