"""Gemma 3 (text; the multimodal gemma3's text_config): GeGLU, RMSNorm gains as offsets from 1, embeddings scaled
by sqrt(dim), q/k norms, post norms, query_pre_attn_scalar, local (sliding, own rotary base) and global layers."""

from scaletrain.model.family.spec import Family, Fields, GGUFLayout
from scaletrain.model.shape import head_width, is_sliding


def _read(f: Fields, n_layers: int) -> dict:
    return dict(qk_norm=True, norm_plus_one=True, scale_embeddings=True, post_norms=True,
                query_pre_attn_scalar=float(f.get("query_pre_attn_scalar")))


def _layer_pattern(f: Fields, n_layers: int) -> list[str]:
    """Every sliding_window_pattern-th layer is global (transformers' Gemma3TextConfig before layer_types)."""
    pattern = int(f.get("sliding_window_pattern"))
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]


def _write(cfg, sliding: list[bool]) -> dict:
    return dict(query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or head_width(cfg)),
                sliding_window=cfg.sliding_window or None,
                layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                rope_local_base_freq=cfg.local_rope_theta or cfg.rope_theta, attention_bias=False,
                attn_logit_softcapping=None, final_logit_softcapping=None)


def _gguf_metadata(writer, cfg) -> None:
    """llama.cpp's gemma3: the window, which layers use it (one bool a layer) and their rotary base."""
    sliding = [is_sliding(cfg, i) for i in range(cfg.n_layers)]
    if any(sliding):
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern(sliding)
        writer.add_rope_freq_base_swa(cfg.local_rope_theta or cfg.rope_theta)


def _gguf_refuse(cfg) -> str | None:
    head_dim = head_width(cfg)
    if cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar != head_dim:
        # llama.cpp's gemma3 scales queries by head_dim**-0.5 (27B: (dim / n_heads)**-0.5), not the config's
        return f"query_pre_attn_scalar {cfg.query_pre_attn_scalar:g} != head_dim {head_dim} (llama.cpp uses head_dim)"
    return None


def _gemma3_shape(dim: int, n_layers: int, ffn: int) -> dict:
    return dict(dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=1, head_dim=256, ffn_hidden_dim=ffn,
                vocab_size=262144, max_seq_len=32768, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True,
                qk_norm=True, activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True, post_norms=True,
                query_pre_attn_scalar=256.0, sliding_window=512,
                sliding_layers=[i for i in range(n_layers) if (i + 1) % 6], local_rope_theta=10000.0)


FAMILY = Family(
    model_type="gemma3_text", hf_class="Gemma3ForCausalLM",
    defaults=dict(tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                  max_position_embeddings=131072, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                  sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh", num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                  num_hidden_layers=26),
    activation_field="hidden_activation",
    activations={"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"},
    read=_read, write=_write, layer_pattern=_layer_pattern, local_rope_field="rope_local_base_freq",
    # post_attention_layernorm normalizes the attention's *output* (our attention_post_norm); the norm before the
    # feed-forward, our ffn_norm, is pre_feedforward_layernorm
    block_modules={"ffn_norm": "pre_feedforward_layernorm", "attention_post_norm": "post_attention_layernorm",
                   "ffn_post_norm": "post_feedforward_layernorm"},
    wrappers=("gemma3",),
    wrapper_prefixes=(("language_model.model.", "model."), ("model.language_model.", "model."),
                      ("language_model.lm_head.", "lm_head.")),
    wrapper_skipped=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
    gguf=GGUFLayout(arch="gemma3", norm_shift=1.0, sliding=True, metadata=_gguf_metadata, refuse=_gguf_refuse),
    presets={
        # Gemma 3 270M: 268M (170M of it the embedding), 5 local layers (window 512, rotary base 10k) to 1 global.
        "gemma-3-270m": _gemma3_shape(640, 18, 2048),
        # Gemma 3 1B: 1.0B.
        "gemma-3-1b": _gemma3_shape(1152, 26, 6912),
    },
)
