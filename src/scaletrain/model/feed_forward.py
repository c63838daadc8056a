"""The dense gated feed-forward (SwiGLU / GeGLU): every block's, unless it is sparse, and a mixture of experts'
shared experts (``model/moe.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); with ``activation = "gelu_tanh"`` GeGLU (Gemma): GELU's tanh form for silu."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.gelu = activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
