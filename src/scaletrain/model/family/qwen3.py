"""Qwen3: RMSNorm over each head's queries and keys (no q/k/v bias); Qwen2's sliding-window fields."""

from scaletrain.model.family.qwen2 import qwen_layer_pattern, qwen_write
from scaletrain.model.family.spec import Family, GGUFLayout, flagged_window

FAMILY = Family(
    model_type="qwen3", hf_class="Qwen3ForCausalLM",
    defaults=dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                  use_sliding_window=False, max_window_layers=28, head_dim=128, hidden_act="silu"),
    read=lambda f, n_layers: dict(qk_norm=True),
    write=lambda cfg, sliding: dict(attention_bias=False, **qwen_write(cfg, sliding)),
    window=flagged_window, layer_pattern=qwen_layer_pattern,
    gguf=GGUFLayout(arch="qwen3"),
    presets={
        # Qwen3-0.6B: 596M, q/k norms, head_dim 128 (16 x 128 = 2048 != dim 1024).
        "qwen3-0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_hidden_dim=3072,
                           vocab_size=151936, max_seq_len=40960, rope_theta=1_000_000.0, norm_eps=1e-6,
                           tie_embeddings=True, qk_norm=True),
    },
)
