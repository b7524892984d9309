"""What torch.compile computes in a training process depends on the step's shapes only, not on
what the process compiled before (gptflow.train.main.compile_each_shape_alone): the
condition for a resumed process to compute its first step as the uninterrupted one did. The
SIGKILL matrix (tests/unit/train/test_train.py) resumes a Muon run compiled, as users run it."""

from __future__ import annotations

import pytest
import torch

from gptflow.errors import GptflowError


def compiled_shapes(fn, *inputs) -> list[bool]:
    """Call torch.compile(fn) on each input in turn, through a backend that records, for every
    graph dynamo hands it, whether the graph is shape-generic (symbolic sizes)."""
    generic = []

    def backend(gm, example_inputs):
        generic.append(any(isinstance(x, torch.SymInt) for x in example_inputs))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    for x in inputs:
        compiled(x)
    torch._dynamo.reset()
    return generic


def scaled_gram(x: torch.Tensor) -> torch.Tensor:
    return (x @ x.T) / x.shape[0]


def test_each_shape_gets_a_kernel_of_its_own_after_the_trainers_setting(monkeypatch):
    """torch's default recompiles a function shape-generic at the second shape it sees, and
    that kernel then serves the first shape too: the first call and a later one of the same
    shape ran different kernels (DeepSpeed's Newton-Schulz: results 1e-4 apart, measured).
    After compile_each_shape_alone every graph is for one shape, and a shape seen before
    reuses its own."""
    import torch._dynamo.config

    from gptflow.train.main import compile_each_shape_alone

    a, b = torch.randn(192, 64), torch.randn(256, 64)
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", True)
    assert compiled_shapes(scaled_gram, a, b, a) == [False, True]  # torch's default
    compile_each_shape_alone()
    assert compiled_shapes(scaled_gram, a, b, a) == [False, False]


def test_the_trainer_compiles_each_shape_alone_before_anything_else(monkeypatch, tmp_path):
    """`gptflow train` sets it first thing, before it reads its config (which fails here)."""
    import torch._dynamo.config

    from gptflow.train import main

    def unreadable(path):
        raise GptflowError(f"{path}: stop here")

    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", True)
    monkeypatch.setattr(main.RunConfig, "load", unreadable)
    with pytest.raises(GptflowError, match="stop here"):
        main.train(tmp_path / "run.yaml", threads=1)
    assert torch._dynamo.config.automatic_dynamic_shapes is False
