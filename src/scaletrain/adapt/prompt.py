"""Prompt tuning (Lester et al., 2021) and prefix tuning (Li & Liang, 2021) as transforms of the pure model.

Both keep the base's parameter names, so base weights load and export as they are:

- prompt tuning swaps ``tok_embeddings`` for a ``PromptEmbedding`` (an ``nn.Embedding`` with a trainable
  ``prompt`` (P, dim) put in front of every sequence) and ``output`` for a ``SkipPromptLinear`` that drops
  those P positions again, so logits stay (B, T, V) and the loss and sampling do not change;
- prefix tuning swaps every block's ``attention`` for a ``PrefixAttention`` holding trainable keys and
  values (P, n_kv_heads * head_dim) that every position attends to.

Both place the real tokens at positions P..P+T-1, as peft does (its virtual tokens, or its key/value cache
of length P, take positions 0..P-1), so the logits equal peft's on the exported base for the same virtual
token weights.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.model.cache import KVCache, LayerCache
from scaletrain.model.llama import Attention, rope_tables


class PromptEmbedding(nn.Embedding):
    """The token embedding with ``prompt`` (P, dim) trainable virtual tokens before every sequence."""

    def __init__(self, num_embeddings: int, dim: int, virtual_tokens: int, device=None, dtype=None):
        super().__init__(num_embeddings, dim, device=device, dtype=dtype)
        self.prompt = nn.Parameter(torch.empty(virtual_tokens, dim, device=device, dtype=dtype))

    takes_cache = True  # the model passes its KV cache: the virtual tokens go in at the first forward only

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        h = super().forward(tokens)  # (B, T, d)
        if cache is not None and cache.length > 0:  # decoding: the virtual tokens are cached already
            return h
        return torch.cat([self.prompt.to(h.dtype).expand(h.shape[0], -1, -1), h], dim=1)  # (B, P + T, d)


class SkipPromptLinear(nn.Linear):
    """The output head applied to the real positions only: hidden (B, P + T, d) -> logits (B, T, V)."""

    def __init__(self, in_features: int, out_features: int, virtual_tokens: int, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.virtual_tokens = virtual_tokens

    takes_cache = True

    def forward(self, h: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None and cache.length > 0:  # decoding: no virtual positions in this forward
            return super().forward(h)
        return super().forward(h[:, self.virtual_tokens:])


class PrefixAttention(Attention):
    """Attention whose keys and values start with P trainable entries per layer (already rotated, as the
    key/value cache peft fills them into), visible to every position; the real tokens stay causal."""

    def __init__(self, cfg, virtual_tokens: int):
        super().__init__(cfg)
        self.virtual_tokens = virtual_tokens
        kv_dim = self.n_kv_heads * self.head_dim
        self.prefix_key = nn.Parameter(torch.empty(virtual_tokens, kv_dim))
        self.prefix_value = nn.Parameter(torch.empty(virtual_tokens, kv_dim))
        self.rope_theta = cfg.rope_theta
        self._tables: dict = {}  # (T, device) -> rotary tables for positions P..P+T-1 (derived, not state)

    def _rope(self, seqlen: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seqlen, device)
        if key not in self._tables:
            cos, sin = rope_tables(self.head_dim, self.virtual_tokens + seqlen, self.rope_theta, device=device)
            self._tables[key] = (cos[self.virtual_tokens:], sin[self.virtual_tokens:])
        return self._tables[key]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """The model's attention (``Attention.project``, ``Attention.attend``) with the prefix put in front of
        the keys and values and the tokens' rotary positions shifted by P. With a KV cache the prefix stays out
        of the cache (it is the same for every row and step) and is put in front of the cached keys and values
        at every step; the positions are the cache's, shifted by P."""
        if attn_mask is not None and cache is None:
            raise ValueError("prefix tuning does not take an attention mask (data.document_attention)")
        n_prefix, seqlen = self.virtual_tokens, x.shape[1]
        if cache is None:
            cos, sin = self._rope(seqlen, x.device)  # (T, hd) for positions P..P+T-1
        else:
            cos, sin = self._rope(cache.owner.capacity, x.device)  # (capacity, hd) for positions P..
            cos, sin = cos[cache.positions], sin[cache.positions]  # (B, T, hd)
        q, k, v = self.project(x, cos, sin)
        if cache is None:
            # (T, P + T): every prefix entry visible, causal among the real tokens. (SDPA's is_causal would
            # align the triangle top-left, hiding most of the prefix from the first positions.)
            visible = torch.ones(seqlen, n_prefix + seqlen, dtype=torch.bool, device=x.device).tril(n_prefix)
        else:
            k, v = cache.update(k, v)  # (B, KV, S, hd)
            mask = cache.mask  # (B, 1, T, S)
            visible = torch.cat([mask.new_ones(*mask.shape[:3], n_prefix), mask], dim=-1)  # (B, 1, T, P + S)
        return self.attend(q, *self._with_prefix(k, v), visible)

    def _with_prefix(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The learned prefix (P keys and values) in front of ``k``, ``v`` (B, KV, S, hd): (B, KV, P + S, hd)."""
        bsz = k.shape[0]
        pk = self.prefix_key.to(k.dtype).view(self.virtual_tokens, -1, self.head_dim).transpose(0, 1)  # (KV, P, hd)
        pv = self.prefix_value.to(v.dtype).view(self.virtual_tokens, -1, self.head_dim).transpose(0, 1)
        return torch.cat([pk.expand(bsz, -1, -1, -1), k], dim=2), torch.cat([pv.expand(bsz, -1, -1, -1), v], dim=2)


def apply_prompt_tuning(model: nn.Module, virtual_tokens: int) -> None:
    """Swap the embedding and head of ``model`` (a full ``Transformer``) for their prompt-tuning versions."""
    emb, head = model.tok_embeddings, model.output
    new_emb = PromptEmbedding(emb.num_embeddings, emb.embedding_dim, virtual_tokens, device=emb.weight.device)
    new_emb.weight = emb.weight
    new_head = SkipPromptLinear(head.in_features, head.out_features, virtual_tokens, device=head.weight.device)
    new_head.weight = head.weight
    model.tok_embeddings, model.output = new_emb, new_head
    model.tie_weights()


def apply_prefix_tuning(model: nn.Module, virtual_tokens: int) -> None:
    """Swap every block's attention for a ``PrefixAttention`` sharing its projection weights."""
    for block in model.layers.values():
        old = block.attention
        with torch.device(old.wq.weight.device):
            new = PrefixAttention(model.cfg, virtual_tokens)
        for name in ("wq", "wk", "wv", "wo"):
            setattr(new, name, getattr(old, name))
        block.attention = new
