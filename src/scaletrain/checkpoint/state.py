"""What a checkpoint holds, as ``torch.distributed.checkpoint`` (DCP) sees it.

DCP saves a dict of tensors in which every tensor is either a plain tensor (the same on every rank that
holds it: DDP replicas, pipeline stages own disjoint keys) or a DTensor (FSDP2 / tensor-parallel shards).
Each rank writes only what it owns, and on load each rank reads only the slices its *current* layout
needs - which is what makes "save on 2 FSDP ranks, resume on 1 plain process" (or 4 -> 2) work.

The keys are the model's own parameter names (``layers.3.attention.wq.weight``) - the same in every
layout, because ``parallelize`` never renames modules: pipeline stages keep the full model's names,
activation checkpointing and ``compile`` work in place, and the DDP wrapper is looked through. Optimizer
states are keyed by the same names (``optimizer.layers.3.attention.wq.weight.exp_avg``), so a ZeRO-1
rank, an FSDP shard and a plain AdamW all find their slice.

Low-communication training (local SGD / DiLoCo) is the exception: between synchronisations every replica
holds *different* weights under the same names. Replica 0 saves under the plain names (so ``eval``,
``generate`` and ``export`` read it like any checkpoint); replica r > 0 under ``replica<r>.``; such a
checkpoint resumes exactly only with the same number of replicas.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that really holds this rank's states (ZeRO-1 wraps a per-rank AdamW)."""
    # torch.distributed.optim is only imported by a ZeRO-1 build (parallel/ddp.py): importing it here cost every
    # process a quarter second, and without it no ZeroRedundancyOptimizer can exist.
    zero = sys.modules.get("torch.distributed.optim")
    return optimizer.optim if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer) else optimizer


def parameter_names(modules: list[nn.Module]) -> dict[nn.Parameter, str]:
    """Each parameter of this rank's model part(s) -> its name in the full model (shared ones once)."""
    names = {}
    for module in modules:
        for name, p in module.named_parameters():
            names.setdefault(p, name)
    return names


def model_tensors(modules: list[nn.Module], prefix: str = "") -> dict[str, torch.Tensor]:
    """Name -> tensor sharing storage with the live parameter (so a DCP load writes into the model)."""
    out = {}
    for module in modules:
        for name, t in module.state_dict(keep_vars=True).items():
            out[prefix + name] = t.detach()
    return out


def trainable_names(modules: list[nn.Module], prefix: str = "") -> set[str]:
    """Names (as ``model_tensors`` keys them) of the parameters that train: a fine-tune saves only these."""
    return {prefix + name for m in modules for name, p in m.named_parameters() if p.requires_grad}


def optimizer_tensors(modules: list[nn.Module], optimizer: torch.optim.Optimizer,
                      prefix: str = "") -> dict[str, torch.Tensor]:
    """``<param name>.<state name>`` -> the live optimizer state tensor (exp_avg, exp_avg_sq, step).

    Only the states this rank holds: its ZeRO-1 partition, its FSDP/TP shards, its pipeline stages."""
    names = parameter_names(modules)
    out = {}
    for p, state in local_optimizer(optimizer).state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{prefix}{names[p]}.{key}"] = value
    return out


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create every state tensor (so a checkpoint can be loaded into them) without changing any weight:
    one step with zero gradients at learning rate 0 (AdamW's update and decay both scale with lr)."""
    opt = local_optimizer(optimizer)
    params = [p for g in opt.param_groups for p in g["params"] if p not in opt.state]
    if not params:
        return
    saved_lrs = [g["lr"] for g in opt.param_groups]
    saved_grads = {p: p.grad for p in params}
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, saved_lrs):
        g["lr"] = lr
    for p, grad in saved_grads.items():
        p.grad = grad
