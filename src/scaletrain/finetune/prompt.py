"""Prompt tuning (Lester et al., 2021) and prefix tuning (Li & Liang, 2021) as transforms of the pure model.

Both keep the base's parameter names, so base weights load and export as they are:

- prompt tuning swaps ``tok_embeddings`` for a ``PromptEmbedding`` (an ``nn.Embedding`` with a trainable
  ``prompt`` (P, dim) put in front of every sequence) and ``output`` for a ``SkipPromptLinear`` that drops
  those P positions again, so logits stay (B, T, V) and the loss and sampling do not change;
- prefix tuning swaps every block's ``attention`` for a ``PrefixAttention`` holding trainable keys and
  values (P, n_kv_heads * head_dim) that every position attends to.

Both place the real tokens at positions P..P+T-1, as peft does (its virtual tokens, or its key/value cache
of length P, take positions 0..P-1), so the logits equal peft's on the exported base for the same virtual
token weights, for every family: a prefix layer keeps its layer's own configuration (sliding window, rotary
base and scaling, no rotary at all, q/k norms), and the prefix sits at positions 0..P-1 for the sliding window
too (a query at position P + t sees a prefix entry j only while P + t - j < window, as transformers' mask does
with peft's cache). Gemma's scaled embedding scales the real tokens only: peft feeds the virtual tokens in as
``inputs_embeds``, which the model does not scale.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.model.cache import KVCache, LayerCache
from scaletrain.model.config import ModelConfig, has_local_rope, is_sliding
from scaletrain.model.decoder import Attention, rope_tables


class PromptEmbedding(nn.Embedding):
    """The token embedding with ``prompt`` (P, dim) trainable virtual tokens before every sequence.

    ``embed_scale`` (Gemma's sqrt(dim), else None): the real tokens' embeddings are scaled here, before the virtual
    tokens join them unscaled, as peft computes it; the model then leaves the result as it is (``scales_itself``)."""

    def __init__(self, num_embeddings: int, dim: int, virtual_tokens: int, device=None, dtype=None,
                 embed_scale: float | None = None):
        super().__init__(num_embeddings, dim, device=device, dtype=dtype)
        self.prompt = nn.Parameter(torch.empty(virtual_tokens, dim, device=device, dtype=dtype))
        self.embed_scale = embed_scale
        self.scales_itself = embed_scale is not None

    takes_cache = True  # the model passes its KV cache: the virtual tokens go in at the first forward only

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        h = super().forward(tokens)  # (B, T, d)
        if self.embed_scale is not None:  # rounded to the dtype first, as the model's own scaling
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype, device=h.device)
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
    """Attention (of block ``layer_id``: its window, rotary base and norms) whose keys and values start with P
    trainable entries (already rotated, as the key/value cache peft fills them into) at positions 0..P-1, visible
    to every position (within the layer's sliding window, if any); the real tokens stay causal."""

    def __init__(self, cfg: ModelConfig, layer_id: int, virtual_tokens: int):
        super().__init__(cfg, layer_id)
        self.virtual_tokens = virtual_tokens
        kv_dim = self.n_kv_heads * self.head_dim
        self.prefix_key = nn.Parameter(torch.empty(virtual_tokens, kv_dim))
        self.prefix_value = nn.Parameter(torch.empty(virtual_tokens, kv_dim))
        # The tables the model gives this layer (Transformer.__init__): a local layer's plain ones at its own base,
        # else the global ones with the config's rope scaling.
        local = has_local_rope(cfg) and is_sliding(cfg, layer_id)
        self.rope_theta = cfg.local_rope_theta if local else cfg.rope_theta
        self.rope_cfg = None if local else cfg
        self._tables: dict = {}  # (T, device) -> rotary tables for positions P..P+T-1 (derived, not state)

    def _rope(self, seqlen: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seqlen, device)
        if key not in self._tables:
            cos, sin = rope_tables(self.head_dim, self.virtual_tokens + seqlen, self.rope_theta, device=device,
                                   cfg=self.rope_cfg)
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
            if self.sliding_window:  # query P + t sees key j (prefix 0..P-1, tokens P..) while P + t - j < window
                visible = visible.triu(n_prefix - self.sliding_window + 1)
        else:
            k, v = cache.update(k, v)  # (B, KV, S, hd)
            mask = cache.owner.window_mask(self.sliding_window) if self.sliding_window else cache.mask  # (B, 1, T, S)
            prefix = mask.new_ones(*mask.shape[:3], n_prefix)  # (B, 1, T, P)
            if self.sliding_window:  # the query at position P + pos sees prefix entry j while P + pos - j < window
                j = torch.arange(n_prefix, device=x.device)
                prefix = n_prefix + cache.positions[:, None, :, None] - j < self.sliding_window
            visible = torch.cat([prefix, mask], dim=-1)  # (B, 1, T, P + S)
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
    scale = model.cfg.dim ** 0.5 if model.cfg.scale_embeddings else None
    new_emb = PromptEmbedding(emb.num_embeddings, emb.embedding_dim, virtual_tokens, device=emb.weight.device,
                              embed_scale=scale)
    new_emb.weight = emb.weight
    new_head = SkipPromptLinear(head.in_features, head.out_features, virtual_tokens, device=head.weight.device)
    new_head.weight = head.weight
    model.tok_embeddings, model.output = new_emb, new_head
    model.tie_weights()


def apply_prefix_tuning(model: nn.Module, virtual_tokens: int) -> None:
    """Swap every block's attention for a ``PrefixAttention`` of the same layer sharing all its modules
    (projections, q/k norms)."""
    for layer_id, block in model.layers.items():
        old = block.attention
        with torch.device(old.wq.weight.device):
            new = PrefixAttention(model.cfg, int(layer_id), virtual_tokens)
        for name, module in old.named_children():
            setattr(new, name, module)
        block.attention = new
