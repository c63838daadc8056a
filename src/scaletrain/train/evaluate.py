"""Evaluation: the loss of a model over token windows of any text, and perplexity."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ConfigError


@torch.no_grad()
def token_loss(model: nn.Module, tokens: torch.Tensor, seq_len: int, batch_size: int = 16,
               vocab_limit: int | None = None) -> tuple[float, int]:
    """Mean next-token loss over every full window of ``seq_len + 1`` tokens (stride seq_len).
    ``vocab_limit``: the tokenizer's vocabulary when the model's is padded; the padding columns are masked
    out as in training (``cross_entropy``). Returns (loss, tokens scored)."""
    n_windows = (tokens.numel() - 1) // seq_len
    if n_windows < 1:
        raise ConfigError(f"the text has {tokens.numel()} tokens, fewer than one window of {seq_len + 1}")
    total, count = 0.0, 0
    for first in range(0, n_windows, batch_size):
        idx = torch.arange(first, min(first + batch_size, n_windows)) * seq_len
        rows = torch.stack([tokens[i:i + seq_len + 1] for i in idx.tolist()])  # (b, T+1)
        logits = model(rows[:, :-1])
        if vocab_limit is not None and vocab_limit < logits.size(-1):
            logits = logits[..., :vocab_limit]  # the same loss as training's -inf mask on the padding columns
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum"))
        count += rows[:, 1:].numel()
    return total / count, count


def perplexity(loss: float) -> float:
    """exp(loss), infinite where it would overflow."""
    return math.exp(loss) if loss < 700 else math.inf
