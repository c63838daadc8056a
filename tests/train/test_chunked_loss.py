"""The chunked loss (model/loss.py): the loss and the gradients of every parameter equal the plain loss on the
whole logits (1e-5), for tied and untied heads, muP's output multiplier, soft-capping, a padded vocabulary, -100
targets, a frozen head (LoRA), prompt tuning's head, bf16 autocast; the trainer's step picks it by
train.loss_chunk_rows; and it composes with DDP and FSDP2 (real gloo processes)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers.launch import HELPERS, PARITY_RTOL, torchrun
from scaletrain.config import ModelConfig
from scaletrain.model import build_model
from scaletrain.model.loss import chunk_rows, chunked_cross_entropy
from scaletrain.train.loss import cross_entropy


def _batch(vocab: int, rows: int = 3, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    targets = tokens[:, 1:].clone()
    targets[0, :12] = -100  # instruction data: prompt positions are no targets (a whole chunk of them included)
    targets[2, 3:5] = -100
    return tokens[:, :-1], targets


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("options,vocab_limit", [
    (dict(), None),
    (dict(tie_embeddings=True), None),
    (dict(tie_embeddings=True), 1000),  # a padded vocabulary: 24 columns at -inf
    (dict(parametrization="mup", mup_base_width=16), None),  # logits times 1 / width_mult
    (dict(norm_plus_one=True, scale_embeddings=True, activation="gelu_tanh", qk_norm=True), 1000),  # Gemma's
])
def test_model_loss_and_every_gradient_equal_the_whole_logits(options, vocab_limit):
    cfg = ModelConfig(vocab_size=1024, dim=32, n_layers=2, n_heads=2, ffn_hidden_dim=64, max_seq_len=16, **options)
    model = build_model(cfg, seed=0)
    inputs, targets = _batch(vocab_limit or 1024)
    whole = cross_entropy(model(inputs), targets, vocab_limit)
    reference = _grads(model, whole)
    chunked = model(inputs, targets=targets, vocab_limit=vocab_limit, loss_rows=10)
    assert chunked.item() == pytest.approx(whole.item(), abs=1e-5)
    got = _grads(model, chunked)
    assert got.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_no_chunk_holds_the_whole_logits(monkeypatch):
    """The head's matrix product runs on 10 positions at a time, in forward and in backward."""
    import scaletrain.model.loss as loss

    shapes: list[tuple[int, ...]] = []
    real = loss._chunk_logits
    monkeypatch.setattr(loss, "_chunk_logits", lambda h, *a: shapes.append(tuple(h.shape)) or real(h, *a))
    model = build_model(ModelConfig(vocab_size=512, dim=16, n_layers=1, n_heads=2, ffn_hidden_dim=32,
                                    max_seq_len=16), seed=0)
    inputs, targets = _batch(512)
    model(inputs, targets=targets, loss_rows=10).backward()
    assert [s[0] for s in shapes] == [10, 10, 10, 10, 8] * 2  # 48 positions: forward, then backward recomputes


@pytest.mark.parametrize("multiplier,softcap,vocab_limit", [(1.0, 0.0, None), (0.5, 3.0, 90), (0.25, 5.0, None)])
def test_function_equals_the_formula_in_float64(multiplier, softcap, vocab_limit):
    """The Function against autograd on the written-out formula: the muP multiplier, a soft-cap (Gemma 2's
    c * tanh(z / c)) and padding columns, -100 rows, chunks that do not divide the rows."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(101, 16, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 90, (37,), generator=g)
    targets[:5] = -100
    logits = hidden @ weight.t() * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if vocab_limit:
        logits = torch.cat([logits[:, :vocab_limit], torch.full_like(logits[:, vocab_limit:], -torch.inf)], 1)
    expected = F.cross_entropy(logits, targets)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, multiplier=multiplier, softcap=softcap,
                                vocab_limit=vocab_limit, rows=8)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    assert got.item() == pytest.approx(expected.item(), abs=1e-6)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_frozen_head_gets_no_gradient_and_an_all_ignored_batch_is_nan():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(50, 8)  # frozen (LoRA's head): its gradient is not computed
    targets = torch.tensor([1, -100, 3, 4, -100, 5])
    loss = chunked_cross_entropy(hidden, weight, targets, rows=4)
    loss.backward()
    assert hidden.grad is not None and weight.grad is None
    assert torch.isnan(chunked_cross_entropy(hidden, weight, torch.full((6,), -100), rows=4))
    assert torch.isnan(F.cross_entropy(hidden @ weight.t(), torch.full((6,), -100)))  # the same as the plain loss


def test_bf16_autocast_matches_the_plain_loss_under_autocast():
    model = build_model(ModelConfig(vocab_size=1024, dim=32, n_layers=1, n_heads=2, ffn_hidden_dim=64,
                                    max_seq_len=16), seed=0)
    inputs, targets = _batch(1024)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = cross_entropy(model(inputs), targets)
        chunked = model(inputs, targets=targets, loss_rows=10)
    reference, got = _grads(model, whole), _grads(model, chunked)
    assert chunked.item() == pytest.approx(whole.item(), abs=1e-3)  # bf16 products, fp32 sums
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, atol=2e-3, rtol=2e-2, msg=name)


def test_prompt_tuning_head_reads_the_real_positions_only():
    from scaletrain.finetune.prompt import apply_prompt_tuning

    model = build_model(ModelConfig(vocab_size=512, dim=16, n_layers=1, n_heads=2, ffn_hidden_dim=32,
                                    max_seq_len=32), seed=0)
    apply_prompt_tuning(model, 4)
    torch.nn.init.normal_(model.tok_embeddings.prompt, std=0.02)  # built empty: its init is the converter's
    inputs, targets = _batch(512)
    whole = cross_entropy(model(inputs), targets)
    chunked = model(inputs, targets=targets, loss_rows=7)
    assert chunked.item() == pytest.approx(whole.item(), abs=1e-5)


def test_the_step_chooses_the_chunked_loss_by_the_setting(tmp_path):
    """train.loss_chunk_rows: -1 chunks only when a batch's logits pass 32 MB, N chunks by N, 0 never."""
    from types import SimpleNamespace

    from scaletrain.train.loss import loss_chunk_rows

    model = build_model(ModelConfig(vocab_size=151_936, dim=8, n_layers=1, n_heads=2, ffn_hidden_dim=16,
                                    max_seq_len=8), device="meta")
    pm = SimpleNamespace(modules=[model], loss_rows=-1, tp_enabled=False, pipeline=None,
                         objective_loss=None)
    small, big = torch.zeros(1, 8, dtype=torch.long), torch.zeros(4, 1024, dtype=torch.long, device="meta")
    assert chunk_rows(151_936) == 55  # 55 x 151,936 fp32 logits: 31.9 MiB, the most under 32 MiB
    assert loss_chunk_rows(pm, small) == 0  # 8 positions' logits are under one chunk: the plain loss
    assert loss_chunk_rows(pm, big) == 55
    pm.loss_rows = 100
    assert loss_chunk_rows(pm, big) == 100
    pm.loss_rows = 0
    assert loss_chunk_rows(pm, big) == 0
    pm.loss_rows, pm.tp_enabled = -1, True  # tensor parallelism keeps its vocabulary-parallel loss
    assert loss_chunk_rows(pm, big) == 0


def test_an_accelerators_auto_chunk_is_larger_and_the_planner_follows():
    """On a GPU the auto chunk is 512 MiB of logits (a 32 MiB chunk is less device work than its host-side
    launches): gpt2-124m's 64 x 1024 micro-batch in 25 chunks instead of 395; the planner holds the same rows."""
    from scaletrain.model.loss import rows_at_once
    from scaletrain.model.presets import PRESETS
    from scaletrain.plan.memory import loss_rows
    from scaletrain.plan.workload import Plan, Workload

    positions, vocab = 64 * 1024, 50_304
    assert rows_at_once(positions, vocab, -1, "cpu") == chunk_rows(vocab) == 166
    assert rows_at_once(positions, vocab, -1, "cuda") == 2_668  # 2,668 x 50,304 x 4 B: 511.9 MiB
    assert -(-positions // 2_668) == 25 and -(-positions // 166) == 395
    assert rows_at_once(positions, vocab, 100, "cuda") == 100 and rows_at_once(positions, vocab, 0, "cuda") == positions
    workload = Workload(model=ModelConfig(**PRESETS["gpt2-124m"]), seq_len=1024, global_batch=64, train_tokens=1e9)
    plan = Plan(micro_batch=64)
    assert loss_rows(workload, plan, positions, device_kind="gpu") == rows_at_once(positions, 50_304, -1, "cuda")
    assert loss_rows(workload, plan, positions, device_kind="cpu") == 166


@pytest.mark.distributed
def test_ddp_and_fsdp2_with_the_chunked_loss_equal_one_process(tmp_path):
    """5 AdamW steps on 2 gloo ranks with the chunked loss (24 positions a chunk; FSDP2 gathers the head's weight
    inside the root's forward, where the loss now runs) equal the single-process run on the whole logits."""
    out = tmp_path / "results.json"
    strategies = ["ddp_chunked", "fsdp3_chunked", "fsdp2_padded_chunked"]
    torchrun(2, str(HELPERS / "dist_parity.py"), "--out", str(out), "--strategies", ",".join(strategies))
    records = {r["strategy"]: r for r in json.loads(out.read_text()) if r["kind"] == "parity"}
    for name in strategies:
        assert records[name]["reference"][-1] < records[name]["reference"][0] - 0.3  # it learns
        assert records[name]["max_rel_diff"] < PARITY_RTOL, records[name]


@pytest.mark.parametrize("method", ["pretrain", "lora", "full"])
@pytest.mark.parametrize("loss_rows", [0, 32])
def test_planner_peak_matches_a_real_step_with_and_without_chunks(method, loss_rows, tmp_path):
    """The planner (plan/memory.py for pretraining, plan/finetune.py for fine-tuning) against the exact live tensor
    bytes of the trainer's step on a shape whose logits dominate (8,192-token vocabulary, 4 x 128 positions), with
    the whole logits and by chunks of 32 positions: within 10% either way."""
    from tokenizers import Tokenizer, models

    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import FinetuneConfig, JobConfig, ParallelConfig, TrainConfig
    from scaletrain.data.tokenizer import BPETokenizer
    from scaletrain.parallel import ParallelDims
    from scaletrain.plan.finetune import finetune_memory
    from scaletrain.plan.measure import LiveTensorBytes, measure_step, resident_extras
    from scaletrain.plan.memory import memory_breakdown
    from scaletrain.plan.workload import Plan, Workload
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    model = ModelConfig(vocab_size=8192, dim=64, n_layers=1, n_heads=2, ffn_hidden_dim=128, max_seq_len=128)
    batch, seq = 4, 128
    ft = FinetuneConfig()
    if method != "pretrain":
        tokenizer = BPETokenizer(Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(8192)}, unk_token="t0")))
        export_hf(build_model(model, seed=0), model, tokenizer, tmp_path / "base")
        ft = FinetuneConfig(source=str(tmp_path / "base"), method=method)
    cfg = JobConfig(model=model, finetune=ft, train=TrainConfig(seed=0, precision="fp32", loss_chunk_rows=loss_rows))
    tracker = LiveTensorBytes().__enter__()
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    micro = [(torch.randint(0, 8192, (batch, seq), generator=gen), torch.randint(0, 8192, (batch, seq), generator=gen),
              None)]
    measured = measure_step(lambda: training_step(pm, optimizer, iter(micro), 1, StepOptions(grad_clip=1.0)).loss,
                            tracker, steps=1)["peak_bytes"]
    workload = Workload(model=model, seq_len=seq, global_batch=batch, train_tokens=batch * seq,
                        loss_chunk_rows=loss_rows)
    if method == "pretrain":
        predicted = memory_breakdown(workload, Plan(micro_batch=batch), "cpu").tensor_total
    else:
        predicted = finetune_memory(workload, Plan(micro_batch=batch), ft, "cpu")["tensor_total"]
    predicted += resident_extras(model, batch, seq)
    assert predicted == pytest.approx(measured, rel=0.10), (predicted / 2**20, measured / 2**20)
