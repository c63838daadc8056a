"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention via SDPA.

The open families people fine-tune (Qwen2/3, Mistral, Gemma 3, Phi-3, SmolLM) are this decoder with a few
options of ``ModelConfig`` (q/k/v bias, q/k norms, GeGLU, (1 + w) norms, scaled embeddings, post-sublayer norms,
rotary scaling, sliding-window layers with their own rotary base, layers without rotary); each option's default
is the Llama computation, unchanged. ``model/families.py`` maps a family's config.json onto them.

Pure PyTorch: nothing here knows about distribution. Blocks live in a ``ModuleDict`` keyed "0".."L-1" so
pipeline splitting can delete blocks and keep parameter names stable; the embedding, final norm and
output head may be set to ``None`` on a pipeline stage that does not own them.

Build on the meta device, then materialize and call ``init_weights()`` once (see ``build_model``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.core.options import ConfigError
from scaletrain.model.cache import KVCache, LayerCache
from scaletrain.model.config import ModelConfig, has_local_rope, head_width, is_moe_layer, is_sliding
from scaletrain.model.feed_forward import FeedForward
from scaletrain.model.loss import chunked_cross_entropy
from scaletrain.model.moe import GroupedExperts, MoEFeedForward, check_moe
from scaletrain.model.mup import attention_scale, hidden_init_scale, output_multiplier
from scaletrain.model.presets import ffn_hidden_dim, kv_heads


def scale_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The rotary inverse frequencies (hd/2,) under ``cfg.rope_scaling``, computed as Hugging Face's
    ``modeling_rope_utils`` does (so the tables agree to the last bit)."""
    factor = cfg.rope_scaling_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling == "yarn":
        return _yarn_frequencies(inv_freq, cfg)
    if cfg.rope_scaling != "llama3":  # none; dynamic is plain rotary within its original context
        return inv_freq
    # Llama 3.1: wavelengths above the original context / low_freq_factor are stretched by factor, those below
    # it / high_freq_factor kept, the band between interpolated.
    old_context = cfg.rope_original_max_seq_len
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023, transformers' ``_compute_yarn_parameters``): the dimensions that turn fewer than
    beta_slow times over the original context are interpolated (frequency / factor), those that turn more than
    beta_fast times are kept, with a linear ramp over the dimensions between."""
    dim, base, context = 2 * inv_freq.numel(), cfg.rope_theta, cfg.rope_original_max_seq_len

    def dimension(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(cfg.rope_yarn_beta_fast), dimension(cfg.rope_yarn_beta_slow)
    if cfg.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # (hd/2,): 1 where the frequency is kept (extrapolated), 0 where interpolated
    return inv_freq / cfg.rope_scaling_factor * (1 - kept) + inv_freq * kept


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other scaling): ``rope_attention_factor``, or the
    paper's 0.1 ln(factor) + 1 when it is 0."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 1.0 if cfg.rope_scaling_factor <= 1 else 0.1 * math.log(cfg.rope_scaling_factor) + 1.0


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None,
                cfg: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, each (max_seq_len, head_dim), in the rotate-half layout Hugging Face Llama uses,
    except that the first half of ``sin`` is negated: the sign of rotate-half folded into the table, so
    ``apply_rope`` needs no negation (see there). ``cfg``: its ``rope_scaling`` applied (none without)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if cfg is not None and cfg.rope_scaling != "none":
        inv_freq = scale_frequencies(inv_freq, cfg)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # (T, hd)
    scale = rope_attention_factor(cfg) if cfg is not None else 1.0
    if scale != 1.0:  # YaRN's attention factor, on the tables as transformers applies it
        return emb.cos() * scale, signed_sin * scale
    return emb.cos(), signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + hd/2) of x: (B, T, n_heads, hd) by the angles of each position; cos, sin:
    (T, hd) from ``rope_tables``.

    Hugging Face computes ``x * cos + cat(-x2, x1) * sin``; with the sign folded into ``sin`` the
    rotation is a swap of halves, ``roll(x, hd/2)`` - one op instead of slice, neg and cat, and a roll
    again in the backward instead of zero-filled slice gradients - and the result is bitwise the same
    ((-x2) * s == x2 * (-s)). x is taken in the layout the projection writes (heads not yet transposed
    before T), where each position's rows are contiguous; the products are updated in place (autograd
    saves only the tables), so two buffers are written instead of four.
    """
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, hd): broadcast over heads
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    # Not in place when x is of lower precision than the tables (bf16 autocast): it would round there.
    rolled = rolled.mul_(sin) if rolled.dtype == sin.dtype else rolled * sin
    return (x * cos).add_(rolled).to(x.dtype)


# torch 2.11's dynamo gives an autograd.Function whose forward returns a tensor it modified in place
# (``(x * r).mul_(w)``) zero gradients under torch.compile, any backend: tracing the forward records the
# tensor before the in-place op as an extra output, and as it is the same tensor autograd routes the
# incoming gradient to that slot instead of the real output (pytorch/pytorch#180642, fixed by #180921, which
# was put forward for 2.12: not checked here, 2.13 is right). Before 2.13, when dynamo traces it, the forward
# returns a fresh product instead (in eager mode it stays in place).
_FUNCTION_MAY_RETURN_INPLACE = torch.__version__ >= "2.13"


class _RMSNormFunction(torch.autograd.Function):
    """y = x * r * w with r = rsqrt(mean(x^2) + eps), differentiated by hand.

    On the CPU torch 2.13 has no fused RMSNorm backward: autograd differentiates the decomposition
    (pow, mean, add, rsqrt, mul, ... about 20 ops a norm, a tenth of this model's step). LayerNorm's
    fused backward kernel, given mean 0 and RMSNorm's r, computes everything but one term:
        LayerNorm: dx = r * (g*w - mean(g*w) - n * mean(g*w*n)),   n = (x - mean) * r
        RMSNorm:   dx = r * (g*w            - n * mean(g*w*n)),   n = x * r
    so dx = LayerNorm's dx + r * mean(g*w), and mean(g*w) is one matrix-vector product. The weight
    gradient sum(g * n) is LayerNorm's as is.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # One pass for sum(x^2), then (..., 1)-sized ops, then two products. Measured faster in this
        # model than the fused rms_norm kernel (aten._fused_rms_norm, which would also return r).
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        inplace = _FUNCTION_MAY_RETURN_INPLACE or not torch.compiler.is_compiling()
        out = (x * rstd).mul_(weight) if inplace else x * rstd * weight  # (..., d)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        dim = x.shape[-1]
        grad_x, grad_weight, _ = torch.ops.aten.native_layer_norm_backward.default(
            grad_out, x, [dim], torch.zeros_like(rstd), rstd, weight, None, [True, True, False])
        mean_gw = torch.mv(grad_out.reshape(-1, dim), weight).view_as(rstd).div_(dim)  # (..., 1) = mean(g * w)
        return grad_x.add_(mean_gw.mul_(rstd)), grad_weight, None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameter, state dict and forward) with a faster backward on the CPU.

    The hand-written backward is used for plain fp32/fp64 CPU tensors; elsewhere it is ``nn.RMSNorm``
    unchanged: CUDA has its own fused backward, and DTensors (tensor parallelism) need torch's sharding
    rules.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and x.device.type == "cpu" and self.weight is not None
                and self.eps is not None and type(x) is torch.Tensor
                and type(self.weight) in (torch.Tensor, nn.Parameter) and x.dtype == self.weight.dtype):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return super().forward(x)


class OffsetRMSNorm(nn.RMSNorm):
    """Gemma's RMSNorm: the gain is stored as an offset from 1 and applied as ``(1 + w)``, normalization and gain
    computed in fp32 and the product rounded once to the input's dtype (``Gemma3RMSNorm``). Initialised to 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def make_norm(dim: int, cfg: ModelConfig) -> nn.RMSNorm:
    """The model's RMSNorm over ``dim`` features: (1 + w) with ``norm_plus_one`` (Gemma), plain otherwise."""
    return OffsetRMSNorm(dim, eps=cfg.norm_eps) if cfg.norm_plus_one else RMSNorm(dim, eps=cfg.norm_eps)


def window_mask(seqlen: int, window: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool: causal, and each position sees only the last ``window`` positions (itself included), as
    Hugging Face's ``sliding_window_overlay`` (kv > q - window)."""
    positions = torch.arange(seqlen, device=device)
    distance = positions[:, None] - positions[None, :]  # (T, T): query - key
    return (distance >= 0) & (distance < window)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = kv_heads(cfg)
        self.head_dim = head_width(cfg)
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        # Qwen3 / Gemma 3: each head's queries and keys normalized (over head_dim) before the rotation; OLMoE: all
        # of a token's queries (H * hd) and all its keys (KV * hd) at once (qk_norm_width = projection).
        self.norm_projection = cfg.qk_norm_width == "projection"
        q_width, k_width = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim) if self.norm_projection \
            else (self.head_dim, self.head_dim)
        self.q_norm = make_norm(q_width, cfg) if cfg.qk_norm else None
        self.k_norm = make_norm(k_width, cfg) if cfg.qk_norm else None
        self.scale = attention_scale(cfg)  # None = SDPA's 1/sqrt(head_dim); muP: ~1/head_dim (model/mup.py)
        self.sliding_window = cfg.sliding_window if is_sliding(cfg, layer_id) else 0  # 0 = the whole context
        self.use_rope = layer_id not in cfg.no_rope_layers  # SmolLM3's NoPE layers have no rotary embedding

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None, cache: LayerCache | None = None,
                spans: Spans | None = None) -> torch.Tensor:
        """x (B, T, d); cos, sin (T, hd), or (B, T, hd) per row with a cache. With ``cache`` the new keys and
        values are stored and the T queries attend over every cached slot (S of them) under ``attn_mask``
        (B, 1, T, S), the cache's mask. ``spans`` (``document_spans`` of a block-causal ``attn_mask``): each
        packed document attends causally to itself alone, computed a document at a time."""
        q, k, v = self.project(x, cos, sin)
        seqlen = x.shape[1]
        if spans is not None and cache is None:
            return self.attend_documents(q, k, v, spans)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, KV, S, hd): the cached slots and these
            if self.sliding_window:
                attn_mask = cache.owner.window_mask(self.sliding_window)  # (B, 1, T, S)
        elif self.sliding_window and seqlen > self.sliding_window:  # a shorter sequence: the window is all of it
            attn_mask = self.windowed(attn_mask, seqlen, x.device)
        return self.attend(q, k, v, attn_mask)

    def windowed(self, attn_mask: torch.Tensor | None, seqlen: int, device: torch.device) -> torch.Tensor:
        """``attn_mask`` (or causal) confined to this layer's sliding window, over T = ``seqlen`` queries and keys."""
        window = window_mask(seqlen, self.sliding_window, device)  # (T, T)
        return window if attn_mask is None else attn_mask & window

    # project and attend are the two halves of forward, apart so that a variant that changes only the keys,
    # values and mask between them (prefix tuning, finetune/prompt.py) reuses the rest, the muP scale included.
    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (B, H, T, hd) and k, v (B, KV, T, hd) of ``x`` (B, T, d): projected, q/k-normed (``qk_norm``) and
        rotated (unless this layer has no rotary embedding)."""
        bsz, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q, k = self.wq(x), self.wk(x)  # (B, T, H*hd), (B, T, KV*hd)
        if self.q_norm is not None and self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(bsz, seqlen, -1, self.head_dim)  # (B, T, H, hd)
        k = k.view(bsz, seqlen, -1, self.head_dim)  # (B, T, KV, hd)
        if self.q_norm is not None and not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        return q.transpose(1, 2), k.transpose(1, 2), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, T, hd) over k, v (B, KV, S, hd): causal without ``attn_mask``, else under it (broadcast to
        (B, H, T, S), True = visible); then the output projection, (B, T, d)."""
        bsz, _, seqlen, _ = q.shape
        k, v = self.repeat_kv(q, k, v)
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # e.g. causal *and* confined to each packed document
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)  # (B, T, H*hd)
        return self.wo(out)

    @staticmethod
    def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # grouped-query attention: each KV head serves n_rep query heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        return k, v

    def attend_documents(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans) -> torch.Tensor:
        """``attend`` under a block-causal mask, computed as one causal attention per packed document (the
        variable-length attention of FlashAttention's varlen kernels, as a loop): the same result, with
        SDPA's causal kernel on each document instead of its explicit-mask path over the whole T x T square,
        work that grows with the sum of the squared document lengths rather than with T^2 (on a CPU the
        masked path made a packed step about 1.3x slower a position than a padded one)."""
        bsz, _, seqlen, _ = q.shape
        k, v = self.repeat_kv(q, k, v)
        rows = []
        for b, row in enumerate(spans):
            parts = []
            for start, end in row:
                qs, ks, vs = (t[b:b + 1, :, start:end] for t in (q, k, v))
                if self.sliding_window and end - start > self.sliding_window:
                    window = window_mask(end - start, self.sliding_window, q.device)
                    parts.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=window, scale=self.scale))
                else:
                    parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale))
            rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
        out = torch.cat(rows) if len(rows) > 1 else rows[0]  # (B, H, T, hd)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.attention_norm = make_norm(cfg.dim, cfg)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = make_norm(cfg.dim, cfg)  # Gemma 3 calls it pre_feedforward_layernorm
        # A sparse layer's feed-forward is a mixture of experts (model/moe.py), called as the dense one is.
        self.feed_forward: nn.Module = MoEFeedForward(cfg) if is_moe_layer(cfg, layer_id) \
            else FeedForward(cfg.dim, ffn_hidden_dim(cfg), cfg.activation)
        # Gemma 3: each sublayer's output normalized before the residual add ("sandwich" norms).
        self.post_norms = cfg.post_norms
        if cfg.post_norms:
            self.attention_post_norm = make_norm(cfg.dim, cfg)
            self.ffn_post_norm = make_norm(cfg.dim, cfg)
        # The sliding-window layers' own rotary tables (Gemma 3's local layers): the model picks them by this.
        self.local_rope = has_local_rope(cfg) and is_sliding(cfg, layer_id)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None, cache: LayerCache | None = None,
                spans: Spans | None = None) -> torch.Tensor:
        # The cache and the spans are passed only when there are some: tensor parallelism's input plan for the
        # attention (parallel/tensor.py) lays out its four training inputs by position, and prefix tuning's
        # attention (finetune/prompt.py) takes no spans.
        if cache is None and spans is None:
            attended = self.attention(self.attention_norm(x), cos, sin, attn_mask)
        elif cache is None:
            attended = self.attention(self.attention_norm(x), cos, sin, attn_mask, spans=spans)
        else:
            attended = self.attention(self.attention_norm(x), cos, sin, attn_mask, cache)
        if self.post_norms:
            x = x + self.attention_post_norm(attended)
            return x + self.ffn_post_norm(self.feed_forward(self.ffn_norm(x)))
        x = x + attended
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (> 0) before building the model")
        check_rope(cfg)
        check_moe(cfg)
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = make_norm(cfg.dim, cfg)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.output_multiplier = output_multiplier(cfg)  # 1, or muP's 1/width_mult (model/mup.py)
        cos, sin = rope_tables(head_width(cfg), cfg.max_seq_len, cfg.rope_theta, cfg=cfg)
        # Not persistent: derived from the config, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if has_local_rope(cfg):  # Gemma 3's local layers: plain rotary with their own base
            cos, sin = rope_tables(head_width(cfg), cfg.max_seq_len, cfg.local_rope_theta)
            self.register_buffer("rope_cos_local", cos, persistent=False)
            self.register_buffer("rope_sin_local", sin, persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """The one place weights are initialised (after materializing from the meta device).

        Normal(0, init_std) everywhere; the residual-stream output projections (wo, w2) are scaled by
        1/sqrt(2 * n_layers) as in GPT-2 so the residual variance does not grow with depth. Under muP
        (model.parametrization = "mup") the block matrices' std is further scaled by 1/sqrt(width_mult).
        """
        self.init_buffers()
        for name, module in self.named_modules():
            self.init_module(name, module)
        self.tie_weights()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The rotary tables, derived from the config (after materializing from the meta device); all that a
        model whose every weight is then loaded (a fine-tune's base) needs besides."""
        cos, sin = rope_tables(head_width(self.cfg), self.cfg.max_seq_len, self.cfg.rope_theta,
                               device=self.rope_cos.device, cfg=self.cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if has_local_rope(self.cfg):
            cos, sin = rope_tables(head_width(self.cfg), self.cfg.max_seq_len, self.cfg.local_rope_theta,
                                   device=self.rope_cos.device)
            self.rope_cos_local.copy_(cos)
            self.rope_sin_local.copy_(sin)
        for module in self.modules():
            if isinstance(module, MoEFeedForward):  # the expert bias and load counts start at 0
                module.init_buffers()

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """``init_weights`` for one module's own parameters (``name`` as in ``named_modules``); called in
        ``named_modules`` order it draws the same random numbers, so a build that holds one module's weights at a
        time (DeepSpeed ZeRO-3's partitioned build) initialises exactly as ``init_weights``."""
        std = self.cfg.init_std
        hidden_std = std * hidden_init_scale(self.cfg)  # = std in the standard parametrization
        if isinstance(module, nn.Linear):
            is_residual_out = name.endswith(("attention.wo", "feed_forward.w2", "shared_experts.w2"))
            is_hidden = name.startswith("layers.")  # the readout (output) keeps init_std
            nn.init.normal_(module.weight, mean=0.0,
                            std=hidden_std / math.sqrt(2 * self.cfg.n_layers) if is_residual_out
                            else hidden_std if is_hidden else std)
            if module.bias is not None:  # q/k/v bias (Qwen2)
                nn.init.zeros_(module.bias)
        elif isinstance(module, GroupedExperts):  # stacked expert weights: w2 is a residual-stream output
            module.init_weights(hidden_std, hidden_std / math.sqrt(2 * self.cfg.n_layers))
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, OffsetRMSNorm):  # (1 + w): a gain of 1 is w = 0
            nn.init.zeros_(module.weight)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor, attn_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                padding: torch.Tensor | None = None, last_only: bool = False, hidden_only: bool = False,
                targets: torch.Tensor | None = None, vocab_limit: int | None = None, loss_rows: int | None = None
                ) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab). On a middle pipeline stage, hidden in / hidden out.
        ``hidden_only``: the final norm's output (B, T, d) without the head, for a caller that runs ``head``
        on part of the positions at a time (evaluation with a big vocabulary: ``train.loss.forward_loss``).

        With ``cache`` (generation, ``model/cache.py``): the tokens follow the cached ones; ``padding`` (B, T)
        bool marks left padding. Without (training, evaluation) nothing below the first ``if`` changes.
        ``last_only`` (generation): the logits of the last position only, (B, 1, vocab): the head runs on one
        position instead of all T (a long prompt's prefill would otherwise hold T x vocab logits).

        ``attn_mask`` (B, 1, T, T) bool, True = visible: a block-causal mask of packed documents (finetune.packing,
        data.document_attention); each position's rotary angle is then its index within its document
        (``document_positions``), as if each document were a sequence of its own.

        ``targets`` (B, T), -100 where no target: the mean next-token loss instead of the logits, computed by
        chunks of ``loss_rows`` positions (default ``model.loss.chunk_rows`` for the device) so the whole logits
        tensor never exists (``model/loss.py``); columns >= ``vocab_limit`` (a padded vocabulary) take no softmax
        mass. Inside the forward, so a sharded data-parallel wrapper (FSDP2) holds the head's weight gathered while
        it runs."""
        if cache is not None:
            return self._forward_cached(tokens, cache, padding, last_only)
        h = self.embed(tokens) if self.tok_embeddings is not None else tokens  # (B, T, d)
        seqlen = h.shape[1]
        positions = document_positions(attn_mask) if attn_mask is not None else slice(seqlen)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (T, hd), or (B, T, hd) per document
        extra = {"spans": spans} if (spans := document_spans(attn_mask)) is not None else {}
        if has_local_rope(self.cfg):
            local = self.rope_cos_local[positions], self.rope_sin_local[positions]
            for layer in self.layers.values():
                h = layer(h, *(local if layer.local_rope else (cos, sin)), attn_mask, **extra)
        else:
            for layer in self.layers.values():
                h = layer(h, cos, sin, attn_mask, **extra)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None or hidden_only:
            return h
        if targets is not None:
            return self.chunked_loss(h, targets, vocab_limit, loss_rows)
        return self._head(h, last_only)

    def chunked_loss(self, h: torch.Tensor, targets: torch.Tensor, vocab_limit: int | None = None,
                     rows: int | None = None) -> torch.Tensor:
        """The mean next-token loss of the normed hidden states h (B, T', d) against targets (B, T) through the
        output head, by chunks of positions (``model/loss.py``). Prompt tuning's head reads the real positions
        only (its ``virtual_tokens`` come first), as its forward does."""
        h = h[:, getattr(self.output, "virtual_tokens", 0):]  # (B, T, d)
        return chunked_cross_entropy(h, self.output.weight, targets, multiplier=self.output_multiplier,
                                     vocab_limit=vocab_limit, rows=rows)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., d), the final norm's output -> logits (..., vocab): the output layer (and muP's multiplier)."""
        return self._head(h, False)

    def _head(self, h: torch.Tensor, last_only: bool, cache: KVCache | None = None) -> torch.Tensor:
        """The output head on the normed hidden states h (B, T, d): logits (B, T, vocab), or (B, 1, vocab) of the
        last position with ``last_only``, where the head then runs on that position alone - except prompt
        tuning's head (``takes_cache``), which drops the virtual positions itself, so it sees them all."""
        if last_only and not getattr(self.output, "takes_cache", False):
            h = h[:, -1:]
        logits = self.output(h) if cache is None else _call_with_cache(self.output, h, cache)  # (B, T, vocab)
        logits = logits[:, -1:] if last_only else logits
        return logits * self.output_multiplier if self.output_multiplier != 1.0 else logits

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> (B, T, d): the embedding, times sqrt(dim) with ``scale_embeddings`` (Gemma)."""
        return self._scale_embeddings(self.tok_embeddings(tokens))

    def _scale_embeddings(self, h: torch.Tensor) -> torch.Tensor:
        # Gemma: sqrt(dim) rounded to the model's dtype first (bf16 makes sqrt(3072) = 55.5), as transformers does.
        # Prompt tuning's embedding scales its real tokens itself (its virtual tokens are not: finetune/prompt.py).
        if not self.cfg.scale_embeddings or getattr(self.tok_embeddings, "scales_itself", False):
            return h
        return h * torch.tensor(self.cfg.dim ** 0.5, dtype=h.dtype, device=h.device)

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache, padding: torch.Tensor | None,
                        last_only: bool = False) -> torch.Tensor:
        """The forward of one generation step; a whole model (embedding and head) on one device."""
        h = _call_with_cache(self.tok_embeddings, tokens, cache)  # (B, T', d): T' > T with virtual tokens in front
        h = self._scale_embeddings(h)
        seqlen = h.shape[1]
        cache.begin(tokens.shape[1], seqlen, padding, h.device)
        cos, sin = self.rope_cos[cache.positions], self.rope_sin[cache.positions]  # (B, T', hd): per-row positions
        if has_local_rope(self.cfg):
            local = self.rope_cos_local[cache.positions], self.rope_sin_local[cache.positions]
        for name, layer in self.layers.items():
            tables = local if layer.local_rope else (cos, sin)
            h = layer(h, *tables, cache.mask, cache.layer(name))
        logits = self._head(self.norm(h), last_only, cache)
        cache.end(seqlen)
        return logits


# Each row's packed documents as [start, end) position ranges, in order and covering the row.
Spans = list[list[tuple[int, int]]]


def document_spans(attn_mask: torch.Tensor | None) -> Spans | None:
    """A block-causal ``attn_mask`` (B, 1, T, T) as its documents' spans: a document starts where a position
    does not see the one before it. For ``Attention.attend_documents``, on a CPU only: reading the spans is a
    host read each forward, which an accelerator's step avoids (it keeps SDPA's masked kernel); not under
    ``torch.compile`` either, which would specialise the graph on every batch's spans and recompile."""
    if attn_mask is None or attn_mask.device.type != "cpu" or attn_mask.dim() != 4 or attn_mask.shape[1] != 1 \
            or torch.compiler.is_compiling():
        return None
    seqlen = attn_mask.shape[-1]
    starts = ~attn_mask[:, 0].diagonal(-1, dim1=-2, dim2=-1)  # (B, T-1): position i+1 does not see i
    spans = []
    for row in starts.tolist():
        bounds = [0] + [i + 1 for i, new in enumerate(row) if new] + [seqlen]
        spans.append(list(zip(bounds[:-1], bounds[1:])))
    return spans


def document_positions(attn_mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) block-causal mask -> (B, T) int64: each query's position within its document, which is the
    number of keys it sees before itself (a causal mask confined to contiguous documents: the keys it sees are
    its document's first tokens up to itself)."""
    return attn_mask[:, 0].sum(-1) - 1


def check_rope(cfg: ModelConfig) -> None:
    """The rotary scalings' own requirements, one line each."""
    if cfg.rope_scaling in ("llama3", "yarn") and cfg.rope_original_max_seq_len <= 0:
        raise ConfigError(f"model.rope_scaling = {cfg.rope_scaling} needs model.rope_original_max_seq_len (the "
                          f"pretraining context, original_max_position_embeddings)")
    if cfg.rope_scaling == "dynamic" and cfg.max_seq_len > cfg.rope_original_max_seq_len:
        raise ConfigError(f"model.rope_scaling = dynamic is computed only within its original context "
                          f"(model.rope_original_max_seq_len = {cfg.rope_original_max_seq_len}); "
                          f"model.max_seq_len {cfg.max_seq_len} is longer: lower it")


def _call_with_cache(module: nn.Module, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """``module(x)``, given the cache when it asks for it (``takes_cache``): prompt tuning's embedding and head
    change the sequence length at the first forward only and need to know which one this is."""
    return module(x, cache=cache) if getattr(module, "takes_cache", False) else module(x)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Transformer:
    """Build on the meta device (no memory), materialize on ``device``, and initialise once.

    Converters and parallelism are applied between these steps by the caller when needed; this helper
    is the single-device path.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights()
    return model
