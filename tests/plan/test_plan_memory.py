"""Memory model: ZeRO accounting exactly as in the paper, activations as autograd saves them, peak as measured."""

import pytest
import torch

from scaletrain.config import ModelConfig, OptimConfig
from scaletrain.model.decoder import TransformerBlock, rope_tables
from scaletrain.model.presets import num_params
from scaletrain.plan.measure import resident_extras, single_process_run
from scaletrain.plan.memory import (
    RECIPES,
    block_activation_elements,
    memory_breakdown,
    model_states,
    muon_matrix_params,
    stage_params,
)
from scaletrain.plan.workload import Plan, Workload

PSI = 7_500_000_000  # the ZeRO paper's running example: 7.5B parameters


@pytest.mark.parametrize("n", [1, 8, 64, 1024])
def test_zero_stages_match_the_paper_mixed_precision(n):
    """Rajbhandari et al. 2020, Fig. 1: K = 12 (fp32 master + m + v), 2+2 bytes of fp16 params and grads."""
    total = lambda stage: sum(model_states(PSI, stage, n, RECIPES["mixed"]).values())  # noqa: E731
    assert total(0) == 16 * PSI
    assert total(1) == pytest.approx(4 * PSI + 12 * PSI / n, rel=1e-12)
    assert total(2) == pytest.approx(2 * PSI + 14 * PSI / n, rel=1e-12)
    assert total(3) == pytest.approx(16 * PSI / n, rel=1e-12)
    if n == 64:  # the paper's worked numbers: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB
        assert [round(total(s) / 1e9, 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]


def test_mixed_precision_split_is_params_grads_master_optimizer():
    states = model_states(PSI, 0, 1, RECIPES["mixed"])
    assert states == {"params": 2 * PSI, "grads": 2 * PSI, "master": 4 * PSI, "optimizer": 8 * PSI}


@pytest.mark.parametrize("n", [1, 2, 16])
def test_fp32_training_is_4_4_8(n):
    states = model_states(PSI, 0, n, RECIPES["fp32"])
    assert states == {"params": 4 * PSI, "grads": 4 * PSI, "master": 0, "optimizer": 8 * PSI}
    assert sum(model_states(PSI, 3, n, RECIPES["fp32"]).values()) == pytest.approx(16 * PSI / n)


def test_bad_stage_is_rejected():
    with pytest.raises(ValueError):
        model_states(PSI, 4, 8, RECIPES["mixed"])


def _saved_elements(cfg: ModelConfig, batch: int, seq: int) -> int:
    """Elements of the distinct storages one block saves for backward (parameters and buffers excluded)."""
    block = TransformerBlock(cfg)
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, seq, cfg.rope_theta)
    owned = {p.untyped_storage().data_ptr() for p in block.parameters()} | {cos.data_ptr(), sin.data_ptr()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned:
            seen[ptr] = t.untyped_storage().nbytes() // t.element_size()
        return t

    x = torch.randn(batch, seq, cfg.dim, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    return sum(seen.values())


@pytest.mark.parametrize("kv", [0, 2])  # plain multi-head and grouped-query attention
def test_block_activations_are_what_autograd_saves(kv):
    cfg = ModelConfig(dim=64, n_heads=4, n_kv_heads=kv, ffn_hidden_dim=160, vocab_size=97, max_seq_len=32)
    assert block_activation_elements(cfg, 3, 32) == _saved_elements(cfg, 3, 32)


def test_tensor_and_sequence_parallel_shrink_activations():
    cfg = ModelConfig(dim=256, n_heads=8, ffn_hidden_dim=688, vocab_size=1000)
    full = block_activation_elements(cfg, 4, 128)
    tp = block_activation_elements(cfg, 4, 128, tp=4, sequence_parallel=False)
    sp = block_activation_elements(cfg, 4, 128, tp=4, sequence_parallel=True)
    assert sp < tp < full
    # Without SP the norm region (6 BTd + 2 BT) stays whole; with SP only y and y2 (2 BTd) do.
    bt = 4 * 128
    assert tp == pytest.approx((4 * bt * 256 + 4 * bt * 688 + 4 * 8 * 128) / 4 + 6 * bt * 256 + 2 * bt)
    assert sp == pytest.approx((4 * bt * 256 + 4 * bt * 688 + 4 * 8 * 128 + 4 * bt * 256 + 2 * bt) / 4 + 2 * bt * 256)


def test_stage_params_add_up():
    cfg = ModelConfig(dim=128, n_layers=4, n_heads=4, ffn_hidden_dim=344, vocab_size=256)
    assert stage_params(cfg, 1, 1) == num_params(cfg)
    assert stage_params(cfg, 1, 2) == num_params(cfg) / 2
    assert stage_params(cfg, 2, 1) < num_params(cfg)


def test_zero3_and_offload_shrink_model_states():
    cfg = ModelConfig(dim=512, n_layers=8, n_heads=8, ffn_hidden_dim=1408, vocab_size=32000, max_seq_len=512)
    w = Workload(cfg, 512, 64, 1e9, "bf16")
    ddp = memory_breakdown(w, Plan(dp_replicate=8, micro_batch=1, zero_stage=0))
    fsdp = memory_breakdown(w, Plan(dp_shard=8, micro_batch=1, zero_stage=3))
    off = memory_breakdown(w, Plan(dp_shard=8, micro_batch=1, zero_stage=3, cpu_offload=True))
    assert fsdp.optimizer == pytest.approx(ddp.optimizer / 8)
    assert off.optimizer == 0 and off.master == 0 and off.offloaded > 0
    assert ddp.comm_buffers >= num_params(cfg) * 2  # DDP's gradient buckets


def test_activation_checkpointing_order():
    cfg = ModelConfig(dim=256, n_layers=6, n_heads=4, ffn_hidden_dim=688, vocab_size=512, max_seq_len=256)
    w = Workload(cfg, 256, 8, 1e6)
    sizes = [memory_breakdown(w, Plan(micro_batch=8, activation_checkpointing=ac), "cpu").tensor_total
             for ac in ("none", "selective", "full")]
    assert sizes[0] > sizes[1] > sizes[2]


@pytest.mark.parametrize("ac,batch,seq,vocab,precision", [
    ("none", 4, 64, 256, "fp32"), ("full", 4, 64, 256, "fp32"), ("none", 1, 16, 2048, "fp32"),
    ("none", 8, 64, 256, "bf16"), ("full", 8, 64, 256, "bf16"), ("selective", 4, 64, 2048, "bf16")])
def test_peak_matches_a_real_step(ac, batch, seq, vocab, precision):
    """The simulated peak against exact tensor bytes of a real step (forward..AdamW), within 10%: fp32, and bf16
    as the trainer runs it (autocast: fp32 weights, grads and moments; bf16 weight copies and activations)."""
    cfg = ModelConfig(dim=64, n_layers=3, n_heads=4, ffn_hidden_dim=176, vocab_size=vocab, max_seq_len=64)
    measured = single_process_run(cfg, batch, seq, ac, steps=1, precision=precision)["peak_bytes"]
    plan = Plan(micro_batch=batch, activation_checkpointing=ac)
    predicted = memory_breakdown(Workload(cfg, seq, batch, 1e6, precision), plan, "cpu").tensor_total + \
        resident_extras(cfg, batch, seq)
    assert predicted == pytest.approx(measured, rel=0.10)
    if precision == "bf16":  # the autocast recipe (fp32 weights, no master copy), not the ZeRO paper's bf16 ones
        mem = memory_breakdown(Workload(cfg, seq, batch, 1e6, precision), plan, "cpu")
        assert mem.master == 0 and mem.optimizer == pytest.approx(8 * num_params(cfg))


@pytest.mark.parametrize("batch,seq,vocab", [(4, 64, 256), (1, 16, 2048)])
def test_muon_peak_matches_a_real_step(batch, seq, vocab):
    """optim.name = muon: one momentum buffer per block matrix instead of AdamW's two moments; the simulated peak
    against exact tensor bytes of a real fp32 Muon step, within 10%, and below AdamW's prediction by the m/v
    bytes of the matrices Muon takes."""
    cfg = ModelConfig(dim=64, n_layers=3, n_heads=4, ffn_hidden_dim=176, vocab_size=vocab, max_seq_len=64)
    measured = single_process_run(cfg, batch, seq, steps=1, optim=OptimConfig(name="muon"))["peak_bytes"]
    w, plan = Workload(cfg, seq, batch, 1e6), Plan(micro_batch=batch)
    muon = memory_breakdown(w, plan, "cpu", optimizer="muon")
    assert muon.tensor_total + resident_extras(cfg, batch, seq) == pytest.approx(measured, rel=0.10)
    adamw = memory_breakdown(w, plan, "cpu")
    assert adamw.optimizer - muon.optimizer == pytest.approx(4 * muon_matrix_params(cfg, cfg.n_layers))
