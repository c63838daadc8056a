"""Structured pruning: remove whole SwiGLU neurons and whole blocks, giving a smaller dense model.

The result is a plain ``Transformer`` with a new ``ModelConfig`` (``ffn_hidden_dim`` and ``n_layers``
changed, ``preset`` cleared so no preset re-applies the old sizes), so train, finetune, export and plan take
it as any other model. Importance is measured on the calibration set (Minitron-style, activation based):

- MLP neuron j of a block: ||a_j||_2 over the calibration tokens, a = silu(w1 x) * w3 x (the input of w2),
  times ||w2[:, j]||_2: how much the neuron writes into the residual stream. The lowest are removed in
  every block alike (same hidden size everywhere, as ``ModelConfig`` has one ``ffn_hidden_dim``).
- Block i: Block Influence (ShortGPT, Men et al. 2024) = 1 - mean cosine(input, output) of the block over
  the calibration tokens; the blocks that change the residual stream least are removed.

Attention heads are not removed: this model's head width is ``dim // n_heads`` (``ModelConfig`` has no
``head_dim``), so fewer heads would change every remaining head's width. Docs/compression.md says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from scaletrain.model import Transformer
from scaletrain.model.config import ModelConfig
from scaletrain.model.presets import ffn_hidden_dim
from scaletrain.options import ConfigError


@torch.no_grad()
def importance(model: Transformer, batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"neurons": (n_layers, hidden) neuron scores, "blocks": (n_layers,) block influence}."""
    names = list(model.layers)
    hidden = ffn_hidden_dim(model.cfg)
    act = torch.zeros(len(names), hidden, dtype=torch.float64)
    cos_sum = torch.zeros(len(names), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    hooks = []
    for i, name in enumerate(names):
        block = model.layers[name]

        def w2_hook(_m, args, i=i):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            act[i] += (a * a).sum(0)

        def block_hook(_m, args, out, i=i):
            x, y = args[0].detach().flatten(0, 1).double(), out.detach().flatten(0, 1).double()
            cos_sum[i] += torch.nn.functional.cosine_similarity(x, y, dim=-1).sum()

        hooks.append(block.feed_forward.w2.register_forward_pre_hook(w2_hook))
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
    w2_norms = torch.stack([model.layers[n].feed_forward.w2.weight.detach().double().norm(dim=0) for n in names])
    return {"neurons": (act.sqrt() * w2_norms).float(), "blocks": (1 - cos_sum / tokens).float()}


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
                     drop_blocks: int = 0) -> tuple[Transformer, ModelConfig, dict]:
    """A new, smaller dense model: the kept blocks (renumbered, in order) with their kept neurons."""
    cfg = model.cfg
    hidden, n_layers = plan_sizes(cfg, mlp_fraction, drop_blocks)
    names = list(model.layers)
    kept_blocks = sorted(torch.topk(scores["blocks"], n_layers).indices.tolist())
    new_cfg = dataclasses.replace(cfg, preset="", n_layers=n_layers, ffn_hidden_dim=hidden)
    new = Transformer(new_cfg)  # on the CPU: every weight is copied below, the rotary tables are derived
    new.init_weights()
    state = {}
    for new_i, old_i in enumerate(kept_blocks):
        old = model.layers[names[old_i]]
        neurons = torch.sort(torch.topk(scores["neurons"][old_i], hidden).indices).values
        prefix = f"layers.{new_i}."
        for key, t in old.state_dict().items():
            if key in ("feed_forward.w1.weight", "feed_forward.w3.weight"):
                t = t[neurons]
            elif key == "feed_forward.w2.weight":
                t = t[:, neurons]
            state[prefix + key] = t.clone()
    for key, t in model.state_dict().items():
        if not key.startswith(("layers.", "rope_")):
            state[key] = t.clone()
    missing, unexpected = new.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rope_")]
    assert not missing and not unexpected, (missing, unexpected)
    new.tie_weights()
    record = {"ffn_hidden_dim": [ffn_hidden_dim(cfg), hidden], "n_layers": [cfg.n_layers, n_layers],
              "removed_blocks": [i for i in range(len(names)) if i not in kept_blocks],
              "parameters": [count(model), count(new)]}
    return new, new_cfg, record


def count(model: nn.Module) -> int:
    """Distinct parameters (a tied head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
