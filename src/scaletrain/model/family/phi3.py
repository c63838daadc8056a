"""Phi-3: the Llama computation with q/k/v stored as one qkv_proj and gate/up as one gate_up_proj (rows stacked in
that order), split at import and joined at export."""

from scaletrain.model.family.spec import Family, GGUFLayout

FAMILY = Family(
    model_type="phi3", hf_class="Phi3ForCausalLM",
    defaults=dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                  hidden_act="silu"),
    write=lambda cfg, sliding: dict(sliding_window=cfg.sliding_window or None),
    fused={"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")},
    # llama.cpp's phi3 reads a sliding_window key but attends over the whole context (its loader's TODO), so a
    # window shorter than the context is refused (GGUFLayout.sliding False)
    gguf=GGUFLayout(arch="phi3"),
)
