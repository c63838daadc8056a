"""Packed fine-tuning (finetune.packing, data/instructions.py ``pack_rows``): several examples a row, a block-causal
mask, rotary positions restarting per example. Each example's loss equals its padded loss (1e-5), the batch loss is
the mean over all target tokens as padded, it trains and resumes bitwise through the CLI, composes with FSDP2, and
what it cannot do is one line with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import faults
from helpers.launch import PARITY_RTOL, torchrun
from helpers.tiny import tiny_hf_base
from helpers.waits import CEILING_S
from scaletrain.cli import main
from scaletrain.config import ModelConfig
from scaletrain.data.instructions import IGNORE, make_rows, pack_rows
from scaletrain.data.loader import block_causal_mask
from scaletrain.model import build_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "instructions.jsonl"


def _examples(count: int, vocab: int, seed: int = 0, longest: int = 30) -> list[tuple[np.ndarray, np.ndarray]]:
    """Examples of skewed lengths (2..longest tokens), the first third of each a prompt (no target)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(min(longest, 2 + rng.geometric(0.12)))
        ids = rng.integers(0, vocab, n)
        out.append((ids, np.arange(n) >= n // 3))
    return out


def test_rows_hold_every_example_once_with_padding_only_at_the_end():
    examples = _examples(40, 50)
    inputs, targets, doc_ids = pack_rows(examples, 32)
    padded_inputs, padded_targets = make_rows(examples, 32)
    assert len(inputs) < len(examples) / 2  # packing fills rows: fewer than half as many
    # Every example's (input, target) pairs appear once, contiguous, in a document of their own.
    found = []
    for row in range(len(inputs)):
        docs = doc_ids[row]
        assert bool((docs[1:] >= docs[:-1]).all())  # documents contiguous, in order
        used = 0
        for doc in range(int(docs[-1]) + 1):
            where = docs == doc
            pair = (tuple(inputs[row][where].tolist()), tuple(targets[row][where].tolist()))
            if doc < int(docs[-1]) or used + int(where.sum()) == 32 and pair in found_all(examples):
                found.append(pair)
                used += int(where.sum())
        assert bool((targets[row][used:] == IGNORE).all()) and bool((inputs[row][used:] == 0).all())  # padding
    expected = [(tuple(padded_inputs[i][:len(ids) - 1].tolist()), tuple(padded_targets[i][:len(ids) - 1].tolist()))
                for i, (ids, _) in enumerate(examples)]  # (examples of 31+ tokens are cut at 33: none here)
    assert sorted(found) == sorted(expected)
    assert pack_rows(examples, 32)[0].equal(inputs)  # deterministic: a resume finds the same rows


def found_all(examples: list) -> set:
    """Every example's (inputs, targets) as ``make_rows`` writes them, without the padding."""
    rows = make_rows(examples, 32)
    return {(tuple(rows[0][i][:len(ids) - 1].tolist()), tuple(rows[1][i][:len(ids) - 1].tolist()))
            for i, (ids, _) in enumerate(examples)}


@pytest.mark.parametrize("options", [
    dict(n_kv_heads=2),
    dict(n_kv_heads=2, tie_embeddings=True, qkv_bias=True),  # Qwen2-like
    dict(qk_norm=True, norm_plus_one=True, scale_embeddings=True, post_norms=True, sliding_window=8,
         sliding_layers=[0], activation="gelu_tanh"),  # Gemma-3-like, a window shorter than the row
])
def test_each_example_loss_equals_its_padded_loss(options):
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, ffn_hidden_dim=64, max_seq_len=64, **options)
    model = build_model(cfg, seed=0)
    examples = _examples(24, 50, seed=1)
    inputs, targets, doc_ids = pack_rows(examples, 64)
    with torch.no_grad():
        packed = F.cross_entropy(model(inputs, attn_mask=block_causal_mask(doc_ids)).flatten(0, 1),
                                 targets.flatten(), reduction="none").view_as(targets)  # (R, T)
        alone_inputs, alone_targets = make_rows(examples, 64)
        alone = F.cross_entropy(model(alone_inputs).flatten(0, 1), alone_targets.flatten(),
                                reduction="none").view_as(alone_targets)  # (N, T): one example a row
    # Match each packed document to its example by its tokens, then compare token by token.
    rows = {}
    for i in range(len(examples)):
        rows.setdefault(tuple(alone_inputs[i].tolist()), []).append(i)
    compared = 0
    for r in range(len(inputs)):
        for doc in range(int(doc_ids[r, -1]) + 1):
            where = doc_ids[r] == doc
            n = int(where.sum())
            key = tuple(inputs[r][where].tolist()) + (0,) * (64 - n)
            if key not in rows:  # the padding document
                continue
            i = rows[key][0]
            counted = targets[r][where] != IGNORE
            torch.testing.assert_close(packed[r][where][counted], alone[i][:n][counted], atol=1e-5, rtol=1e-5)
            compared += 1
    assert compared == len(examples)
    # The batch loss: the mean over every target token, the same as all the examples padded in one batch.
    batch_packed = F.cross_entropy(model(inputs, attn_mask=block_causal_mask(doc_ids)).flatten(0, 1),
                                   targets.flatten())
    batch_alone = F.cross_entropy(model(alone_inputs).flatten(0, 1), alone_targets.flatten())
    assert batch_packed.item() == pytest.approx(batch_alone.item(), abs=1e-5)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    return tiny_hf_base(tmp_path_factory.mktemp("base"))


def _args(base: Path, run: Path, tiny, **extra) -> list[str]:
    over = tiny(run, **{"train.steps": 6, "finetune.instructions": str(FIXTURE), "data.seq_len": 64,
                        "data.val_fraction": 0.2, "logging.log_interval": 1, **extra})
    for key in [k for k in over if k.startswith("model.")]:
        over.pop(key)  # the model comes from the base
    return ["finetune", "--from", str(base)] + [f"--{k}={v}" for k, v in over.items()]


@pytest.mark.parametrize("method", ["lora", "dora", "full"])
def test_packed_finetune_resumes_bitwise(hf_base, tmp_path, tiny, method):
    """Stop at step 3 and resume to 6 == 6 steps straight, packed (the loader's rows and cursor are restored)."""
    extra = {"finetune.method": "lora" if method == "dora" else method, "finetune.dora": method == "dora",
             "finetune.packing": "true", "checkpoint.interval": 3}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(_args(hf_base, straight, tiny, **extra)) == 0
    assert main(_args(hf_base, resumed, tiny, **extra, **{"train.stop_at_step": 3})) == 0
    assert main(_args(hf_base, resumed, tiny, **extra) + ["--resume"]) == 0
    faults.assert_same_run(straight, resumed)


def test_packing_that_cannot_be_done_is_one_line_exit_2(hf_base, tmp_path, tiny, capsys):
    assert main(_args(hf_base, tmp_path / "a", tiny, **{"finetune.method": "prefix", "finetune.packing": "true"})) == 2
    err = capsys.readouterr().err
    assert "finetune.packing=true cannot be done here" in err and len(err.strip().splitlines()) == 1
    assert main(_args(hf_base, tmp_path / "b", tiny, **{"finetune.packing": "sometimes"})) == 2


def test_auto_packs_lora_and_pads_prompt_tuning():
    from scaletrain.config import JobConfig
    from scaletrain.finetune.method_table import packs_instructions

    cfg = JobConfig()
    assert packs_instructions(cfg)  # lora, one process
    for method, expected in (("full", True), ("qlora", True), ("prompt", False), ("prefix", False)):
        cfg.finetune.method = method
        assert packs_instructions(cfg) is expected
    cfg.finetune.method, cfg.finetune.packing = "lora", "false"
    assert not packs_instructions(cfg)


@pytest.mark.distributed
def test_packed_lora_under_fsdp2_matches_one_process(tmp_path):
    """Packed LoRA on 2 gloo ranks (FSDP2, a row each) == one process accumulating the same two rows one at a time
    (each rank's loss is the mean over its own row's targets, as each accumulated micro-batch's): losses to
    PARITY_RTOL."""
    base = tiny_hf_base(tmp_path / "base")
    common = ["-m", "scaletrain.cli", "finetune", "--from", str(base), "--data.seq_len=64",
              f"--finetune.instructions={FIXTURE}", "--finetune.packing=true", "--data.val_fraction=0.2",
              "--train.steps=4", "--train.eval_interval=0", "--train.eval_batches=1", "--train.sample_tokens=0",
              "--logging.progress=off", "--logging.tensorboard=false", "--logging.log_interval=1",
              "--train.precision=fp32", "--schedule.warmup_steps=1", "--optim.lr=0.01"]
    one = subprocess.run([sys.executable, *common, "--train.batch_size=1", "--train.grad_accum_steps=2",
                          f"--train.run_dir={tmp_path / 'one'}"],
                         capture_output=True, text=True, timeout=CEILING_S)
    assert one.returncode == 0, one.stderr[-3000:]
    torchrun(2, *common, "--train.batch_size=1", "--parallel.dp_shard=2", f"--train.run_dir={tmp_path / 'fsdp'}")

    def losses(run: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line]

    expected, got = losses(tmp_path / "one"), losses(tmp_path / "fsdp")
    assert len(got) == len(expected) == 4
    assert max(abs(a - b) / b for a, b in zip(got, expected)) < PARITY_RTOL, (got, expected)


@pytest.mark.parametrize("window", [0, 5])
def test_attention_a_document_at_a_time_equals_the_block_causal_mask(window):
    """On a CPU a packed row's attention runs one causal SDPA a document (``Attention.attend_documents``, the
    spans read from the mask by ``document_spans``); an accelerator keeps the masked kernel over T x T. Both give
    the same output and gradients, with grouped-query heads and a sliding window shorter than some documents."""
    from scaletrain.model.decoder import Attention, document_spans

    cfg = ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=24,
                      sliding_window=window)
    attention = Attention(cfg, layer_id=0)
    assert attention.sliding_window == window
    doc_ids = torch.tensor([[0] * 7 + [1] * 3 + [2] * 14, [0] * 24, [0] + [1] * 11 + [2] * 12])
    mask = block_causal_mask(doc_ids)
    spans = document_spans(mask)
    assert spans == [[(0, 7), (7, 10), (10, 24)], [(0, 24)], [(0, 1), (1, 12), (12, 24)]]
    q, k, v = (torch.randn(3, h, 24, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    attention = attention.double()
    masked = attention.attend(q, k, v, attention.windowed(mask, 24, q.device) if window else mask)
    grads = torch.autograd.grad(masked.square().sum(), (q, k, v))
    by_document = attention.attend_documents(q, k, v, spans)
    torch.testing.assert_close(by_document, masked, rtol=0, atol=1e-12)
    for ours, reference in zip(torch.autograd.grad(by_document.square().sum(), (q, k, v)), grads):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)
    assert document_spans(mask.to("meta")) is None  # not on a CPU: the masked kernel, no host read
