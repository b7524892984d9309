"""GPT-NeoX: pre-LayerNorm decoder with partial rotary embeddings and a parallel residual.

Parameter names and layouts are those of Hugging Face ``GPTNeoXForCausalLM`` (``gpt_neox.*``,
fused ``query_key_value`` with rows grouped per head as ``[q_h; k_h; v_h]``, untied
``embed_out``), so export is a rename of one key at most. No DeepSpeed or distributed code here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gptflow.config.settings import ModelConfig


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the first `dim` dimensions of each head (NeoX ``rotate_half`` form)."""

    def __init__(self, dim: int, base: float) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The frequencies, computed on the CPU (as Hugging Face computes them) and copied to
        the buffer's device; also after ``to_empty``, which leaves buffers unset."""
        arange = torch.arange(0, self.dim, 2, dtype=torch.int64, device="cpu").float()
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / (self.base ** (arange / self.dim)))

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))  # (T, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, dim)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x (B, H, T, hd); pass the rest through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos.to(x.dtype) + rotate_half(x_rot) * sin.to(x.dtype)
    return torch.cat((x_rot, x_pass), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = cfg.attention_dropout
        # the RNG of the dropout of this rank's heads: under tensor parallel, a stream of the
        # tensor-parallel rank's own (set by gptflow.train.model_parallel.use_split_region_rng)
        self.split_rng: Callable[[], AbstractContextManager] = nullcontext

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # heads counted from the projection's width: under tensor parallelism a rank holds
        # whole heads, a contiguous block of `query_key_value`'s rows ([q_h; k_h; v_h] each)
        qkv = self.query_key_value(x).unflatten(-1, (-1, 3 * self.head_dim))
        q, k, v = qkv.permute(0, 2, 1, 3).chunk(3, dim=-1)  # each (B, H, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        with self.split_rng():
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )  # (B, H, T, hd)
        return self.dense(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.dense_4h_to_h = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))  # exact (erf) GELU, as NeoX


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attention = Attention(cfg)
        self.mlp = MLP(cfg)
        self.parallel_residual = cfg.parallel_residual
        self.drop = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.drop(self.attention(self.input_layernorm(x), cos, sin))
        if self.parallel_residual:  # x + attn(ln1(x)) + mlp(ln2(x))
            return x + attn + self.drop(self.mlp(self.post_attention_layernorm(x)))
        h = x + attn  # sequential (GPT-2 style)
        return h + self.drop(self.mlp(self.post_attention_layernorm(h)))


class Embedding(nn.Embedding):
    """``nn.Embedding`` that draws nothing on the meta device, where the model is built first
    (:func:`gptflow.train.engine.build_module`): its N(0, 1) draw there runs ``normal_``'s Python
    reference, whose wrapper imports ``torch._dynamo`` (~1.3 s of CPU a process), for values
    :meth:`GPTNeoX.init_module` replaces anyway. Elsewhere it draws as ``nn.Embedding`` does, so
    the global random stream is unchanged."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class Backbone(nn.Module):
    """``gpt_neox.*`` of the Hugging Face layout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_in = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.emb_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_ndims, cfg.rotary_emb_base)


class GPTNeoX(nn.Module):
    """Causal LM: token ids (B, T) -> logits (B, T, vocab), or the mean loss given labels."""

    def __init__(self, cfg: ModelConfig, seed: int | None = None) -> None:
        """`seed`: of the initialisation (default ``torch.initial_seed()``, the seed last given
        to ``torch.manual_seed``); on the meta device nothing is drawn."""
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (padded tokenizer vocabulary)")
        self.cfg = cfg
        self.gpt_neox = Backbone(cfg)
        self.embed_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # (logits, labels) -> mean loss; under tensor parallel the logits are split along the
        # vocabulary and gptflow.train.model_parallel.split_tensor_parallel puts its vocab-parallel
        # loss here
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
        if self.embed_out.weight.device.type != "meta":
            self.reset_parameters(torch.initial_seed() if seed is None else seed)

    def reset_parameters(self, seed: int) -> None:
        init = random_init(self.cfg, seed)
        for name, module in self.named_modules():
            self.init_module(name, module, init)

    def init_module(self, name: str, module: nn.Module, init: Initializer) -> None:
        """Set the parameters `module` holds itself (not its children's) to their initial
        values, ``init(name, shape)``: module by module, so that a partitioned model (ZeRO-3)
        can be initialised one gathered module at a time."""
        with torch.no_grad():
            for own, p in module.named_parameters(recurse=False):
                full = f"{name}.{own}" if name else own
                p.copy_(init(full, tuple(p.shape)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        T = input_ids.shape[1]
        cos, sin = self.gpt_neox.rotary(T, input_ids.device)  # (T, rot)
        x = self.gpt_neox.emb_dropout(self.gpt_neox.embed_in(input_ids))  # (B, T, C)
        for layer in self.gpt_neox.layers:
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.embed_out(self.gpt_neox.final_layer_norm(x))  # (B, T, V), or V/tp
        if labels is None:
            return logits
        return self.loss_fn(logits, labels)


# The initial value of a parameter, whole, by its GPTNeoX name and shape (a CPU tensor, fp32):
# drawn (random_init) or read from a Hugging Face checkpoint (gptflow.train.init_from.HFWeights).
# gptflow.train.engine.build_model takes one and slices it for the rank.
Initializer = Callable[[str, tuple[int, ...]], torch.Tensor]


def random_init(cfg: ModelConfig, seed: int) -> Initializer:
    """The random initialisation of a run seeded `seed` (:func:`initial_value`)."""
    return partial(initial_value, cfg, seed=seed)


def initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial value of parameter `name` (its :class:`GPTNeoX` name), whole, in fp32 on the
    CPU. NeoX's init: 'small_init' N(0, sqrt(2/5d)) for the embedding, the head and the input
    projections, 'wang_init' N(0, 2/(L sqrt d)) for each layer's two output projections
    (``attention.dense``, ``mlp.dense_4h_to_h``), zero biases, unit LayerNorm weights.

    Each parameter draws from a generator of its own, seeded by (seed, name): so every layout
    starts from the same weights -- one rank, ZeRO-3 partitions, tensor-parallel slices,
    pipeline stages -- while each rank draws only the parameters it holds, one at a time."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "layernorm" in name or "layer_norm" in name:
        return torch.ones(shape)
    d, n = cfg.hidden_size, cfg.num_layers
    std = cfg.init_std or math.sqrt(2.0 / (5.0 * d))
    is_out = name.endswith(("attention.dense.weight", "mlp.dense_4h_to_h.weight"))
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.empty(shape).normal_(
        0.0, 2.0 / (n * math.sqrt(d)) if is_out else std, generator=generator
    )


def reset_buffers(module: nn.Module) -> None:
    """Recompute the buffers of `module` (the rotary tables): after ``to_empty`` of a model
    built on the meta device they hold whatever the allocation held."""
    for m in module.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_buffers()


# ----------------------------------------------------------------------------- pipeline form
#
# The same modules as consecutive stages (DeepSpeed's PipelineModule takes a list of layers, each
# mapping one tensor to the next): the embedding, each decoder layer, then the final LayerNorm
# with the output head; the loss is applied by the engine on the last stage. The stages hold the
# parameters of a built GPTNeoX, so a pipeline starts from the single-rank initialisation.


class EmbedStage(nn.Module):
    def __init__(self, model: GPTNeoX) -> None:
        super().__init__()
        self.embed_in = model.gpt_neox.embed_in
        self.emb_dropout = model.gpt_neox.emb_dropout

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb_dropout(self.embed_in(input_ids))


class LayerStage(nn.Module):
    def __init__(self, model: GPTNeoX, index: int) -> None:
        super().__init__()
        self.layer = model.gpt_neox.layers[index]
        self.rotary = model.gpt_neox.rotary  # no parameters: a buffer, not saved
        self.checkpointed = model.cfg.activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(x.shape[1], x.device)
        if self.checkpointed and self.training:
            return checkpoint(self.layer, x, cos, sin, use_reentrant=False)
        return self.layer(x, cos, sin)


class HeadStage(nn.Module):
    def __init__(self, model: GPTNeoX) -> None:
        super().__init__()
        self.final_layer_norm = model.gpt_neox.final_layer_norm
        self.embed_out = model.embed_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed_out(self.final_layer_norm(x))


def pipeline_stages(model: GPTNeoX) -> list[nn.Module]:
    """`model` as the layer list of a pipeline: embedding, decoder layers, head."""
    n = model.cfg.num_layers
    return [EmbedStage(model), *(LayerStage(model, i) for i in range(n)), HeadStage(model)]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32 (the model's, and the last pipeline stage's)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


# Hugging Face checkpoint names that are not the model's own (gptflow.results.export writes them,
# and gptflow.train.init_from reads either): transformers 5 calls the output head ``lm_head``; its
# checkpoints, like transformers 4's (Pythia's), may name it ``embed_out`` as the model does.
HF_CHECKPOINT_NAMES = {"embed_out.weight": "lm_head.weight"}
# Tensors of older Hugging Face checkpoints that are buffers, not weights (the causal mask, the
# rotary frequencies): present in Pythia's files, recomputed by every implementation.
HF_BUFFER_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def checkpoint_name(name: str) -> str:
    """The name a Hugging Face checkpoint written by gptflow gives parameter `name`."""
    return HF_CHECKPOINT_NAMES.get(name, name)


def checkpoint_names(name: str) -> tuple[str, ...]:
    """The names parameter `name` may have in a Hugging Face checkpoint, the model's first."""
    return (name, HF_CHECKPOINT_NAMES[name]) if name in HF_CHECKPOINT_NAMES else (name,)


def hf_name(pipeline_name: str, num_layers: int) -> str:
    """A pipeline parameter's name (``{stage index}.{name in the stage}``, as PipelineModule
    names them) -> the Hugging Face name :class:`GPTNeoX` gives it."""
    index, rest = pipeline_name.split(".", 1)
    i = int(index)
    if i == 0:
        return f"gpt_neox.{rest}"  # embed_in.*
    if i <= num_layers:
        return f"gpt_neox.layers.{i - 1}.{rest.removeprefix('layer.')}"
    return rest if rest.startswith("embed_out.") else f"gpt_neox.{rest}"


def pipeline_name(hf: str, num_layers: int) -> str:
    """The inverse of :func:`hf_name`: the model's parameter name -> the pipeline's."""
    if hf.startswith("gpt_neox.embed_in."):
        return f"0.{hf.removeprefix('gpt_neox.')}"
    if hf.startswith("gpt_neox.layers."):
        index, rest = hf.removeprefix("gpt_neox.layers.").split(".", 1)
        return f"{int(index) + 1}.layer.{rest}"
    return f"{num_layers + 1}.{hf.removeprefix('gpt_neox.')}"


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: decay on matrices, none on biases and LayerNorms.

    Told apart by what holds them, not by their shape: a partitioned (ZeRO-3) parameter is a
    flat, empty tensor whatever it stands for."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                plain = isinstance(module, nn.LayerNorm) or name == "bias"
                (no_decay if plain else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
