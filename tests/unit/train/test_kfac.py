"""K-FAC (gptflow.train.kfac) on one small nn.Linear against the formulas computed directly,
the preflight's count of its memory, and the layouts it is refused with."""

import pytest
import torch
from torch import nn

from gptflow.config.settings import (
    KfacConfig,
    ModelConfig,
    TrainConfig,
    check_kfac,
    kfac_floats,
)
from gptflow.errors import GptflowError
from gptflow.train.kfac import Kfac


def one_layer_step(damping: float, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """A Linear(3 -> 4) on 2 x 16 tokens, a mean-over-tokens loss, one K-FAC step (decay 0:
    the factors are this batch's); returns (x, per-token output gradients, the gradient before
    and after preconditioning as (out, in+1) matrices, the layer's factors). `scale`: fp16's
    loss scale, multiplying the loss as DeepSpeed's does and handed to the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4))
    kfac = Kfac(model, KfacConfig(1, 1, damping, 0.0), torch.device("cpu"))
    x, target = torch.randn(2, 16, 3), torch.randn(2, 16, 4)
    kfac.begin(0)
    y = model(x)
    loss = ((y - target) ** 2).sum(-1).mean()  # the mean over tokens, as lm_loss
    (loss * scale).backward()
    lin = model[0]
    before = torch.cat([lin.weight.grad, lin.bias.grad[:, None]], 1).clone()
    kfac.step(0, loss_scale=scale)
    after = torch.cat([lin.weight.grad, lin.bias.grad[:, None]], 1)
    per_token = (2 * (y - target)).detach().reshape(-1, 4)  # d loss_i / d y_i
    (ly,) = kfac.layers
    return x, per_token, before, after, ly.A.clone(), ly.G.clone()


def test_factors_are_the_input_and_output_gradient_second_moments():
    x, g, _, _, A, G = one_layer_step(damping=1e-3)
    a = torch.cat([x.reshape(-1, 3), torch.ones(32, 1)], 1).double()  # the bias as a 1 input
    torch.testing.assert_close(A.double(), a.T @ a / 32, rtol=1e-6, atol=1e-6)  # fp32 sums
    torch.testing.assert_close(G.double(), g.double().T @ g.double() / 32, rtol=1e-6, atol=1e-6)


def test_preconditioned_gradient_is_inverse_G_times_gradient_times_inverse_A():
    """With damping negligible: G⁻¹ ∇ A⁻¹ (the issue's A⁻¹ G B⁻¹), computed directly in float64
    from the layer's inputs and per-token output gradients."""
    x, g, before, after, _, _ = one_layer_step(damping=1e-12)
    a = torch.cat([x.reshape(-1, 3), torch.ones(32, 1)], 1).double()
    A, G = a.T @ a / 32, g.double().T @ g.double() / 32
    want = torch.linalg.inv(G) @ before.double() @ torch.linalg.inv(A)
    torch.testing.assert_close(after.double(), want, rtol=0, atol=1e-6)


def test_damping_is_added_to_the_kronecker_product():
    """(G ⊗ A + damping I)⁻¹ vec(∇), solved directly in float64 from the factors."""
    _, _, before, after, A, G = one_layer_step(damping=0.1)
    K = torch.kron(G.double(), A.double()) + 0.1 * torch.eye(4 * 4, dtype=torch.float64)
    want = torch.linalg.solve(K, before.double().flatten()).reshape(4, 4)
    torch.testing.assert_close(after.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "device-tensor"])
def test_fp16_loss_scale_leaves_the_statistics_and_the_update_unscaled(as_tensor):
    """fp16: the loss and its scale S multiplied (S = 2^16, DeepSpeed's first scale): the
    factors are the unscaled step's, and the preconditioned gradient is the unscaled one times
    S, which DeepSpeed divides out before clipping and the update. The scale comes as a float
    or, as DeepSpeed's ZeRO holds it, a tensor (read on the device, not the host)."""
    S = 2.0**16
    _, _, before, after, A, G = one_layer_step(damping=1e-3)
    scale = torch.tensor(S) if as_tensor else S
    _, _, s_before, s_after, s_A, s_G = one_layer_step(damping=1e-3, scale=scale)
    torch.testing.assert_close(s_before / S, before, rtol=1e-5, atol=0)
    torch.testing.assert_close(s_A, A, rtol=1e-6, atol=0)
    torch.testing.assert_close(s_G, G, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(s_after / S, after, rtol=1e-4, atol=1e-9)


def test_the_preflight_count_is_what_the_model_holds(repo):
    """Every nn.Linear but the output head, with its bias row: config.kfac_floats, the one
    count the preflight and the trainer's start-up line use, is the buffers' size."""
    import yaml

    from gptflow.train.model import GPTNeoX

    m = ModelConfig(
        **yaml.safe_load((repo / "config/models/tiny.yaml").read_text()), vocab_size=512
    )
    kfac = Kfac(GPTNeoX(m), KfacConfig(), torch.device("cpu"))
    kfac.check_count(m)
    assert kfac.numel() == kfac_floats(m)
    assert all(ly.module.out_features != 512 for ly in kfac.layers)  # no head
    assert len(kfac.layers) == 4 * m.num_layers


@pytest.mark.parametrize(
    "train, model, refused",
    [({"tensor_parallel": 2, "zero_stage": 1}, {}, "train.tensor_parallel 2"),
     ({"pipeline_parallel": 2, "zero_stage": 1}, {}, "train.pipeline_parallel 2"),
     ({"zero_stage": 3}, {}, "train.zero_stage 3"),
     ({"zero_stage": 1, "offload": "optimizer"}, {}, "train.offload optimizer"),
     ({"compile": True}, {}, "train.compile true"),
     ({}, {"activation_checkpointing": True}, "model.activation_checkpointing true")],
)  # fmt: skip
def test_unsupported_layouts_are_refused_at_planning(tiny_config, train, model, refused):
    """preflight.run (snakemake -n) refuses each in one line naming the key and the fix."""
    from gptflow.plan import preflight
    from gptflow.plan.placement import Placement
    from gptflow.plan.runs import run_plan

    cfg = {
        **tiny_config,
        "model": {**tiny_config["model"], "num_layers": 2, "hidden_size": 64,
                  "num_attention_heads": 4, **model},
        "train": {**tiny_config["train"], "kfac": {}, **train},
    }  # fmt: skip
    placement = Placement(executor="local", nproc_per_node=2)
    with pytest.raises(GptflowError) as err:
        preflight.run(
            run_plan("kfac", cfg, None), placement, sinfo=lambda: None, accounts=lambda: None
        )
    message = str(err.value)
    assert message.startswith(f"train.kfac is not supported with {refused}: ")
    assert "\n" not in message and message.endswith("or train.kfac null")
    t = TrainConfig(**{**cfg["train"], "kfac": None})
    check_kfac(ModelConfig(**{k: v for k, v in cfg["model"].items() if k != "preset"},
                           vocab_size=512), t)  # fmt: skip  # off: nothing refused


def test_a_step_reads_nothing_on_the_host():
    """K-FAC's hooks and its update (factors, eigendecomposition, preconditioning) make no
    host read of a tensor (item, tolist, float, int, bool) in gptflow.train.kfac: on a GPU
    each would wait for the device inside the step."""
    import sys

    import gptflow.train.kfac as module

    calls = []
    plain = {
        n: getattr(torch.Tensor, n) for n in ("item", "tolist", "__float__", "__int__", "__bool__")
    }

    def probe(name):
        def read(self, *a, **k):
            if sys._getframe(1).f_code.co_filename == module.__file__:
                calls.append(name)
            return plain[name](self, *a, **k)

        return read

    try:
        for name in plain:
            setattr(torch.Tensor, name, probe(name))
        one_layer_step(damping=1e-3)
    finally:
        for name, f in plain.items():
            setattr(torch.Tensor, name, f)
    assert calls == []


def test_the_memory_check_counts_the_factors(repo):
    """gpu_memory.memory_per_gpu has a "K-FAC factors" term of 4 bytes x config.kfac_floats
    with train.kfac on, none without; at pythia-160m's size it is named as the fix's target."""
    import yaml

    from gptflow.plan import gpu_memory, placement

    preset = yaml.safe_load((repo / "config/models/pythia-160m.yaml").read_text())
    m = ModelConfig(**{k: v for k, v in preset.items() if k != "description"}, vocab_size=50304)
    t = TrainConfig(train_iters=10, seq_length=2048, micro_batch_size=1, global_batch_size=1)
    on = TrainConfig(**{**vars(t), "kfac": KfacConfig()})
    small_gpu = placement.Placement(executor="slurm", gres="gpu:1", tasks=1, gpu_mem_mb=8192)
    assert "K-FAC factors" not in gpu_memory.memory_per_gpu(m, t, 1, small_gpu).terms
    fit = gpu_memory.memory_per_gpu(m, on, 1, small_gpu)
    assert fit.terms["K-FAC factors"] == 4 * kfac_floats(m)
    assert fit.largest == "K-FAC factors" and not fit.fits
    with pytest.raises(GptflowError, match=r"the largest is K-FAC factors: set train\.kfac null"):
        gpu_memory.check_memory(fit)


def test_under_bf16_the_preconditioned_gradient_stays_fp32():
    """bf16 with BF16_Optimizer (ZeRO 1): the model and its ``param.grad`` are bf16, the
    gradient the optimizer steps on is the fp32 buffer each parameter views (``_hp_grad``,
    what gptflow.train.engine.full_grad reads and set_full_grad writes). The preconditioned
    gradient is written there in fp32, to 1e-5 of the float64 solve: cast to the parameter's
    bf16 on the way (2^-9 relative), the fp32 optimizer would step on a rounded gradient. The
    fp32 buffers stand in for DeepSpeed's; everything else is the trainer's K-FAC."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4)).to(torch.bfloat16)
    kfac = Kfac(model, KfacConfig(1, 1, 0.1, 0.0), torch.device("cpu"))
    x, target = torch.randn(2, 16, 3, dtype=torch.bfloat16), torch.randn(2, 16, 4)
    kfac.begin(0)
    loss = ((model(x).float() - target) ** 2).sum(-1).mean()
    loss.backward()
    lin = model[0]
    for p in lin.parameters():  # an fp32 gradient no bf16 number equals
        p._hp_grad = torch.randn(p.shape, dtype=torch.float32) * (1 + 2**-12)
    before = torch.cat([lin.weight._hp_grad, lin.bias._hp_grad[:, None]], 1).double()
    kfac.step(0)
    (ly,) = kfac.layers
    after = torch.cat([lin.weight._hp_grad, lin.bias._hp_grad[:, None]], 1)
    assert after.dtype == torch.float32
    K = torch.kron(ly.G.double(), ly.A.double()) + 0.1 * torch.eye(16, dtype=torch.float64)
    want = torch.linalg.solve(K, before.flatten()).reshape(4, 4)
    torch.testing.assert_close(after.double(), want, rtol=1e-5, atol=1e-7)
