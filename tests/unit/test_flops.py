"""The TFLOP/s the trainer logs: FLOPs per token = 6 x the parameters that multiply (every
parameter but the input embedding) + 12 x layers x hidden x sequence (attention), checked
against figures worked out by hand from the GPT-NeoX layout."""

from __future__ import annotations

import pytest

from gptflow.config import ModelConfig
from gptflow.model import GPTNeoX
from gptflow.train import flops_per_token


def layer_params(h: int, ffn: int) -> int:
    """One GPT-NeoX layer by hand: two LayerNorms (weight + bias), fused QKV, attention
    output, MLP up and down (all with biases)."""
    return 2 * (h + h) + (h * 3 * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h)


@pytest.mark.parametrize(
    ("keys", "seq", "parameters", "expected"),
    [
        # the tiny preset: h 64, 2 layers, vocab 512, ffn 4h = 256; seq 64
        # layer 256 + 12,480 + 4,160 + 16,640 + 16,448 = 49,984
        # N = 512*64 (embed) + 2*49,984 + 2*64 (final LN) + 64*512 (head) = 165,632
        # 6 * (165,632 - 32,768) + 12 * 2 * 64 * 64 = 797,184 + 98,304
        (
            {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512},
            64,
            165_632,
            895_488,
        ),
        # h 96, 3 layers, vocab 1,024, ffn 200; seq 128
        # layer 384 + 27,936 + 9,312 + 19,400 + 19,296 = 76,328
        # N = 98,304 + 3*76,328 + 192 + 98,304 = 425,784
        # 6 * (425,784 - 98,304) + 12 * 3 * 96 * 128 = 1,964,880 + 442,368
        (
            {"num_layers": 3, "hidden_size": 96, "num_attention_heads": 6, "vocab_size": 1024,
             "intermediate_size": 200},
            128,
            425_784,
            2_407_248,
        ),
    ],
)  # fmt: skip
def test_flops_per_token_is_6n_without_the_input_embedding_plus_attention(
    keys, seq, parameters, expected
):
    cfg = ModelConfig(**keys)
    real = sum(p.numel() for p in GPTNeoX(cfg).parameters())
    h, layers, v = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    ffn = cfg.intermediate_size or 4 * h
    assert real == v * h + layers * layer_params(h, ffn) + 2 * h + h * v == parameters
    assert flops_per_token(cfg, real, seq) == expected


def test_flops_per_token_grows_with_the_sequence_by_the_attention_term_only():
    """Doubling the sequence adds exactly 12 x layers x hidden x seq; the 6N part is fixed."""
    cfg = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=8, vocab_size=2048)
    n = sum(p.numel() for p in GPTNeoX(cfg).parameters())
    short, long = flops_per_token(cfg, n, 256), flops_per_token(cfg, n, 512)
    assert long - short == 12 * 4 * 128 * 256
    assert short == 6 * (n - 2048 * 128) + 12 * 4 * 128 * 256
