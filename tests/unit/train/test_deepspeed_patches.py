"""gptflow's patches of DeepSpeed's code (gptflow.train.deepspeed_patches): how a rewrite is
made and refused. What each patch fixes is tested where it shows, in training:
tests/unit/train/test_muon_layouts.py fails without any one of them."""

from __future__ import annotations

import sys
import types

import pytest

from gptflow.errors import GptflowError
from gptflow.train import deepspeed_patches


@pytest.fixture
def module():
    """A module of its own holding a class, as DeepSpeed's modules hold theirs."""
    source = (
        "LIMIT = 3\n"
        "class Optimizer:\n"
        "    def merge(self, a, b):\n"
        "        if a is None and b < LIMIT:\n"
        "            return 'merged'\n"
        "        return 'apart'\n"
    )
    mod = types.ModuleType("patch_target")
    mod.__file__ = "patch_target.py"
    sys.modules["patch_target"] = mod
    code = compile(source, "patch_target.py", "exec")
    exec(code, mod.__dict__)
    import linecache

    linecache.cache["patch_target.py"] = (
        len(source),
        None,
        source.splitlines(True),
        "patch_target.py",
    )
    yield mod
    del sys.modules["patch_target"]
    linecache.cache.pop("patch_target.py", None)


def test_a_rewrite_changes_only_its_stretch_and_runs_in_the_methods_module(module):
    cls = module.Optimizer
    assert cls().merge(None, 1) == "merged"
    deepspeed_patches.rewrite(cls, "merge", "if a is None and", "if a is None and b > 0 and")
    assert deepspeed_patches.patched(cls, "merge")
    assert cls().merge(None, 1) == "merged"  # LIMIT read from the method's own module
    assert cls().merge(None, 0) == "apart"
    assert cls.merge.__qualname__ == "Optimizer.merge"
    assert cls.merge.__code__.co_firstlineno == 3  # DeepSpeed's line numbers in tracebacks
    # idempotent; a second rewrite of the same method keeps the first
    deepspeed_patches.rewrite(cls, "merge", "if a is None and", "if a is None and b > 0 and")
    deepspeed_patches.rewrite(cls, "merge", "return 'apart'", "return 'kept apart'")
    assert cls().merge(None, 0) == "kept apart" and cls().merge(None, 1) == "merged"


def test_a_rewrite_of_code_that_is_not_there_once_is_refused_in_one_line(module):
    """Another DeepSpeed release is never patched blindly: the stretch must be found exactly once."""
    cls = module.Optimizer
    with pytest.raises(GptflowError) as e:
        deepspeed_patches.rewrite(cls, "merge", "if a is not None", "if False")
    message = str(e.value)
    assert "Optimizer.merge is not the code gptflow's patch was written for" in message
    assert f"deepspeed=={deepspeed_patches.TESTED}" in message and "\n" not in message
    with pytest.raises(GptflowError):
        deepspeed_patches.rewrite(cls, "merge", "return '", "return '")  # twice
    assert not deepspeed_patches.patched(cls, "merge")


def test_every_patch_applies_to_the_pinned_deepspeed():
    """The pinned release holds each stretch once (apply() would refuse otherwise), and each
    method the trainer relies on is gptflow's after apply()."""
    import deepspeed
    from deepspeed.runtime.zero.muon import original_muon
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert deepspeed.__version__ == deepspeed_patches.TESTED
    deepspeed_patches.apply()
    assert deepspeed_patches.patched(DeepSpeedZeroOptimizer, "average_tensor")
    assert deepspeed_patches.patched(DeepSpeedZeroOptimizer, "_muon_momentum_buffer")
    assert deepspeed_patches.patched(DeepSpeedZeroOptimizer_Stage3, "_create_momentum_buffer")
    assert deepspeed_patches.patched(
        DeepSpeedZeroOptimizer_Stage3, "_apply_muon_to_accumulated_grads"
    )
    assert getattr(original_muon.muon_update, "gptflow_rewrites", ())


def test_muon_update_lifts_a_bf16_gradient_to_an_fp32_momentum(monkeypatch):
    """The update is computed and returned in the momentum's dtype (fp32), so no bf16
    rounding of the momentum or of the update before the fp32 master step; equal dtypes
    are DeepSpeed's own path."""
    import torch
    from deepspeed.runtime.zero.muon import original_muon

    deepspeed_patches.apply()
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # Newton-Schulz eager: no compile
    torch.manual_seed(0)
    grad = torch.randn(16, 8)
    momentum = torch.randn(16, 8) * 1e-3
    bf16_grad = grad.to(torch.bfloat16)
    m = momentum.clone()
    update = original_muon.muon_update(bf16_grad.clone(), m, beta=0.95, ns_method="standard")
    assert update.dtype == torch.float32 and m.dtype == torch.float32
    want = momentum.lerp(bf16_grad.float(), 1 - 0.95)
    assert torch.equal(m, want)  # the momentum combined in fp32, bit for bit


def test_on_another_deepspeed_nothing_is_patched_and_muon_is_refused_in_one_line(monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    deepspeed_patches.apply.cache_clear()
    try:
        assert deepspeed_patches.apply() is False
        with pytest.raises(GptflowError) as e:
            deepspeed_patches.require("train.optimizer muon")
        assert str(e.value) == (
            "train.optimizer muon needs gptflow's fixes of DeepSpeed 0.19.8 "
            "(gptflow.train.deepspeed_patches), and this is DeepSpeed 0.20.0: install "
            "deepspeed==0.19.8 (make setup)"
        )
    finally:
        deepspeed_patches.apply.cache_clear()
