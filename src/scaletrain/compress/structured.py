"""Structured pruning: remove attention heads (by KV group), whole SwiGLU neurons and whole blocks, giving a
smaller dense model.

The result is a plain ``Transformer`` with a new ``ModelConfig`` (``n_heads``, ``n_kv_heads``, ``head_dim``,
``ffn_hidden_dim`` and ``n_layers`` changed, ``preset`` cleared so no preset re-applies the old sizes), so
train, finetune, export and plan take it as any other model. Importance is measured on the calibration set
(Minitron-style, activation based):

- MLP neuron j of a block: ||a_j||_2 over the calibration tokens, a = silu(w1 x) * w3 x (the input of w2),
  times ||w2[:, j]||_2: how much the neuron writes into the residual stream. The lowest are removed in
  every block alike (same hidden size everywhere, as ``ModelConfig`` has one ``ffn_hidden_dim``).
- Attention heads, grouped-query aware: the unit removed is a **KV group** (one key/value head with the
  n_heads / n_kv_heads query heads that read it; under plain MHA a group is one head), so the ratio of query
  to KV heads is kept and n_heads stays a multiple of n_kv_heads. Query head h scores the L2 norm over the
  calibration tokens of what it writes into the residual stream, wo[:, h] o_h (o_h its attention output),
  computed exactly from the Gram matrix of o_h: sqrt(trace(wo_h^T wo_h sum_t o_h o_h^T)); a group scores
  sqrt(sum of its heads' squares). The lowest groups are removed in every block alike (one ``n_heads``).
  The head width is kept (``head_dim`` set to the old ``dim // n_heads``), so the rotary tables and the
  attention scale of every kept head are unchanged.
- Block i: Block Influence (ShortGPT, Men et al. 2024) = 1 - mean cosine(input, output) of the block over
  the calibration tokens; the blocks that change the residual stream least are removed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from scaletrain.core.options import ConfigError
from scaletrain.model import Transformer
from scaletrain.model.config import ModelConfig, head_width
from scaletrain.model.hf_names import PROJECTIONS, block_suffix
from scaletrain.model.presets import ffn_hidden_dim, kv_heads

# A block's projection weight (``attention.wq.weight``) or bias (Qwen2's q/k/v) -> its role (``q``), from the one
# name table. A bias is cut by the same output rows as its weight; the q/k norms (Qwen3, Gemma 3) act over one
# head's width, which pruning keeps, so they are copied as they are.
_ROLE_OF_WEIGHT = {f"{block_suffix(role)}.{kind}": role for role in PROJECTIONS for kind in ("weight", "bias")}


def _weight(block: nn.Module, role: str) -> torch.Tensor:
    """The float64 copy of a block's projection weight by role (model/hf_names.py)."""
    return block.get_submodule(block_suffix(role)).weight.detach().double()


@torch.no_grad()
def importance(model: Transformer, batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"neurons": (n_layers, hidden) neuron scores, "heads": (n_layers, n_kv_heads) KV-group scores,
    "blocks": (n_layers,) block influence}."""
    names = list(model.layers)
    hidden, hd, n_heads = ffn_hidden_dim(model.cfg), head_width(model.cfg), model.cfg.n_heads
    act = torch.zeros(len(names), hidden, dtype=torch.float64)
    gram = torch.zeros(len(names), n_heads, hd, hd, dtype=torch.float64)  # sum_t o_h o_h^T per query head
    cos_sum = torch.zeros(len(names), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    hooks = []
    for i, name in enumerate(names):
        block = model.layers[name]

        def w2_hook(_m, args, i=i):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            act[i] += (a * a).sum(0)

        def wo_hook(_m, args, i=i):
            o = args[0].detach().reshape(-1, n_heads, hd).double()  # (tokens, H, hd): each head's output
            gram[i] += torch.einsum("thi,thj->hij", o, o)

        def block_hook(_m, args, out, i=i):
            x, y = args[0].detach().flatten(0, 1).double(), out.detach().flatten(0, 1).double()
            cos_sum[i] += torch.nn.functional.cosine_similarity(x, y, dim=-1).sum()

        hooks.append(block.get_submodule(block_suffix("down")).register_forward_pre_hook(w2_hook))
        hooks.append(block.get_submodule(block_suffix("o")).register_forward_pre_hook(wo_hook))
        hooks.append(block.register_forward_hook(block_hook))
    try:
        was_training = model.training
        model.eval()
        for batch in batches:
            model(batch)
            tokens += batch.numel()
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    if tokens == 0:
        raise ConfigError("structured pruning needs a calibration set (--calibration-sequences > 0)")
    w2_norms = torch.stack([_weight(model.layers[n], "down").norm(dim=0) for n in names])
    heads = []
    for i, n in enumerate(names):
        wo = _weight(model.layers[n], "o").view(-1, n_heads, hd).transpose(0, 1)  # H,d,hd
        per_head = torch.einsum("hdi,hdj,hji->h", wo, wo, gram[i]).clamp_min(0)  # ||wo_h o_h||^2 over tokens
        heads.append(per_head.view(kv_heads(model.cfg), -1).sum(1).sqrt())  # KV groups: their query heads
    return {"neurons": (act.sqrt() * w2_norms).float(), "heads": torch.stack(heads).float(),
            "blocks": (1 - cos_sum / tokens).float()}


def plan_heads(cfg: ModelConfig, head_fraction: float) -> tuple[int, int]:
    """(new n_heads, new number of KV groups) after removing ``head_fraction`` of the query heads as whole KV
    groups; a share that is not a whole number of groups, or that removes every head, is refused."""
    if not 0.0 <= head_fraction < 1.0:
        raise ConfigError(f"--head-fraction {head_fraction}: must be in [0, 1) (the share of attention heads "
                          f"removed, e.g. 0.25)")
    kv = kv_heads(cfg)
    per_group = cfg.n_heads // kv
    removed = head_fraction * cfg.n_heads
    groups = round(removed / per_group)
    if head_fraction and (abs(removed - groups * per_group) > 1e-6 or groups == 0 or groups >= kv):
        raise ConfigError(
            f"--head-fraction {head_fraction}: removes {removed:g} of {cfg.n_heads} query heads, which is not a "
            f"whole number of KV groups leaving at least one ({kv} groups of {per_group} query heads; heads go by "
            f"group so n_heads stays divisible by n_kv_heads): use a multiple of {1 / kv:g} below 1")
    return cfg.n_heads - groups * per_group, kv - groups


def plan_sizes(cfg: ModelConfig, mlp_fraction: float, drop_blocks: int, multiple: int = 8) -> tuple[int, int]:
    """(new SwiGLU hidden size, new number of blocks); the hidden size is rounded to ``multiple`` (kernels
    and 2:4 / int4 groups like widths that divide evenly)."""
    if not 0.0 <= mlp_fraction < 1.0:
        raise ConfigError(f"--mlp-fraction {mlp_fraction}: must be in [0, 1) (the share of SwiGLU neurons "
                          f"removed, e.g. 0.25)")
    if not 0 <= drop_blocks < cfg.n_layers:
        raise ConfigError(f"--drop-blocks {drop_blocks}: must be in [0, {cfg.n_layers - 1}] (the model has "
                          f"{cfg.n_layers} blocks)")
    hidden = ffn_hidden_dim(cfg)
    keep = hidden - int(round(hidden * mlp_fraction))
    keep = max(multiple, keep // multiple * multiple) if hidden >= multiple else keep
    return keep, cfg.n_layers - drop_blocks


@torch.no_grad()
def prune_structured(model: Transformer, scores: dict[str, torch.Tensor], mlp_fraction: float = 0.25,
                     drop_blocks: int = 0, head_fraction: float = 0.0) -> tuple[Transformer, ModelConfig, dict]:
    """A new, smaller dense model: the kept blocks (renumbered, in order) with their kept heads and neurons."""
    cfg = model.cfg
    hidden, n_layers = plan_sizes(cfg, mlp_fraction, drop_blocks)
    n_heads, groups = plan_heads(cfg, head_fraction)
    hd, kv, per_group = head_width(cfg), kv_heads(cfg), cfg.n_heads // kv_heads(cfg)
    names = list(model.layers)
    kept_blocks = sorted(torch.topk(scores["blocks"], n_layers).indices.tolist())
    new_cfg = dataclasses.replace(cfg, preset="", n_layers=n_layers, ffn_hidden_dim=hidden)
    if n_heads != cfg.n_heads:  # the head width stays; plain MHA stays n_kv_heads = 0
        new_cfg = dataclasses.replace(new_cfg, n_heads=n_heads, head_dim=hd,
                                      n_kv_heads=groups if cfg.n_kv_heads else 0)
    kept_groups = []
    new = Transformer(new_cfg)  # on the CPU: every weight is copied below, the rotary tables are derived
    new.init_weights()
    state = {}
    for new_i, old_i in enumerate(kept_blocks):
        old = model.layers[names[old_i]]
        neurons = torch.sort(torch.topk(scores["neurons"][old_i], hidden).indices).values
        group = torch.sort(torch.topk(scores["heads"][old_i], groups).indices).values
        kept_groups.append(group.tolist())
        q_cols = ((group[:, None] * per_group + torch.arange(per_group))[..., None] * hd + torch.arange(hd)).flatten()
        kv_cols = (group[:, None] * hd + torch.arange(hd)).flatten()
        prefix = f"layers.{new_i}."
        rows = {"gate": neurons, "up": neurons, "q": q_cols, "k": kv_cols, "v": kv_cols}  # kept output rows
        cols = {"down": neurons, "o": q_cols}  # kept input columns
        for key, t in old.state_dict().items():
            role = _ROLE_OF_WEIGHT.get(key)
            if role in rows:
                t = t[rows[role]]  # a weight's rows, or a bias's entries
            elif role in cols:
                t = t[:, cols[role]]
            state[prefix + key] = t.clone()
    for key, t in model.state_dict().items():
        if not key.startswith(("layers.", "rope_")):
            state[key] = t.clone()
    missing, unexpected = new.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rope_")]
    assert not missing and not unexpected, (missing, unexpected)
    new.tie_weights()
    record = {"ffn_hidden_dim": [ffn_hidden_dim(cfg), hidden], "n_layers": [cfg.n_layers, n_layers],
              "n_heads": [cfg.n_heads, n_heads], "n_kv_heads": [kv, groups], "head_dim": hd,
              "kept_kv_groups": kept_groups if n_heads != cfg.n_heads else "all",
              "removed_blocks": [i for i in range(len(names)) if i not in kept_blocks],
              "parameters": [count(model), count(new)]}
    return new, new_cfg, record


def count(model: nn.Module) -> int:
    """Distinct parameters (a tied head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
