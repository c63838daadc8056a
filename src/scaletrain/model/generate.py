"""Autoregressive sampling: temperature, top-k and nucleus (top-p)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, *, max_seq_len: int,
             temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, stop_id: int | None = None,
             vocab_limit: int | None = None) -> list[int]:
    """Sample up to ``max_new_tokens`` after ``prompt``; temperature 0 is greedy. The context is cropped
    to ``max_seq_len``: pass the context the model was trained on (``data.seq_len``), not the rotary tables'
    length, since positions beyond the trained ones produce gibberish. ``vocab_limit``: only ids below it
    are ever produced (the tokenizer's vocabulary when the model's is padded: padding rows have no token to
    decode). Returns only the new tokens."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    out: list[int] = []
    for _ in range(max_new_tokens):
        # (1, V), cut to the real vocabulary before greedy / top-k / top-p so padding never competes
        logits = model(ids[:, -max_seq_len:])[:, -1, :vocab_limit].float()
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1, None]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if top_p < 1.0:
                sorted_logits, order = torch.sort(logits, descending=True)
                cumulative = sorted_logits.softmax(-1).cumsum(-1)
                # Drop tokens once the mass before them already reaches top_p (always keep the first).
                drop = cumulative - sorted_logits.softmax(-1) >= top_p
                logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator).to(device)
        token = int(nxt)
        if stop_id is not None and token == stop_id:
            break
        out.append(token)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train(was_training)
    return out
