"""SmolLM3: the Llama computation with no rotary embedding on some layers (NoPE: every no_rope_layer_interval-th
by default, or the config's no_rope_layers list, 1 = rotary)."""

from scaletrain.model.family.spec import Family, Fields, GGUFLayout, flagged_window

# llama.cpp's smollm3 leaves out the rotary embedding on every 4th layer (n_no_rope_layer_step, not read from the file)
LLAMA_CPP_NO_ROPE_STEP = 4


def _read(f: Fields, n_layers: int) -> dict:
    interval = int(f.get("no_rope_layer_interval"))
    uses_rope = f.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
    return dict(no_rope_layers=[i for i in range(n_layers) if not uses_rope[i]])


def _write(cfg, sliding: list[bool]) -> dict:
    return dict(attention_bias=False, mlp_bias=False,
                no_rope_layers=[int(i not in cfg.no_rope_layers) for i in range(cfg.n_layers)],
                use_sliding_window=cfg.sliding_window > 0, sliding_window=cfg.sliding_window or None,
                layer_types=["sliding_attention" if s else "full_attention" for s in sliding])


def _refuse_pattern(f: Fields, n_layers: int) -> list[str]:
    raise f.refuse("use_sliding_window", "give layer_types with it")


def _gguf_refuse(cfg) -> str | None:
    expected = [i for i in range(cfg.n_layers) if (i + 1) % LLAMA_CPP_NO_ROPE_STEP == 0]
    if sorted(cfg.no_rope_layers) != expected:
        return (f"no_rope_layers {cfg.no_rope_layers} (llama.cpp's smollm3 leaves rotary out of every "
                f"{LLAMA_CPP_NO_ROPE_STEP}th layer: {expected})")
    return None


FAMILY = Family(
    model_type="smollm3", hf_class="SmolLM3ForCausalLM",
    defaults=dict(tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=2_000_000.0, max_position_embeddings=32768,
                  use_sliding_window=False, no_rope_layer_interval=4, hidden_act="silu"),
    read=_read, write=_write, layer_pattern=_refuse_pattern,
    window=flagged_window,
    gguf=GGUFLayout(arch="smollm3", interleave_rotary=True, refuse=_gguf_refuse),
)
