"""Mixture of Experts (model/moe.py): the grouped experts against a per-expert reference loop (outputs and
gradients), the counts, the sparse layers, balancing through the auxiliary-loss channel, the expert bias, training
and a bitwise resume, and the one-line refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from scaletrain.cli import main
from scaletrain.config import ModelConfig, build, load_config
from scaletrain.model import PRESETS, build_model, num_params
from scaletrain.model.moe import MoEFeedForward, expert_load, grouped_mm_fits, moe_layers
from scaletrain.model.presets import matmul_params
from scaletrain.model.shape import is_moe_layer
from scaletrain.train.loss import take_auxiliary
from scaletrain.train.trainer import Trainer


def cfg(**kw) -> ModelConfig:
    return build(ModelConfig, kw, presets=PRESETS)


def moe_layer(seed: int = 0, **kw) -> MoEFeedForward:
    """One sparse feed-forward of a 32-wide model (8 experts of width 24, top-2 unless ``kw`` says), initialised."""
    kw = {"moe_top_k": 2, "moe_hidden_dim": 24, **kw}
    model = build_model(cfg(dim=32, n_layers=2, n_heads=2, vocab_size=17, moe_experts=8, **kw), seed=seed)
    return model.layers["0"].feed_forward


def reference(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed token by token: the router from its weight, each token's top-k experts one at a
    time as separate SwiGLUs, an expert over capacity skipping the token (assignments in token order)."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router.weight.T
    scores = logits.softmax(-1) if layer.score == "softmax" else logits.sigmoid()
    chosen = (scores + layer.expert_bias).topk(layer.top_k, dim=-1).indices
    capacity = layer.capacity(tokens.shape[0]) if layer.capacity_factor else math.inf
    taken = [0] * layer.n_experts
    rows = []
    for n in range(tokens.shape[0]):
        weights = scores[n, chosen[n]]
        if layer.renormalize:
            weights = weights / weights.sum()
        out = torch.zeros_like(tokens[n])
        for j, e in enumerate(chosen[n].tolist()):
            taken[e] += 1
            if taken[e] > capacity:
                continue
            w1, w2, w3 = layer.experts.w1[e], layer.experts.w2[e], layer.experts.w3[e]
            out = out + layer.route_scale * weights[j] * (w2 @ (F.silu(w1 @ tokens[n]) * (w3 @ tokens[n])))
        if layer.shared_experts is not None:
            out = out + layer.shared_experts(tokens[n])
        rows.append(out)
    return torch.stack(rows).view_as(x)


def grads(layer: MoEFeedForward, x: torch.Tensor, out: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of sum(out * upstream) w.r.t. x and every parameter of the layer."""
    params = [x, *layer.parameters()]
    return list(torch.autograd.grad((out * upstream).sum(), params))


@pytest.mark.parametrize("options", [
    {},
    {"moe_score": "sigmoid", "moe_route_scale": 2.5, "moe_renormalize": False},
    {"moe_shared_experts": 2, "moe_top_k": 3},
    {"moe_capacity_factor": 0.5},
    {"moe_top_k": 1, "moe_bias_rate": 0.01},
])
def test_grouped_experts_equal_the_per_expert_reference_in_outputs_and_gradients(options):
    layer = moe_layer(**options)
    if layer.bias_rate:  # a bias that changes the choice: the reference must pick by it too
        layer.expert_bias.copy_(torch.linspace(-0.05, 0.05, layer.n_experts))
    x = torch.randn(3, 10, 32, requires_grad=True)
    assert grouped_mm_fits(x.reshape(-1, 32), layer.experts.w1, layer.experts.w2)  # the grouped GEMM is tested
    upstream = torch.randn(3, 10, 32)
    out = layer(x)
    expected = reference(layer, x)
    assert (out - expected).abs().max() < 1e-5
    for got, want in zip(grads(layer, x, out, upstream), grads(layer, x, expected, upstream)):
        assert (got - want).abs().max() < 1e-5
    if options.get("moe_capacity_factor"):
        assert int(layer.dropped_since_log) > 0  # half the even share: some expert is over capacity


def test_the_sorted_token_loop_equals_the_grouped_gemm(monkeypatch):
    layer = moe_layer(moe_shared_experts=1)
    x = torch.randn(2, 9, 32, requires_grad=True)
    upstream = torch.randn(2, 9, 32)
    grouped = layer(x)
    grouped_grads = grads(layer, x, grouped, upstream)
    monkeypatch.setattr("scaletrain.model.moe.grouped_mm_fits", lambda *a: False)
    looped = layer(x)
    assert (grouped - looped).abs().max() < 1e-5
    for a, b in zip(grouped_grads, grads(layer, x, looped, upstream)):
        assert (a - b).abs().max() < 1e-5


def test_widths_the_grouped_gemm_cannot_take_run_as_the_loop():
    layer = moe_layer(moe_hidden_dim=22)  # 22 fp32 = 88 bytes: not a multiple of 16
    x = torch.randn(1, 6, 32)
    assert not grouped_mm_fits(x.reshape(-1, 32), layer.experts.w1, layer.experts.w2)
    assert (layer(x) - reference(layer, x)).abs().max() < 1e-5


def test_counts_total_and_active_parameters():
    for options in ({}, {"moe_shared_experts": 1, "moe_every": 2}, {"moe_layers": [0, 3], "moe_hidden_dim": 64}):
        c = cfg(preset="nano-moe", vocab_size=65, **options)
        model = build_model(c)
        assert num_params(c) == sum(p.numel() for p in model.parameters())
    c = cfg(preset="nano-moe", vocab_size=65)
    d, v, L = 128, 65, 4
    attention, active_ffn = 4 * d * d, d * 8 + 3 * d * 176 * 2  # router + 2 of the 8 experts
    assert matmul_params(c) == L * (attention + active_ffn) + v * d
    assert matmul_params(c) - matmul_params(cfg(preset="nano", vocab_size=65)) == L * (d * 8 + 3 * d * 8)  # + router


def test_which_layers_are_sparse():
    def sparse(**kw):
        c = cfg(n_layers=6, moe_experts=4, **kw)
        return [i for i in range(6) if is_moe_layer(c, i)]

    assert sparse() == [0, 1, 2, 3, 4, 5]
    assert sparse(moe_every=2) == [1, 3, 5]
    assert sparse(moe_first_dense=2) == [2, 3, 4, 5]
    assert sparse(moe_layers=[0, 4]) == [0, 4]
    assert not any(is_moe_layer(cfg(n_layers=6), i) for i in range(6))  # the default is dense
    model = build_model(cfg(n_layers=6, moe_experts=4, moe_every=3, vocab_size=11))
    assert [name for name, _ in moe_layers(model)] == ["2", "5"]


def test_a_dense_model_is_unchanged():
    model = build_model(cfg(preset="nano", vocab_size=65))
    assert not moe_layers(model)
    assert not any("expert" in name or "router" in name for name in model.state_dict())
    assert expert_load([model]) == {}


def test_balance_and_z_loss_reach_training_only_through_the_auxiliary_channel():
    layer = moe_layer(moe_z_loss_coef=0.001)
    x = torch.randn(4, 8, 32)
    layer(x)
    terms = take_auxiliary(layer)
    tokens = x.reshape(-1, 32)
    logits = tokens @ layer.router.weight.T
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(2, -1).indices.flatten(), minlength=8).float()
    balance = 0.01 * 8 * (counts / counts.sum() * probs.mean(0)).sum()
    assert terms["moe_balance_loss"].item() == pytest.approx(balance.item(), rel=1e-5)
    assert terms["moe_z_loss"].item() == pytest.approx(0.001 * torch.logsumexp(logits, -1).square().mean().item(),
                                                       rel=1e-5)
    assert take_auxiliary(layer) == {}  # taken once
    with torch.no_grad():  # evaluation and generation leave none
        layer(x)
    assert take_auxiliary(layer) == {}


def test_recomputation_under_activation_checkpointing_counts_once():
    layer = moe_layer()
    x = torch.randn(2, 8, 32, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    take_auxiliary(layer)
    out.sum().backward()  # re-runs the forward
    assert int(layer.tokens_since_log.sum()) == 2 * 8 * 2
    assert take_auxiliary(layer) == {}


def test_the_expert_bias_moves_towards_balance_and_picks_without_weighing():
    layer = moe_layer(moe_bias_rate=0.1, moe_top_k=1)
    x = torch.randn(4, 8, 32)
    layer(x)
    load = layer.tokens_since_update.float()
    counts = layer.tokens_since_update.clone()
    for skipped in (False, torch.tensor(0.0)):  # a step the guard skipped (on the host, or on the device): no move
        layer.update_bias(keep=skipped)
        assert not layer.expert_bias.any() and not layer.tokens_since_update.any()  # its tokens dropped with it
        layer.tokens_since_update.copy_(counts)
    layer.update_bias()
    assert torch.equal(layer.expert_bias, 0.1 * torch.sign(load.mean() - load))
    assert int(layer.tokens_since_update.sum()) == 0
    layer.expert_bias.zero_()
    layer.expert_bias[5] = 10.0  # every token now picks expert 5, weighted by its own (renormalised) score
    with torch.no_grad():
        _, scores, chosen, weights = layer.route(x.reshape(-1, 32))
    assert (chosen == 5).all() and torch.allclose(weights, torch.ones_like(weights))
    assert scores[:, 5].max() < 1  # the score itself is untouched by the bias


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_hidden_dim": 48, "model.moe_z_loss_coef": 0.001,
       "model.moe_bias_rate": 0.001}


def test_an_moe_model_trains_and_logs_its_auxiliary_terms_and_expert_load(tmp_path, tiny):
    cfg_ = load_config(None, tiny(tmp_path / "run", **MOE, **{"train.steps": 40, "logging.log_interval": 10}))
    trainer = Trainer(cfg_, log=True)
    first = trainer.evaluate().loss
    summary = trainer.train()
    assert summary["final_val_loss"] < first - 0.5
    steps = [r for r in _records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in steps] == [10, 20, 30, 40]
    for r in steps:
        assert r["moe_balance_loss"] > 0 and r["moe_z_loss"] > 0
        for layer in ("0", "1"):  # 10 steps x 4 rows x 32 positions x top-2 assignments since the last log
            assert sum(r[f"moe_tokens_per_expert/{layer}"]) == 10 * 4 * 32 * 2
            assert r[f"moe_max_mean_load/{layer}"] >= 1 and r[f"moe_dropped_tokens/{layer}"] == 0
        assert r["moe_max_mean_load"] == max(r["moe_max_mean_load/0"], r["moe_max_mean_load/1"])
    from scaletrain.report.html import render
    from scaletrain.report.runs import read_run

    page = render([read_run(tmp_path / "run")])  # the report plots the load and the auxiliary losses
    assert "no mixture of experts in these runs" not in page and "no MoE auxiliary loss" not in page
    assert "no mixture of experts in these runs" in render([])  # what a page without them says
    bias = trainer.pm.modules[0].layers["0"].feed_forward.expert_bias
    assert bias.abs().sum() > 0  # the bias moved (and is a buffer a checkpoint keeps)


def test_an_moe_resume_is_bitwise_exact(tmp_path, tiny):
    from train.test_train import args, final_weights, losses

    straight, split = tmp_path / "straight", tmp_path / "split"
    common = {**MOE, "logging.log_interval": 1, "train.eval_interval": 10, "checkpoint.interval": 15,
              "train.steps": 30}
    assert main(args(tiny(straight, **common))) == 0
    assert main(args(tiny(split, **common, **{"train.stop_at_step": 15}))) == 0
    assert main(args(tiny(split, **common)) + ["--resume"]) == 0
    a, b = losses(straight), losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 31))
    assert all(a[s] == b[s] for s in a), "per-step losses differ after resume"
    wa, wb = final_weights(straight), final_weights(split)
    assert any(k.endswith("expert_bias") for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final parameters (or expert bias) differ after resume"


@pytest.mark.parametrize("flags,message", [
    (["--model.moe_experts=4", "--model.moe_top_k=5"], "model.moe_top_k must be between 1 and model.moe_experts (4)"),
    (["--model.moe_experts=4", "--model.moe_top_k=0"], "model.moe_top_k must be between 1 and model.moe_experts (4)"),
    (["--model.moe_experts=4", "--model.moe_capacity_factor=-1"], "model.moe_capacity_factor must be >= 0"),
    (["--model.moe_experts=4", "--model.family=qwen3"], "model.family = qwen3 has no mixture of experts"),
    (["--model.moe_experts=4", "--model.moe_layers=7"], "model.moe_layers [7] are not layers of this model"),
    (["--model.moe_experts=4", "--model.moe_first_dense=4"], "no layer is sparse"),
])
def test_bad_moe_options_exit_2_with_one_line(flags, message, tmp_path, capsys):
    assert main(["train", f"--train.run_dir={tmp_path / 'run'}", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_commands_that_do_not_model_moe_refuse_in_one_line(tmp_path, tiny, capsys):
    # (`plan` models a mixture of experts: tests/plan/test_plan_moe.py)
    run = tmp_path / "run"
    assert main(args_of(tiny(run, **MOE, **{"train.steps": 2}))) == 0
    capsys.readouterr()
    # our own MoE (family llama) has no Hugging Face class: its export names the field (the MoE families export)
    assert main(["export", "--run", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.moe_experts = 4 cannot be written as a llama config.json" in err and "\n" not in err
    # nor has llama.cpp's llama experts for it (the MoE families write theirs: tests/checkpoint/test_gguf.py)
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "4 experts (this architecture has none)" in err and "\n" not in err
    assert not (tmp_path / "m.gguf").exists()
    assert main(["compress", "--run", str(run), "--out", str(tmp_path / "out"), "--quantize", "int8-weight"]) == 2
    err = capsys.readouterr().err.strip()
    assert "scaletrain compress does not model a mixture of experts yet" in err and "\n" not in err


def test_a_finetune_cannot_add_experts_to_its_base(tmp_path, tiny, capsys):
    from helpers.tiny import tiny_hf_base

    base = tiny_hf_base(tmp_path / "base")
    assert main(["finetune", "--from", str(base), f"--train.run_dir={tmp_path / 'ft'}",
                 "--model.moe_experts=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.moe_experts=4 is set, but a fine-tune takes [model] from finetune.source" in err
    assert "\n" not in err


def args_of(overrides: dict) -> list[str]:
    return ["train"] + [f"--{k}={v}" for k, v in overrides.items()]
