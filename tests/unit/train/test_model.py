"""GPT-NeoX model: shapes, causality, residual variants, Hugging Face parameter names."""

import pytest
import torch

from gptflow.config.settings import ModelConfig
from gptflow.errors import GptflowError
from gptflow.train.model import GPTNeoX

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128)


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    m = GPTNeoX(CFG)
    x = torch.randint(0, 128, (3, 11))
    logits = m(x)
    assert logits.shape == (3, 11, 128)
    loss = m(x, x)
    assert loss.shape == () and 3.5 < loss.item() < 6.5  # ~ln(128) at initialisation


def test_causal():
    torch.manual_seed(0)
    m = GPTNeoX(CFG).eval()
    x = torch.randint(0, 128, (1, 10))
    y = x.clone()
    y[0, 7] = (y[0, 7] + 1) % 128
    a, b = m(x), m(y)
    assert torch.equal(a[0, :7], b[0, :7])
    assert not torch.allclose(a[0, 7:], b[0, 7:])


def test_parallel_residual_toggle_changes_the_function():
    torch.manual_seed(0)
    par = GPTNeoX(CFG)
    seq = GPTNeoX(ModelConfig(**{**CFG.__dict__, "parallel_residual": False}))
    seq.load_state_dict(par.state_dict())
    x = torch.randint(0, 128, (2, 9))
    assert not torch.allclose(par(x), seq(x))


def test_parameter_names_are_the_hugging_face_gpt_neox_names():
    names = set(GPTNeoX(CFG).state_dict())
    per_layer = [
        "input_layernorm.weight", "input_layernorm.bias",
        "post_attention_layernorm.weight", "post_attention_layernorm.bias",
        "attention.query_key_value.weight", "attention.query_key_value.bias",
        "attention.dense.weight", "attention.dense.bias",
        "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
        "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias",
    ]  # fmt: skip
    expected = {"gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm.weight",
                "gpt_neox.final_layer_norm.bias", "embed_out.weight"}  # fmt: skip
    expected |= {f"gpt_neox.layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert names == expected


def test_parameter_count_matches_config():
    m = GPTNeoX(CFG)
    assert sum(p.numel() for p in m.parameters()) == CFG.num_parameters()


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    a = GPTNeoX(CFG)
    b = GPTNeoX(ModelConfig(**{**CFG.__dict__, "activation_checkpointing": True}))
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 128, (2, 9))
    a(x, x).backward()
    b(x, x).backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), n


def test_odd_rotary_dimensions_are_a_config_error():
    assert (
        ModelConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, rotary_pct=0.3
        ).rotary_ndims
        == 2
    )
    with pytest.raises(GptflowError, match=r"rotary_pct 0\.4 gives 3 rotary"):
        ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, rotary_pct=0.4)


def test_decay_groups_by_role_equal_the_groups_by_shape():
    """Weight decay on embeddings and linear weights, none on biases and LayerNorms: the same
    parameters, in the same order, as choosing by dimension on an unpartitioned model."""
    from gptflow.train.model import decay_groups

    model = GPTNeoX(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64))
    decay, plain = decay_groups(model, 0.1)
    assert (decay["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    by_shape = [p for p in model.parameters() if p.dim() >= 2]
    assert [id(p) for p in decay["params"]] == [id(p) for p in by_shape]
    assert [id(p) for p in plain["params"]] == [id(p) for p in model.parameters() if p.dim() < 2]


def test_building_on_the_meta_device_neither_draws_nor_imports_dynamo():
    """The trainer, the evaluation and the export build the model on the meta device first.
    nn.Embedding's own N(0, 1) draw there runs normal_'s Python reference, whose wrapper
    imports torch._dynamo (sympy, FSDP, DTensor: ~1.3 s of CPU in every evaluation process);
    the model's Embedding skips that draw on meta only. Off meta it draws as nn.Embedding does:
    the same values and the same global random stream after it (fresh interpreter: the import
    is per process)."""
    import json
    import subprocess
    import sys

    script = """
import json, sys, torch
from gptflow.config.settings import ModelConfig
from gptflow.train.model import Embedding
with torch.device("meta"):
    Embedding(64, 16)
meta_imported = "torch._dynamo" in sys.modules
torch.manual_seed(3); ours = Embedding(64, 16).weight; after_ours = torch.rand(2)
torch.manual_seed(3); theirs = torch.nn.Embedding(64, 16).weight; after_theirs = torch.rand(2)
print(json.dumps({"dynamo": meta_imported, "same": bool(torch.equal(ours, theirs)),
                  "stream": bool(torch.equal(after_ours, after_theirs))}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "dynamo": False,
        "same": True,
        "stream": True,
    }
