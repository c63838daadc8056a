"""LoRA / DoRA on a mixture of experts (finetune/lora.py's ``LoRAExperts``): every expert's gate / up / down gets
its own adapter, the router is a target too; each expert's adapter trains; merging equals the unmerged forward;
targets that name no module of the base, QLoRA and a peft export of the experts are one line each."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.config import ConfigError, ModelConfig, build
from scaletrain.finetune.lora import (
    ExpertAdapter,
    LoRAExperts,
    LoRALinear,
    adapters_disabled,
    apply_lora,
    is_nf4,
    merge_lora,
    nf4_bytes,
    put_back,
    quantize_from_base,
)
from scaletrain.finetune.methods import initial_adapter_state
from scaletrain.model import PRESETS, build_model
from scaletrain.model.moe import GroupedExperts, grouped_mm_fits

ALL = ["q", "k", "v", "o", "gate", "up", "down", "router"]


def _moe(**kw):
    """A 2-layer 32-wide model, 8 experts of width 24 (top-2) in every layer, initialised (seed 0)."""
    cfg = build(ModelConfig, {"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64, "moe_experts": 8,
                              "moe_top_k": 2, "moe_hidden_dim": 24, **kw}, presets=PRESETS)
    return build_model(cfg, seed=0)


def _adapted(rank: int, dora: bool = False, targets=ALL, random_b: bool = True, **kw):
    """The model with adapters on ``targets`` at their initial values (B random when ``random_b``, DoRA's magnitude
    off the row norms, so that the update is not zero)."""
    model = _moe(**kw).requires_grad_(False)  # as method_table's _apply_lora
    apply_lora(model, targets, rank=rank, alpha=2 * rank, dropout=0.0, rslora=False, dora=dora)
    state = initial_adapter_state(model, seed=1)
    gen = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if name.endswith("lora_B") and random_b:
            state[name] = torch.randn(tuple(p.shape), generator=gen) * 0.1
        if name.endswith("lora_magnitude"):
            weight = model.get_parameter(name.replace(".adapters.", ".").rsplit(".", 1)[0]) if ".adapters." in name \
                else model.get_parameter(name.removesuffix("lora_magnitude") + "weight")
            state[name] = torch.linalg.norm(weight.float(), dim=-1) * (1 + 0.1 * torch.rand(p.shape, generator=gen))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state:
                p.copy_(state[name])
    return model


def _ids(n: int = 3, length: int = 16) -> torch.Tensor:
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("rank", [4, 3])  # 4: the grouped GEMM (16-byte strides); 3: the per-expert loop
@pytest.mark.parametrize("dora", [False, True])
def test_every_expert_gets_its_own_adapter_and_merging_equals_the_unmerged_forward(rank, dora):
    model = _adapted(rank, dora)
    experts = [m for m in model.modules() if isinstance(m, LoRAExperts)]
    assert len(experts) == 2 and all(sorted(e.adapters) == ["w1", "w2", "w3"] for e in experts)
    a = experts[0].adapters["w1"]
    assert tuple(a.lora_A.shape) == (8, rank, 32) and tuple(a.lora_B.shape) == (8, 24, rank)
    assert isinstance(model.layers["0"].feed_forward.router, LoRALinear)
    x = torch.randn(40, 32)
    assert grouped_mm_fits(x, experts[0].w1, a.lora_A, a.lora_B) == (rank == 4)
    ids = _ids()
    with torch.no_grad():
        unmerged = model(ids)
        with adapters_disabled(model) as n:
            base = model(ids)
        assert n == 2 * 5 + 2  # q, k, v, o, router a layer, and the experts
        merged = merge_lora(model)(ids)
    assert not any(isinstance(m, (LoRAExperts, LoRALinear, ExpertAdapter)) for m in model.modules())
    assert all(type(m) is GroupedExperts for m in model.modules() if isinstance(m, GroupedExperts))
    assert (unmerged - base).abs().max().item() > 1e-3  # the adapters change the function
    assert (unmerged - merged).abs().max().item() <= 1e-5


def _quantized(model):
    """QLoRA on ``model`` (adapters applied): its blocks' frozen weights, the stacked experts' too, in 4-bit NF4 read
    from its own state (``quantize_from_base``, then ``put_back``); returns the fp32 state they came from."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    put_back(quantize_from_base(model, state))
    return state


@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("qlora", [False, True])
def test_each_expert_adapter_trains_where_its_expert_got_tokens(rank, qlora):
    """From peft's initialisation (B = 0): after one step, every expert that got tokens has a nonzero gradient on
    both its A and its B (A's is zero while B is, so the second backward is the check); an expert without tokens
    has none. The router's adapter trains too. With QLoRA's 4-bit experts the same, and the loss moves."""
    model = _adapted(rank, random_b=False)
    if qlora:
        pytest.importorskip("torchao")
        _quantized(model)
        assert all(is_nf4(e.w1) and e.w1.dim() == 2 for e in model.modules() if isinstance(e, LoRAExperts))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(trainable, lr=0.1)
    ids = _ids()
    losses = []
    for step in range(2):
        opt.zero_grad()
        for layer in model.layers.values():
            layer.feed_forward.tokens_since_log.zero_()
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            opt.step()
    assert losses[1] < losses[0]
    for layer in model.layers.values():
        got = layer.feed_forward.tokens_since_log > 0
        assert got.sum() >= 2
        for key, adapter in layer.feed_forward.experts.adapters.items():
            for p in (adapter.lora_A, adapter.lora_B):
                norms = p.grad.flatten(1).norm(dim=1)
                assert (norms[got] > 0).all(), key
                assert (norms[~got] == 0).all(), key
        router = layer.feed_forward.router
        assert router.lora_A.grad.abs().sum() > 0 and router.lora_B.grad.abs().sum() > 0


def test_targets_that_name_no_module_of_the_base_are_one_line():
    dense = build_model(build(ModelConfig, {"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64},
                              presets=PRESETS), seed=0)
    with pytest.raises(ConfigError) as err:
        apply_lora(dense, ["q", "router"], rank=4, alpha=8, dropout=0.0, rslora=False)
    message = str(err.value)
    assert "router" in message and "q, k, v, o, gate, up, down" in message and "\n" not in message
    moe = _moe()  # every layer sparse: gate / up / down are the experts' (and the router is there)
    assert len(apply_lora(moe, ["gate", "router"], rank=4, alpha=8, dropout=0.0, rslora=False)) == 4


@pytest.mark.parametrize("dora", [False, True])
def test_the_planners_trainable_count_is_the_models(dora):
    """method_table's LoRA count (the planner's memory and FLOPs read it) = the adapted model's parameters that
    train, on a model with a dense first block, shared experts, every target and the router."""
    from scaletrain.config import FinetuneConfig
    from scaletrain.finetune.method_table import METHODS

    kw = {"moe_first_dense": 1, "moe_shared_experts": 1, "n_layers": 3}
    model = _adapted(4, dora, **kw)
    ft = build(FinetuneConfig, {"method": "lora", "lora_rank": 4, "lora_targets": ALL, "dora": dora})
    measured = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert METHODS["lora"].trainable_parameters(model.cfg, ft) == measured


@pytest.mark.parametrize("targets", [ALL, ["q", "v"]])  # the experts adapted, and left without adapters
def test_4bit_experts_are_torchaos_nf4_of_the_stacked_weight_and_save_no_full_copy(targets):
    """QLoRA's experts (``_quantize_experts``): each stacked weight (E, out, in) is one 2-D NF4 tensor (E out, in),
    whose dequantization viewed (E, out, in) is torchao's of that same matrix, bit for bit, at ~4.5 bits a weight.
    The forward and the input gradient equal those of the same model with the dequantized weights in full
    precision, and the backward keeps no full-precision (E, out, in) copy (FrozenExpertsMM re-dequantizes)."""
    pytest.importorskip("torchao")
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    model = _adapted(4, targets=targets)
    state = _quantized(model)
    experts = [m for m in model.modules() if isinstance(m, LoRAExperts)]
    assert len(experts) == 2 and all(not isinstance(m, GroupedExperts) or isinstance(m, LoRAExperts)
                                     for m in model.modules())
    for key in ("w1", "w2", "w3"):
        stacked = state[f"layers.0.feed_forward.experts.{key}"]  # (E, out, in)
        # QLoRA's blocks of 64 and scaler blocks of 256, or the divisors of a small matrix (lora.to_nf4)
        blocks = math.gcd(stacked.numel(), 64)
        scalers = math.gcd(stacked.numel() // blocks, 256)
        theirs = to_nf4(stacked.reshape(-1, stacked.shape[-1]), blocks, scalers).get_original_weight().view_as(stacked)
        ours = experts[0].stacked(key)
        assert torch.equal(ours, theirs), key
        assert 0 < (ours - stacked).abs().max() < 0.2 * stacked.abs().max()  # NF4: 16 levels a block
        assert nf4_bytes(experts[0].get_parameter(key)) < stacked.numel() * 4.6 / 8
    plain = _adapted(4, targets=targets)  # the same adapters over the dequantized weights, in fp32
    plain.load_state_dict(_dequantized_state(model), strict=False)
    ids = _ids()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ours = model(ids)
    theirs = plain(ids)
    assert (ours - theirs).abs().max().item() <= 1e-5
    expert_numel = experts[0].n_experts * experts[0].hidden * experts[0].dim
    assert expert_numel not in saved
    ours.square().mean().backward()
    theirs.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def _dequantized_state(model) -> dict[str, torch.Tensor]:
    """Every 4-bit weight of ``model`` dequantized, under its name ((E, out, in) for the experts)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRAExperts):
            out.update({f"{name}.{k}": module.stacked(k) for k in ("w1", "w2", "w3")})
        elif isinstance(module, torch.nn.Linear) and is_nf4(module.weight):
            out[f"{name}.weight"] = module.weight.get_original_weight()
    return out


def test_the_planners_4bit_base_is_the_quantized_models_bytes():
    """plan/finetune.py's ``frozen_bytes`` under QLoRA (NF4 for the blocks' projections, the routers and every
    expert's stacked weights, fp32 for the rest) = the bytes the quantized model's frozen tensors hold, within 2%
    (the planner's NF4 bytes a weight are QLoRA's 64 / 256 blocks; each tensor's code book and scale factors, 1.0%
    of this tiny model's, are not counted)."""
    pytest.importorskip("torchao")
    from scaletrain.config import FinetuneConfig
    from scaletrain.plan.finetune import frozen_bytes

    model = _adapted(4, targets=["q", "v"], dim=64, moe_hidden_dim=64, moe_first_dense=1, n_layers=3)
    _quantized(model)
    measured = sum(nf4_bytes(p) if is_nf4(p) else p.numel() * p.element_size()
                   for p in model.parameters() if not p.requires_grad)
    ft = build(FinetuneConfig, {"method": "qlora", "lora_rank": 4, "lora_targets": ["q", "v"]})
    predicted = frozen_bytes(model.cfg, ft)
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)
    dense_experts = 4 * sum(m.n_experts * m.hidden * m.dim * 3 for m in model.modules() if isinstance(m, LoRAExperts))
    assert measured < sum(p.numel() * 4 for p in model.parameters()) - 0.8 * dense_experts  # the experts in 4 bits


def test_4bit_experts_compiled_dequantization_is_eagers():
    """``finetune.qlora_compile`` on the experts (``put_back(compiled=True)``): the stacked weights dequantized by the
    compiled kernel are torchao's bit for bit, and the logits and adapter gradients are the eager ones."""
    pytest.importorskip("torchao")
    model = _adapted(4)
    _quantized(model)
    experts = [m for m in model.modules() if isinstance(m, LoRAExperts)]
    eager_weights = [e.stacked(k) for e in experts for k in ("w1", "w2", "w3")]
    runs = []
    for compiled in (False, True):
        for m in model.modules():
            if hasattr(m, "nf4_compiled"):
                m.nf4_compiled = compiled
        model.zero_grad()
        logits = model(_ids())
        logits.square().mean().backward()
        runs.append((logits.detach(), experts[0].adapters["w1"].lora_A.grad.clone()))
    assert all(torch.equal(w, e.stacked(k)) for w, (e, k) in
               zip(eager_weights, [(e, k) for e in experts for k in ("w1", "w2", "w3")]))
    assert (runs[0][0] - runs[1][0]).abs().max().item() <= 1e-6
    assert torch.allclose(runs[0][1], runs[1][1], atol=1e-7, rtol=1e-5) and runs[0][1].abs().sum() > 0
