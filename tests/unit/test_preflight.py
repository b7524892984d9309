"""The preflight (gptflow.preflight): what `snakemake -n` refuses before a job is queued, and
the per-GPU memory estimate, checked against what DeepSpeed allocates and estimates."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gptflow import preflight
from gptflow.config import ModelConfig, TrainConfig
from gptflow.errors import GptflowError
from gptflow.preflight import PartitionNodes, Placement

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
    groups = preflight.parse_sinfo(SINFO)
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
    assert preflight.minutes(limit) == minutes


def test_the_shipped_profiles_fit_a_cluster_that_has_what_it_asks_for():
    preflight.check_cluster(SLURM, "cpu", preflight.parse_sinfo(SINFO), {"acct"}, {"x": 2880})


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
    ],
)  # fmt: skip
def test_what_the_cluster_does_not_have_is_refused(change, message):
    with pytest.raises(GptflowError, match=message):
        preflight.check_cluster(
            dataclasses.replace(SLURM, **change), "cpu", preflight.parse_sinfo(SINFO)
        )


def test_a_foreign_account_a_missing_cpu_partition_and_a_long_runtime_are_refused():
    groups = preflight.parse_sinfo(SINFO)
    with pytest.raises(GptflowError, match=r"slurm_account is 'acct', which is not one of your "
                       r"Slurm accounts \(lab, other\)"):  # fmt: skip
        preflight.check_cluster(SLURM, "cpu", groups, {"lab", "other"})
    with pytest.raises(GptflowError, match="default-resources slurm_partition is 'cpus'"):
        preflight.check_cluster(SLURM, "cpus", groups)
    with pytest.raises(GptflowError, match=r"runtime is 3000 minutes, beyond partition 'gpu''s "
                       r"time limit of 2880 minutes"):  # fmt: skip
        preflight.check_cluster(
            SLURM, "cpu", groups, None, {"set-resources train_gpt runtime": 3000}
        )


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
        preflight.check_launch(dataclasses.replace(SLURM, **change))


def test_one_gpu_on_each_of_several_nodes_and_cpus_against_threads():
    spread = dataclasses.replace(SLURM, nodes=4, tasks_per_node=None, tasks=4, gres="gpu:1")
    assert preflight.check_launch(spread) == [] and spread.ranks == 4
    (warning,) = preflight.check_launch(dataclasses.replace(SLURM, cpus_per_task=4))
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
        preflight.check_launch(Placement(**change))


def test_local_launches_that_can_run():
    """As many CPU ranks as asked where no GPU shows; up to one per GPU where some do."""
    for p in (
        Placement(nproc_per_node=3, gpus=0),
        Placement(nproc_per_node=4, gpus=4),
        Placement(gpus=2),
        Placement(mpi="srun", tasks=8, gpus=2, nproc_per_node=9),
    ):
        assert preflight.check_launch(p) == []  # fmt: skip


def test_placeholders_are_named():
    shipped = dataclasses.replace(
        SLURM, settings=(("default-resources slurm_account", "<account>"),
                         ("set-resources train_gpt slurm_partition", "gpu"))
    )  # fmt: skip
    found = preflight.placeholders(shipped)
    assert found == [("default-resources slurm_account", "<account>")]
    assert preflight.placeholder_message(found, "P").startswith(
        "edit P first: default-resources slurm_account is <account> (your cluster's values"
    )
    assert preflight.placeholders(SLURM) == []


def test_a_batch_the_ranks_cannot_split_names_the_fixes():
    t = TrainConfig(train_iters=1, micro_batch_size=8, global_batch_size=16)
    assert preflight.check_layout(t, 2) == 1
    with pytest.raises(GptflowError) as e:
        preflight.check_layout(t, 16)
    assert str(e.value) == (
        "train.global_batch_size 16 is not a multiple of train.micro_batch_size 8 x 16 ranks = "
        "128: a step is whole micro-batches on every data-parallel rank; set "
        "train.global_batch_size a multiple of 128, or train.micro_batch_size one of [1], or "
        "fewer ranks (the profile's nodes x tasks_per_node, or nproc_per_node on one machine)"
    )


# ----------------------------------------------------------------------------- memory


def kept_bytes(engine) -> int:
    """Bytes of the distinct tensor storages a DeepSpeed engine keeps between steps: the
    module's parameters (and gradients, if kept), the optimizer's state and DeepSpeed's own
    buffers (fp32 partitions, accumulation buffers), found by walking the objects."""
    seen: dict[int, int] = {}

    def walk(o, depth: int = 0) -> None:
        if depth > 4:
            return
        if isinstance(o, torch.Tensor):
            if o.numel():
                storage = o.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            if o.is_leaf and o.grad is not None:
                walk(o.grad, depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v, depth + 1)

    walk(list(engine.module.parameters()))
    opt = engine.optimizer
    for o in {
        id(opt): opt,
        id(getattr(opt, "optimizer", opt)): getattr(opt, "optimizer", opt),
    }.values():
        walk(list(o.state.values()))
        walk(list(vars(o).values()))
    return sum(seen.values())


def test_the_kept_model_state_is_what_deepspeed_holds_after_a_step(tmp_path, monkeypatch, request):
    """One rank on the CPU, after a forward, backward and update: the bytes DeepSpeed keeps
    (weights, optimizer states, its fp32 partition and accumulation buffers) equal the
    formula's terms that outlive a step, for fp32 at ZeRO 0-2 and bf16 at ZeRO 1-2 (measured:
    12, 16, 16, 18 and 14 bytes a parameter), but for scalars: Adam's step counter of each
    tensor and DeepSpeed's flags (measured: 12 to 268 bytes)."""
    from gptflow import distributed
    from gptflow import engine as ds
    from gptflow.model import decay_groups
    from gptflow.train import device

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.setenv(name, "")  # export sets them; monkeypatch takes them away after
    monkeypatch.setenv("MASTER_PORT", "0")
    env = distributed.resolve({})
    distributed.export(env)
    dev = device.setup(env, timeout_minutes=5)
    request.addfinalizer(dev.shutdown)
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
    measured = {}
    for zero, precision in [(0, "fp32"), (1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")]:
        t = TrainConfig(train_iters=2, global_batch_size=2, micro_batch_size=2, seq_length=16,
                        zero_stage=zero, precision=precision)  # fmt: skip
        model = ds.build_model(m, t, 1, dev.device)
        engine = ds.build_engine(model, decay_groups(model, 0.1), t, 1)
        x = torch.randint(0, 256, (2, 16))
        engine.backward(engine(x, x))
        engine.step()
        terms = preflight.model_state_bytes(m.num_parameters(), 1, zero, precision)
        kept = sum(v for k, v in terms.items() if k not in preflight.TRANSIENT)
        measured[(zero, precision)] = (kept_bytes(engine), kept)
    assert all(0 <= got - want <= 512 for got, want in measured.values()), measured


@pytest.mark.parametrize("gpus", [1, 8, 64])
def test_half_precision_zero_2_and_3_agree_with_deepspeeds_estimators(gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    params, largest = 1_280_000_000, 50_000_000
    _, zero2 = estimate_zero2_model_states_mem_needs(params, gpus, 1, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(params, largest, gpus, 1, cpu_offload=False)
    for zero, want in ((2, zero2), (3, zero3)):
        got = sum(preflight.model_state_bytes(params, gpus, zero, "fp16", largest=largest).values())
        assert got == want, (zero, got, want)


def test_parameters_per_rank_is_the_split_models_own_count():
    """Tensor 2 x pipeline 2 of an 8-layer model: the last stage's ranks hold half of each of
    4 layers' split matrices, their LayerNorms and biases whole, the final LayerNorm and the
    head -- counted on the real modules, split as gptflow.engine splits them."""
    from gptflow.engine import tensor_parallel_slice
    from gptflow.model import GPTNeoX

    m = ModelConfig(num_layers=8, hidden_size=128, num_attention_heads=4, vocab_size=128)
    with torch.device("meta"):
        model = GPTNeoX(m)
    last_stage = [
        (n, p) for n, p in model.named_parameters()
        if n.startswith(("gpt_neox.layers.4.", "gpt_neox.layers.5.", "gpt_neox.layers.6.",
                         "gpt_neox.layers.7.", "gpt_neox.final_layer_norm", "embed_out"))
    ]  # fmt: skip
    held = sum(tensor_parallel_slice(n, p, 0, 2).numel() for n, p in last_stage)
    assert preflight.parameters_per_rank(m, 2, 2) == held
    assert preflight.parameters_per_rank(m, 1, 1) == m.num_parameters()


def test_a_model_that_does_not_fit_names_its_largest_term():
    """Megatron's 18.4B sizes on 8 ranks of one node without model parallelism at ZeRO 1:
    each GPU holds the 16-bit weights and gradients of all 18.4B parameters and their fp32
    sums; at tensor parallel 8 (the table's layout) it fits."""
    from gptflow.schema import load_yaml

    preset = load_yaml("config/models/megatron-gpt3-18.4b.yaml")
    preset.pop("description")
    m = ModelConfig(**{**preset, "vocab_size": 51200})
    t = TrainConfig(train_iters=1, seq_length=2048, micro_batch_size=1, global_batch_size=8,
                    precision="bf16", zero_stage=1)  # fmt: skip
    fit = preflight.memory_per_gpu(m, t, 8, SLURM)
    # bf16 at ZeRO 1 sums every gradient in fp32: 4 bytes a parameter, the largest term
    assert not fit.fits and fit.largest == "fp32 gradient accumulation"
    with pytest.raises(GptflowError, match=r"about 170.0 GiB per GPU \(weights 34.9, .* against "
                       r"80 GiB \(assumed: 80 GB GPUs\); the largest is fp32 gradient accumulation: "
                       r"raise train.zero_stage to 2, or train.tensor_parallel"):  # fmt: skip
        preflight.check_memory(fit)
    split = dataclasses.replace(t, tensor_parallel=8)
    assert preflight.memory_per_gpu(m, split, 8, SLURM).fits


def test_the_vocabulary_comes_from_the_tokenizer_on_disk(tmp_path):
    cfg = {"model": {}, "tokenizer": {"source": "file"}}
    path = tmp_path / "tokenizer.json"
    assert preflight.vocab_size(cfg, path)[0] == preflight.ASSUMED_VOCAB
    path.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                "added_tokens": [{"id": 70000, "content": "<eod>"}]}))  # fmt: skip
    assert preflight.vocab_size(cfg, path) == (70001, str(path))
    trained = {"model": {}, "tokenizer": {"source": "train", "train": {"vocab_size": 8192}}}
    assert preflight.vocab_size(trained, tmp_path / "none.json") == (
        8192,
        "tokenizer.train.vocab_size",
    )


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
    assert preflight.token_bytes({"d": d}, 512, "tok") == (2 * 2 * 1000, 0)  # estimates
    whole = tmp_path / f"{paths.shard_prefix('tok', 'd', '00000')}.bin"
    whole.parent.mkdir(parents=True)
    whole.write_bytes(b"x" * 10)
    for part, size in ((0, 3), (1, 4)):
        (tmp_path / f"{paths.part_prefix('tok', 'd', '00001', part)}.bin").write_bytes(b"x" * size)
    assert preflight.token_bytes({"d": d}, 512, "tok") == (10 + 3 + 4, 0)
    assert preflight.token_bytes({"d": d}, 512, "other") == (2 * 2 * 1000, 0)
