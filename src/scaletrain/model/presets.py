"""Named model sizes, and parameter / FLOP counts computed from a ModelConfig alone.

The counts are closed-form so the planner can use them for a 70B model without building it; the tests
check them against ``sum(p.numel())`` of real modules.
"""

from __future__ import annotations

from scaletrain.model.config import ModelConfig, head_width, is_moe_layer
from scaletrain.model.family import presets as family_presets

# Each preset sets only what differs from ModelConfig's defaults. vocab_size 0 means "from the data".
PRESETS: dict[str, dict] = {
    # ~0.8M parameters: the nanoGPT "baby GPT" shape (4 x 128, 4 heads).
    "nano": dict(dim=128, n_layers=4, n_heads=4, ffn_hidden_dim=344, max_seq_len=256),
    # ~3.2M: a few minutes per thousand steps on a laptop CPU.
    "micro": dict(dim=256, n_layers=4, n_heads=4, ffn_hidden_dim=688, max_seq_len=512),
    # ~18M: the largest size that trains usefully on 2 CPU cores within an hour.
    "small": dict(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1408, max_seq_len=1024),
    # GPT-2 small class: 12 x 768, 12 heads, tied embeddings, 50304 vocab -> 123.6M parameters.
    "gpt2-124m": dict(dim=768, n_layers=12, n_heads=12, ffn_hidden_dim=2048, vocab_size=50304,
                      max_seq_len=1024, tie_embeddings=True),
    # Llama 3.2 1B shape.
    "llama-1b": dict(dim=2048, ffn_hidden_dim=0, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                     multiple_of=256,
                     vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    # Llama 3 8B shape.
    "llama-8b": dict(dim=4096, ffn_hidden_dim=0, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=1024,
                     vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    # Llama 3 70B shape.
    "llama-70b": dict(dim=8192, ffn_hidden_dim=0, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                      multiple_of=4096,
                      vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    # nano with a mixture of experts in every block: 8 experts of about a quarter the width, 2 a token, so its
    # active feed-forward (2 x 176) is about nano's (344) and it holds 4x its feed-forward weights (model/moe.py);
    # 176, not 172: a multiple of 8, so the experts run as grouped GEMMs in bf16 too.
    "nano-moe": dict(dim=128, n_layers=4, n_heads=4, ffn_hidden_dim=344, max_seq_len=256, moe_experts=8, moe_top_k=2,
                     moe_hidden_dim=176),
    # Published mixture-of-experts shapes, for `scaletrain plan` (their config.json; every block sparse). Our decoder
    # computes them as its own blocks, so each differs from the original where noted; the parameter counts match the
    # published totals and active counts within a few percent (tests/plan/test_plan_moe.py).
    # OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924): 64 experts top-8 of width 1024, no top-k renormalisation. OLMoE's
    # q/k norm spans the whole projection (2048 wide), ours each head's (128): 2 x 1792 fewer gains a block.
    "olmoe-1b-7b": dict(dim=2048, n_layers=16, n_heads=16, ffn_hidden_dim=1024, vocab_size=50304, max_seq_len=4096,
                        qk_norm=True, moe_experts=64, moe_top_k=8, moe_hidden_dim=1024, moe_renormalize=False),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B): 128 experts top-8 of width 768, 32 query / 4 key-value heads of 128,
    # per-head q/k norm, renormalised top-k: our decoder's own options, nothing left out.
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_hidden_dim=768,
                          vocab_size=151936, max_seq_len=32768, rope_theta=1e6, qk_norm=True, norm_eps=1e-6,
                          moe_experts=128, moe_top_k=8, moe_hidden_dim=768),
    # Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B): 94 layers of 128 experts top-8 of width 1536, 64 / 4 heads of 128; the
    # shape of Megatron-MoE-ModelZoo's published H100 rows (docs/planning.md).
    "qwen3-235b-a22b": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, ffn_hidden_dim=1536,
                            vocab_size=151936, max_seq_len=32768, rope_theta=1e6, qk_norm=True, norm_eps=1e-6,
                            moe_experts=128, moe_top_k=8, moe_hidden_dim=1536),
    # Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1): 8 experts top-2 of width 14336, 32 / 8 heads; softmax over the
    # chosen two is our renormalised top-k. Its 4096-position sliding window is not set (plan at <= 4096 positions).
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, vocab_size=32000,
                         max_seq_len=32768, rope_theta=1e6, moe_experts=8, moe_top_k=2, moe_hidden_dim=14336),
    # gpt-oss-20b (openai/gpt-oss-20b): 32 experts top-4 of width 2880, 64 query heads of 64, 8 key-value heads,
    # q/k/v biases, a 128-position window on every other layer (from the first). Not in our decoder: attention
    # sinks, the output projection's and the experts' biases, its clamped SwiGLU (alpha 1.702), YaRN rotary, and
    # MXFP4 expert weights (here trained in bf16/fp32); together ~7M parameters of 20.9B.
    "gpt-oss-20b": dict(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, ffn_hidden_dim=2880,
                        vocab_size=201088, max_seq_len=4096, rope_theta=150000.0, qkv_bias=True,
                        sliding_window=128, sliding_layers=list(range(0, 24, 2)), moe_experts=32, moe_top_k=4,
                        moe_hidden_dim=2880),
    # The open families' published shapes (their config.json as model/families.py reads it), for `scaletrain plan`
    # before anything is downloaded: each family's entry lists its own (model/family/, ``presets``).
    **family_presets(),
}


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    """SwiGLU hidden size: explicit, or Llama's 8/3*dim*multiplier rounded up to multiple_of."""
    if cfg.ffn_hidden_dim:
        return cfg.ffn_hidden_dim
    hidden = int(2 * 4 * cfg.dim / 3)
    hidden = int(cfg.ffn_dim_multiplier * hidden)
    return cfg.multiple_of * ((hidden + cfg.multiple_of - 1) // cfg.multiple_of)


def expert_hidden_dim(cfg: ModelConfig) -> int:
    """One expert's SwiGLU hidden size: ``moe_hidden_dim``, or the dense feed-forward's."""
    return cfg.moe_hidden_dim or ffn_hidden_dim(cfg)


def sparse_layers(cfg: ModelConfig) -> int:
    """How many blocks have a mixture-of-experts feed-forward (0 for a dense model)."""
    return sum(is_moe_layer(cfg, layer) for layer in range(cfg.n_layers))


def moe_extra_params(cfg: ModelConfig, *, active: bool) -> int:
    """What one sparse block's feed-forward adds over the dense one it replaces (which ``block_params`` counts,
    3*d*h): the router d*E and 3*d*h_e an expert, for every expert, or with ``active`` the top-k a token runs,
    plus the shared experts every token runs."""
    d, h = cfg.dim, expert_hidden_dim(cfg)
    experts = cfg.moe_top_k if active else cfg.moe_experts
    return d * cfg.moe_experts + 3 * d * h * (experts + cfg.moe_shared_experts) - 3 * d * ffn_hidden_dim(cfg)


def routed_expert_params(cfg: ModelConfig) -> int:
    """Weights of every routed expert of the model (3 d h_e an expert, ``moe_experts`` a sparse block): what expert
    parallelism shards; 0 for a dense model."""
    return sparse_layers(cfg) * cfg.moe_experts * 3 * cfg.dim * expert_hidden_dim(cfg)


def active_params(cfg: ModelConfig, *, exclude_embedding: bool = False) -> int:
    """Parameters one token uses: ``num_params`` less the routed experts it does not run (all but its top-k in
    every sparse block); a dense model's total. ``exclude_embedding`` as ``num_params``'s."""
    unused = sparse_layers(cfg) * (cfg.moe_experts - cfg.moe_top_k) * 3 * cfg.dim * expert_hidden_dim(cfg)
    return num_params(cfg, exclude_embedding=exclude_embedding) - unused


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_heads or cfg.n_heads


def block_vector_params(cfg: ModelConfig) -> int:
    """Parameters of one block outside its matrices: the norm gains (two of d; two more with ``post_norms``; q and
    k's of head_dim with ``qk_norm``, of the whole projections with ``qk_norm_width`` projection) and the q/k/v
    biases (``qkv_bias``)."""
    hd = head_width(cfg)
    qk = (hd * (cfg.n_heads + kv_heads(cfg)) if cfg.qk_norm_width == "projection" else 2 * hd) if cfg.qk_norm else 0
    norms = (4 if cfg.post_norms else 2) * cfg.dim + qk
    return norms + ((cfg.n_heads + 2 * kv_heads(cfg)) * hd if cfg.qkv_bias else 0)


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one block: attention d*(H*hd + 2*kv*hd) + H*hd*d, the gated feed-forward 3*d*h, and
    ``block_vector_params``."""
    d, hd = cfg.dim, head_width(cfg)
    attn = d * (cfg.n_heads * hd + 2 * kv_heads(cfg) * hd) + cfg.n_heads * hd * d
    return attn + 3 * d * ffn_hidden_dim(cfg) + block_vector_params(cfg)


def num_params(cfg: ModelConfig, *, exclude_embedding: bool = False) -> int:
    """Parameter count.

    per block ``block_params``; plus embedding V*d, final norm d, output V*d (unless tied).
    ``exclude_embedding`` drops the input embedding table (the lookup costs no FLOPs), following Kaplan et al.
    """
    d, v = cfg.dim, cfg.vocab_size
    total = cfg.n_layers * block_params(cfg) + d + v * d + (0 if cfg.tie_embeddings else v * d)
    if cfg.moe_experts:  # every expert's weights (the total, not the active parameters)
        total += sparse_layers(cfg) * moe_extra_params(cfg, active=False)
    if exclude_embedding:  # the V x d table (shared with the head when tied)
        total -= v * d
    return total


def checkpoint_size(total_params: float, trainable_params: float, trainable_weights_only: bool) -> int:
    """Estimated bytes of one training checkpoint (``checkpoint/run_folder.py:checkpoint_bytes``, and the
    planner's, which has counts, not modules): fp32 weights (a fine-tune's trainable ones only: the base is
    referenced, not copied) + AdamW's two fp32 moments of the trainable ones."""
    saved_weights = trainable_params if trainable_weights_only else total_params
    return int(4 * (saved_weights + 2 * trainable_params))


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every Linear in the blocks plus the output head; of a
    mixture of experts the router and the experts a token runs (its top-k and the shared ones: the active
    parameters)."""
    d, v = cfg.dim, cfg.vocab_size
    hd = head_width(cfg)
    per_block = d * (cfg.n_heads * hd + 2 * kv_heads(cfg) * hd) + cfg.n_heads * hd * d + 3 * d * ffn_hidden_dim(cfg)
    total = cfg.n_layers * per_block + v * d
    if cfg.moe_experts:
        total += sparse_layers(cfg) * moe_extra_params(cfg, active=True)
    return total


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear projection of a block (LoRA's targets by name; together a block's matrices)."""
    d, h = cfg.dim, ffn_hidden_dim(cfg)
    q, kv = cfg.n_heads * head_width(cfg), kv_heads(cfg) * head_width(cfg)
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, h), "up": (d, h), "down": (h, d)}


def flops_per_token(cfg: ModelConfig, seq_len: int, frozen_matmul_params: float = 0.0,
                    adapter_params: float = 0.0) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): MFU's numerator, in ``train``, ``report``
    and ``plan`` alike (``train/metrics.py:mfu``).

    ``6 * N_matmul + 12 * n_layers * seq_len * dim`` where N_matmul counts the weights of every matmul
    (blocks + output head, not the embedding lookup or norms) and the second term is attention's
    QK^T and AV (2 matmuls x 2 FLOPs x seq_len x n_heads * head_dim per layer, times 3 for fwd+bwd). Following the
    PaLM / nanoGPT / torchtitan convention we do *not* halve the attention term for the causal mask,
    so our MFU is comparable with theirs. Activation recomputation is not counted (it is overhead,
    not useful work). A fine-tune's frozen weights (``frozen_matmul_params`` of N_matmul) compute no weight
    gradient, so they count 4 FLOPs a token (forward, input gradient), not 6; its adapters (LoRA's A and B,
    ``adapter_params``) are matmuls that train: 6 each (``finetune/flops.py``).
    """
    return (6.0 * (matmul_params(cfg) + adapter_params) - 2.0 * frozen_matmul_params
            + 12.0 * cfg.n_layers * seq_len * cfg.n_heads * head_width(cfg))
