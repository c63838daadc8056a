"""muP (Tensor Programs V, Yang et al. 2022, Table 3 and the ``mup`` package's MuReadout / MuAdam): what
scales with the width, as plain functions of ``ModelConfig`` that the model's init and forward and the
optimizer's parameter groups read. Nothing here knows about distribution.

With ``width_mult = dim / mup_base_width``:

- hidden matrices (every Linear inside a block): init std ``init_std / sqrt(width_mult)``, Adam lr
  ``lr / width_mult`` (and AdamW weight decay ``* width_mult``, so lr * wd stays put, as MuAdam does);
- the embedding, norm gains and the output (readout) matrix: init and lr unchanged;
- the logits are multiplied by ``1 / width_mult`` (MuReadout's output multiplier);
- attention logits use ``1 / head_dim`` instead of ``1 / sqrt(head_dim)`` (scaled to agree at the base width).

At ``dim == mup_base_width`` every factor is 1: muP is the standard model there, so hyperparameters tuned on
the base width are the ones that transfer.
"""

from __future__ import annotations

import math

from scaletrain.model.config import ModelConfig, head_width


def is_mup(cfg: ModelConfig) -> bool:
    return cfg.parametrization == "mup"


def width_mult(cfg: ModelConfig) -> float:
    """dim / mup_base_width under muP, 1 otherwise."""
    return cfg.dim / cfg.mup_base_width if is_mup(cfg) else 1.0


def hidden_init_scale(cfg: ModelConfig) -> float:
    """Factor on the init std of hidden matrices: 1 / sqrt(width_mult) (their fan-in grows with the width)."""
    return 1.0 / math.sqrt(width_mult(cfg))


def output_multiplier(cfg: ModelConfig) -> float:
    """Factor on the logits: 1 / width_mult (the readout's fan-in grows with the width)."""
    return 1.0 / width_mult(cfg)


def attention_scale(cfg: ModelConfig) -> float | None:
    """SDPA's ``scale``: None (1/sqrt(head_dim)) in the standard parametrization (query_pre_attn_scalar**-0.5 when
    that is set); under muP
    sqrt(base_head_dim) / head_dim, which is 1/sqrt(head_dim) at the base width and 1/head_dim in shape."""
    if not is_mup(cfg):  # Gemma 3 scales by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5
        return cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
    head_dim = head_width(cfg)
    # the head width at dim = mup_base_width: with head_dim set, heads scale with the width like dim // n_heads
    base_head_dim = max(1, cfg.mup_base_width // cfg.n_heads if not cfg.head_dim
                        else cfg.head_dim * cfg.mup_base_width // cfg.dim)
    return math.sqrt(base_head_dim) / head_dim
