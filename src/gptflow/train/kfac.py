"""K-FAC: the gradients of the transformer layers' ``nn.Linear`` weights (and biases)
preconditioned by a Kronecker-factored Fisher before DeepSpeed's optimizer step.

For a layer y = W a (+ b), K-FAC approximates its block of the Fisher by A ⊗ G, A = E[a aᵀ]
over its inputs (with a row of ones for the bias: W and b are one (out, in + 1) matrix) and
G = E[g gᵀ] over the per-token gradients of the loss with respect to its outputs. Every
``factor_update_steps`` steps the statistics of that step's normal forward and backward
(hooks on the layers: the empirical Fisher, as kfac-pytorch computes it, so no extra pass)
update the running averages ``A ← decay A + (1 - decay) A_step`` (from the identity), averaged
over the data-parallel ranks first, so every replica holds the same factors. Every
``inv_update_steps`` steps each factor is eigendecomposed, A = Q_A diag(λ_A) Q_Aᵀ and the same
for G; the gradient M of the layer becomes

    Q_G [(Q_Gᵀ M Q_A) / (λ_G λ_Aᵀ + damping)] Q_Aᵀ  =  (G ⊗ A + damping I)⁻¹ vec(M)

which is G⁻¹ M A⁻¹ as the damping goes to zero. AdamW then steps on it; DeepSpeed's gradient
clipping applies to the preconditioned gradient.

Why our own and not ASDL (``asdfghjkl`` 0.1a5, the one PyTorch K-FAC on the package index):
measured under DeepSpeed 0.19.8 (issue 29), its public ``GradientMaker`` wants to run forward
and backward itself, which DeepSpeed's engine refuses; through its internals its factor
reduction asserts CUDA, it rejects DDP, it calls ``torch.cuda.nvtx`` unconditionally, its
backward hook is deprecated in torch 2.13, and its Embedding preconditioning is wrong. What
we need is one module: forward hooks and tensor hooks (not module backward hooks: they leave
DeepSpeed's gradient hooks alone), one all-reduce of the factors, ``torch.linalg.eigh``, and
the gradient the optimizer steps on, read and written through :func:`gptflow.train.engine.full_grad`
and :func:`~gptflow.train.engine.set_full_grad` (DeepSpeed's accessors for ZeRO 1/2, where
``p.grad`` is None after the backward; BF16_Optimizer's fp32 buffer under bf16 at ZeRO 1, where
DeepSpeed's setter writes a ``p.grad`` that optimizer never reads).

Which layers: the ``nn.Linear`` modules of :class:`gptflow.train.model.GPTNeoX` but its output
head (``embed_out``: its G would be vocabulary x vocabulary); the embedding is an
``nn.Embedding``. Under tensor parallel DeepSpeed's AutoTP replaces them by slices
(``LinearLayer``/``LinearAllreduce``), which is one reason that layout is refused
(:func:`gptflow.config.settings.check_kfac`). Their shapes are
:func:`gptflow.config.settings.kfac_layer_shapes`, the memory
:func:`gptflow.config.settings.kfac_floats`, which this class checks it holds exactly.

No host sync from this module: the hooks and the update are device work, and a step whose
statistics are not finite (an fp16 overflow) leaves the factors as they were, decided on the
device. (On a GPU ``torch.linalg.eigh`` checks its result on the host: one wait per
``inv_update_steps``, not per step.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gptflow.config.settings import KfacConfig, ModelConfig, kfac_floats, kfac_layer_shapes
from gptflow.errors import GptflowError
from gptflow.train import engine as ds

HEAD = "embed_out"  # the output head, left out


def kfac_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The layers K-FAC preconditions, in module order."""
    return [
        (name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != HEAD
    ]


@dataclass
class Layer:
    """One layer's views into the flat buffers of :class:`Kfac`."""

    module: nn.Linear
    A: torch.Tensor  # (in+1, in+1) the running input factor
    G: torch.Tensor  # (out, out) the running output-gradient factor
    A_step: torch.Tensor  # this step's sum of a aᵀ
    G_step: torch.Tensor  # this step's sum of g gᵀ
    QA: torch.Tensor  # eigenvectors of A (columns)
    QG: torch.Tensor
    dA: torch.Tensor  # eigenvalues of A
    dG: torch.Tensor
    rows: int = 0  # tokens gathered into A_step this step (a Python count: no sync)


def views(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = torch.Size(shape).numel()
        out.append(flat[at : at + n].view(shape))
        at += n
    return out


class Kfac:
    """The factors of `model`'s layers, hooks that gather them, and :meth:`step`, called after
    the last micro-batch's backward and before ``engine.step()``.

    Three flat fp32 buffers hold everything (views per layer): the factors (what a
    checkpoint keeps, with the eigendecomposition), the step's statistics, and the
    eigenvectors and eigenvalues; each is all-reduced in one collective."""

    def __init__(self, model: nn.Module, cfg: KfacConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.collecting = False
        found = kfac_layers(model)
        dims = [(m.in_features + (m.bias is not None), m.out_features) for _, m in found]
        f32 = dict(dtype=torch.float32, device=device)
        square = [s for a, g in dims for s in ((a, a), (g, g))]
        self.factors = torch.zeros(sum(a * a + g * g for a, g in dims), **f32)
        self.stats = torch.zeros_like(self.factors)
        self.eigen = torch.zeros(self.factors.numel() + sum(a + g for a, g in dims), **f32)
        fv, sv = views(self.factors, square), views(self.stats, square)
        ev = views(self.eigen, square + [(n,) for a, g in dims for n in (a, g)])
        vals = ev[len(square) :]
        self.layers = [
            Layer(m, fv[2 * i], fv[2 * i + 1], sv[2 * i], sv[2 * i + 1], ev[2 * i],
                  ev[2 * i + 1], vals[2 * i], vals[2 * i + 1])
            for i, (_, m) in enumerate(found)
        ]  # fmt: skip
        for ly in self.layers:  # start at the identity: the first updates are mostly AdamW
            for f in (ly.A, ly.G, ly.QA, ly.QG):
                f.copy_(torch.eye(f.shape[0], **f32))
            ly.dA.fill_(1.0)
            ly.dG.fill_(1.0)
            ly.module.register_forward_hook(self._gather_inputs(ly))

    def numel(self) -> int:
        return self.factors.numel() + self.stats.numel() + self.eigen.numel()

    def check_count(self, model_cfg: ModelConfig) -> None:
        """The preflight's count (:func:`gptflow.config.settings.kfac_floats`) is what this
        holds."""
        want = kfac_floats(model_cfg)
        dims = [(ly.A.shape[0], ly.G.shape[0]) for ly in self.layers]
        if self.numel() != want or dims != kfac_layer_shapes(model_cfg):
            raise GptflowError(
                f"K-FAC holds {self.numel():,} numbers for layers {dims}, the preflight counted "
                f"{want:,} for {kfac_layer_shapes(model_cfg)}; "
                "gptflow.config.settings.kfac_layer_shapes no longer describes gptflow.train.model"
            )

    # -- gathering (in the forward and backward of the micro-batches) --------------------
    def _gather_inputs(self, ly: Layer):
        def hook(module: nn.Linear, inputs: tuple, output: torch.Tensor) -> None:
            if not (self.collecting and module.training and torch.is_grad_enabled()):
                return
            a = inputs[0].detach().flatten(0, -2).float()  # (N, in)
            if module.bias is not None:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)  # (N, in+1)
            ly.A_step.addmm_(a.T, a)
            ly.rows += a.shape[0]
            output.register_hook(self._gather_grads(ly))  # a tensor hook: DeepSpeed's are apart

        return hook

    @staticmethod
    def _gather_grads(ly: Layer) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            g = grad.detach().flatten(0, -2).float()  # (N, out)
            ly.G_step.addmm_(g.T, g)

        return hook

    # -- the update, at the step's last micro-batch -------------------------------------------
    def begin(self, step: int) -> None:
        """Before step `step`'s first micro-batch (0-based): gather its statistics or not."""
        self.collecting = step % self.cfg.factor_update_steps == 0

    def step(self, step: int, loss_scale: float | torch.Tensor = 1.0) -> None:
        """Update the factors (if gathered this step) and the eigendecomposition (if due),
        then precondition the gradients. `loss_scale`: fp16's, in the output gradients."""
        if self.collecting:
            self.update_factors(loss_scale)
        if step % self.cfg.inv_update_steps == 0:
            self.update_eigen()
        self.precondition()

    def update_factors(self, loss_scale: float | torch.Tensor = 1.0) -> None:
        """The step's statistics into the running factors, averaged over the ranks.

        A hook's output gradient is the per-token gradient / (tokens per micro-batch x
        micro-batches) x loss scale (the loss is the micro-batch's mean, DeepSpeed divides it by
        the micro-batches): times the step's `rows`, the sum of g gᵀ becomes the mean of the
        per-token gradients' outer products."""
        self.collecting = False
        unscale = 1.0 / (loss_scale * loss_scale)  # a float, or fp16's scale as a device tensor
        for ly in self.layers:
            ly.A_step.div_(max(ly.rows, 1))
            ly.G_step.mul_(ly.rows * unscale)
            ly.rows = 0
        world = all_reduce_sum(self.stats)
        if world > 1:
            self.stats.div_(world)
        finite = torch.isfinite(self.stats).all()
        self.stats.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        weight = torch.where(finite, 1.0 - self.cfg.factor_decay, 0.0)  # 0: keep the factors
        self.factors.lerp_(self.stats, weight)  # decay x old + (1 - decay) x new
        self.stats.zero_()

    def update_eigen(self) -> None:
        """Eigendecompose every factor: each rank its share of the layers, then one all-reduce
        of the buffer, zero where a rank computed nothing, so that every rank holds the same
        bits (x + 0 is x) and a replica never drifts on its own rounding."""
        rank = dist.get_rank() if is_distributed() else 0
        world = dist.get_world_size() if is_distributed() else 1
        self.eigen.zero_()
        for i, ly in enumerate(self.layers):
            if i % world != rank:
                continue
            for f, q, d in ((ly.A, ly.QA, ly.dA), (ly.G, ly.QG, ly.dG)):
                vals, vecs = torch.linalg.eigh(f)
                d.copy_(vals.clamp_(min=0.0))  # a factor is positive semi-definite
                q.copy_(vecs)
        all_reduce_sum(self.eigen)

    def precondition(self) -> None:
        """Each layer's gradient (W and b as one matrix) through the eigenbasis; read and
        written where the optimizer steps on it (``p.grad`` at ZeRO 0, the partitions at 1/2,
        BF16_Optimizer's fp32 buffer)."""
        damping = self.cfg.damping
        for ly in self.layers:
            w, b = ly.module.weight, ly.module.bias
            gw = ds.full_grad(w)
            if gw is None:
                raise GptflowError(f"K-FAC: no gradient for a {tuple(w.shape)} weight")
            m = gw if b is None else torch.cat([gw, ds.full_grad(b)[:, None]], dim=1)
            m = m.float()  # (out, in+1)
            v = ly.QG.T @ m @ ly.QA
            v.div_(torch.outer(ly.dG, ly.dA).add_(damping))
            p = ly.QG @ v @ ly.QA.T  # (out, in+1)
            ds.set_full_grad(w, p[:, : w.shape[1]].to(gw.dtype))
            if b is not None:
                ds.set_full_grad(b, p[:, -1].to(gw.dtype))

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps (the same on every rank): the factors and the
        eigendecomposition in use; the step's statistics are empty between steps."""
        return {"factors": self.factors.detach().cpu(), "eigen": self.eigen.detach().cpu()}

    def load_state_dict(self, state: dict | None, where: str) -> None:
        if state is None:
            raise GptflowError(f"{where}: the checkpoint has no K-FAC factors (train.kfac)")
        for key in ("factors", "eigen"):
            mine = getattr(self, key)
            if state[key].shape != mine.shape:
                raise GptflowError(
                    f"{where}: its K-FAC {key} hold {state[key].numel():,} numbers, this "
                    f"model's {mine.numel():,}"
                )
            mine.copy_(state[key])


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor) -> int:
    """Sum `t` over the ranks in place (every rank is data-parallel: K-FAC refuses tensor and
    pipeline parallel); returns the number of ranks."""
    if not is_distributed():
        return 1
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dist.get_world_size()
