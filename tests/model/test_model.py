"""The model: shapes, exact parameter counts, causality, GQA, tied weights, meta-device build."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import ModelConfig, build
from scaletrain.model import PRESETS, build_model, flops_per_token, num_params
from scaletrain.model.decoder import Transformer
from scaletrain.model.presets import ffn_hidden_dim


def cfg(**kw) -> ModelConfig:
    return build(ModelConfig, kw, presets=PRESETS)


def test_nano_parameter_count_by_hand():
    c = cfg(preset="nano", vocab_size=65)
    d, h, v, L = 128, 344, 65, 4
    attention = 4 * d * d  # wq, wk, wv, wo (MHA)
    mlp = 3 * d * h  # w1, w2, w3
    norms = 2 * d
    expected = L * (attention + mlp + norms) + d + 2 * v * d  # + final norm + embedding + head
    assert num_params(c) == expected == 808_320
    model = build_model(c)
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("preset,expected_millions", [
    ("gpt2-124m", 123.6), ("llama-1b", 1235.8), ("llama-8b", 8030.3), ("llama-70b", 70553.7)])
def test_large_presets_match_published_sizes(preset, expected_millions):
    c = cfg(preset=preset)
    assert num_params(c) / 1e6 == pytest.approx(expected_millions, abs=0.1)


def test_llama_8b_ffn_rounding():
    assert ffn_hidden_dim(cfg(preset="llama-8b")) == 14336
    assert ffn_hidden_dim(cfg(preset="llama-70b")) == 28672
    assert ffn_hidden_dim(cfg(preset="llama-1b")) == 8192


def test_gqa_and_tied_counts_match_modules():
    c = cfg(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=100, tie_embeddings=True, ffn_hidden_dim=0)
    model = build_model(c)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == num_params(c)
    assert model.layers["0"].attention.wk.weight.shape == (16, 64)  # 2 kv heads x head_dim 8
    logits = model(torch.randint(0, 100, (3, 10)))
    assert logits.shape == (3, 10, 100)


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = build_model(cfg(preset="nano", vocab_size=50), seed=0)
    x = torch.randint(0, 50, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 50
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_built_on_meta_then_materialized_once():
    c = cfg(preset="nano", vocab_size=65)
    with torch.device("meta"):
        m = Transformer(c)
    assert all(p.is_meta for p in m.parameters())
    m1, m2 = build_model(c, seed=3), build_model(c, seed=3)
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p, q), n
    # residual output projections get the depth-scaled std
    std = m1.layers["0"].attention.wo.weight.std().item()
    assert std == pytest.approx(0.02 / (2 * 4) ** 0.5, rel=0.1)
    assert m1.rope_cos.abs().max() <= 1.0 and not m1.rope_cos.is_meta


def test_flops_formula():
    c = cfg(preset="nano", vocab_size=65)
    n_matmul = 4 * (4 * 128 * 128 + 3 * 128 * 344) + 65 * 128
    assert flops_per_token(c, 64) == 6 * n_matmul + 12 * 4 * 64 * 128
    # For a big model the matmul weights are the non-embedding parameters minus the norm gains, and
    # attention adds 12*L*T*d (about 7% for Llama 3 8B at 2048 tokens).
    big = cfg(preset="llama-8b")
    norms = (2 * 32 + 1) * 4096
    six_n = 6 * (num_params(big, exclude_embedding=True) - norms)
    assert flops_per_token(big, 2048) == six_n + 12 * 32 * 2048 * 4096
    assert flops_per_token(big, 2048) / six_n == pytest.approx(1.07, abs=0.01)


def test_missing_vocab_is_a_clear_error():
    with pytest.raises(ValueError, match="vocab_size must be set"):
        build_model(cfg(preset="nano"))


def test_rmsnorm_hand_written_backward_matches_autograd():
    """The CPU RMSNorm differentiates by hand (LayerNorm's fused kernel + one term): its output and both
    gradients equal autograd's through the decomposition, in fp64 to rounding, on a batch of rows with
    very different scales (where a wrong mean term would show)."""
    from scaletrain.model.decoder import RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(3, 5, 48, dtype=torch.float64) * torch.logspace(-2, 2, 5, dtype=torch.float64)[:, None])
    g = torch.randn(3, 5, 48, dtype=torch.float64)
    ours, ref = RMSNorm(48, eps=1e-5).double(), torch.nn.RMSNorm(48, eps=1e-5).double()
    with torch.no_grad():
        ours.weight.copy_(torch.randn(48, dtype=torch.float64))
        ref.weight.copy_(ours.weight)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    assert ya.grad_fn is not None and "RMSNormFunction" in type(ya.grad_fn).__name__  # the hand-written path ran
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # no autograd: plain nn.RMSNorm forward
        torch.testing.assert_close(ours(x), ref(x))
