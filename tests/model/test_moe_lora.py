"""LoRA / DoRA on a mixture of experts (finetune/lora.py's ``LoRAExperts``): every expert's gate / up / down gets
its own adapter, the router is a target too; each expert's adapter trains; merging equals the unmerged forward;
targets that name no module of the base, QLoRA and a peft export of the experts are one line each."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import ConfigError, ModelConfig, build
from scaletrain.finetune.lora import ExpertAdapter, LoRAExperts, LoRALinear, adapters_disabled, apply_lora, merge_lora
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


@pytest.mark.parametrize("rank", [4, 3])
def test_each_expert_adapter_trains_where_its_expert_got_tokens(rank):
    """From peft's initialisation (B = 0): after one step, every expert that got tokens has a nonzero gradient on
    both its A and its B (A's is zero while B is, so the second backward is the check); an expert without tokens
    has none. The router's adapter trains too."""
    model = _adapted(rank, random_b=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(trainable, lr=0.1)
    ids = _ids()
    for step in range(2):
        opt.zero_grad()
        for layer in model.layers.values():
            layer.feed_forward.tokens_since_log.zero_()
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        if step == 0:
            opt.step()
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
