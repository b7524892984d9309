"""What DeepSpeed's Muon holds and sends (gptflow.plan.muon), against what DeepSpeed 0.19.8
allocates and sends on 1, 2 and 3 gloo ranks (tests/support/muon_memory.py), for two model
sizes: the ZeRO-3 update allocation by allocation, ZeRO 1/2's momentum held twice; the
reduce_bucket_size the engine sets; and on paper, the issue's Pythia-6.9B in bf16 on 64
data-parallel ranks, which the preflight refuses for its traffic."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from gptflow.config.settings import ModelConfig, TrainConfig, muon_state_floats
from gptflow.errors import GptflowError
from gptflow.plan import gpu_memory, muon
from tests.unit.train.test_train import BIN

MUON = {"optimizer": "muon", "clip_grad": 0.0}
# tests/support/muon_memory.py's sizes
SIZES = {
    "tiny": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256),
    "small": ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=256),
}
# size:zero:precision[:key=value...] (tests/support/muon_memory.py): gptflow's bucket (dp x
# the largest matrix: several chunks); DeepSpeed's default (one chunk a group) with one Muon
# group (train.muon.lr set: on 2 ranks a round of the two MLP matrices, equal in size, differs
# in shape) and with sub-groups cut small (a chunk a sub-group); a bucket under every matrix
# with the gather cache's 256 MiB scaled down to 400 kB (entries evicted every step); ZeRO
# 1/2 in fp32 and bf16 (BF16_Optimizer at ZeRO 1)
SETTINGS = ["tiny:3:fp32", "small:3:fp32", "tiny:3:bf16", "tiny:3:fp32:lr=0.02:deepspeed",
            "small:3:bf16:deepspeed:subgroup=50000", "small:3:fp32:bucket=20000:cache=400000",
            "tiny:1:fp32", "small:2:fp32", "small:2:bf16", "tiny:1:bf16"]  # fmt: skip
# one rank: no gathers, no padded rounds; what is left is the gradients' copy into bf16
ONE_RANK = ["tiny:3:fp32", "small:3:bf16"]
GB = 10**9


def measure(repo, tmp_path, ranks: int, settings: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    script = [str(repo / "tests" / "support" / "muon_memory.py"), str(tmp_path), ",".join(settings)]
    cmd = ([str(BIN / "python"), *script] if ranks == 1 else
           [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", *script])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]


def train_config(setting: str, dp: int) -> tuple[ModelConfig, TrainConfig, dict]:
    """The model, train settings and options of a probe setting on `dp` ranks."""
    size, zero, precision, *rest = setting.split(":")
    options = dict(option.partition("=")[::2] for option in rest)
    muon_lr = {"muon": {"lr": float(options["lr"])}} if "lr" in options else {}
    t = TrainConfig(train_iters=2, global_batch_size=2 * dp, micro_batch_size=2, seq_length=16,
                    zero_stage=int(zero), precision=precision, **MUON, **muon_lr)  # fmt: skip
    return SIZES[size], t, options


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_what_deepspeeds_muon_allocates_and_sends_is_the_formula(repo, tmp_path, ranks):
    """On every rank and in every setting, what DeepSpeed does equals gptflow.plan.muon's
    count exactly (the update's peak to one matrix above, where a gloo worker lets go of a
    buffer late), on 1, 2 and 3 ranks (3: partitions padded, slices written back padded) and
    two model sizes, so the formula's growth is tested, not only a value:

    - ZeRO 3, each of 2 steps: the update's peak above where it started (the first step fills
      the gather cache), the cache and the momentum partitions it keeps, the bytes it sends,
      the Muon groups (shapes and order) and the reduce_bucket_size DeepSpeed runs with; and
      the preflight's count, the worst rank's (not rank 0 for small). The worst rank's peak in
      the second step, fp32, gptflow's bucket: tiny 0.20 / 1.34 / 1.59 MB on 1 / 2 / 3 ranks,
      small 0.79 / 3.74 / 7.71 MB, while the momentum partition shrinks (small: 3.15, 1.57,
      1.05 MB); sent per rank and step: tiny 0.98 / 1.51 MB on 2 / 3 ranks, small with buckets
      under every matrix 9.4 / 16.8 MB;
    - ZeRO 1/2 (DeepSpeedZeroOptimizer): the committed momentum and the staged copy, each the
      matrices the rank's partition touches, whole (tiny at ZeRO 1 in fp32, the most loaded
      rank: 0.197 MB each on 2 ranks, 0.246 on 3, where the preflight counted 0.197 and
      0.131 MB once); BF16_Optimizer (bf16 at ZeRO 1) the partition's fp32 momentum, once.
      And every byte the engine keeps after the step is gpu_memory's kept terms with Muon's,
      to DeepSpeed's scalars and padding (measured: 12 bytes; 92 on 3 ranks)."""
    settings = ONE_RANK if ranks == 1 else SETTINGS
    records = measure(repo, tmp_path, ranks, settings)
    worst: dict[str, int] = {}  # ZeRO 3: the update's transient peak on the worst rank
    for setting in settings:
        m, t, options = train_config(setting, ranks)
        groups, dp, precision = muon.muon_groups(m, t), ranks, t.precision
        scaled = {k: int(options[o]) for k, o in (("cache_limit", "cache"),
                  ("sub_group_size", "subgroup")) if o in options}  # fmt: skip
        held = groups  # DeepSpeed's groups (ZeRO 3: its sub-groups)
        if t.zero_stage == 3:
            cut = scaled.get("sub_group_size", muon.DEEPSPEED_SUB_GROUP_SIZE)
            held = muon.sub_groups(groups, dp, cut)
        for rank, record in enumerate(r[setting] for r in records):
            assert record["groups"] == [[list(s) for s in g] for g in held], setting
            if t.zero_stage == 3:
                bucket = int(options.get("bucket", muon.zero3_bucket(m, t, dp)))
                bucket = 500_000_000 if "deepspeed" in options else bucket
                assert record["bucket"] == bucket, setting
                u = muon.zero3_update(groups, dp, precision, bucket, rank, "gloo", 2, **scaled)
                # a gloo worker may let go of a round's buffer after the main thread's next
                # allocation (seen once under a load of 6: one qkv matrix late); so the peak is
                # the formula's to one matrix above it, never below (the preflight's promise)
                late = 4 * max(rows * cols for g in groups for rows, cols in g)
                for got, want in zip(record["peaks"], u.peaks, strict=True):
                    assert want <= got <= want + late, (setting, rank, record["peaks"], u.peaks)
                assert (record["cache"], record["momentum"]) == (u.cache, u.momentum), setting
                assert record["traffic"] == [u.traffic] * 2, (setting, rank)
                worst[setting] = max(worst.get(setting, 0), u.transient)
                assert u.transient == max(u.peaks[-1], u.peaks[0] - u.cache)
                continue
            terms = muon.muon_memory(m, t, dp, precision)  # the most loaded rank's
            if record["optimizer"] == "BF16_Optimizer":
                assert record["momentum"] == terms["Muon momentum"] and not record["staged"]
            else:
                mine = muon.muon_widths(t.zero_stage, precision)[1]
                mine *= muon.zero12_momentum(groups, dp, rank)
                assert record["momentum"] == record["staged"] == mine, (setting, rank)
                assert terms["Muon momentum"] == terms["Muon staged momentum"] >= mine
                terms = {"Muon momentum": mine, "Muon staged momentum": mine}  # this rank's
            params = gpu_memory.stage_parameters(m, 1, 1, 0)
            state = gpu_memory.model_state_bytes(params, dp, t.zero_stage, precision,
                                                 muon=gpu_memory.muon_floats(m, t)[0])  # fmt: skip
            kept = sum(v for k, v in {**state, **terms}.items() if k not in gpu_memory.TRANSIENT)
            # DeepSpeed's scalars (12 bytes) and, on 3 ranks, its partitions' padding (80)
            assert 0 <= record["kept"] - kept <= 128, (setting, rank, record["kept"], kept)
    for setting, peak in worst.items():  # the preflight's rank is the worst one
        m, t, options = train_config(setting, ranks)
        if not options:  # gptflow's bucket and DeepSpeed's cache and sub-groups
            assert muon.muon_memory(m, t, ranks, t.precision, "gloo")["Muon update"] == peak


def test_the_engine_sets_the_planned_bucket_at_zero_3_only():
    """deepspeed_config sets zero_optimization.reduce_bucket_size for Muon at ZeRO 3 only, to
    the one rule the preflight counts with: dp x the largest Muon matrix, at most DeepSpeed's
    default 5e8 (the probe above checks the engine DeepSpeed builds runs with it)."""
    from gptflow.train.engine import deepspeed_config

    base = dict(train_iters=2, global_batch_size=16, micro_batch_size=2)
    zero3 = TrainConfig(**base, zero_stage=3, **MUON)
    assert deepspeed_config(zero3, 4, muon_largest=65536)["zero_optimization"] == {
        "stage": 3, "reduce_scatter": False, "reduce_bucket_size": 4 * 65536}  # fmt: skip
    assert deepspeed_config(zero3, 8, muon_largest=4096**2 * 4)["zero_optimization"][
        "reduce_bucket_size"] == 500_000_000  # fmt: skip
    for t in (TrainConfig(**base, zero_stage=2, **MUON), TrainConfig(**base, zero_stage=3)):
        assert "reduce_bucket_size" not in deepspeed_config(t, 4, muon_largest=65536)[
            "zero_optimization"]  # fmt: skip


def preset(repo, name: str, **model) -> ModelConfig:
    spec = yaml.safe_load((repo / "config/models" / f"{name}.yaml").read_text())
    spec.pop("description")
    return ModelConfig(**{**spec, **model}, vocab_size=50304)


def test_pythia_6_9b_bf16_on_64_data_parallel_ranks(repo):
    """The issue's example, on paper (NCCL; tests above hold the replay to DeepSpeed on gloo):
    Pythia-6.9B in bf16 at ZeRO 3 on 64 data-parallel ranks, global batch 1024 x 2048 tokens,
    micro batch 4 (4 micro-batches a step). Muon's 6.44B matrix elements in 2 groups, bucket
    5e8 (64 x the 67M-element MLP matrix is more: DeepSpeed's default stays), 15 chunks of 1-11
    matrices, each one round padded to 64 x 67M: gradients in bf16, momenta in fp32
    (gptflow.train.deepspeed_patches). The update's peak is 56.0 GB: 26.2 GB of round buffers
    (65 x 67M x (2 + 4) bytes), 25.8 GB of NCCL's flat copies of the round's two gathers,
    4.1 GB of gathered chunks (this one's gradients and momenta, the last one's gradients)
    and the update; it keeps 0.40 GB of momentum and 0.14 GB of gather cache. The preflight
    counted 0.8 GB (Newton-Schulz's working set). Each rank receives 419 GB a step in the
    update (38 GB of chunk gathers, 381 GB of padded rounds) against 216 GB for the rest of
    the step (the parameters gathered twice and the gradients all-reduced, 4 micro-batches):
    refused, in one line; at a global batch of 2048 (8 micro-batches, 432 GB) it passes."""
    m = preset(repo, "pythia-6.9b", activation_checkpointing=True)
    t = TrainConfig(train_iters=10, seq_length=2048, micro_batch_size=4, global_batch_size=1024,
                    zero_stage=3, precision="bf16", **MUON)  # fmt: skip
    groups = muon.muon_groups(m, t)
    assert [len(g) for g in groups] == [96, 32]
    assert sum(r * c for g in groups for r, c in g) == 6_442_450_944
    assert muon.zero3_bucket(m, t, 64) == 500_000_000
    terms = muon.muon_memory(m, t, 64, "bf16")
    assert terms == pytest.approx({"Muon momentum": 0.4027e9, "Muon gather cache": 0.1363e9,
                                   "Muon update": 56.00e9}, rel=1e-3)  # fmt: skip
    own = muon.zero3_update(groups, 64, "bf16", 500_000_000, collective="none")  # DeepSpeed's
    largest = 4 * 4096**2
    rounds = 65 * largest * (2 + 4)
    assert rounds == pytest.approx(26.17e9, rel=1e-3)
    assert own.transient == pytest.approx(rounds + 4.06e9, rel=1e-3)
    assert terms["Muon update"] - own.transient == 64 * largest * (2 + 4)  # NCCL's flat copies
    assert 4 * muon_state_floats(m)[1] == pytest.approx(0.805e9, rel=1e-3)
    fit = gpu_memory.stage_memory(m, t, 64, 4, "bf16", 0)
    assert fit["Muon update"] == terms["Muon update"] and "Newton-Schulz" in fit
    assert own.traffic == pytest.approx(418.6e9, rel=1e-3)
    assert muon.zero3_step_traffic(m, t, 64, 4, "bf16") == pytest.approx(216.0e9, rel=1e-3)
    with pytest.raises(GptflowError) as err:
        muon.check_traffic(m, t, 64, "bf16")
    assert str(err.value).startswith(
        "train.optimizer muon at train.zero_stage 3 on 64 data-parallel ranks: DeepSpeed's "
        "Muon update would move 419 GB per rank a step, more than the rest of the step (216 "
        "GB: 4 micro-batch(es), each gathering the parameters twice and all-reducing the "
        "gradients)"
    )
    assert "\n" not in str(err.value) and "train.zero_stage 1 or 2" in str(err.value)
    larger = TrainConfig(**{**vars(t), "global_batch_size": 2048})
    assert muon.check_traffic(m, larger, 64, "bf16") == (
        "  Muon at ZeRO 3: its update moves 419 GB per rank a step (97% of the step's other "
        "432 GB; refused above 100%)"
    )


def test_the_bucket_lowers_the_update_where_a_round_still_fills(repo):
    """Pythia-1.4B in bf16 at ZeRO 3 on 8 ranks (on paper): gptflow's bucket (8 x the 16.8M-
    element MLP matrix, 134M) lowers the update's peak from 6.67 to 4.03 GB against DeepSpeed's
    default for 12 % more of its traffic (15.0 -> 16.7 GB, the step's own 317 GB); on 64 ranks
    the cap (5e8) is DeepSpeed's default."""
    m = preset(repo, "pythia-1.4b")
    t = TrainConfig(train_iters=10, seq_length=2048, micro_batch_size=4, global_batch_size=1024,
                    zero_stage=3, precision="bf16", **MUON)  # fmt: skip
    groups = muon.muon_groups(m, t)
    ours, default = (muon.zero3_update(groups, 8, "bf16", b) for b in (134_217_728, 500_000_000))
    assert muon.zero3_bucket(m, t, 8) == 134_217_728 and muon.zero3_bucket(m, t, 64) == 5e8
    assert (ours.transient, default.transient) == pytest.approx((4.03e9, 6.67e9), rel=0.01)
    assert (ours.traffic, default.traffic) == pytest.approx((16.7e9, 15.0e9), rel=0.01)
    assert muon.zero3_step_traffic(m, t, 8, 32, "bf16") == pytest.approx(317e9, rel=0.01)
    assert muon.check_traffic(m, t, 8, "bf16").startswith("  Muon at ZeRO 3: its update moves")


def test_a_plan_refuses_it_and_prints_the_traffic(repo, tiny_config):
    """preflight.run (snakemake -n) refuses the 6.9B example on 8 nodes x 8 GPUs in one line,
    and prints the update's traffic for the test config's tiny model at ZeRO 3 on 2 ranks."""
    from gptflow.plan import preflight
    from gptflow.plan.placement import Placement
    from gptflow.plan.runs import run_plan

    def plan(model: dict, train: dict, placement: Placement) -> list[str]:
        cfg = {**tiny_config, "model": model, "train": {**tiny_config["train"], **train, **MUON}}
        return preflight.run(
            run_plan("muon", cfg, None), placement, sinfo=lambda: None, accounts=lambda: None
        ).lines

    tiny = {"preset": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    lines = plan(tiny, {"zero_stage": 3}, Placement(executor="local", nproc_per_node=2))
    assert any(line.startswith("  Muon at ZeRO 3: its update moves") for line in lines), lines
    big = {**vars(preset(repo, "pythia-6.9b")), "description": ""}
    gpus = Placement(executor="slurm", nodes=8, tasks_per_node=8, gres="gpu:8", mpi="srun",
                     partition="gpu", settings=(("default-resources slurm_account", "a"),))  # fmt: skip
    with pytest.raises(GptflowError, match=r"^train.optimizer muon at train.zero_stage 3 on 64 "):
        plan(big, {"zero_stage": 3, "precision": "bf16", "seq_length": 2048,
                   "micro_batch_size": 4, "global_batch_size": 1024}, gpus)  # fmt: skip
