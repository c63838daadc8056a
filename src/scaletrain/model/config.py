"""The model's own config: the one section the model reads (sizes, rotary base, init).

It lives with the model so the model imports nothing above it; ``scaletrain.config`` puts it in the job's
tree as the ``[model]`` section.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.core.options import opt
from scaletrain.model.family import NAMES as FAMILY_NAMES
from scaletrain.model.shape import head_width as head_width  # re-exported: the model's code imports it from here
from scaletrain.model.shape import is_moe_layer as is_moe_layer  # re-exported, as head_width
from scaletrain.model.shape import is_sliding

# The default training context (the job's data.seq_len) and the default rotary tables' length: equal, so a
# default model is never asked for positions it was not trained on.
DEFAULT_CONTEXT = 128


@dataclass
class ModelConfig:
    preset: str = opt("", "named size from scaletrain.model.presets (nano, micro, small, gpt2-124m, "
                          "llama-1b, llama-8b, llama-70b; nano-moe, nano with 8 experts top-2; the open families' "
                          "published shapes: qwen2.5-0.5b, "
                          "qwen3-0.6b, llama-3.2-1b, smollm2-135m, gemma-3-270m, gemma-3-1b, mistral-7b-v0.3); "
                          "model fields set in the same TOML or on the command "
                          "line override it, and a preset on the command line overrides the TOML's fields it sets")
    vocab_size: int = opt(0, "vocabulary size; 0 = the prepared data's tokenizer's, padded to a multiple of "
                             "parallel.tp, and of lcm(64, tp) when that adds at most 1% rows (50257 -> 50304, "
                             "65 stays 65); padding rows are masked out of the loss and sampling", ge=0)
    dim: int = opt(128, "model width (embedding / residual size)", ge=1)
    n_layers: int = opt(4, "number of transformer blocks", ge=1)
    n_heads: int = opt(4, "attention (query) heads; must divide dim unless head_dim is set", ge=1)
    n_kv_heads: int = opt(0, "key/value heads for grouped-query attention; 0 = n_heads (plain MHA)", ge=0)
    head_dim: int = opt(0, "width of each attention head; 0 = dim // n_heads (then n_heads must divide dim); "
                           "set apart from dim by head pruning (`scaletrain compress --head-fraction`)", ge=0)
    ffn_hidden_dim: int = opt(344, "SwiGLU hidden size; 0 = 8/3*dim*ffn_dim_multiplier rounded up to multiple_of", ge=0)
    ffn_dim_multiplier: float = opt(1.0, "scales the computed SwiGLU hidden size (Llama 3 8B uses 1.3)", gt=0)
    multiple_of: int = opt(64, "SwiGLU hidden size is rounded up to a multiple of this", ge=1)
    max_seq_len: int = opt(DEFAULT_CONTEXT, "longest sequence the rotary tables cover; data.seq_len must not "
                                            "exceed it (generation crops at data.seq_len, the trained context)",
                           ge=1)
    rope_theta: float = opt(10000.0, "rotary position embedding base", gt=0)
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", gt=0)
    tie_embeddings: bool = opt(False, "share the input embedding and the output projection")
    init_std: float = opt(0.02, "standard deviation of the normal weight init", gt=0)
    parametrization: str = opt("standard", "standard, or mup (Tensor Programs V: hidden matrices init std and "
                                           "Adam lr scaled by 1/width_mult, logits by 1/width_mult, attention "
                                           "by 1/head_dim; width_mult = dim / mup_base_width; docs/tuning.md)",
                               choices=("standard", "mup"))
    mup_base_width: int = opt(128, "mup: the width whose hyperparameters transfer (at dim = mup_base_width "
                                   "muP equals the standard parametrization)", ge=1)

    family: str = opt("llama", "the Hugging Face model family (config.json model_type) whose names and class an "
                               "import reads and an export writes: " + ", ".join(FAMILY_NAMES) +
                               " (one file each in model/family/)",
                      choices=FAMILY_NAMES)
    # The options below are what the open model families compute differently from Llama (model/families.py
    # maps each family's config.json onto them); the defaults are the Llama computation above, unchanged.
    qkv_bias: bool = opt(False, "bias on the q, k and v projections (Qwen2/2.5); the output projection has none")
    qk_norm: bool = opt(False, "RMSNorm over each head's queries and keys before the rotary embedding (Qwen3, "
                               "Gemma 3)")
    qk_norm_width: str = opt("head", "what qk_norm normalizes over: head (each head's head_dim: Qwen3, Gemma 3) or "
                                     "projection (all of a token's queries, and all its keys, at once: OLMoE, "
                                     "OLMo 2; not under tensor parallelism, which splits that width)",
                             choices=("head", "projection"))
    activation: str = opt("silu", "the gated feed-forward's activation: silu (SwiGLU) or gelu_tanh (GeGLU with "
                                  "the tanh approximation of GELU, Gemma)", choices=("silu", "gelu_tanh"))
    norm_plus_one: bool = opt(False, "RMSNorm gains stored as offsets from 1 and applied as (1 + w), the "
                                     "normalization computed in fp32 (Gemma)")
    scale_embeddings: bool = opt(False, "multiply the token embeddings by sqrt(dim), rounded to the model's "
                                        "dtype (Gemma)")
    post_norms: bool = opt(False, "also RMSNorm each sublayer's output before it is added to the residual "
                                  "(Gemma 3's post_attention_layernorm and post_feedforward_layernorm)")
    query_pre_attn_scalar: float = opt(0.0, "attention logits scaled by query_pre_attn_scalar**-0.5 instead of "
                                             "head_dim**-0.5; 0 = head_dim (Gemma 3 sets it)", ge=0)
    rope_scaling: str = opt("none", "rotary frequency scaling as Hugging Face computes it: none, linear "
                                    "(frequencies / rope_scaling_factor), llama3 (Llama 3.1/3.2's smoothed "
                                    "low-frequency scaling), dynamic (NTK: plain rotary within "
                                    "rope_original_max_seq_len, which max_seq_len must not exceed), yarn (YaRN: "
                                    "frequencies blended between interpolated and kept over a ramp set by "
                                    "rope_yarn_beta_fast/slow, cos/sin scaled by rope_attention_factor)",
                            choices=("none", "linear", "llama3", "dynamic", "yarn"))
    rope_scaling_factor: float = opt(1.0, "rope_scaling's factor", gt=0)
    rope_low_freq_factor: float = opt(1.0, "llama3 rope scaling: low_freq_factor", gt=0)
    rope_high_freq_factor: float = opt(4.0, "llama3 rope scaling: high_freq_factor", gt=0)
    rope_original_max_seq_len: int = opt(0, "llama3 / dynamic / yarn rope scaling: the pretraining context "
                                            "(original_max_position_embeddings)", ge=0)
    rope_yarn_beta_fast: float = opt(32.0, "yarn rope scaling: beta_fast, the rotations below which a frequency is "
                                           "interpolated fully", gt=0)
    rope_yarn_beta_slow: float = opt(1.0, "yarn rope scaling: beta_slow, the rotations above which a frequency is "
                                          "kept", gt=0)
    rope_yarn_truncate: bool = opt(True, "yarn rope scaling: round the ramp's ends to whole dimensions (truncate)")
    rope_attention_factor: float = opt(0.0, "yarn rope scaling: the factor cos and sin are multiplied by "
                                            "(attention_factor); 0 = 0.1 ln(rope_scaling_factor) + 1, the paper's",
                                       ge=0)
    sliding_window: int = opt(0, "layers in sliding_layers attend only to the last sliding_window positions "
                                 "(themselves included); 0 = every layer sees the whole context (Gemma 3's "
                                 "local layers, Mistral v0.1, Phi-3)", ge=0)
    sliding_layers: list[int] = opt([], "the layers (0-based) that use sliding_window; [] = all of them when "
                                        "sliding_window > 0")
    local_rope_theta: float = opt(0.0, "rotary base of the sliding_layers, which then get plain (unscaled) rotary "
                                       "embeddings; 0 = the same tables as every layer (Gemma 3: 10000)", ge=0)
    no_rope_layers: list[int] = opt([], "the layers (0-based) with no rotary embedding at all (SmolLM3's NoPE "
                                        "layers)")

    # Mixture of Experts (model/moe.py): with moe_experts > 0 the sparse layers' feed-forward is a router over
    # moe_experts SwiGLU experts of which each token takes moe_top_k (plus the shared experts every token takes).
    # The default, 0, is the dense decoder above, unchanged; the other moe_ options are read only with experts.
    moe_experts: int = opt(0, "routed experts of each sparse layer's feed-forward; 0 = a dense model (every "
                              "moe_ option below is then unused)", ge=0)
    moe_top_k: int = opt(2, "experts each token is routed to, 1..moe_experts", ge=0)
    moe_shared_experts: int = opt(0, "shared experts every token passes through besides its routed ones (DeepSeek, "
                                     "Qwen2-MoE), computed as one SwiGLU moe_shared_experts times the expert width",
                                  ge=0)
    moe_hidden_dim: int = opt(0, "each expert's SwiGLU hidden size; 0 = the dense ffn's (ffn_hidden_dim's rule); "
                                 "a multiple of 4 (8 for 16-bit weights) lets the experts run as grouped GEMMs",
                              ge=0)
    moe_every: int = opt(1, "every moe_every-th layer is sparse, counting from 1 (2: layers 1, 3, 5, ..; "
                            "Qwen-MoE's decoder_sparse_step), the first moe_first_dense left dense", ge=1)
    moe_first_dense: int = opt(0, "the first moe_first_dense layers stay dense (DeepSeek's first_k_dense_replace)",
                               ge=0)
    moe_layers: list[int] = opt([], "the sparse layers (0-based), listed; [] = moe_every and moe_first_dense "
                                    "decide")
    moe_score: str = opt("softmax", "the router's scores: softmax over the experts (Mixtral, Qwen-MoE, OLMoE) or "
                                    "each expert's sigmoid (DeepSeek-V3)", choices=("softmax", "sigmoid"))
    moe_renormalize: bool = opt(True, "a token's top-k scores divided by their sum, so its expert weights add up to "
                                      "1 (times moe_route_scale)")
    moe_route_scale: float = opt(1.0, "the routed experts' weights multiplied by this (DeepSeek-V3: 2.5)", gt=0)
    moe_capacity_factor: float = opt(0.0, "0 = no capacity: no token is dropped; else each expert takes at most "
                                          "ceil(moe_capacity_factor * tokens * moe_top_k / moe_experts) tokens of a "
                                          "batch, in token order, and the rest of that expert's tokens are dropped "
                                          "(they pass by the residual and the shared experts; counted in the "
                                          "metrics as moe_dropped_tokens)", ge=0)
    moe_balance_coef: float = opt(0.01, "coefficient of the Switch/GShard load-balancing loss, E * sum_e f_e * "
                                        "P_e (fraction of the assignments to expert e times its mean router "
                                        "probability: 1 when balanced); 0 = off", ge=0)
    moe_z_loss_coef: float = opt(0.0, "coefficient of the router z-loss (ST-MoE), the mean squared logsumexp of "
                                       "the router logits; 0 = off (ST-MoE used 0.001)", ge=0)
    moe_bias_rate: float = opt(0.0, "the auxiliary-loss-free balancing of DeepSeek-V3: after each optimizer step "
                                     "each expert's selection bias moves by this rate towards balance (up when "
                                     "the expert took fewer tokens than the mean, down when more); the bias "
                                     "picks the experts, never weighs them; 0 = off (DeepSeek-V3: 0.001)", ge=0)


def has_local_rope(cfg: ModelConfig) -> bool:
    """Whether the sliding layers have rotary tables of their own (``local_rope_theta``)."""
    return cfg.local_rope_theta > 0 and any(is_sliding(cfg, i) for i in range(cfg.n_layers))
