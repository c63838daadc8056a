"""Muon (optim.name = muon, train/muon.py): the step is torch.optim.Muon's, batched Newton-Schulz is the
per-matrix one, the split of parameters, a run that
learns, bitwise resume after kill -9, the planner's memory for one momentum buffer, and one-line refusals.
2-rank DDP / FSDP2 / pipeline parity with one process: tests/parallel/test_parallel_dist.py (the *_muon strategies)."""

from __future__ import annotations

import pytest
import torch

from helpers.faults import assert_same_run, last_step, launch, run_ok, train_args, wait_for, write_config
from scaletrain.cli import main
from scaletrain.config import ModelConfig, OptimConfig, load_config
from scaletrain.model import build_model
from scaletrain.train.muon import NS_COEFFICIENTS, Muon, MuonAdamW, muon_matrices, newton_schulz, newton_schulz_batched
from scaletrain.train.optimizer import build_optimizer
from scaletrain.train.trainer import Trainer

MODEL = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=128, max_seq_len=32)


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_step_is_torch_muon_bit_for_bit(adjust_lr_fn):
    """With bf16 Newton-Schulz (torch's) our step (foreach momentum, Newton-Schulz batched by shape) equals
    torch.optim.Muon's (one matrix at a time) exactly: tall and wide matrices, stacks of one shape in both
    orientations, and a shape of its own."""
    shapes = [(48, 32), (32, 80), (32, 48), (80, 32), (32, 80), (40, 40)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
            for i, s in enumerate(shapes)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a = Muon(ours, lr=0.02, adjust_lr_fn=adjust_lr_fn, ns_dtype=torch.bfloat16)
    b = torch.optim.Muon(theirs, lr=0.02, adjust_lr_fn=adjust_lr_fn)
    for step in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + step))
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])


NANO_SHAPES = [(128, 128)] * 4 + [(344, 128), (128, 344), (344, 128)]  # wq wk wv wo, w1 w2 w3 of the nano preset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_newton_schulz_is_the_per_matrix_one_bit_for_bit(dtype):
    """Two layers of the nano model's matrices (the stacks: 8 x (128, 128) and 6 x (128, 344), tall ones
    transposed): each result equals ``newton_schulz`` of that matrix alone. Bit for bit on the AMD EPYCs (Zen 4,
    Zen 5, AVX2-only) in fp32 and bf16; on a 2-vCPU Intel Xeon with AMX (2026-12-02) bf16 is bit for bit and
    fp32 within 9.8e-7 (all 14 matrices differ: there torch's CPU ``bmm`` and ``mm`` take kernels that sum in
    another order), so fp32 is held to the tiny matrices' bound below. A stack in the wrong orientation or order
    differs by the entries themselves (~0.05)."""
    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(shape, generator=g) for shape in NANO_SHAPES * 2]
    batched = newton_schulz_batched(updates, NS_COEFFICIENTS, 5, 1e-7, dtype)
    for update, ortho in zip(updates, batched):
        assert ortho.shape == update.shape and ortho.dtype == dtype
        single = newton_schulz(update, NS_COEFFICIENTS, 5, 1e-7, dtype)
        if dtype == torch.bfloat16:
            assert torch.equal(ortho, single)
        else:
            assert (ortho - single).abs().max() <= 1e-5 * single.abs().max()


def test_batched_newton_schulz_on_tiny_matrices_is_within_rounding():
    """Matrices below ~400 multiply-adds a product take another kernel in torch's CPU ``bmm`` (a plain loop),
    which sums in another order than ``mm``: a few fp32 ulps (1.2e-7 each) a product, which each of the 5
    iterations can amplify up to its linear coefficient a = 3.4445 (3.4445^5 ~ 490 at most); measured at most
    6.8e-6 of the largest entry over 200 random draws of these shapes, so 1e-5 is the bound."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        updates = [torch.randn(shape, generator=g) for shape in [(4, 6), (6, 4), (3, 5), (5, 3), (7, 7), (7, 7)]]
        batched = newton_schulz_batched(updates, NS_COEFFICIENTS, 5, 1e-7, torch.float32)
        for update, ortho in zip(updates, batched):
            single = newton_schulz(update, NS_COEFFICIENTS, 5, 1e-7, torch.float32)
            assert (ortho - single).abs().max() <= 1e-5 * single.abs().max()


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    model = build_model(MODEL, "cpu", seed=1)
    opt = build_optimizer(model, OptimConfig(name="muon", muon_lr=0.02, muon_adjust_lr="original"),
                          torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    assert on_muon == {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    assert len(on_muon) == 7 * MODEL.n_layers  # wq wk wv wo w1 w2 w3
    assert {id(p) for p in opt.muon.param_groups[0]["params"]} == muon_matrices(model)
    muon_group = opt.muon.param_groups[0]
    assert muon_group["lr_scale"] == pytest.approx(0.02 / 1e-3) and muon_group["adjust_lr_fn"] == "original"
    # One state buffer per Muon matrix, AdamW's two (+ step) for the embedding, head and norms.
    x = torch.randint(0, 64, (2, 16))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    for name, p in model.named_parameters():
        assert set(opt.state[p]) == ({"momentum_buffer"} if name in on_muon else {"exp_avg", "exp_avg_sq", "step"})


def test_a_muon_run_learns(tmp_path, tiny):
    """The trainer's own run with Muon: the validation loss falls at every evaluation. (Whether it beats AdamW
    is a benchmark question, not a test's: benchmarks/time_to_loss.py.)"""
    overrides = tiny(tmp_path / "run", **{"optim.name": "muon", "train.eval_interval": 20})
    evals = Trainer(load_config(None, overrides), log=False).train()["evals"]
    assert [e["step"] for e in evals] == [0, 20, 40]
    assert evals[0]["val_loss"] > evals[1]["val_loss"] > evals[2]["val_loss"]
    assert evals[2]["val_loss"] < evals[0]["val_loss"] - 0.3


def test_kill9_then_resume_is_bitwise_exact(tmp_path):
    """Muon's momentum buffers and AdamW's moments are in the checkpoint: a run killed with SIGKILL and resumed
    ends with the uninterrupted run's every loss and weight."""
    config = write_config(tmp_path, steps=30, interval=5)
    config.write_text(config.read_text() + '[optim]\nname = "muon"\n')
    run_ok(train_args(config, tmp_path / "straight"))
    run = tmp_path / "killed"
    proc = launch(train_args(config, run))
    wait_for(lambda: last_step(run) >= 12, proc, what="step 12")
    proc.kill()
    proc.wait()
    assert last_step(run) < 30, "the run finished before the kill landed"
    assert "resumed from" in run_ok(train_args(config, run, "--resume"))
    assert_same_run(tmp_path / "straight", run)


@pytest.mark.parametrize("flags,message", [
    (["--parallel.tp=2"], "optim.name=muon needs whole weight matrices: not with parallel.tp > 1"),
    (["--parallel.zero_stage=1"], "ZeRO-1, DeepSpeed and local SGD / DiLoCo build their own AdamW"),
    (["--model.parametrization=mup", "--model.tie_embeddings=false"], "optim.name=muon with "
                                                                       "model.parametrization=mup is not supported"),
])
def test_unsupported_settings_exit_2_in_one_line_before_the_run_folder(flags, message, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--optim.name=muon", f"--train.run_dir={run}", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert not run.exists()


def test_muon_settings_without_muon_are_refused(tmp_path, capsys):
    assert main(["train", "--optim.muon_lr=0.02", f"--train.run_dir={tmp_path / 'run'}"]) == 2
    assert "optim.muon_lr applies to optim.name=muon only" in capsys.readouterr().err


def test_chunking_bounds_the_step_and_does_not_change_it(monkeypatch):
    """A large model's Muon step runs chunk by chunk (its transient memory bounded); each matrix's arithmetic is
    its own, so one matrix per chunk gives the one-chunk step bit for bit."""
    from scaletrain.train import muon as muon_mod

    shapes = [(32, 32), (32, 48), (48, 32), (32, 32), (16, 48)]
    torch.manual_seed(0)
    weights = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    real = muon_mod.chunks
    assert [len(c) for c in real([torch.zeros(4)] * 3, limit=8)] == [2, 1]
    assert [len(c) for c in real([torch.zeros(20)], limit=8)] == [1]  # a larger matrix alone
    results = []
    for limit in (None, 1):
        if limit is not None:
            monkeypatch.setattr(muon_mod, "chunks", lambda ps: real(ps, limit=1))
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = muon_mod.Muon(params, lr=0.02, ns_dtype=torch.float32)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        assert torch.equal(a, b)
