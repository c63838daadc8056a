"""Llama 1, 2, 3, 3.1, 3.2 and SmolLM2 (a llama): the decoder's own computation, no sliding window."""

from scaletrain.model.family.spec import Family, GGUFLayout

FAMILY = Family(
    model_type="llama", hf_class="LlamaForCausalLM",
    defaults=dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                  hidden_act="silu"),
    write=lambda cfg, sliding: dict(attention_bias=False, mlp_bias=False),
    window=lambda f: 0,  # LlamaConfig has no sliding window
    gguf=GGUFLayout(arch="llama", interleave_rotary=True),
    presets={
        # Llama 3.2 1B: 1.24B, rope scaling llama3.
        "llama-3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=8192,
                             vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, rope_scaling="llama3",
                             rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                             rope_original_max_seq_len=8192, tie_embeddings=True),
        # SmolLM2-135M: 135M, a Llama.
        "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_hidden_dim=1536, vocab_size=49152,
                             max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True,
                             init_std=0.041666666666666664),
    },
)
