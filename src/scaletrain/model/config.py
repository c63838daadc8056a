"""The model's own config: the one section the model reads (sizes, rotary base, init).

It lives with the model so the model imports nothing above it; ``scaletrain.config`` puts it in the job's
tree as the ``[model]`` section.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.options import opt

# The default training context (the job's data.seq_len) and the default rotary tables' length: equal, so a
# default model is never asked for positions it was not trained on.
DEFAULT_CONTEXT = 128


@dataclass
class ModelConfig:
    preset: str = opt("", "named size from scaletrain.model.presets (nano, micro, small, gpt2-124m, "
                          "llama-1b, llama-8b, llama-70b); model fields set in the same TOML or on the command "
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


def head_width(cfg: ModelConfig) -> int:
    """The width of one attention head: ``head_dim``, or ``dim // n_heads`` when it is 0."""
    return cfg.head_dim or cfg.dim // cfg.n_heads
