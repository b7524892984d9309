"""The preflight (gptflow.plan.preflight): what `snakemake -n` refuses before a job is queued, and
the per-GPU memory estimate, checked against what DeepSpeed allocates and estimates."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.errors import GptflowError
from gptflow.plan import cluster, gpu_memory, host_memory, placement, preflight, run_size
from gptflow.plan.cluster import PartitionNodes, check_cluster, parse_sinfo
from gptflow.plan.gpu_memory import GIB
from gptflow.plan.placement import Placement
from gptflow.plan.runs import run_plan
from gptflow.train.async_save import PAGE
from tests.support.memory import kept_bytes, saved_peak
from tests.unit.train.test_train import BIN

SLURM = Placement(
    executor="slurm", nodes=1, tasks_per_node=8, gres="gpu:8", threads=12, mem_mb=480000,
    partition="gpu", mpi="srun",
    settings=(("default-resources slurm_account", "acct"),
              ("default-resources slurm_partition", "cpu"),
              ("set-resources train_gpt slurm_partition", "gpu")),
)  # fmt: skip
# what `sinfo --format=%P|%G|%D|%c|%m|%a|%l` prints on a cluster of two kinds of GPU nodes
SINFO = """cpu*|(null)|40|64|256000|up|2-00:00:00
gpu|gpu:a100:8(S:0-1)|16|128|1000000|up|2-00:00:00
gpu|gpu:h100:4|4|96|512000|up|2-00:00:00
old|gpu:2|8|16|64000|down|infinite
"""


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [("gpu:8", 8), ("gpu:a100:8", 8), ("gpu", 1), ("shard:2,gpu:4", 4), ("nic:1", None), (None, None)],
)  # fmt: skip
def test_gpus_per_node_from_gres(gres, gpus):
    assert Placement(gres=gres).gpus_per_node == gpus


def test_sinfo_lines_become_node_groups_of_partitions_that_are_up():
    groups = cluster.parse_sinfo(SINFO)
    assert groups == [
        PartitionNodes("cpu", 0, 40, 64, 256000, 2880),
        PartitionNodes("gpu", 8, 16, 128, 1000000, 2880),
        PartitionNodes("gpu", 4, 4, 96, 512000, 2880),
    ]


@pytest.mark.parametrize(
    ("limit", "minutes"),
    [("infinite", None), ("30", 30), ("30:00", 30), ("45:30", 46), ("2:00:00", 120),
     ("1-0", 1440), ("1-2:30", 1590), ("1-12:00:00", 2160)],
)  # fmt: skip
def test_slurm_time_limits(limit, minutes):
    assert cluster.minutes(limit) == minutes


# How the train_gpt rule reads profiles/slurm (rules/setup.smk, profile_placement): the keys of
# set-resources train_gpt checked against sinfo, and those that are not a node's resource
PROFILE = Path(__file__).resolve().parents[3] / "profiles" / "slurm" / "config.yaml"
CHECKED_AGAINST_SINFO = {"slurm_partition", "nodes", "tasks_per_node", "gres", "mem_mb", "runtime"}
NOT_IN_SINFO = {
    "gpu_mem_mb": "one GPU's memory: the fit check of the model, sinfo does not list it",
    "mpi": "how the rule starts the ranks",
    "slurm_extra": "sbatch options (the signal before the time limit, --exclusive)",
}


def shipped_profile(names: dict[str, str]) -> tuple[Placement, dict[str, int], dict]:
    """(train_gpt's Placement, the runtimes, evaluate's set-resources) of profiles/slurm as
    shipped, its placeholders filled with `names` (account, cpu, gpu) as the quick start says."""
    profile = yaml.safe_load(PROFILE.read_text())
    fill = {"<account>": names["account"], "<cpu partition>": names["cpu"],
            "<gpu partition>": names["gpu"]}  # fmt: skip
    default = {k: fill.get(v, v) for k, v in profile["default-resources"].items()}
    rules = {
        r: {k: fill.get(v, v) for k, v in res.items()}
        for r, res in profile["set-resources"].items()
    }
    train = rules["train_gpt"]
    assert set(train) == CHECKED_AGAINST_SINFO | set(NOT_IN_SINFO), sorted(train)
    placement = Placement(
        executor="slurm", nodes=train["nodes"], tasks_per_node=train["tasks_per_node"],
        gres=train["gres"], threads=profile["set-threads"]["train_gpt"], mem_mb=train["mem_mb"],
        partition=train["slurm_partition"], mpi=train["mpi"], gpu_mem_mb=train["gpu_mem_mb"],
        settings=(("default-resources slurm_account", default["slurm_account"]),
                  ("default-resources slurm_partition", default["slurm_partition"]),
                  ("set-resources train_gpt slurm_partition", train["slurm_partition"])),
    )  # fmt: skip
    runtimes = {"default-resources runtime": default["runtime"],
                "set-resources train_gpt runtime": train["runtime"]}  # fmt: skip
    return placement, runtimes, {**rules["evaluate"], "threads": profile["set-threads"]["evaluate"]}


def test_the_shipped_profiles_fit_a_cluster_that_has_what_it_asks_for():
    """profiles/slurm as shipped (placeholders filled) against a cluster of exactly what it
    asks: it fits; a cluster short of any one thing -- a GPU, a CPU, a MB, a node, a minute
    of either partition's time limit -- is refused, naming the profile key to lower."""
    names = {"account": "acct", "cpu": "cpu", "gpu": "gpu"}
    p, runtimes, evaluate = shipped_profile(names)
    assert (p.nodes, p.tasks_per_node, p.gpus_per_node, p.threads) == (1, 8, 8, 12)
    cpu_runtime, train_runtime = runtimes.values()
    have = {"gpus": p.gpus_per_node, "cpus": p.threads * p.tasks_per_node, "mem": p.mem_mb,
            "nodes": p.nodes, "minutes": train_runtime, "cpu minutes": cpu_runtime}  # fmt: skip

    def cluster(**short) -> list[PartitionNodes]:
        h = {k: v - short.get(k.replace(" ", "_"), 0) for k, v in have.items()}
        return parse_sinfo(
            f"cpu*|(null)|4|64|256000|up|{h['cpu minutes']}\n"
            f"gpu|gpu:h100:{h['gpus']}(S:0-1)|{h['nodes']}|{h['cpus']}|{h['mem']}|up|"
            f"{h['minutes']}\n"
        )

    check_cluster(p, names["cpu"], cluster(), {"acct"}, runtimes)
    # evaluate runs on the training partition's nodes, with its set-threads within one's CPUs
    assert evaluate["slurm_partition"] == p.partition
    assert evaluate["threads"] <= have["cpus"]
    for short, names_the_key in [
        ({"gpus": 1}, r"asks for 8 gres GPUs per node but the nodes of partition 'gpu' have "
                      r"at most 7; lower gres"),
        ({"cpus": 1}, r"asks for 96 CPUs per node \(set-threads train_gpt 12 x 8 ranks per node\) "
                      r"but the nodes of partition 'gpu' have at most 95; lower set-threads"),
        ({"mem": 1}, r"asks for 480000 MB of memory per node but the nodes of partition 'gpu' "
                     r"have at most 479999; lower mem_mb"),
        ({"nodes": 1}, r"set-resources train_gpt nodes 1, but partition 'gpu' has 0"),
        ({"minutes": 1}, r"profile set-resources train_gpt runtime is 2880 minutes, beyond "
                         r"partition 'gpu''s time limit of 2879 minutes"),
        ({"cpu_minutes": 1}, r"profile default-resources runtime is 120 minutes, beyond "
                             r"partition 'cpu''s time limit of 119 minutes"),
    ]:  # fmt: skip
        with pytest.raises(GptflowError, match=names_the_key):
            check_cluster(p, names["cpu"], cluster(**short), {"acct"}, runtimes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"partition": "gpus"}, r"set-resources train_gpt slurm_partition is 'gpus', which sinfo "
         r"does not list as up \(partitions: cpu, gpu\); set one of them"),
        ({"gres": "gpu:16", "tasks_per_node": 16}, "asks for 16 gres GPUs per node but the nodes "
         "of partition 'gpu' have at most 8; lower gres"),
        ({"threads": 24}, r"asks for 192 CPUs per node \(set-threads train_gpt 24 x 8 ranks per "
         r"node\) but the nodes of partition 'gpu' have at most 128; lower set-threads train_gpt"),
        ({"mem_mb": 2000000}, "asks for 2000000 MB of memory per node but the nodes of partition "
         "'gpu' have at most 1000000; lower mem_mb"),
        ({"nodes": 21}, "set-resources train_gpt nodes 21, but partition 'gpu' has 20"),
        # two GPUs on each of 16 nodes as tasks over nodes: 2 ranks a node, not 1
        ({"nodes": 16, "tasks_per_node": None, "tasks": 32, "gres": "gpu:2", "threads": 80},
         r"asks for 160 CPUs per node \(set-threads train_gpt 80 x 2 ranks per node\)"),
    ],
)  # fmt: skip
def test_what_the_cluster_does_not_have_is_refused(change, message):
    with pytest.raises(GptflowError, match=message):
        cluster.check_cluster(
            dataclasses.replace(SLURM, **change), "cpu", cluster.parse_sinfo(SINFO)
        )


def test_a_foreign_account_a_missing_cpu_partition_and_a_long_runtime_are_refused():
    groups = cluster.parse_sinfo(SINFO)
    with pytest.raises(GptflowError, match=r"slurm_account is 'acct', which is not one of your "
                       r"Slurm accounts \(lab, other\)"):  # fmt: skip
        cluster.check_cluster(SLURM, "cpu", groups, {"lab", "other"})
    with pytest.raises(GptflowError, match="default-resources slurm_partition is 'cpus'"):
        cluster.check_cluster(SLURM, "cpus", groups)
    with pytest.raises(GptflowError, match=r"runtime is 3000 minutes, beyond partition 'gpu''s "
                       r"time limit of 2880 minutes"):  # fmt: skip
        cluster.check_cluster(SLURM, "cpu", groups, None, {"set-resources train_gpt runtime": 3000})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tasks_per_node": 1, "gres": "gpu:1"}, r"one training task per job step \(tasks_per_node "
         r"1 or tasks 1\) is refused by the Slurm plugin .* set `tasks: N` and `nodes: N`"),
        ({"tasks_per_node": None, "tasks": 1, "gres": "gpu:1"}, "for a single GPU remove `mpi`"),
        ({"tasks": 8}, "sets both tasks_per_node 8 and tasks 8"),
        ({"gres": "gpu:4"}, r"8 training ranks per node but gres gpu:4 \(4 GPU\(s\) per node\)"),
    ],
)  # fmt: skip
def test_launches_the_plugin_or_srun_would_refuse_are_refused(change, message):
    with pytest.raises(GptflowError, match=message):
        placement.check_launch(dataclasses.replace(SLURM, **change))


def test_one_gpu_on_each_of_several_nodes_and_cpus_against_threads():
    spread = dataclasses.replace(SLURM, nodes=4, tasks_per_node=None, tasks=4, gres="gpu:1")
    assert placement.check_launch(spread) == [] and spread.ranks == 4
    assert spread.ranks_per_node == 1
    # srun's block distribution of 3 tasks over 2 nodes: 2 on the first, which one GPU cannot take
    uneven = dataclasses.replace(spread, nodes=2, tasks=3)
    assert uneven.ranks_per_node == 2
    with pytest.raises(GptflowError, match=r"2 training ranks per node but gres gpu:1"):
        placement.check_launch(uneven)
    assert dataclasses.replace(spread, nodes=None).ranks_per_node == 4  # srun may pack them
    (warning,) = placement.check_launch(dataclasses.replace(SLURM, cpus_per_task=4))
    assert "cpus_per_task 4 differs from set-threads train_gpt 12" in warning


def test_the_ranks_on_one_machine():
    """Without srun: nproc_per_node, else one per visible GPU, else one; srun's counts when
    the profile gives mpi (nproc_per_node is then not what starts the ranks)."""
    assert [Placement().ranks, Placement(gpus=4).ranks, Placement(nproc_per_node=2).ranks,
            Placement(nproc_per_node=2, gpus=8).ranks] == [1, 4, 2, 2]  # fmt: skip
    assert Placement(mpi="srun", tasks=4, nproc_per_node=2).ranks == 4
    assert SLURM.ranks == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nproc_per_node": "two"}, r"nproc_per_node is 'two'; expected the number of training "
         r"ranks to start on this machine \(one per GPU\), e.g. --set-resources "
         r"train_gpt:nproc_per_node=2"),
        ({"nproc_per_node": 0}, "nproc_per_node is 0; expected the number"),
        ({"nproc_per_node": 8, "gpus": 4, "gpus_source": "nvidia-smi -L"}, r"nproc_per_node is "
         r"8, but this machine shows 4 GPU\(s\) \(nvidia-smi -L\); gptflow runs one rank per "
         r"GPU: set nproc_per_node to at most 4"),
    ],
)  # fmt: skip
def test_local_launches_that_cannot_run_are_refused(change, message):
    with pytest.raises(GptflowError, match=message):
        placement.check_launch(Placement(**change))


def test_local_launches_that_can_run():
    """As many CPU ranks as asked where no GPU shows; up to one per GPU where some do."""
    for p in (
        Placement(nproc_per_node=3, gpus=0),
        Placement(nproc_per_node=4, gpus=4),
        Placement(gpus=2),
        Placement(mpi="srun", tasks=8, gpus=2, nproc_per_node=9),
    ):
        assert placement.check_launch(p) == []  # fmt: skip


def test_placeholders_are_named():
    shipped = dataclasses.replace(
        SLURM, settings=(("default-resources slurm_account", "<account>"),
                         ("set-resources train_gpt slurm_partition", "gpu"))
    )  # fmt: skip
    found = placement.placeholders(shipped)
    assert found == [("default-resources slurm_account", "<account>")]
    assert placement.placeholder_message(found, "slurm", "P").startswith(
        "edit P first: default-resources slurm_account is <account> (your cluster's values: "
        "`sacctmgr show assoc"
    )
    assert placement.placeholders(SLURM) == []
    # profiles/pbs: its own hint, and its GPU jobs count as a cluster's (the memory fit check)
    pbs = dataclasses.replace(shipped, executor="pbs")
    assert "`qstat -Q` lists the queues" in placement.placeholder_message(found, "pbs", "P")
    # an unset pbs_filesystems: the Torque edit (the README's, tests/workflow/test_pbs.py)
    torque = placement.placeholder_message(
        [("default-resources pbs_filesystems", "<filesystems>")], "pbs", "P"
    )
    assert torque.endswith(
        "; on Torque (no filesystems resource), delete ,filesystems={resources.pbs_filesystems} "
        "from cluster-generic-submit-cmd and the pbs_filesystems line of default-resources)"
    )
    assert "Torque" not in placement.placeholder_message(found, "pbs", "P")
    assert pbs.on_cluster and SLURM.on_cluster
    assert not dataclasses.replace(shipped, executor="local").on_cluster


def test_a_batch_the_ranks_cannot_split_names_the_fixes():
    t = TrainConfig(train_iters=1, micro_batch_size=8, global_batch_size=16)
    assert placement.check_layout(t, 2) == 1
    with pytest.raises(GptflowError) as e:
        placement.check_layout(t, 16)
    assert str(e.value) == (
        "train.global_batch_size 16 is not a multiple of train.micro_batch_size 8 x 16 ranks = "
        "128: a step is whole micro-batches on every data-parallel rank; set "
        "train.global_batch_size a multiple of 128, or train.micro_batch_size one of [1], or "
        "fewer ranks (the profile's nodes x tasks_per_node, or nproc_per_node on one machine)"
    )


# ----------------------------------------------------------------------------- memory


def bucket_bytes(engine) -> int:
    """Bytes of DeepSpeed's ZeRO 1/2 gradient buckets now (each bucket's buffer: a list of
    tensors, or one tensor)."""
    total = 0
    for bucket in getattr(engine.optimizer, "ipg_buckets", {}).values():
        held = bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer]
        total += sum(b.numel() * b.element_size() for b in held)
    return total


def test_the_kept_model_state_is_what_deepspeed_holds_after_a_step(tmp_path, monkeypatch, request):
    """One rank on the CPU, after a forward, backward and update (and during the backward, ZeRO
    1/2's gradient bucket, which the update frees): the bytes DeepSpeed keeps
    (weights, optimizer states, its fp32 partition and accumulation buffers) equal the
    formula's terms that outlive a step, for fp32 at ZeRO 0-2 and bf16 at ZeRO 1-2 (measured:
    12, 16, 16, 18 and 14 bytes a parameter), but for scalars: Adam's step counter of each
    tensor and DeepSpeed's flags (measured: 12 to 268 bytes). The files a save writes, taken
    as an asynchronous save's snapshot (also at ZeRO 3: the partition's 12 bytes a parameter,
    the model file's parameters partitioned away), are snapshot_bytes but for their pickles,
    and the BufferPool they are taken into holds them and at most two pages a buffer (it starts
    each on a page of its own; at ZeRO 0, a buffer per tensor, this tiny model's 112 tensors)."""
    from gptflow.train import device, distributed
    from gptflow.train import engine as ds
    from gptflow.train.async_save import BufferPool
    from gptflow.train.checkpoint import _snapshots
    from gptflow.train.model import decay_groups

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.setenv(name, "")  # export sets them; monkeypatch takes them away after
    monkeypatch.setenv("MASTER_PORT", "0")
    env = distributed.resolve({})
    distributed.export(env)
    dev = device.setup(env, timeout_minutes=5)
    request.addfinalizer(dev.shutdown)
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
    measured, snapshots, held, buckets = {}, {}, {}, {}
    settings = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")]
    for zero, precision in settings:
        t = TrainConfig(train_iters=2, global_batch_size=2, micro_batch_size=2, seq_length=16,
                        zero_stage=zero, precision=precision)  # fmt: skip
        model = ds.build_model(m, t, 1, dev.device)
        engine = ds.build_engine(model, decay_groups(model, 0.1), t, 1)
        x = torch.randint(0, 256, (2, 16))
        # ZeRO 1/2's gradient bucket lives from the backward to the update: read it there
        look = next(engine.module.parameters()).register_post_accumulate_grad_hook(
            lambda _p, e=engine, k=(zero, precision): buckets.__setitem__(k, bucket_bytes(e))
        )
        engine.backward(engine(x, x))
        look.remove()
        engine.step()
        if zero < 3:
            terms = gpu_memory.model_state_bytes(m.num_parameters(), 1, zero, precision)
            kept = sum(v for k, v in terms.items() if k not in gpu_memory.TRANSIENT)
            measured[(zero, precision)] = (kept_bytes(engine), kept)
        # what an asynchronous save holds in host memory: every file DeepSpeed writes
        pool = BufferPool()
        taken = _snapshots(engine, str(tmp_path / "ckpt"), f"z{zero}{precision}", {}, pool)
        want = host_memory.snapshot_bytes(m, t, 1, precision)
        snapshots[(zero, precision)] = (sum(s.nbytes for s in taken), want)
        buffers = sum(len(s.storages) for s in taken)
        held[(zero, precision)] = (pool.held_bytes(), want, buffers)
    assert all(0 <= got - want <= 512 for got, want in measured.values()), measured
    # ZeRO 1/2's bucket during the backward: 5e8 elements, fp32 (or bf16 at ZeRO 2), none
    # under bf16's BF16_Optimizer at ZeRO 1; the formula's, byte for byte
    assert {k: v for k, v in buckets.items() if k[0] < 3} == {
        k: gpu_memory.gradient_bucket_bytes(*k) for k in buckets if k[0] < 3}  # fmt: skip
    assert [buckets[k] for k in ((1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16"))] == [
        2 * 10**9, 2 * 10**9, 0, 10**9]  # fmt: skip
    # the estimate is the tensors' bytes; the pickles (DeepSpeed's config, shapes) add < 32 KiB
    assert all(0 <= got - want <= 32 * 1024 for got, want in snapshots.values()), snapshots
    assert all(0 <= got - want <= 2 * n * PAGE for got, want, n in held.values()), held


TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)


def rotary_tables(m: ModelConfig, seq: int, layers: int = 1) -> int:
    """The rotary cos and sin tables (fp32, seq x rotary dims) the layers multiply q and k by:
    autograd keeps them, once per micro-batch (per layer under a pipeline, whose layers each
    make their own); not in the estimate, which counts what grows with the micro batch."""
    return layers * 2 * seq * m.rotary_ndims * 4


@pytest.mark.parametrize(
    ("split", "settings"),
    [((2, 1), "1:fp32,1:bf16,2:bf16"), ((1, 2), "1:fp32,1:bf16")],
    ids=["tp2xdp2", "pp2xdp2"],
)
def test_kept_state_and_activations_on_4_ranks_are_the_estimate(repo, tmp_path, split, settings):
    """Four torchrun ranks on the CPU (tensor 2 x data 2, pipeline 2 x data 2), one step of the
    tiny model (micro batch 2, 16 tokens; the pipeline's 2 micro-batches in flight on its first
    stage): on every rank the bytes DeepSpeed keeps are model_state_bytes' kept terms for that
    rank's parameters over 2 data-parallel ranks (ZeRO 1 and 2, fp32 and bf16: DeepSpeed's
    scalars aside, measured 12-268 bytes), and what autograd keeps for backward at its peak is
    activation_bytes' activations plus the fp32 log-softmax on the last stage (LOGITS_PEAK's
    kept 4 bytes a logit; at tensor parallel 2 the vocab-parallel loss's fp32 softmax of the
    rank's half of the vocabulary), but for the rotary tables and nll_loss's 4-byte total
    weight (one rank's loss) -- in
    fp32 (CPU's bf16 LayerNorm keeps its mean and 1/std in bf16 where CUDA's keep fp32).

    And the host memory of an asynchronous save, the files each rank's DeepSpeed writes taken
    as the trainer takes them: on every rank the tensors are snapshot_bytes for that rank (its
    optimizer partition; the model file only on data-parallel rank 0 of its model-parallel
    group), and what the rank's BufferPool holds is that and at most two pages a buffer; the
    four ranks (one node) hold snapshot_fit's snapshots, within two pages a buffer."""
    tp, pp = split
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=4",
           str(repo / "tests" / "support" / "kept_memory.py"), str(tp), str(pp), str(tmp_path),
           settings]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    dp, gas, micro, seq = 2, pp, 2, 16
    for setting in settings.split(","):
        zero, precision = int(setting[0]), setting[2:]
        t = TrainConfig(train_iters=2, global_batch_size=micro * dp * gas, micro_batch_size=micro,
                        seq_length=seq, zero_stage=zero, precision=precision,
                        tensor_parallel=tp, pipeline_parallel=pp)  # fmt: skip
        ranks = [
            json.loads(f.read_text()) for f in tmp_path.glob(f"rank*-{setting[0]}-{precision}.json")
        ]
        assert sorted(r["stage"] for r in ranks) == ([0] * 4 if pp == 1 else [0, 0, 1, 1])
        node = Placement(executor="slurm", nodes=1, tasks_per_node=4, gres="gpu:4", mpi="srun")
        fit = host_memory.snapshot_fit(TINY, t, 4, node)
        held = sum(r["held"] for r in ranks)
        assert 0 <= held - fit.snapshots <= sum(r["buffers"] for r in ranks) * 2 * PAGE, setting
        # the model file (or a pipeline stage's layer files) on data-parallel rank 0 alone
        writers = [r for r in ranks if any("model_states" in f for f in r["files"])]
        want = [0, 1] if pp == 1 else [0, 2]  # rank = (stage x dp + data rank) x tp + tp rank
        assert sorted(r["rank"] for r in writers) == want, (setting, ranks)
        assert fit.writers == len(writers) == 2
        assert fit.clones == sum(r["clones"] for r in ranks), setting
        for r in ranks:
            params = gpu_memory.stage_parameters(TINY, tp, pp, r["stage"])
            terms = gpu_memory.model_state_bytes(params, dp, zero, precision)
            kept = sum(v for k, v in terms.items() if k not in gpu_memory.TRANSIENT)
            assert 0 <= r["kept"] - kept <= 512, (setting, r, kept)
            # the tensors DeepSpeed pads its partitions with aside (measured: 8-16 bytes)
            snap = host_memory.snapshot_bytes(TINY, t, 4, precision, r["rank"])
            assert 0 <= r["snapshot"] - snap <= 64, (setting, r, snap)
            assert r["snapshot"] <= r["held"] <= r["snapshot"] + r["buffers"] * 2 * PAGE, (
                setting,
                r,
            )
            # under a pipeline DeepSpeed copies each layer file to the host first, one at a
            # time: the stage's largest file (pipeline_clone_bytes)
            clones = host_memory.pipeline_clone_bytes(TINY, t, 4, precision, r["rank"])
            assert r["clones"] == clones and (clones > 0) == (pp > 1 and r in writers), (
                setting,
                r,
            )
            if precision != "fp32":
                continue
            last = r["stage"] == pp - 1
            held = gpu_memory.activation_bytes(TINY, t, precision, r["stage"], gas)
            # the loss keeps a 4-byte softmax (or log-softmax) a logit, 1/tp of the vocabulary
            want = held["activations"] + (4 * micro * seq * TINY.vocab_size // tp if last else 0)
            in_flight = min(pp - r["stage"], gas)
            # F.cross_entropy's nll_loss keeps a 4-byte total weight; the vocab-parallel loss not
            rest = in_flight * rotary_tables(TINY, seq) + (4 if last and tp == 1 else 0)
            assert r["saved_peak"] - want == rest, (setting, r, want, rest)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_what_autograd_keeps(checkpointing):
    """The tiny model on one rank in fp32, forward and backward with a loss, micro batch 1 and
    2: what autograd keeps for backward at its peak grows by activation_bytes' activations plus
    the fp32 log-softmax (4 bytes a logit) for each sequence added, exactly; with activation
    checkpointing the layers' inputs (the estimate adds one layer's whole set, recomputed in
    the backward, which these hooks do not see: checkpoint packs it under hooks of its own)."""
    from gptflow.train.model import GPTNeoX

    m = dataclasses.replace(TINY, activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = GPTNeoX(m).train()
    peaks = []
    for micro in (1, 2):
        x, y = torch.randint(0, 256, (2, micro, 16))
        peaks.append(saved_peak(lambda: model(x, y).backward(), model.parameters()))  # noqa: B023
    t = TrainConfig(train_iters=1, global_batch_size=1, micro_batch_size=1, seq_length=16)
    held = gpu_memory.activation_bytes(m, t, "fp32")["activations"] + 4 * 16 * 256
    if checkpointing:  # the recomputed layer's are packed by checkpoint's own hooks, unseen here
        held -= gpu_memory.layer_activation_bytes(m, 1, 16, 4)
    assert peaks[1] - peaks[0] == held
    assert peaks[0] - held == rotary_tables(m, 16) + 4


def test_auto_precision_is_planned_as_the_trainer_decides_it():
    """train.precision auto on GPUs trains fp32 at ZeRO 0 and on GPUs before compute
    capability 8.0 (gptflow.hardware.training_precision, the trainer's own call): the GPU
    estimate then counts fp32 activations and weights, not bf16 ones (1.3B, micro 8 x 2048 at
    ZeRO 0: 27 GiB of activations counted where 54 GiB are held), and so does the snapshot. A
    gres without a GPU type plans for A100/H100-class GPUs, and the -n line says so."""
    m = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50304)
    t = TrainConfig(train_iters=10, seq_length=2048, micro_batch_size=8, global_batch_size=64,
                    precision="auto", zero_stage=0)  # fmt: skip
    fit = gpu_memory.memory_per_gpu(m, t, 8, SLURM)
    fp32 = gpu_memory.activation_bytes(m, dataclasses.replace(t, precision="fp32"), "fp32")
    assert fit.terms["activations"] == fp32["activations"]  # 54.3 GiB, not bf16's 27.1
    assert round(fp32["activations"] / GIB, 1) == 54.3
    assert fit.terms["weights"] == 4 * m.num_parameters()
    n = m.num_parameters()  # ZeRO 0 in fp32: rank 0 writes weights and Adam's moments
    assert host_memory.snapshot_fit(m, t, 8, SLURM).snapshots == 12 * n
    precision, why = gpu_memory.planned_precision(t, SLURM)
    assert precision == "fp32" and "assumed" in why and "train.zero_stage 0" in why
    lines = preflight.memory_lines(preflight.Report(), TINY, t, 8, SLURM, {})
    assert lines[0].startswith("  precision: fp32 (auto on GPUs assumed to be A100/H100 ")
    zero1 = dataclasses.replace(t, zero_stage=1)
    assert gpu_memory.planned_precision(zero1, SLURM)[0] == "bf16"
    v100 = dataclasses.replace(SLURM, gres="gpu:v100:8")
    assert gpu_memory.planned_precision(zero1, v100) == (
        "fp32",
        "auto on v100 GPUs (the gres's type) (compute capability 7.0: no bf16 tensor "
        "cores; set train.precision fp16 for half precision with loss scaling)",
    )
    assert gpu_memory.planned_precision(zero1, dataclasses.replace(SLURM, gres="gpu:h100:8")) == (
        "bf16",
        "auto on h100 GPUs (the gres's type) (bf16 tensor cores, ZeRO stage 1)",
    )
    assert gpu_memory.planned_precision(zero1, Placement())[0] == "fp32"  # on this CPU


@pytest.mark.parametrize("gpu", ["rtx6000", "mi250"])
def test_auto_on_a_gpu_type_the_table_does_not_know_is_refused_at_planning(gpu):
    """The trainer decides auto by the GPU's compute capability; a gres type gptflow.hardware
    does not know (a Quadro RTX 6000 is 7.5, an RTX 6000 Ada 8.9) was planned as an A100's
    bf16 where the trainer may train fp32 (twice the activations and weights counted short).
    Such a type with auto is one line asking for an explicit precision; with one, it plans; a
    P40 (6.1, now in the table) plans fp32, as the trainer trains it; a gres without a type
    is still planned for the A100/H100s the memory check assumes, and says so."""
    t = TrainConfig(train_iters=10, global_batch_size=8, micro_batch_size=1, zero_stage=1,
                    precision="auto")  # fmt: skip
    unknown = dataclasses.replace(SLURM, gres=f"gpu:{gpu}:8")
    with pytest.raises(GptflowError) as e:
        gpu_memory.planned_precision(t, unknown)
    assert str(e.value) == (
        "train.precision is auto, which the trainer decides by the GPU's compute capability "
        f"(bf16 on 8.0 and later at train.zero_stage 1+, else fp32), and the profile's gres "
        f"gpu:{gpu}:8 names '{gpu}', a GPU type gptflow.hardware does not know: set "
        "train.precision bf16 (Ampere or later) or fp32 (older GPUs)"
    )
    with pytest.raises(GptflowError, match=r"^train\.precision is auto, "):
        preflight.memory_lines(preflight.Report(), TINY, t, 8, unknown, {})
    for explicit in ("fp32", "bf16"):
        given = dataclasses.replace(t, precision=explicit)
        assert gpu_memory.planned_precision(given, unknown) == (explicit, "train.precision")
    p40 = dataclasses.replace(SLURM, gres="gpu:p40:8")
    assert gpu_memory.planned_precision(t, p40)[0] == "fp32"
    assert "compute capability 6.1" in gpu_memory.planned_precision(t, p40)[1]
    assert gpu_memory.planned_precision(t, SLURM) == (
        "bf16",
        "auto on GPUs assumed to be A100/H100 (compute capability 8.0+: the profile's gres "
        "names no GPU type) (bf16 tensor cores, ZeRO stage 1)",
    )


def test_muons_refusal_of_bf16_at_zero_1_under_tensor_parallel_meets_auto_at_planning(tiny_config):
    """train.precision auto at ZeRO 1 is bf16 on A100/H100-class GPUs: with Muon under tensor
    parallel the trainer would refuse it at start (TrainConfig.check_muon, after auto is
    decided), so snakemake -n refuses it, saying what auto became and why; the config's own
    check could not (auto is not bf16). On CPUs (fp32) and on V100s (fp32) it plans."""
    cfg = {
        **tiny_config,
        "model": {**tiny_config["model"], "num_layers": 2, "hidden_size": 64,
                  "num_attention_heads": 4},
        "train": {**tiny_config["train"], "optimizer": "muon", "clip_grad": 0.0,
                  "precision": "auto", "zero_stage": 1, "tensor_parallel": 2,
                  "global_batch_size": 4, "micro_batch_size": 1},
    }  # fmt: skip
    gpus = Placement(executor="slurm", nodes=1, tasks_per_node=2, gres="gpu:2", mpi="srun")
    with pytest.raises(GptflowError) as e:
        preflight.run(run_plan("a", cfg, None), gpus, sinfo=lambda: None, accounts=lambda: None)
    message = str(e.value)
    assert message.startswith(
        "train.precision auto is bf16 here (auto on GPUs assumed to be A100/H100 (compute "
        "capability 8.0+: the profile's gres names no GPU type) (bf16 tensor cores, ZeRO stage "
        "1)): train.optimizer muon is not supported with train.precision bf16 at "
        "train.zero_stage 1 with 2-way tensor x pipeline parallel: "
    )
    assert "\n" not in message
    with pytest.raises(GptflowError, match=r"^study run 'a': train\.precision auto is bf16 here"):
        preflight.study({"a": run_plan("a", cfg, None)}, gpus, indexes=1, trained=set())
    for planned in (Placement(executor="local", nproc_per_node=2),
                    dataclasses.replace(gpus, gres="gpu:v100:2")):  # fmt: skip
        preflight.run(run_plan("a", cfg, None), planned, sinfo=lambda: None, accounts=lambda: None)


def test_each_tensor_parallel_rank_holds_its_share_of_the_logits():
    """Pythia-12B at tensor parallel 4, micro batch 8, as its layout trains it: the head is split
    along the vocabulary, so each rank holds a quarter of the (8, 2048, 50,688) logits, and the
    vocab-parallel loss's peak over them is its fp32 softmax made the gradient in place plus the
    16-bit gradient (6 bytes a logit): 1.2 GiB, where the replicated head's F.cross_entropy
    held 12 bytes of every logit on every rank (9.3 GiB, as one rank still does). Under a
    pipeline only the last stage holds them."""
    m = ModelConfig(num_layers=36, hidden_size=5120, num_attention_heads=40, vocab_size=50688)
    t = TrainConfig(train_iters=1, seq_length=2048, micro_batch_size=8, global_batch_size=1024,
                    precision="fp16", zero_stage=1, tensor_parallel=4)  # fmt: skip
    whole, share = 12 * 8 * 2048 * 50688, 6 * 8 * 2048 * 50688 // 4
    fit = gpu_memory.memory_per_gpu(m, t, 256, SLURM)
    assert fit.terms["logits"] == share and round(share / 2**30, 2) == 1.16
    assert round(whole / 2**30, 1) == 9.3
    one = dataclasses.replace(t, tensor_parallel=1)
    assert gpu_memory.activation_bytes(m, one, "fp16")["logits"] == whole
    # fp32 logits: the forward holds them and their fp32 copy, 8 bytes a logit
    assert gpu_memory.activation_bytes(m, t, "fp32")["logits"] == 8 * 8 * 2048 * 50688 // 4
    piped = dataclasses.replace(t, pipeline_parallel=4)
    assert gpu_memory.activation_bytes(m, piped, "fp16", stage=0, gas=4)["logits"] == 0
    last = gpu_memory.activation_bytes(m, piped, "fp16", stage=3, gas=4)
    assert last["logits"] == share
    # its buffers: 3 received inputs (b, s, h) and two micro-batches' split logits, 16-bit
    tokens = 8 * 2048
    assert last["pipeline buffers"] == 3 * tokens * 2 * 5120 + 2 * tokens * 2 * 50688 // 4


def test_fits_leaves_the_margin_free():
    """A model whose terms alone fit an 80 GiB GPU but not with the margin (2 GiB runtime and
    10 % fragmentation: 10 GiB) does not fit, and the message says the margin."""
    m = ModelConfig(num_layers=2, hidden_size=1024, num_attention_heads=8, vocab_size=50304)
    t = TrainConfig(train_iters=1, seq_length=2048, micro_batch_size=60, global_batch_size=480,
                    precision="bf16", zero_stage=1)  # fmt: skip
    fit = gpu_memory.memory_per_gpu(m, t, 8, SLURM)
    assert fit.margin == 10 * 2**30 and 70 * 2**30 < fit.total < 80 * 2**30, fit.total / 2**30
    assert not fit.fits
    with pytest.raises(GptflowError, match=r"\+ margin 10.0 GiB: 2.0 GiB CUDA context and NCCL "
                       r"buffers \+ 10% of the GPU for allocator fragmentation, against 80 GiB"):  # fmt: skip
        gpu_memory.check_memory(fit)


@pytest.mark.parametrize("gpus", [1, 8, 64])
def test_half_precision_zero_2_and_3_agree_with_deepspeeds_estimators(gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    params, largest = 1_280_000_000, 50_000_000
    _, zero2 = estimate_zero2_model_states_mem_needs(params, gpus, 1, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(params, largest, gpus, 1, cpu_offload=False)
    for zero, want in ((2, zero2), (3, zero3)):
        terms = gpu_memory.model_state_bytes(params, gpus, zero, "fp16", largest=largest)
        # the estimators count the model's states, not ZeRO 2's gradient bucket (1 GB in fp16)
        assert terms.pop("gradient bucket", 0) == (10**9 if zero == 2 else 0)
        assert sum(terms.values()) == want, (zero, terms, want)


def test_stage_parameters_are_the_split_models_own_count():
    """Tensor 2 x pipeline 2 of an 8-layer model: the last stage's ranks hold half of each of
    4 layers' split matrices, their LayerNorms and biases whole, the final LayerNorm and the
    head -- counted on the real modules, split as gptflow.train.engine splits them; the first
    stage's, the embedding instead."""
    from gptflow.train.model import GPTNeoX
    from gptflow.train.model_parallel import tensor_parallel_slice

    m = ModelConfig(num_layers=8, hidden_size=128, num_attention_heads=4, vocab_size=128)
    with torch.device("meta"):
        model = GPTNeoX(m)
    last_stage = [
        (n, p) for n, p in model.named_parameters()
        if n.startswith(("gpt_neox.layers.4.", "gpt_neox.layers.5.", "gpt_neox.layers.6.",
                         "gpt_neox.layers.7.", "gpt_neox.final_layer_norm", "embed_out"))
    ]  # fmt: skip
    held = sum(tensor_parallel_slice(n, p, 0, 2).numel() for n, p in last_stage)
    assert gpu_memory.stage_parameters(m, 2, 2, 1) == held
    first = sum(
        tensor_parallel_slice(n, p, 0, 2).numel() for n, p in model.named_parameters()
        if n.startswith(("gpt_neox.embed_in", *(f"gpt_neox.layers.{i}." for i in range(4))))
    )  # fmt: skip
    assert gpu_memory.stage_parameters(m, 2, 2, 0) == first
    assert gpu_memory.stage_parameters(m, 1, 1, 0) == m.num_parameters()


def test_a_model_that_does_not_fit_names_its_largest_term():
    """Megatron's 18.4B sizes on 8 ranks of one node without model parallelism at ZeRO 1:
    each GPU holds the 16-bit weights and gradients of all 18.4B parameters and their fp32
    sums; at tensor parallel 8 (the table's layout) it fits."""
    from gptflow.config.schema import load_yaml

    preset = load_yaml("config/models/megatron-gpt3-18.4b.yaml")
    preset.pop("description")
    m = ModelConfig(**{**preset, "vocab_size": 51200})
    t = TrainConfig(train_iters=1, seq_length=2048, micro_batch_size=1, global_batch_size=8,
                    precision="bf16", zero_stage=1)  # fmt: skip
    fit = gpu_memory.memory_per_gpu(m, t, 8, SLURM)
    # bf16 at ZeRO 1 sums every gradient in fp32: 4 bytes a parameter, the largest term
    assert not fit.fits and fit.largest == "fp32 gradient accumulation"
    with pytest.raises(GptflowError, match=r"about 168.5 GiB per GPU \(weights 34.9, .* logits "
                       r"1.2 GiB\) \+ margin 10.0 GiB: 2.0 GiB CUDA context and NCCL buffers \+ "
                       r"10% of the GPU for allocator fragmentation, against 80 GiB \(assumed: 80 "
                       r"GB GPUs\); the largest is fp32 gradient accumulation: raise "
                       r"train.zero_stage to 2, or train.tensor_parallel"):  # fmt: skip
        gpu_memory.check_memory(fit)
    split = dataclasses.replace(t, tensor_parallel=8)
    assert gpu_memory.memory_per_gpu(m, split, 8, SLURM).fits


def test_the_vocabulary_comes_from_the_tokenizer_on_disk(tmp_path):
    cfg = {"model": {}, "tokenizer": {"source": "file"}}
    path = tmp_path / "tokenizer.json"
    assert run_size.vocab_size(cfg, path)[0] == run_size.ASSUMED_VOCAB
    path.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                "added_tokens": [{"id": 70000, "content": "<eod>"}]}))  # fmt: skip
    assert run_size.vocab_size(cfg, path) == (70001, str(path))
    trained = {"model": {}, "tokenizer": {"source": "train", "train": {"vocab_size": 8192}}}
    assert run_size.vocab_size(trained, tmp_path / "none.json") == (
        8192,
        "tokenizer.train.vocab_size",
    )
    # a half-written or corrupt tokenizer.json: one line naming the file and the fix
    for text in ('{"model": {"vocab": {"a"', '{"model": {}}', "[]"):
        path.write_text(text)
        with pytest.raises(
            GptflowError, match=r"tokenizer.json: not a tokenizer.json .* Delete it"
        ):
            run_size.vocab_size(cfg, path)


def test_made_shards_count_their_bytes_whole_or_in_parts(tmp_path, monkeypatch):
    """Once tokenized, a shard's bytes are its .bin's (gptflow.paths.SHARD), or the sum of its
    parts' (PART, tokenize.documents_per_shard), not the estimate from its input."""
    from gptflow import paths
    from gptflow.data.sources import Dataset, Shard

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_bytes(b"x" * 4000)
    d = Dataset(
        "d", "files", (Shard("00000", "a.jsonl", "jsonl"), Shard("00001", "a.jsonl", "jsonl"))
    )
    assert run_size.token_bytes({"d": d}, 512, "tok") == (2 * 2 * 1000, 0)  # estimates
    whole = tmp_path / f"{paths.shard_prefix('tok', 'd', '00000')}.bin"
    whole.parent.mkdir(parents=True)
    whole.write_bytes(b"x" * 10)
    for part, size in ((0, 3), (1, 4)):
        (tmp_path / f"{paths.part_prefix('tok', 'd', '00001', part)}.bin").write_bytes(b"x" * size)
    assert run_size.token_bytes({"d": d}, 512, "tok") == (10 + 3 + 4, 0)
    assert run_size.token_bytes({"d": d}, 512, "other") == (2 * 2 * 1000, 0)


# ----------------------------------------------------------------------------- saves


def pythia_12b() -> ModelConfig:
    from gptflow.config.schema import load_yaml

    preset = load_yaml("config/models/pythia-12b.yaml")
    preset.pop("description")
    return ModelConfig(**{**preset, "vocab_size": 50304})


def test_an_asynchronous_saves_snapshot_is_counted_against_the_nodes_memory():
    """Pythia-12B at ZeRO 1 over 8 H100s of a node: rank 0 holds the bf16 weights (2 bytes a
    parameter: the model file, written by data-parallel rank 0 alone) and its eighth of the
    fp32 master and Adam moments (12 / 8), the 7 others their eighth: 2 + 12 bytes a parameter
    for the node, ~154 GiB, and 2 GiB for each rank's process. A node of 480,000 MB holds it;
    one of 160,000 MB does not, and the refusal names the way out; synchronous saves need no
    host memory."""
    m = pythia_12b()
    t = TrainConfig(train_iters=10, global_batch_size=8, micro_batch_size=1, zero_stage=1,
                    precision="bf16")  # fmt: skip
    node = placement.Placement(executor="slurm", nodes=1, tasks_per_node=8, mpi="srun",
                               gres="gpu:8", mem_mb=480000)  # fmt: skip
    fit = host_memory.snapshot_fit(m, t, 8, node)
    n = m.num_parameters()
    assert fit.largest == 2 * n + 12 * n // 8 and fit.snapshots == 2 * n + 8 * (12 * n // 8)
    assert (fit.writers, fit.ranks, fit.state) == (1, 8, 0) and not fit.on_cpu
    assert fit.need == fit.snapshots + 8 * 2 * GIB
    line = host_memory.check_saves(t, fit)
    assert line == (
        "  checkpoint saves: in the background (train.async_save): about 170.4 GiB of host "
        "memory per node, of 468.8 GiB (set-resources train_gpt mem_mb): snapshots 154.4 GiB "
        "(1 of 8 rank(s) write the model file; 38.6 GiB on the largest) + 8 process(es) x "
        "2.0 GiB"
    )
    small = dataclasses.replace(node, mem_mb=160000)
    with pytest.raises(GptflowError, match=r"^train.async_save: .* set train.async_save false"):
        host_memory.check_saves(t, host_memory.snapshot_fit(m, t, 8, small))
    assert "synchronous" in host_memory.check_saves(t, None)
    unknown = dataclasses.replace(node, mem_mb=None)  # a cluster's node: not known, not refused
    assert "not known" in host_memory.check_saves(t, host_memory.snapshot_fit(m, t, 8, unknown))


def test_one_gpu_on_each_of_16_nodes_counts_one_rank_a_node(tiny_config):
    """Pythia-12B in bf16 at ZeRO 1 on 16 nodes x 1 GPU, as `tasks: 16` and `nodes: 16` (what
    check_launch asks for instead of tasks_per_node 1): each node holds one rank -- rank 0's
    node its model file and its sixteenth of the fp32 partitions, 30.3 GiB, 32.3 GiB with its
    process -- which a node of 64,000 MB holds. The 16 ranks were counted on one node: 186.4
    GiB "per node", a refusal of the layout the launch check itself recommends."""
    m = pythia_12b()
    t = TrainConfig(train_iters=10, global_batch_size=16, micro_batch_size=1, zero_stage=1,
                    precision="bf16")  # fmt: skip
    spread = Placement(executor="slurm", nodes=16, tasks=16, gres="gpu:1", mpi="srun",
                       mem_mb=64000)  # fmt: skip
    assert placement.check_launch(spread) == []
    fit = host_memory.snapshot_fit(m, t, 16, spread)
    n = m.num_parameters()
    assert (fit.ranks, fit.writers, fit.clones) == (1, 1, 0)
    assert fit.snapshots == fit.largest == 2 * n + 12 * n // 16
    assert round(fit.snapshots / GIB, 1) == 30.3 and round(fit.need / GIB, 1) == 32.3
    assert host_memory.check_saves(t, fit).startswith(
        "  checkpoint saves: in the background (train.async_save): about 32.3 GiB of host "
        "memory per node, of 62.5 GiB (set-resources train_gpt mem_mb)"
    )
    packed = dataclasses.replace(spread, nodes=1, tasks=None, tasks_per_node=16, gres="gpu:16")
    assert round(host_memory.snapshot_fit(m, t, 16, packed).need / GIB, 1) == 186.4
    tiny = {**tiny_config, "model": {**tiny_config["model"], "num_layers": 2, "hidden_size": 64,
                                      "num_attention_heads": 4},
            "train": {**tiny_config["train"], "global_batch_size": 16, "micro_batch_size": 1}}  # fmt: skip
    rep = preflight.run(
        run_plan("tiny", tiny, None), spread, sinfo=lambda: None, accounts=lambda: None
    )
    assert rep.lines[0].startswith("gptflow preflight: train_gpt on 16 node(s) x 1 rank(s) = 16")


def test_a_pipelines_layer_file_copies_are_counted_on_the_nodes_that_write_them():
    """Under a pipeline DeepSpeed copies each layer file to the host before the snapshot copies
    it again (PipelineModule.save_state_dict, clone_tensors_for_torch_save), one file at a time
    (measured on four CPU ranks: test_kept_state_and_activations_on_4_ranks_are_the_estimate):
    on GPT-NeoX-20B as shipped (fp16, tensor 2 x pipeline 4, 12 nodes x 8 GPUs) rank 0's node
    holds two writers (data-parallel rank 0 of the first stage's two tensor-parallel ranks),
    each a decoder layer's half in fp16; it was not counted. Nothing without a pipeline."""
    m = gpt_neox_20b()
    t = TrainConfig(train_iters=10, global_batch_size=96, micro_batch_size=1, zero_stage=1,
                    precision="fp16", tensor_parallel=2, pipeline_parallel=4)  # fmt: skip
    nodes = dataclasses.replace(SLURM, nodes=12)
    fit = host_memory.snapshot_fit(m, t, 96, nodes)
    layer = gpu_memory.layer_parameters(m, 2)
    assert layer > m.vocab_size * m.hidden_size // 2  # a layer outweighs the embedding's half
    assert fit.writers == 2 and fit.clones == 2 * 2 * layer
    assert fit.need == fit.snapshots + fit.clones + 8 * 2 * GIB
    assert [host_memory.pipeline_clone_bytes(m, t, 96, "fp16", r) for r in range(4)] == [
        2 * layer, 2 * layer, 0, 0]  # fmt: skip
    assert f"+ {gpu_memory.human(fit.clones)} DeepSpeed's copy of a layer file" in (
        host_memory.check_saves(t, fit)
    )
    flat = dataclasses.replace(t, tensor_parallel=8, pipeline_parallel=1)
    assert host_memory.snapshot_fit(m, flat, 8, SLURM).clones == 0


def test_the_most_loaded_node_is_checked_not_the_first():
    """Pythia-12B in bf16 at ZeRO 1, pipeline parallel 2 over 2 nodes x 1 GPU: the last
    stage holds the final LayerNorm and the head besides its layers, so its node needs more
    host memory than rank 0's; that node is the one checked against mem_mb."""
    m = pythia_12b()
    t = TrainConfig(train_iters=10, global_batch_size=8, micro_batch_size=1, zero_stage=1,
                    precision="bf16", pipeline_parallel=2)  # fmt: skip
    two = Placement(executor="slurm", nodes=2, tasks=2, gres="gpu:1", mpi="srun", mem_mb=64000)
    per_rank = [host_memory.snapshot_bytes(m, t, 2, "bf16", r) for r in (0, 1)]
    assert per_rank[1] > per_rank[0]
    fit = host_memory.snapshot_fit(m, t, 2, two)
    assert fit.snapshots == fit.largest == per_rank[1]
    assert fit.clones == host_memory.pipeline_clone_bytes(m, t, 2, "bf16", 1)


def test_the_snapshot_is_counted_in_the_precision_auto_becomes():
    """train.precision auto at ZeRO 1 on A100/H100-class GPUs trains bf16: the snapshot is the
    bf16 model file and the fp32 partitions, 154.4 GiB for Pythia-12B over 8 GPUs of a node --
    not the 176.5 GiB of fp32 weights that counting the configured value ('auto', not a half
    precision) gives, which refused nodes near the limit. At ZeRO 0 auto is fp32 either way."""
    m = pythia_12b()
    auto = TrainConfig(train_iters=10, global_batch_size=8, micro_batch_size=1, zero_stage=1,
                       precision="auto")  # fmt: skip
    fit = host_memory.snapshot_fit(m, auto, 8, SLURM)
    bf16 = host_memory.snapshot_fit(m, dataclasses.replace(auto, precision="bf16"), 8, SLURM)
    fp32 = host_memory.snapshot_fit(m, dataclasses.replace(auto, precision="fp32"), 8, SLURM)
    assert fit == bf16 and round(fit.snapshots / GIB, 1) == 154.4
    assert round(fp32.snapshots / GIB, 1) == 176.5
    n = m.num_parameters()
    assert host_memory.snapshot_bytes(m, auto, 8, "bf16") == 2 * n + 12 * n // 8


def gpt_neox_20b() -> ModelConfig:
    from gptflow.config.schema import load_yaml

    preset = load_yaml("config/models/gpt-neox-20b.yaml")
    preset.pop("description")
    return ModelConfig(**{**preset, "vocab_size": 50432})


def test_each_rank_of_the_node_counts_what_it_writes():
    """GPT-NeoX-20B in bf16 at ZeRO 1, tensor parallel 8 on one 8-GPU node (issue 36's
    example): every rank is data-parallel rank 0 of its group and writes its 1/8 of the model
    (2 bytes a parameter) and the whole fp32 partition of it (12): 268 GiB of snapshots, which
    with 8 x 2 GiB fit the shipped profile's 480,000 MB. On 2 such nodes (2 data-parallel
    copies) node 1's ranks write half a partition each and no model file: rank 0's node is the
    one counted. Under pure data parallel (ZeRO 2 over 16 ranks) the model file is written
    once, by rank 0."""
    m = gpt_neox_20b()
    tp8 = TrainConfig(train_iters=10, global_batch_size=8, micro_batch_size=1, zero_stage=1,
                      precision="bf16", tensor_parallel=8)  # fmt: skip
    fit = host_memory.snapshot_fit(m, tp8, 8, SLURM)
    share = gpu_memory.stage_parameters(m, 8, 1, 0)
    assert fit.snapshots == 8 * (2 * share + 12 * share) and fit.writers == 8
    assert round(fit.snapshots / GIB, 1) == 268.2 and fit.fits
    two = dataclasses.replace(SLURM, nodes=2)
    fit = host_memory.snapshot_fit(m, tp8, 16, two)  # the worst node: rank 0's
    assert fit.snapshots == 8 * (2 * share + 12 * share // 2) and fit.writers == 8
    dp = TrainConfig(train_iters=10, global_batch_size=16, micro_batch_size=1, zero_stage=2,
                     precision="bf16")  # fmt: skip
    n = m.num_parameters()
    fit = host_memory.snapshot_fit(m, dp, 16, two)
    assert fit.snapshots == 2 * n + 8 * (12 * n // 16) and fit.writers == 1
    assert [host_memory.writes_model_file(dp, r, 16) for r in range(16)] == [True] + [False] * 15


def test_offloaded_optimizer_state_is_in_the_nodes_memory():
    """train.offload optimizer on GPUs (ZeRO 2, bf16): each rank's fp32 partition, Adam's
    moments and fp32 gradient partition live in host memory (16 bytes a parameter over the
    data-parallel ranks, what the GPU estimate leaves out of the GPU), besides the snapshot."""
    m = pythia_12b()
    t = TrainConfig(train_iters=10, global_batch_size=8, micro_batch_size=1, zero_stage=2,
                    precision="bf16", offload="optimizer")  # fmt: skip
    fit = host_memory.snapshot_fit(m, t, 8, SLURM)
    n = m.num_parameters()
    assert fit.state == 8 * (12 * n // 8 + 4 * n // 8)
    assert fit.need == fit.snapshots + 8 * 2 * GIB + fit.state
    assert "+ offloaded optimizer state 176.5 GiB" in host_memory.check_saves(t, fit)


def test_training_on_cpus_counts_the_state_and_the_snapshot_in_this_machines_memory():
    """On CPUs the training state is in host memory too; too much is a warning at -n."""
    t = TrainConfig(train_iters=10, global_batch_size=8, micro_batch_size=1, zero_stage=1)
    fit = host_memory.snapshot_fit(pythia_12b(), t, 2, placement.Placement())
    assert fit.on_cpu and fit.node_bytes == host_memory.node_memory()
    # ~ 2 x (12 + 16) bytes x 12B on a 24 GB machine: a GPU run planned here is warned about,
    # not refused (the plan is still worth seeing)
    line = host_memory.check_saves(t, fit)
    assert line.startswith("  WARNING: ") and "set train.async_save false" in line


def test_auto_saves_in_the_background_with_gpus_and_synchronously_on_cpus():
    from gptflow.hardware import background_saves

    assert background_saves("auto", True) == (True, "auto with GPUs")
    assert background_saves("auto", False)[0] is False
    assert background_saves(True, False) == (True, "train.async_save")
    assert background_saves(False, True) == (False, "train.async_save")
    t = TrainConfig(train_iters=10, global_batch_size=8, micro_batch_size=1, zero_stage=1)
    rep = preflight.memory_lines(preflight.Report(), TINY, t, 1, Placement(), {})
    assert rep[-1].startswith("  checkpoint saves: synchronous (auto on CPUs, where the write")
    rep = preflight.memory_lines(preflight.Report(), TINY, t, 8, SLURM, {})
    assert rep[-1].startswith("  checkpoint saves: in the background (train.async_save)")
