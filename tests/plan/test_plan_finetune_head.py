"""A fine-tune's frozen head on a CPU (issue 54 item 3): the chunked loss runs the head's products a chunk of
``chunk_rows(vocab)`` positions at a time (55 of a 151,936-token vocabulary), which doctor measures at those row
counts (``head_chunk_curve``), and casts the fp32 weight to bf16 once a micro-batch under autocast; the step's parts
(``finetune_cpu_breakdown``) add up to the step. Without the new rates (an older calibration, the reference CPU) the
plan is what it was."""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.config import FinetuneConfig, ModelConfig, build
from scaletrain.hardware.catalog import Cluster
from scaletrain.model.loss import chunk_rows
from scaletrain.model.presets import PRESETS, projection_shapes
from scaletrain.plan import calibration, timing
from scaletrain.plan.finetune import finetune_cpu_breakdown, finetune_step_time
from scaletrain.plan.hardware_spec import parse_hardware
from scaletrain.plan.workload import Plan, Workload

QWEN = build(ModelConfig, {"preset": "qwen2.5-0.5b", "n_layers": 2, "max_seq_len": 1024}, presets=PRESETS)


def _cluster(extra: dict) -> Cluster:
    cpu = parse_hardware("cpu")
    hardware = dataclasses.replace(cpu.hardware, calibration={**cpu.hardware.calibration, **extra})
    return dataclasses.replace(cpu, hardware=hardware)


def _curve(scale: float) -> list[list[float]]:
    """A chunk curve whose rate grows with the rows (as measured: few rows run far from the matrix unit's peak)."""
    return [[float(rows), scale * rows ** 0.5, 0.8 * scale * rows ** 0.5] for rows in timing.HEAD_CHUNK_ROWS]


def test_chunked_head_is_charged_per_chunk_at_its_rows_rate_with_one_cast():
    entry = {"head_chunk_curve": _curve(1e10), "memory_bandwidth": 1e10, "weight_cast_s_per_element": 2e-9}
    vocab, dim, rows = 151936, 1024, chunk_rows(151936)
    assert rows == 55
    tokens = 4 * rows + 36
    chunks = (rows,) * 4 + (36,)
    forward = sum(2.0 * n * dim * vocab / timing.interp_curve(entry["head_chunk_curve"], n, 1) for n in chunks)
    grad = sum(2.0 * n * dim * vocab / timing.interp_curve(entry["head_chunk_curve"], n, 2) for n in chunks)
    cast = vocab * dim * 2e-9
    assert timing.chunked_head_seconds(tokens, rows, vocab, dim, entry, cast=False) == pytest.approx(2 * forward + grad)
    assert timing.chunked_head_seconds(tokens, rows, vocab, dim, entry, cast=True) == pytest.approx(
        2 * forward + grad + cast)
    # the same products on fewer rows a chunk cost more: the rate falls with the rows
    assert timing.chunked_head_seconds(tokens, 16, vocab, dim, entry, False) > timing.chunked_head_seconds(
        tokens, rows, vocab, dim, entry, False)
    assert timing.chunked_head_seconds(tokens, rows, vocab, dim, {"memory_bandwidth": 1e10}, True) is None


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_family_base_lora_pays_its_chunked_head_and_the_parts_add_up(method):
    workload = Workload(model=QWEN, seq_len=512, global_batch=1, train_tokens=512, precision="bf16")
    plan, ft = Plan(micro_batch=1), FinetuneConfig(method=method)
    reference = parse_hardware("cpu")
    before = finetune_step_time(workload, plan, reference, ft)["step_seconds"]
    parts = finetune_cpu_breakdown(workload, plan, reference, ft)
    assert sum(parts.values()) == pytest.approx(before, rel=1e-9)  # the reference CPU: the head curve, as before
    assert parts["loss recompute"] > 0  # 512 positions of a 151,936 vocabulary: chunked
    # A calibration with the chunk curve at a tenth of the head curve's rate: the head's products cost about ten
    # times what the head curve charged, and nothing else changes
    head = reference.hardware.calibration["head_curve_bf16"]
    slow = [[float(rows), rate / 10, rate / 10] for rows in timing.HEAD_CHUNK_ROWS
            for rate in [timing.interp_curve(head, timing.HEAD_CHUNK_DIM, 1)]]
    cluster = _cluster({"head_chunk_curve_bf16": slow, "head_chunk_curve": slow, "weight_cast_s_per_element": 0.0})
    after = finetune_cpu_breakdown(workload, plan, cluster, ft)
    assert "loss recompute" not in after  # the chunk model counts the recomputed logits in the head's products
    old_head = parts["head gemm"] + parts["loss recompute"]
    assert 6 * old_head < after["head gemm"] < 14 * old_head
    # (QLoRA's input-gradient dequantizations end in the same weight cast: its own test below)
    assert {k: v for k, v in after.items() if k not in ("head gemm", "nf4 dequant")} == {
        k: v for k, v in parts.items() if k not in ("head gemm", "loss recompute", "nf4 dequant")}
    assert finetune_step_time(workload, plan, cluster, ft)["step_seconds"] == pytest.approx(sum(after.values()))
    # the weight's cast is charged under autocast (an fp32 weight cast to bf16), not in fp32
    cast = _cluster({"head_chunk_curve_bf16": slow, "head_chunk_curve": slow, "weight_cast_s_per_element": 1e-9})
    extra = finetune_cpu_breakdown(workload, plan, cast, ft)["head gemm"] - after["head gemm"]
    assert extra == pytest.approx(QWEN.vocab_size * QWEN.dim * 1e-9)
    fp32 = dataclasses.replace(workload, precision="fp32")
    assert finetune_cpu_breakdown(fp32, plan, cast, ft)["head gemm"] == pytest.approx(
        finetune_cpu_breakdown(fp32, plan, _cluster({"head_chunk_curve": slow, "weight_cast_s_per_element": 0.0}),
                               ft)["head gemm"])


def test_qlora_pays_a_weight_cast_after_each_input_gradients_dequantization():
    """torchao's NF4 weight dequantizes to the fp32 it was quantized from and casts that to the gradient's bf16
    (``LinearNF4``'s backward): one weight-sized cast per input-gradient dequantization under autocast (the
    forward's cast is in the GEMM curve), none in fp32 or with the compiled dequantization."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from scaletrain.finetune.lora import to_nf4

    weight = to_nf4(torch.randn(64, 64), 64, 256)
    assert weight.get_original_weight().dtype == torch.float32  # what the cast is from
    assert torch.equal(weight.to(torch.bfloat16), weight.get_original_weight().to(torch.bfloat16))
    workload = Workload(model=QWEN, seq_len=256, global_batch=1, train_tokens=256, precision="bf16")
    plan, shapes = Plan(micro_batch=1), projection_shapes(QWEN)
    # every projection's input gradient but the first block's q, k, v (nothing below them trains)
    elements = QWEN.n_layers * sum(i * o for i, o in shapes.values()) - sum(
        i * o for name, (i, o) in shapes.items() if name in ("q", "k", "v"))

    def dequant(cast: float, ft: FinetuneConfig, precision: str = "bf16") -> float:
        cluster = _cluster({"weight_cast_s_per_element": cast, "nf4_dequant_s_per_element": 1e-8})
        return finetune_cpu_breakdown(dataclasses.replace(workload, precision=precision), plan, cluster,
                                      ft)["nf4 dequant"]

    eager, compiled = FinetuneConfig(method="qlora"), FinetuneConfig(method="qlora", qlora_compile="true")
    assert dequant(1e-9, eager) - dequant(0.0, eager) == pytest.approx(elements * 1e-9)
    assert dequant(1e-9, eager, "fp32") == pytest.approx(dequant(0.0, eager, "fp32"))
    assert dequant(1e-9, compiled) == pytest.approx(dequant(0.0, compiled))


def test_a_full_fine_tune_keeps_the_trained_heads_model():
    """A trained head also computes its weight gradient, which the chunk curve does not measure: unchanged."""
    workload = Workload(model=QWEN, seq_len=512, global_batch=1, train_tokens=512, precision="bf16")
    ft, plan = FinetuneConfig(method="full"), Plan(micro_batch=1)
    slow = [[float(rows), 1e9, 1e9] for rows in timing.HEAD_CHUNK_ROWS]
    assert finetune_step_time(workload, plan, _cluster({"head_chunk_curve_bf16": slow}), ft)["step_seconds"] == \
        pytest.approx(finetune_step_time(workload, plan, parse_hardware("cpu"), ft)["step_seconds"], rel=1e-12)


def test_doctor_measures_the_chunk_curve_the_cast_and_the_dequantization(monkeypatch):
    monkeypatch.setattr(timing, "HEAD_CHUNK_VOCAB", 512)
    monkeypatch.setattr(timing, "HEAD_CHUNK_DIM", 64)
    monkeypatch.setattr(timing, "HEAD_CHUNK_ROWS", (16, 64))
    for precision in ("fp32", "bf16"):
        curve = calibration.measure_head_chunk_curve(precision)
        assert [row[0] for row in curve] == [16.0, 64.0]
        assert all(rate > 1e6 for row in curve for rate in row[1:])
    assert 0 < calibration.measure_weight_cast(1 << 16) < 1e-6
    pytest.importorskip("torchao")
    rate = calibration.measure_nf4_dequant_rate(n=256, weights=2)["nf4_dequant_s_per_element"]
    assert 0 < rate < 1e-6
