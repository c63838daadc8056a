"""Mistral (v0.1 slides every layer over a window; v0.3 has none): Llama's layout and llama.cpp's llama arch."""

from scaletrain.model.family.spec import Family, GGUFLayout

FAMILY = Family(
    model_type="mistral", hf_class="MistralForCausalLM",
    defaults=dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                  max_position_embeddings=131072, hidden_act="silu"),
    write=lambda cfg, sliding: dict(sliding_window=cfg.sliding_window or None),
    gguf=GGUFLayout(arch="llama", interleave_rotary=True),
    presets={
        # Mistral 7B v0.3: 7.25B, no sliding window.
        "mistral-7b-v0.3": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336,
                                vocab_size=32768, max_seq_len=32768, rope_theta=1_000_000.0),
    },
)
