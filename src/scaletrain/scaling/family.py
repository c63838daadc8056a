"""Which family a scaling fit speaks for: the dense decoder, or a mixture of experts of one fixed sparsity.

A law L(N, D) is a property of one family of models: a mixture of experts buys a lower loss per FLOP than the
dense model of the same active size (Fedus et al. 2021; Clark et al. 2022 fit it as a family of its own), so a
fit of the dense grid says nothing about an MoE run, and the other way round. ``scale --moe 8x2`` trains the
grid's shapes with every feed-forward replaced by 8 routed experts of which each token runs 2, and writes the
fit beside the dense one (``scaling_fit.moe8x2.json``); ``plan --data --target-bpb`` then prices both.

The MoE member of a dense shape keeps its active compute: each expert's width is the dense feed-forward's divided
by top-k (rounded up to 16, as ``nano-moe``'s 176 of nano's 344), so a token runs about the dense model's
feed-forward FLOPs and holds E / top-k times its feed-forward weights. N of an MoE law is its *active*
non-embedding parameters (``fit.law_params``), so 6 N D is the compute of either family and the two laws compare
at equal FLOPs; what an MoE FLOP costs in time (the router, the grouped GEMM at few rows an expert, the
balancing) is the planner's, not the law's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from scaletrain.core.options import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.presets import ffn_hidden_dim

DENSE = "dense"
_WIDTH_STEP = 16  # an expert's width is a multiple of this (the grid's multiple_of)


@dataclass(frozen=True)
class MoEShape:
    """``experts`` routed experts a sparse layer, each token to ``top_k`` of them; every layer sparse."""

    experts: int
    top_k: int

    @classmethod
    def parse(cls, text: str) -> MoEShape | None:
        """'8x2' -> 8 experts, top-2; '' or 'dense' -> None (the dense family); ConfigError otherwise."""
        if not text or text == DENSE:
            return None
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
        if not m or not 1 <= int(m.group(2)) <= int(m.group(1)) or int(m.group(1)) < 2:
            raise ConfigError(f"--moe must be EXPERTSxTOPK with at least 2 experts and 1 <= TOPK <= EXPERTS, like "
                              f"8x2 (got {text!r})")
        return cls(int(m.group(1)), int(m.group(2)))

    @property
    def spec(self) -> str:
        """'8x2': what ``--moe`` takes and a grid run records."""
        return f"{self.experts}x{self.top_k}"

    @property
    def key(self) -> str:
        return f"moe{self.spec}"

    def expert_width(self, cfg: ModelConfig) -> int:
        """The dense feed-forward width of ``cfg`` over top-k, rounded up to a multiple of 16."""
        return _WIDTH_STEP * math.ceil(ffn_hidden_dim(cfg) / self.top_k / _WIDTH_STEP)

    def apply(self, cfg: ModelConfig) -> ModelConfig:
        """The MoE member of the dense shape ``cfg`` (every layer sparse, the router's defaults)."""
        return replace(cfg, moe_experts=self.experts, moe_top_k=self.top_k, moe_hidden_dim=self.expert_width(cfg))

    def overrides(self, cfg: ModelConfig) -> dict[str, str]:
        """The dotted ``model.moe_*`` overrides of ``apply`` (a grid run is trained from overrides)."""
        return {"model.moe_experts": str(self.experts), "model.moe_top_k": str(self.top_k),
                "model.moe_hidden_dim": str(self.expert_width(cfg))}

    def describe(self) -> str:
        return f"{self.experts} experts, top-{self.top_k}"


def shape_of(key: str) -> MoEShape | None:
    """The shape of a family key ('dense' -> None, 'moe8x2' -> MoEShape(8, 2))."""
    return None if key == DENSE else MoEShape.parse(key.removeprefix("moe"))


def family_key(cfg: ModelConfig) -> str:
    """The fit a model's prediction is read from: 'dense', or 'moe{experts}x{top_k}'."""
    return MoEShape(cfg.moe_experts, cfg.moe_top_k).key if cfg.moe_experts else DENSE


def family_name(key: str) -> str:
    """'dense' or 'MoE 8x2' (for tables and lines)."""
    shape = shape_of(key)
    return DENSE if shape is None else f"MoE {shape.spec}"
