"""AdamW with parameter groups: weight decay on matrices only; or Muon on the blocks' matrices + AdamW on the
rest (``optim.name = "muon"``, train/muon.py)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from scaletrain.config import OptimConfig
from scaletrain.parallel import ParallelModel
from scaletrain.parallel.ddp import build_zero1_optimizer
from scaletrain.train.muon import Muon, MuonAdamW, muon_matrices


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights of Linear layers; never norms or embeddings (decaying the embedding table
    pulls rare tokens' vectors to zero, and norm gains towards zero, neither of which helps)."""
    decay, no_decay, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue  # a tied weight is listed once
            seen.add(id(p))
            ndim = len(getattr(p, "ds_shape", p.shape))  # DeepSpeed ZeRO-3 leaves an empty tensor, ds_shape
            (decay if isinstance(module, nn.Linear) and ndim >= 2 else no_decay).append(p)
    # The tied output head is an nn.Linear whose weight *is* the embedding: keep it undecayed.
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    no_decay += [p for p in decay if id(p) in emb_ids]
    decay = [p for p in decay if id(p) not in emb_ids]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def mup_param_groups(model: nn.Module, weight_decay: float, width_mult: float) -> list[dict]:
    """``param_groups`` split for muP (model/mup.py, as the ``mup`` package's MuAdam): the hidden matrices (the
    Linear layers inside blocks, both dimensions growing with the width) get ``lr_scale = 1 / width_mult`` and
    weight decay ``* width_mult`` (AdamW multiplies the decay by the lr, so their product stays put); the
    embedding, norms and the readout (output) keep the base lr. The trainer sets each group's lr to the
    schedule's lr times its ``lr_scale``."""
    decay, no_decay = param_groups(model, weight_decay)
    hidden_ids = {id(p) for name, module in model.named_modules() if isinstance(module, nn.Linear)
                  and ".layers." in f".{name}." for p in module.parameters(recurse=False)}
    hidden = [p for p in decay["params"] if id(p) in hidden_ids]
    rest = [p for p in decay["params"] if id(p) not in hidden_ids]
    return [{"params": hidden, "weight_decay": weight_decay * width_mult, "lr_scale": 1.0 / width_mult},
            {"params": rest, "weight_decay": weight_decay, "lr_scale": 1.0},
            {**no_decay, "lr_scale": 1.0}]


def lora_plus_groups(model: nn.Module, groups: list[dict], ratio: float) -> list[dict]:
    """LoRA+ (Hayou et al. 2024): each group split, the LoRA adapters' B matrices (``lora_B``) moved to a group of
    their own whose ``lr_scale`` is ``ratio`` times the group's (peft's ``create_loraplus_optimizer`` does the
    same). The paper shows that one rate for both is inefficient for wide layers, and that the update learns
    faster with B's rate ~16x A's."""
    b_ids = {id(p) for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "lora_B"}
    out = []
    for group in groups:
        scale = group.get("lr_scale", 1.0)
        out.append({**group, "params": [p for p in group["params"] if id(p) not in b_ids], "lr_scale": scale})
        b = [p for p in group["params"] if id(p) in b_ids]
        if b:
            out.append({**group, "params": b, "lr_scale": scale * ratio})
    return out


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_supported(model: nn.Module, device: torch.device) -> bool:
    """Whether torch's fused AdamW can take every trainable parameter of ``model``: all on ``device``'s type,
    CUDA or CPU, in a floating dtype its kernel has (a parameter elsewhere, e.g. offloaded to another device
    type, or in another dtype makes ``fused=True`` raise at the first step). The fused kernel is also what skips
    a non-finite step on the device (train/step.py ``skips_on_device``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return device.type in ("cuda", "cpu") and all(p.device.type == device.type and p.dtype in FUSED_DTYPES
                                                  for p in params)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    width_mult: float = 1.0, lora_plus_ratio: float = 1.0) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; ``width_mult`` != 1 (muP): ``mup_param_groups``; ``lora_plus_ratio`` != 1:
    ``lora_plus_groups``. Each group's initial lr is already times its ``lr_scale``."""
    impl = cfg.implementation
    if impl == "auto":  # fused: one kernel per step; on the CPU too since torch 2.4, where foreach took ~4x longer
        impl = "fused" if fused_supported(model, device) else "foreach"
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"} if impl != "loop" else {"foreach": False}
    if impl == "fused":
        kwargs.pop("foreach")
    groups = param_groups(model, cfg.weight_decay) if width_mult == 1.0 else \
        mup_param_groups(model, cfg.weight_decay, width_mult)
    if lora_plus_ratio != 1.0:
        groups = lora_plus_groups(model, groups, lora_plus_ratio)
    groups = [{**g, "lr": cfg.lr * g["lr_scale"]} if "lr_scale" in g else g for g in groups]
    if cfg.name == "muon":
        return build_muon(model, groups, cfg, device, kwargs)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def build_muon(model: nn.Module, groups: list[dict], cfg: OptimConfig, device: torch.device,
               adamw_kwargs: dict) -> MuonAdamW:
    """``groups`` (AdamW's) with the blocks' matrices (``muon_matrices``) moved to one Muon group at
    ``optim.muon_lr`` (0: optim.lr), ``lr_scale`` = muon_lr / lr so the trainer's schedule scales both alike.
    Newton-Schulz in bf16 on a GPU, fp32 on a CPU (train/muon.py)."""
    matrices = muon_matrices(model, adapters=cfg.muon_adapters)
    by_id = {id(p): p for g in groups for p in g["params"]}
    adamw_groups = [{**g, "params": [p for p in g["params"] if id(p) not in matrices]} for g in groups]
    adamw_groups = [g for g in adamw_groups if g["params"]]
    scale = (cfg.muon_lr or cfg.lr) / cfg.lr
    muon_group = {"params": [by_id[i] for i in by_id if i in matrices], "lr_scale": scale, "lr": cfg.lr * scale}
    adamw = torch.optim.AdamW(adamw_groups or [{"params": []}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                              eps=cfg.eps, **adamw_kwargs)
    muon = Muon([muon_group], lr=cfg.lr * scale, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                adjust_lr_fn=cfg.muon_adjust_lr, ns_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return MuonAdamW(adamw, muon)


def build_parallel_optimizer(pm: ParallelModel, cfg: OptimConfig, device: torch.device, zero_stage: int,
                             width_mult: float = 1.0, lora_plus_ratio: float = 1.0):
    """AdamW over this rank's parameters (all parts), or ZeRO-1 (``ZeroRedundancyOptimizer``) around it."""
    adamw = build_optimizer(nn.ModuleList(pm.modules), cfg, device, width_mult, lora_plus_ratio)
    if zero_stage != 1 or pm.dims.dp_replicate == 1:
        return adamw
    accepted = inspect.signature(torch.optim.AdamW.__init__).parameters
    kwargs = {k: v for k, v in adamw.defaults.items() if k in accepted and k not in ("weight_decay", "params")}
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "lr": g["lr"],
               **({"lr_scale": g["lr_scale"]} if "lr_scale" in g else {})} for g in adamw.param_groups]
    return build_zero1_optimizer(groups, pm.group("dp_replicate"), **kwargs)
