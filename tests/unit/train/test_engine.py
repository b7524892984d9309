"""The DeepSpeed config is rendered from ours: batch arithmetic, explicit clipping, precision."""

import pytest

from gptflow.config.settings import TrainConfig
from gptflow.errors import GptflowError
from gptflow.train.engine import deepspeed_config, grad_accum_dtype
from tests.support.hardware import fp16_env


def test_batch_arithmetic_for_world_sizes():
    t = TrainConfig(
        train_iters=10, micro_batch_size=4, global_batch_size=64, clip_grad=0.5, zero_stage=2
    )
    for world, gas in [(1, 16), (2, 8), (4, 4), (16, 1)]:
        cfg = deepspeed_config(t, world)
        assert cfg["train_batch_size"] == 64
        assert cfg["train_micro_batch_size_per_gpu"] == 4
        assert cfg["gradient_accumulation_steps"] == gas
        assert cfg["train_batch_size"] == 4 * gas * world
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"] == {"stage": 2}
    assert "bf16" not in cfg and "fp16" not in cfg


def test_clipping_is_always_explicit():
    """DeepSpeed silently clips at 1.0 when the key is absent; ours is always written."""
    cfg = deepspeed_config(TrainConfig(train_iters=1, clip_grad=0.0), 1)
    assert cfg["gradient_clipping"] == 0.0


def test_precision_sections():
    for stage in (1, 2, 3):
        bf16 = deepspeed_config(TrainConfig(train_iters=1, precision="bf16", zero_stage=stage), 1)
        # DeepSpeed's ZeRO optimizers skip a step with a NaN/inf gradient whole (pinned: our
        # SkippingAdamW leaves the verdict to them)
        assert bf16["bf16"] == {"enabled": True, "check_grad_overflow": True}
        assert "fp16" not in bf16
        assert bf16["data_types"] == {"grad_accum_dtype": "fp32"}  # Megatron's fp32 sums
        fp16 = deepspeed_config(TrainConfig(train_iters=1, precision="fp16", zero_stage=stage), 1)
        assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic scaling
        assert fp16["data_types"] == {"grad_accum_dtype": "fp32"}  # as for bf16
    assert "data_types" not in deepspeed_config(TrainConfig(train_iters=1), 1)
    # DeepSpeed refuses fp32 sums of fp16 gradients without ZeRO ("unsupported mix"): what an
    # existing run's config at ZeRO 0 reads as (training there is refused: check_trainable)
    assert grad_accum_dtype(TrainConfig(train_iters=1, precision="fp16")) is None


def test_indivisible_batch_names_the_numbers():
    t = TrainConfig(train_iters=1, micro_batch_size=4, global_batch_size=16)
    with pytest.raises(
        GptflowError, match=r"global_batch_size 16 is not a multiple of .* 4 x 3 ranks = 12"
    ):
        deepspeed_config(t, 3)


def test_offload_sections_and_their_zero_requirements():
    opt = deepspeed_config(TrainConfig(train_iters=1, zero_stage=2, offload="optimizer"), 1)
    assert opt["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in opt["zero_optimization"]
    assert opt["zero_force_ds_cpu_optimizer"] is False  # torch AdamW, no C++ build
    both = TrainConfig(train_iters=1, zero_stage=3, offload="optimizer_and_params")
    assert deepspeed_config(both, 1)["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert (
        "offload_optimizer"
        not in deepspeed_config(TrainConfig(train_iters=1), 1)["zero_optimization"]
    )
    with pytest.raises(GptflowError, match=r"train\.offload optimizer needs ZeRO"):
        TrainConfig(train_iters=1, offload="optimizer")
    with pytest.raises(GptflowError, match="only ZeRO stage 3 partitions"):
        TrainConfig(train_iters=1, zero_stage=2, offload="optimizer_and_params")


def one_gloo_rank(script: str, env: dict | None = None) -> dict:
    """`script` run by a fresh Python as one gloo rank (its rendezvous port is argv[1]: 0, so
    the rank's store binds a free port itself, rather than one found free here and released,
    which a test running beside it could take meanwhile); the JSON object its last line prints."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", script, "0"], capture_output=True, text=True, timeout=300,
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


SKIP_SCRIPT = r"""
import json, os, sys
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
from gptflow.train import engine as ds
from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train.model import GPTNeoX, decay_groups
import deepspeed

ds.init_distributed()
torch.manual_seed(0)
x = torch.randint(0, 128, (2, 16))
out = {}
for stage in (0, 1, 2, 3):
    torch.manual_seed(0)
    model = GPTNeoX(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128))
    t = TrainConfig(train_iters=10, zero_stage=stage, micro_batch_size=2, global_batch_size=2,
                    lr=1e-2, min_lr=1e-3, lr_warmup_iters=0)
    eng = ds.build_engine(model, decay_groups(model, 0.1), t, 1)

    def params():
        ps = list(eng.module.parameters())
        with deepspeed.zero.GatheredParameters(ps, enabled=stage == 3):
            return [p.detach().clone() for p in ps]

    def step(poison):
        loss = eng(x, x)
        eng.backward(loss * float("nan") if poison else loss)
        eng.step()

    step(False)
    before, lr = params(), eng.get_lr()[0]
    step(True)
    after = params()
    skipped_ok = all(torch.equal(a, b) for a, b in zip(before, after))
    lr_held = eng.get_lr()[0] == lr
    step(False)
    moved = params()
    out[stage] = {
        "unchanged": skipped_ok,
        "lr_held": lr_held,
        "skipped_steps": eng.skipped_steps,
        "then_trains": any(not torch.equal(a, b) for a, b in zip(after, moved)),
        "finite": all(bool(torch.isfinite(p).all()) for p in moved),
    }
print(json.dumps(out))
from gptflow.train import device
sys.exit(device.leave(0))  # without the interpreter's teardown (gptflow.train.device.leave)
"""


def test_a_step_with_nan_gradients_is_skipped_at_every_zero_stage():
    """A backward of a NaN loss: the weights and the learning-rate schedule stay as they were,
    DeepSpeed counts the skip (ZeRO 0 through our optimizer's overflow flag, ZeRO 1-3 by their
    own gradient-norm checks), and the next step trains normally. Real DeepSpeed engines, one
    gloo rank."""
    result = one_gloo_rank(SKIP_SCRIPT)
    for stage, r in result.items():
        assert r["unchanged"] and r["then_trains"] and r["finite"], (stage, r)
    assert {s: result[s]["skipped_steps"] for s in result} == {"0": 1, "1": 1, "2": 1, "3": 1}
    assert all(r["lr_held"] for r in result.values()), result


GROUP_SKIP_SCRIPT = r"""
import collections, json, os, sys
import torch
import torch.distributed as dist
from gptflow.train import engine as ds
from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train.model import GPTNeoX, decay_groups
import deepspeed

ds.init_distributed()
rank = dist.get_rank()
collectives = collections.Counter()  # all-reduces made by gptflow.train.engine, per layout
plain = dist.all_reduce
def counted(*a, **k):
    if sys._getframe(1).f_code.co_filename == ds.__file__:
        collectives[layout] += 1
    return plain(*a, **k)
dist.all_reduce = counted
x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
out = {}
for stage, precision in ((0, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")):
    layout = f"{stage} {precision}"
    torch.manual_seed(0)
    model = GPTNeoX(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128))
    t = TrainConfig(train_iters=10, zero_stage=stage, micro_batch_size=2, global_batch_size=4,
                    lr=1e-2, min_lr=1e-3, lr_warmup_iters=0, precision=precision)
    eng = ds.build_engine(model, decay_groups(model, 0.1), t, 2)
    # a LayerNorm weight (the no-decay group) gets a NaN gradient, on rank 1 only
    poison = {"on": False}
    norm = next(m for m in eng.module.modules() if isinstance(m, torch.nn.LayerNorm)).weight
    norm.register_hook(lambda g: g * float("nan") if poison["on"] and rank == 1 else g)

    def params():
        ps = list(eng.module.parameters())
        with deepspeed.zero.GatheredParameters(ps, enabled=stage == 3):
            return [p.detach().float().clone() for p in ps]

    def step():
        loss = eng(x, x)
        eng.backward(loss)
        eng.step()

    step()
    before, lr = params(), eng.get_lr()[0]
    poison["on"] = True
    step()
    after = params()
    out[layout] = {
        "changed": sum(not torch.equal(a, b) for a, b in zip(before, after)),
        "skipped_steps": eng.skipped_steps,
        "lr_held": eng.get_lr()[0] == lr,
        "collectives": collectives[layout],
    }
with open(f"{sys.argv[1]}.{rank}", "w") as f:  # a file per rank: printed lines interleave
    json.dump(out, f)
dist.destroy_process_group()
from gptflow.train import device
sys.exit(device.leave(0))  # without the interpreter's teardown (gptflow.train.device.leave)
"""


def test_a_nan_in_one_group_on_one_rank_skips_the_whole_step_everywhere(tmp_path):
    """A NaN gradient in one parameter group (the LayerNorm weights) on one of two gloo ranks:
    no parameter of either group changes on either rank, the step is counted in DeepSpeed's
    skipped_steps and the schedule is held, at ZeRO 0 fp32 and ZeRO 1/2/3 bf16. At ZeRO 0
    gptflow's optimizer decides, in one all-reduce per step (two steps here); under ZeRO 1-3
    DeepSpeed's optimizer has decided for the whole step before it calls ours, which then
    makes no collective of its own (it made one per group or sub-group, each read on the
    host)."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "skip.py"
    script.write_text(GROUP_SKIP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", str(script), str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.{rank}").read_text())
        for layout, r in result.items():
            assert r["changed"] == 0 and r["skipped_steps"] == 1 and r["lr_held"], (layout, r)
        collectives = {layout: r["collectives"] for layout, r in result.items()}
        assert collectives == {"0 fp32": 2, "1 bf16": 0, "2 bf16": 0, "3 bf16": 0}


FP16_SCRIPT = r"""
import json, os, sys
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
from gptflow.train import engine as ds
from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train.model import GPTNeoX, decay_groups

ds.init_distributed()
x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
out = {}
for stage in (1, 2, 3):
    torch.manual_seed(0)
    model = GPTNeoX(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128))
    t = TrainConfig(train_iters=10, zero_stage=stage, micro_batch_size=2, global_batch_size=4,
                    lr=1e-3, min_lr=1e-4, lr_warmup_iters=0, precision="fp16")
    eng = ds.build_engine(model, decay_groups(model, 0.1), t, 1)
    losses = []
    for step in range(2):
        for micro in range(2):
            loss = eng(x, x)
            eng.backward(loss)
            eng.step()
        losses.append(loss.item())
    sums = getattr(eng.optimizer, "gradient_accumulation_dtype", None)
    out[stage] = {"losses": losses, "sums": str(sums), "skipped": eng.skipped_steps,
                  "params": str(next(eng.module.parameters()).dtype)}
print(json.dumps(out))
from gptflow.train import device
sys.exit(device.leave(0))  # without the interpreter's teardown (gptflow.train.device.leave)
"""


def test_fp16_sums_gradients_in_fp32_under_zero():
    """fp16 (the published layouts' precision) at ZeRO 1/2/3: DeepSpeed's optimizer sums the
    micro-batches' gradients in fp32, as for bf16, and two steps of two micro-batches train (no
    skipped step, the loss falls). ZeRO 0 is refused (the next test). Real DeepSpeed engines
    on one gloo rank; the CPU
    runs fp16 matmuls through oneDNN, or, where oneDNN has no fp16 (DeepSpeed refuses fp16
    there), through PyTorch's reference kernels with DeepSpeed's gate lifted
    (tests/support/hardware.py)."""
    result = one_gloo_rank(FP16_SCRIPT, env=fp16_env())
    for stage, r in result.items():
        assert r["params"] == "torch.float16" and r["skipped"] == 0, (stage, r)
        assert r["losses"][1] < r["losses"][0], (stage, r)
    assert {s: r["sums"] for s, r in result.items()} == {
        "1": "torch.float32", "2": "torch.float32", "3": "torch.float32"
    }  # fmt: skip


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_without_zero_is_refused_with_the_fix(repo, tiny_config, precision):
    """DeepSpeed's bf16 and fp16 at ZeRO 0 (FP16_UnfusedOptimizer) start Adam one step ahead
    and sum gradients in half precision; in fp16 it also never scales the loss (issue 36:
    found by the K-FAC layout test, the held gradient's norm was the true one, not 2^16 times
    it). Refused when a run is planned and when it starts, naming stage 1; an existing run's
    config still reads (its export must work)."""
    from gptflow.plan.workflow_config import load_workflow_config

    old_run = TrainConfig(train_iters=1, precision=precision)  # reading is fine
    with pytest.raises(
        GptflowError, match=rf"train\.precision {precision} needs train\.zero_stage 1"
    ):
        deepspeed_config(old_run, 1)
    cfg = {
        **tiny_config,
        "train": {**tiny_config["train"], "precision": precision, "zero_stage": 0},
    }
    with pytest.raises(
        GptflowError, match=r"Adam's step count one ahead.* Set train\.zero_stage 1"
    ):
        load_workflow_config(
            cfg,
            schema_path=repo / "config/schema/config.schema.yaml",
            models_dir=repo / "config/models",
            source="test",
        )


def test_auto_precision_never_reaches_deepspeed():
    """`auto` is decided on the training device (gptflow.train.main.on_device) first."""
    with pytest.raises(GptflowError, match="decided on the training device"):
        deepspeed_config(TrainConfig(train_iters=1, precision="auto", zero_stage=1), 1)


MUON_IMPORT_SCRIPT = r"""
import json, os, sys
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
compiled = []  # torch.compile's calls: (function name, its arguments)
real_compile, mode = torch.compile, {"delegate": True}
def recording_compile(model=None, **kwargs):
    if model is None:
        return lambda f: recording_compile(f, **kwargs)
    compiled.append((model.__name__, kwargs))
    return real_compile(model, **kwargs) if mode["delegate"] else model
torch.compile = recording_compile
from gptflow.train import engine as ds
from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train.model import GPTNeoX, decay_groups

ds.init_distributed()
torch.manual_seed(0)
model = GPTNeoX(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64))
t = TrainConfig(train_iters=2, zero_stage=1, micro_batch_size=2, global_batch_size=2, lr=1e-3,
                min_lr=1e-4, lr_warmup_iters=0)
eng = ds.build_engine(model, decay_groups(model, 0.1), t, 1)
x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
eng.backward(eng(x, x))
eng.step()  # ZeRO 1's average_tensor imports Muon's module every step
out = {"muon_imported": "deepspeed.runtime.zero.muon.original_muon" in sys.modules,
       "inductor_imported": "torch._inductor.compile_fx" in sys.modules,
       "compiled_by_a_zero1_step": list(compiled)}
from deepspeed.runtime.zero.muon import original_muon
mode["delegate"] = False  # the first call compiles: recorded, then run eagerly here
g = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
got = original_muon.zeropower_via_newtonschulz5(g, 5)
again = original_muon.zeropower_via_newtonschulz5(g, 5)
want = original_muon.zeropower_via_newtonschulz5.__wrapped__(g, 5)
out["compiled_after_two_calls"] = list(compiled)
out["same_result"] = bool(torch.equal(got, want) and torch.equal(again, want))
print(json.dumps(out))
from gptflow.train import device
sys.exit(device.leave(0))  # without the interpreter's teardown (gptflow.train.device.leave)
"""


def test_deepspeeds_muon_is_compiled_at_its_first_call_not_at_every_ranks_start():
    """DeepSpeed imports its Muon module in every ZeRO engine, and that module decorates three
    functions with torch.compile, which imports torch._inductor (1.1 s of CPU per rank here).
    After a real ZeRO 1 engine's start and step: the module is imported, nothing compiled and
    torch._inductor not imported; the first call of a decorated function compiles it (once, with
    the decorator's arguments) and it computes what the undecorated function does."""
    result = one_gloo_rank(MUON_IMPORT_SCRIPT)
    assert result["muon_imported"], result
    assert result["compiled_by_a_zero1_step"] == [], result
    assert not result["inductor_imported"], result
    assert result["compiled_after_two_calls"] == [["zeropower_via_newtonschulz5", {}]], result
    assert result["same_result"], result
