"""Qwen2 / Qwen2.5: bias on q, k and v; an optional sliding window above max_window_layers."""

from scaletrain.model.family.spec import Family, Fields, GGUFLayout, flagged_window


def qwen_layer_pattern(f: Fields, n_layers: int) -> list[str]:
    """Layers from max_window_layers on slide (transformers' Qwen2/3 configs)."""
    first = int(f.get("max_window_layers"))
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]


def qwen_write(cfg, sliding: list[bool]) -> dict:
    first = sliding.index(True) if any(sliding) else cfg.n_layers
    return dict(use_sliding_window=cfg.sliding_window > 0, sliding_window=cfg.sliding_window or None,
                max_window_layers=first)


FAMILY = Family(
    model_type="qwen2", hf_class="Qwen2ForCausalLM",
    defaults=dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                  use_sliding_window=False, max_window_layers=28, hidden_act="silu"),
    read=lambda f, n_layers: dict(qkv_bias=True),
    write=qwen_write, window=flagged_window, layer_pattern=qwen_layer_pattern,
    gguf=GGUFLayout(arch="qwen2"),
    presets={
        # Qwen2.5-0.5B: 494M, q/k/v bias.
        "qwen2.5-0.5b": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_hidden_dim=4864,
                             vocab_size=151936, max_seq_len=32768, rope_theta=1_000_000.0, norm_eps=1e-6,
                             tie_embeddings=True, qkv_bias=True),
    },
)
