"""Pure functions of a model config's shape fields, one layer below ``model/config.py``: the family entries
(``model/family/``) use them, and ``model/config.py`` reads the family list, so they cannot live there without a
circle (``model/config.py`` re-exports them, where the rest of the code imports them from)."""

from __future__ import annotations

from typing import Protocol


class Shape(Protocol):
    """The fields of ``ModelConfig`` these functions read."""

    dim: int
    n_heads: int
    head_dim: int
    sliding_window: int
    sliding_layers: list[int]


def head_width(cfg: Shape) -> int:
    """The width of one attention head: ``head_dim``, or ``dim // n_heads`` when it is 0."""
    return cfg.head_dim or cfg.dim // cfg.n_heads


def is_sliding(cfg: Shape, layer: int) -> bool:
    """Whether block ``layer`` attends within ``cfg.sliding_window`` (Gemma 3's local layers)."""
    return cfg.sliding_window > 0 and (not cfg.sliding_layers or layer in cfg.sliding_layers)


class ExpertShape(Protocol):
    """The fields of ``ModelConfig`` that say which blocks are sparse."""

    moe_experts: int
    moe_every: int
    moe_first_dense: int
    moe_layers: list[int]


def is_moe_layer(cfg: ExpertShape, layer: int) -> bool:
    """Whether block ``layer``'s feed-forward is a mixture of experts: none without ``moe_experts``; else the
    layers of ``moe_layers`` when it is set, or every ``moe_every``-th layer (1-based: with 2, layers 1, 3, 5, ..
    as Qwen-MoE's ``decoder_sparse_step``) from ``moe_first_dense`` on (DeepSeek's ``first_k_dense_replace``)."""
    if cfg.moe_experts <= 0:
        return False
    if cfg.moe_layers:
        return layer in cfg.moe_layers
    return layer >= cfg.moe_first_dense and (layer + 1) % cfg.moe_every == 0
