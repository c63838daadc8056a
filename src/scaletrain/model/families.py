"""The open model families as options of our one decoder: a Hugging Face config.json -> ``ModelConfig`` and back,
and a family's tensors -> our parameters and back.

Supported (``model_type``): llama (1, 2, 3, 3.1, 3.2), mistral, qwen2 (2.5), qwen3, gemma3_text (and gemma3's
text_config), phi3, smollm3. SmolLM2 is a llama. What each family computes is a ``ModelConfig`` option
(``model/config.py``); anything a config asks for that the decoder does not compute is a one-line
``ConfigError`` naming the field, never a silent difference. Names go through ``model/hf_names.py``; Phi-3's
fused ``qkv_proj`` / ``gate_up_proj`` are split here at import and joined at export.

Nothing here reads files: callers pass the parsed config.json and a dict of tensors (``finetune/hf_import.py``
reads the folder).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from scaletrain.model.config import ModelConfig, head_width, is_sliding
from scaletrain.model.hf_names import from_hf, to_hf
from scaletrain.model.llama import rope_attention_factor
from scaletrain.model.presets import ffn_hidden_dim, kv_heads
from scaletrain.options import ConfigError

# model_type -> the causal-LM class an export names in ``architectures``.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}

# The class defaults transformers uses for a field a config.json leaves out (save_pretrained drops values equal
# to them; Gemma 3's nested text_config drops most). Only the fields read below.
_DEFAULTS: dict[str, dict] = {
    "llama": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                  hidden_act="silu"),
    "mistral": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                    max_position_embeddings=131072, hidden_act="silu"),
    "qwen2": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                  use_sliding_window=False, max_window_layers=28, hidden_act="silu"),
    "qwen3": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                  use_sliding_window=False, max_window_layers=28, head_dim=128, hidden_act="silu"),
    "gemma3_text": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                        rope_local_base_freq=10000.0, max_position_embeddings=131072, head_dim=256,
                        query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                        hidden_activation="gelu_pytorch_tanh", num_attention_heads=8, num_key_value_heads=4,
                        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26),
    "phi3": dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                 hidden_act="silu"),
    "smollm3": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=2_000_000.0,
                    max_position_embeddings=32768, use_sliding_window=False, no_rope_layer_interval=4,
                    hidden_act="silu"),
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "dynamic": "dynamic", "yarn": "yarn"}
# Tensors of Gemma 3's multimodal checkpoint that are not the text decoder (kept out of an import on purpose).
_GEMMA3_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class _Fields:
    """config.json fields with the family's class defaults; a missing required one is a one-line error."""

    def __init__(self, config: dict, family: str, where: str):
        self.config, self.defaults, self.where = config, _DEFAULTS[family], where

    def get(self, key: str, default=None):
        value = self.config.get(key)
        return value if value is not None or key in self.config else self.defaults.get(key, default)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.where}: missing field {key}")
        return value

    def refuse(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key} = {self.config.get(key)!r} is not supported ({why})")


def model_config_from_hf(config: dict, path: str | Path = "config.json", *,
                         max_seq_len: int | None = None) -> ModelConfig:
    """A family's config.json (parsed) as our ``ModelConfig``; ``path`` names it in errors. ``max_seq_len``: the
    context to build rotary tables for (default: the config's max_position_embeddings)."""
    where = str(path)
    family = config.get("model_type")
    if family == "gemma3":  # the multimodal checkpoint: its text decoder is a gemma3_text
        if not isinstance(config.get("text_config"), dict):
            raise ConfigError(f"{where}: model_type gemma3 without a text_config")
        config, family = {**config["text_config"], "model_type": "gemma3_text"}, "gemma3_text"
    if family not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type {family!r} is not supported (supported: "
                          f"{', '.join(ARCHITECTURES)}, and gemma3)")
    f = _Fields(config, family, where)
    for key in ("attention_bias", "mlp_bias"):
        if f.get(key):
            raise f.refuse(key, "no bias on these projections in our decoder")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f.get(key) is not None:
            raise f.refuse(key, "logit soft-capping is not computed")
    if f.get("use_bidirectional_attention"):
        raise f.refuse("use_bidirectional_attention", "causal attention only")
    act_key = "hidden_activation" if family == "gemma3_text" else "hidden_act"
    activation = _ACTIVATIONS.get(f.get(act_key))
    if activation is None or (activation == "gelu_tanh") != (family == "gemma3_text"):
        raise f.refuse(act_key, "silu, or gelu_pytorch_tanh for Gemma")
    dim, n_heads, n_layers = int(f.need("hidden_size")), int(f.need("num_attention_heads")), int(
        f.need("num_hidden_layers"))
    n_kv = int(f.get("num_key_value_heads") or n_heads)
    hd = int(f.get("head_dim") or dim // n_heads)
    if hd % 2:
        raise ConfigError(f"{where}: head_dim {hd} must be even (rotary embeddings)")
    if n_heads % n_kv:
        raise ConfigError(f"{where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    context = int(max_seq_len or f.need("max_position_embeddings"))
    rope = _rope_fields(f, family, context)
    sliding_window, sliding = _sliding_layers(f, family, n_layers)
    no_rope = []
    if family == "smollm3":
        interval = int(f.get("no_rope_layer_interval"))
        uses_rope = f.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
        no_rope = [i for i in range(n_layers) if not uses_rope[i]]
    gemma = family == "gemma3_text"
    return ModelConfig(
        family=family, vocab_size=int(f.need("vocab_size")), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=0 if hd * n_heads == dim else hd,
        ffn_hidden_dim=int(f.need("intermediate_size")), max_seq_len=context, norm_eps=float(f.get("rms_norm_eps")),
        tie_embeddings=bool(f.get("tie_word_embeddings")), init_std=float(f.get("initializer_range", 0.02)),
        qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "gemma3_text"), activation=activation,
        norm_plus_one=gemma, scale_embeddings=gemma, post_norms=gemma,
        query_pre_attn_scalar=float(f.get("query_pre_attn_scalar")) if gemma else 0.0,
        sliding_window=sliding_window, sliding_layers=sliding, no_rope_layers=no_rope, **rope)


def _rope_params(f: _Fields, family: str) -> tuple[dict, dict | None]:
    """(the global layers' rope parameters, Gemma 3's local layers' or None) from either config format:
    transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``. A ``rope_scaling``
    present beside ``rope_parameters`` replaces it, as transformers 5 reads such a file
    (``convert_rope_params_to_dict``: ``rope_scaling or rope_parameters``)."""
    params, legacy = f.get("rope_parameters"), f.config.get("rope_scaling")
    if family == "gemma3_text" and isinstance(params, dict) and "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    if isinstance(params, dict) and params and not legacy:
        return dict(params), None
    scaling = dict(legacy or {})
    scaling.setdefault("rope_theta", f.get("rope_theta"))
    if "partial_rotary_factor" in f.config:
        scaling.setdefault("partial_rotary_factor", f.get("partial_rotary_factor"))
    local = {"rope_theta": f.get("rope_local_base_freq")} if family == "gemma3_text" else None
    return scaling, local


def _yarn_fields(f: _Fields, params: dict) -> dict:
    """YaRN's ModelConfig fields as transformers 5 reads them (``_compute_yarn_parameters``,
    ``standardize_rope_params``): the original context from a top-level original_max_position_embeddings, else
    the rope dict's, else max_position_embeddings; a missing factor is max_position_embeddings / that; the
    attention factor from attention_factor, else mscale / mscale_all_dim, else 0 (0.1 ln(factor) + 1)."""
    original = int(f.config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or f.need("max_position_embeddings"))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(f.need("max_position_embeddings")) / original
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        def scaled(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        attention = scaled(float(mscale)) / scaled(float(mscale_all_dim))
    return dict(rope_scaling_factor=factor, rope_original_max_seq_len=original,
                rope_yarn_beta_fast=float(params.get("beta_fast") or 32), rope_yarn_beta_slow=float(
                    params.get("beta_slow") or 1), rope_yarn_truncate=bool(params.get("truncate", True)),
                rope_attention_factor=float(attention or 0.0))


def _rope_fields(f: _Fields, family: str, context: int) -> dict:
    """The ModelConfig rotary fields: base, scaling and Gemma 3's local base."""
    params, local = _rope_params(f, family)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in _ROPE_TYPES:
        field = "rope_scaling" if f.config.get("rope_scaling") else "rope_parameters"
        raise ConfigError(f"{f.where}: {field}.rope_type = {rope_type!r} is not computed by our decoder (supported: "
                          f"{', '.join(_ROPE_TYPES)}); transformers would apply it, so the model would differ")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConfigError(f"{f.where}: partial_rotary_factor = {params['partial_rotary_factor']} is not computed "
                          f"(rotary embeddings over the whole head only)")
    out = dict(rope_theta=float(params.get("rope_theta") or f.get("rope_theta")), rope_scaling=_ROPE_TYPES[rope_type])
    if rope_type not in ("default", "yarn"):  # yarn's factor may be left out (see _yarn_fields)
        out["rope_scaling_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_seq_len=int(params["original_max_position_embeddings"]))
    if rope_type == "yarn":
        out.update(_yarn_fields(f, params))
    if rope_type == "dynamic":
        original = int(f.need("max_position_embeddings"))
        if context > original:
            raise ConfigError(f"{f.where}: rope_scaling dynamic is computed only within max_position_embeddings "
                              f"({original}); a context of {context} is longer")
        out["rope_original_max_seq_len"] = original
    if local is not None:
        if (local.get("rope_type") or "default") != "default":
            raise ConfigError(f"{f.where}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is "
                              f"not computed (plain rotary on the local layers)")
        out["local_rope_theta"] = float(local.get("rope_theta") or f.get("rope_local_base_freq"))
    return out


def _sliding_layers(f: _Fields, family: str, n_layers: int) -> tuple[int, list[int]]:
    """(sliding_window, the layers that use it): 0 and [] when every layer sees the whole context."""
    if family in ("qwen2", "qwen3", "smollm3") and not f.get("use_sliding_window"):
        return 0, []
    window = f.get("sliding_window") if family != "llama" else None
    if not window:
        return 0, []
    types = f.get("layer_types")
    if types is None:
        if family == "gemma3_text":
            pattern = int(f.get("sliding_window_pattern"))
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
        elif family in ("qwen2", "qwen3"):
            first = int(f.get("max_window_layers"))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        elif family == "smollm3":
            raise f.refuse("use_sliding_window", "give layer_types with it")
        else:  # mistral, phi3: every layer
            types = ["sliding_attention"] * n_layers
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n_layers:
        raise f.refuse("layer_types", f"one of sliding_attention / full_attention per layer ({n_layers})")
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return int(window), [] if len(sliding) == n_layers else sliding


def hf_config_from_model_config(cfg: ModelConfig) -> dict:
    """Our ``ModelConfig`` as its family's config.json (architectures, model_type and every field the family's
    class reads for the computation); a config the family cannot express is a ConfigError naming the field."""
    family = cfg.family
    hd, n_layers = head_width(cfg), cfg.n_layers
    sliding = [is_sliding(cfg, i) for i in range(n_layers)]
    out = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": ffn_hidden_dim(cfg), "num_hidden_layers": n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": kv_heads(cfg), "head_dim": hd,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg), "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
    }
    if cfg.rope_scaling == "dynamic":  # plain within max_position_embeddings (checked at build)
        out["max_position_embeddings"] = cfg.rope_original_max_seq_len
    if family == "gemma3_text":
        out.update(hidden_activation="gelu_pytorch_tanh" if cfg.activation == "gelu_tanh" else cfg.activation,
                   query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or hd),
                   sliding_window=cfg.sliding_window or None,
                   layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                   rope_local_base_freq=cfg.local_rope_theta or cfg.rope_theta, attention_bias=False,
                   attn_logit_softcapping=None, final_logit_softcapping=None)
    else:
        out["hidden_act"] = cfg.activation
    if family in ("llama", "qwen3", "smollm3"):
        out["attention_bias"] = False
    if family in ("llama", "smollm3"):
        out["mlp_bias"] = False
    if family in ("mistral", "phi3"):
        out["sliding_window"] = cfg.sliding_window or None
    if family in ("qwen2", "qwen3"):
        first = sliding.index(True) if any(sliding) else n_layers
        out.update(use_sliding_window=cfg.sliding_window > 0, sliding_window=cfg.sliding_window or None,
                   max_window_layers=first)
    if family == "smollm3":
        out.update(no_rope_layers=[int(i not in cfg.no_rope_layers) for i in range(n_layers)],
                   use_sliding_window=cfg.sliding_window > 0, sliding_window=cfg.sliding_window or None,
                   layer_types=["sliding_attention" if s else "full_attention" for s in sliding])
    _check_expressed(cfg, out)
    return out


def _rope_scaling(cfg: ModelConfig) -> dict | None:
    if cfg.rope_scaling == "none":
        return None
    scaling = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                       original_max_position_embeddings=cfg.rope_original_max_seq_len)
    if cfg.rope_scaling == "yarn":
        scaling.update(original_max_position_embeddings=cfg.rope_original_max_seq_len,
                       beta_fast=cfg.rope_yarn_beta_fast, beta_slow=cfg.rope_yarn_beta_slow,
                       truncate=cfg.rope_yarn_truncate)
        if cfg.rope_attention_factor:
            scaling["attention_factor"] = cfg.rope_attention_factor
    return scaling


# The ModelConfig fields that decide the computation (the rest: preset, init, muP, the ffn size's recipe).
_COMPUTED = ("family", "vocab_size", "dim", "n_layers", "n_heads", "norm_eps", "tie_embeddings", "rope_theta",
             "qkv_bias", "qk_norm", "activation", "norm_plus_one", "scale_embeddings", "post_norms",
             "rope_scaling", "sliding_window", "no_rope_layers")


def _computation(cfg: ModelConfig) -> dict:
    out = {name: getattr(cfg, name) for name in _COMPUTED}
    out.update(head_dim=head_width(cfg), n_kv_heads=kv_heads(cfg), ffn_hidden_dim=ffn_hidden_dim(cfg),
               sliding=[is_sliding(cfg, i) for i in range(cfg.n_layers)],
               query_pre_attn_scalar=cfg.query_pre_attn_scalar or head_width(cfg) ** 1.0,
               local_rope_theta=cfg.local_rope_theta if any(is_sliding(cfg, i) for i in range(cfg.n_layers)) else 0)
    if cfg.rope_scaling != "none":
        out.update(factor=cfg.rope_scaling_factor, original=cfg.rope_original_max_seq_len)
    if cfg.rope_scaling == "llama3":
        out.update(low=cfg.rope_low_freq_factor, high=cfg.rope_high_freq_factor)
    if cfg.rope_scaling == "yarn":
        out.update(beta=(cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow), truncate=cfg.rope_yarn_truncate,
                   attention=rope_attention_factor(cfg))
    return out


def _check_expressed(cfg: ModelConfig, hf: dict) -> None:
    """Refuse an export whose config.json would compute something else: read it back and compare."""
    back = model_config_from_hf(hf, f"{cfg.family} config.json", max_seq_len=cfg.max_seq_len)
    ours, theirs = _computation(cfg), _computation(back)
    for name, value in ours.items():
        if theirs.get(name) != value:
            raise ConfigError(f"model.{name} = {value!r} cannot be written as a {cfg.family} config.json "
                              f"({ARCHITECTURES[cfg.family]} computes {theirs.get(name)!r})")


# Phi-3's fused tensors: the suffix -> the Llama layout's separate ones, in the order their rows are stacked.
_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def _fused_rows(suffix: str, cfg: ModelConfig) -> list[int]:
    """Rows of each part of a fused Phi-3 tensor (q, k, v or gate, up)."""
    if suffix == "self_attn.qkv_proj.weight":
        q_rows, kv_rows = cfg.n_heads * head_width(cfg), kv_heads(cfg) * head_width(cfg)
        return [q_rows, kv_rows, kv_rows]
    return [ffn_hidden_dim(cfg)] * 2


def text_decoder_name(name: str) -> str | None:
    """A tensor name of Gemma 3's multimodal checkpoint as the text decoder's (transformers 4's
    ``language_model.model.``, 5's ``model.language_model.``); None for the vision tower and projector (left out on
    purpose). Other names as they are."""
    if name.startswith(_GEMMA3_NOT_TEXT):
        return None
    for prefix, plain in (("language_model.model.", "model."), ("model.language_model.", "model."),
                          ("language_model.lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return plain + name[len(prefix):]
    return name


def hf_places(name: str, cfg: ModelConfig) -> list[tuple[str, slice | None]] | None:
    """Where one of a family's tensors goes in our model: [(our parameter, its rows of the tensor or None for all
    of it)]; [] for what is not ours to read (a derived rotary buffer, Gemma 3's vision tower); None for a name with
    no place in the model (refused by the callers, never dropped). Phi-3's fused ``qkv_proj`` / ``gate_up_proj``
    give one place per part."""
    name = text_decoder_name(name)
    if name is None:
        return []
    if cfg.family == "phi3":
        for fused, parts in _FUSED.items():
            if name.endswith(fused):
                stem, starts = name[: -len(fused)], 0
                places = []
                for part, rows in zip(parts, _fused_rows(fused, cfg)):
                    ours = from_hf(stem + part, cfg.family)
                    if not ours:
                        return None
                    places.append((ours, slice(starts, starts + rows)))
                    starts += rows
                return places
    ours = from_hf(name, cfg.family)
    if ours is None:
        return None
    return [] if ours == "" else [(ours, None)]


def check_fused_rows(name: str, rows: int, places: list[tuple[str, slice | None]]) -> None:
    """A fused tensor must have exactly the rows its parts take (else the split would be silently wrong)."""
    if places and places[-1][1] is not None and places[-1][1].stop != rows:
        raise ConfigError(f"{name} has {rows} rows but config.json implies {places[-1][1].stop} "
                          f"({' + '.join(str(r.stop - r.start) for _, r in places)})")


def join_fused(hf_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Separate q/k/v and gate/up projections (Hugging Face names) as Phi-3's fused ones (the export)."""
    parts = {part: fused for fused, group in _FUSED.items() for part in group}
    out = {}
    for name, tensor in hf_tensors.items():
        suffix = next((p for p in parts if name.endswith(p)), None)
        if suffix is None:
            out[name] = tensor
        elif suffix == _FUSED[parts[suffix]][0]:  # the first part: stack the group here
            stem = name[: -len(suffix)]
            out[stem + parts[suffix]] = torch.cat([hf_tensors[stem + p] for p in _FUSED[parts[suffix]]])
    return out


def state_dict_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A family's tensors (Hugging Face names) as our parameters (``Transformer.state_dict`` names, the tied head
    included when tied). A name with no place in the model is refused, not dropped."""
    out = {}
    for name, tensor in hf_tensors.items():
        places = hf_places(name, cfg)
        if places is None:
            raise ConfigError(f"tensor {name} has no place in a {cfg.family} model (another architecture?)")
        check_fused_rows(name, tensor.shape[0], places)
        for ours, rows in places:
            out[ours] = tensor if rows is None else tensor[rows]
    if cfg.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameters as the family's tensors (the tied head left out, as transformers saves it)."""
    out = {to_hf(name, cfg.family): tensor for name, tensor in state.items()
           if not (cfg.tie_embeddings and name == "output.weight")}
    return join_fused(out) if cfg.family == "phi3" else out


def load_hf_tensors(model: torch.nn.Module, hf_tensors: dict[str, torch.Tensor]) -> None:
    """Copy a family's tensors into ``model`` (a ``Transformer`` built for the matching ``ModelConfig``); a
    missing, extra or misshapen tensor is a one-line ConfigError."""
    cfg = model.cfg
    state = state_dict_from_hf(hf_tensors, cfg)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = [name for name in expected if name not in state]
    if missing:
        raise ConfigError(f"weights missing for {len(missing)} parameter(s), e.g. {to_hf(missing[0], cfg.family)} "
                          f"(config.json and the safetensors do not match)")
    extra = [name for name in state if name not in expected]
    if extra:
        raise ConfigError(f"tensor {to_hf(extra[0], cfg.family)} is not in a model of this config.json")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"{to_hf(name, cfg.family)} has shape {tuple(state[name].shape)} but config.json "
                              f"implies {shape}")
    model.load_state_dict(state)
