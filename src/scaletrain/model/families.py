"""The open model families as options of our one decoder: a Hugging Face config.json -> ``ModelConfig`` and back,
and a family's tensors -> our parameters and back.

Family-blind: what a family does differently is its entry in ``model/family/`` (one file each: llama, mistral,
qwen2, qwen3, gemma3_text and the multimodal gemma3's text_config, phi3, smollm3; SmolLM2 is a llama; with experts
qwen3_moe, mixtral, olmoe, whose per-expert tensors are stacked here into our GroupedExperts and split back;
transformers 5's fused 3-D experts, ``mlp.experts.gate_up_proj`` / ``down_proj``, are read too), read here.
What each family computes is a ``ModelConfig`` option (``model/config.py``); anything a config asks for that the
decoder does not compute is a one-line ``ConfigError`` naming the field, never a silent difference. Names go
through ``model/hf_names.py``; fused tensors (Phi-3's ``qkv_proj`` / ``gate_up_proj``, the entry's ``fused``) are
split here at import and joined at export.

Nothing here reads files: callers pass the parsed config.json and a dict of tensors (``finetune/hf_import.py``
reads the folder).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from scaletrain.core.options import ConfigError
from scaletrain.model.config import ModelConfig, head_width, is_moe_layer, is_sliding
from scaletrain.model.decoder import rope_attention_factor
from scaletrain.model.family import WRAPPERS, family
from scaletrain.model.family.spec import Family, Fields
from scaletrain.model.hf_names import HF_BLOCK_PREFIX, OUR_BLOCK_PREFIX, PROJECTIONS, from_hf, to_hf
from scaletrain.model.presets import expert_hidden_dim, ffn_hidden_dim, kv_heads

# Hugging Face's rope types -> ModelConfig.rope_scaling (the others are refused).
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "dynamic": "dynamic", "yarn": "yarn"}

def model_config_from_hf(config: dict, path: str | Path = "config.json", *,
                         max_seq_len: int | None = None) -> ModelConfig:
    """A family's config.json (parsed) as our ``ModelConfig``; ``path`` names it in errors. ``max_seq_len``: the
    context to build rotary tables for (default: the config's max_position_embeddings)."""
    where = str(path)
    model_type = config.get("model_type")
    if model_type in WRAPPERS:  # a multimodal checkpoint: its text decoder is the family of its text_config
        if not isinstance(config.get("text_config"), dict):
            raise ConfigError(f"{where}: model_type {model_type} without a text_config")
        config = {**config["text_config"], "model_type": WRAPPERS[model_type]}
    fam = family(config.get("model_type"), where)
    f = Fields(config, fam.defaults, where)
    for key in ("attention_bias", "mlp_bias"):
        if f.get(key):
            raise f.refuse(key, "no bias on these projections in our decoder")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f.get(key) is not None:
            raise f.refuse(key, "logit soft-capping is not computed")
    if f.get("use_bidirectional_attention"):
        raise f.refuse("use_bidirectional_attention", "causal attention only")
    activation = fam.activations.get(f.get(fam.activation_field))
    if activation is None:
        raise f.refuse(fam.activation_field, f"{fam.model_type} computes {', '.join(fam.activations)}")
    dim, n_heads, n_layers = int(f.need("hidden_size")), int(f.need("num_attention_heads")), int(
        f.need("num_hidden_layers"))
    n_kv = int(f.get("num_key_value_heads") or n_heads)
    hd = int(f.get("head_dim") or dim // n_heads)
    if hd % 2:
        raise ConfigError(f"{where}: head_dim {hd} must be even (rotary embeddings)")
    if n_heads % n_kv:
        raise ConfigError(f"{where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    context = int(max_seq_len or f.need("max_position_embeddings"))
    sliding_window, sliding = _sliding_layers(f, fam, n_layers)
    return ModelConfig(
        family=fam.model_type, vocab_size=int(f.need("vocab_size")), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=0 if hd * n_heads == dim else hd,
        ffn_hidden_dim=int(f.need("intermediate_size")), max_seq_len=context, norm_eps=float(f.get("rms_norm_eps")),
        tie_embeddings=bool(f.get("tie_word_embeddings")), init_std=float(f.get("initializer_range", 0.02)),
        activation=activation, sliding_window=sliding_window, sliding_layers=sliding,
        **_rope_fields(f, fam, context), **fam.read(f, n_layers))


def _rope_params(f: Fields, fam: Family) -> tuple[dict, dict | None]:
    """(the global layers' rope parameters, Gemma 3's local layers' or None) from either config format:
    transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``. A ``rope_scaling``
    present beside ``rope_parameters`` replaces it, as transformers 5 reads such a file
    (``convert_rope_params_to_dict``: ``rope_scaling or rope_parameters``)."""
    params, legacy = f.get("rope_parameters"), f.config.get("rope_scaling")
    if fam.local_rope_field and isinstance(params, dict) and "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    if isinstance(params, dict) and params and not legacy:
        return dict(params), None
    scaling = dict(legacy or {})
    scaling.setdefault("rope_theta", f.get("rope_theta"))
    if "partial_rotary_factor" in f.config:
        scaling.setdefault("partial_rotary_factor", f.get("partial_rotary_factor"))
    local = {"rope_theta": f.get(fam.local_rope_field)} if fam.local_rope_field else None
    return scaling, local


def _yarn_fields(f: Fields, params: dict) -> dict:
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


def _rope_fields(f: Fields, fam: Family, context: int) -> dict:
    """The ModelConfig rotary fields: base, scaling and the local layers' base (Gemma 3)."""
    params, local = _rope_params(f, fam)
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
        out["local_rope_theta"] = float(local.get("rope_theta") or f.get(fam.local_rope_field))
    return out


def _sliding_layers(f: Fields, fam: Family, n_layers: int) -> tuple[int, list[int]]:
    """(sliding_window, the layers that use it): 0 and [] when every layer sees the whole context."""
    window = fam.window(f)
    if not window:
        return 0, []
    types = f.get("layer_types")
    if types is None:
        types = fam.layer_pattern(f, n_layers)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n_layers:
        raise f.refuse("layer_types", f"one of sliding_attention / full_attention per layer ({n_layers})")
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return int(window), [] if len(sliding) == n_layers else sliding


def hf_config_from_model_config(cfg: ModelConfig) -> dict:
    """Our ``ModelConfig`` as its family's config.json (architectures, model_type and every field the family's
    class reads for the computation); a config the family cannot express is a ConfigError naming the field."""
    fam = family(cfg.family)
    hd, n_layers = head_width(cfg), cfg.n_layers
    sliding = [is_sliding(cfg, i) for i in range(n_layers)]
    activation = next((theirs for theirs, ours in fam.activations.items() if ours == cfg.activation), cfg.activation)
    out = {
        "architectures": [fam.hf_class], "model_type": fam.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": ffn_hidden_dim(cfg), "num_hidden_layers": n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": kv_heads(cfg), "head_dim": hd,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg), "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, fam.activation_field: activation,
    }
    if cfg.rope_scaling == "dynamic":  # plain within max_position_embeddings (checked at build)
        out["max_position_embeddings"] = cfg.rope_original_max_seq_len
    out.update(fam.write(cfg, sliding))
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
             "qkv_bias", "qk_norm", "qk_norm_width", "activation", "norm_plus_one", "scale_embeddings", "post_norms",
             "rope_scaling", "sliding_window", "no_rope_layers", "moe_experts")
# With experts, the routing's fields too (capacity and the selection bias: no family's file computes them).
_COMPUTED_MOE = ("moe_top_k", "moe_shared_experts", "moe_score", "moe_renormalize", "moe_route_scale",
                 "moe_capacity_factor", "moe_bias_rate")


def _computation(cfg: ModelConfig) -> dict:
    out = {name: getattr(cfg, name) for name in _COMPUTED}
    sparse = [is_moe_layer(cfg, i) for i in range(cfg.n_layers)]
    if cfg.moe_experts:
        out.update({name: getattr(cfg, name) for name in _COMPUTED_MOE}, sparse=sparse,
                   expert_hidden_dim=expert_hidden_dim(cfg))
    if not all(sparse):  # the dense feed-forward's width counts only where a layer has one (not in Mixtral)
        out["ffn_hidden_dim"] = ffn_hidden_dim(cfg)
    out.update(head_dim=head_width(cfg), n_kv_heads=kv_heads(cfg),
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
                              f"({family(cfg.family).hf_class} computes {theirs.get(name)!r})")


def _role_rows(role: str, cfg: ModelConfig) -> int:
    """Rows of a projection role's weight (its output features)."""
    if role == "q":
        return cfg.n_heads * head_width(cfg)
    if role in ("k", "v"):
        return kv_heads(cfg) * head_width(cfg)
    return ffn_hidden_dim(cfg)  # gate, up


def text_decoder_name(name: str, fam: Family) -> str | None:
    """A tensor name of a wrapper checkpoint (Gemma 3's multimodal: transformers 4's ``language_model.model.``, 5's
    ``model.language_model.``) as the text decoder's; None for what is not the text decoder (the vision tower and
    projector, left out on purpose). Other names as they are."""
    if name.startswith(fam.wrapper_skipped):
        return None
    for prefix, plain in fam.wrapper_prefixes:
        if name.startswith(prefix):
            return plain + name[len(prefix):]
    return name


def _expert_place(name: str, fam: Family) -> tuple[str, int] | None:
    """A per-expert tensor (``model.layers.3.mlp.experts.5.gate_proj.weight``) -> (our stacked weight,
    ``layers.3.feed_forward.experts.w1``, and the expert, 5); None for any other name."""
    if not fam.experts or not name.startswith(HF_BLOCK_PREFIX):
        return None
    layer, _, rest = name[len(HF_BLOCK_PREFIX):].partition(".")
    stem = f"{fam.experts_module}."
    if not (layer.isdigit() and rest.startswith(stem) and rest.endswith(".weight")):
        return None
    expert, _, projection = rest[len(stem): -len(".weight")].partition(".")
    ours = {theirs: mine for mine, theirs in fam.experts.items()}.get(projection)
    if not expert.isdigit() or ours is None:
        return None
    return f"{OUR_BLOCK_PREFIX}{layer}.feed_forward.experts.{ours}", int(expert)


# transformers 5's fused 3-D experts (``Qwen3MoeExperts``, ``MixtralExperts``, ``OlmoeExperts``): what
# ``save_pretrained(save_original_format=False)`` writes, without a ``.weight`` suffix. gate_up_proj (E, 2h, d) holds
# every expert's gate rows, then its up rows (transformers' conversion: MergeModulelist(dim=0), Concatenate(dim=1));
# down_proj (E, d, h) is our w2 as it is.
FUSED_GATE_UP, FUSED_DOWN = "gate_up_proj", "down_proj"


def _fused_expert_places(name: str, fam: Family, cfg: ModelConfig) -> list[tuple[str, tuple | None]] | None:
    """A transformers 5 fused expert tensor (``model.layers.3.mlp.experts.gate_up_proj``) -> its places in our
    stacked weights: gate_up's halves along dim 1 as (all experts, rows) index tuples; None for any other name."""
    if not fam.experts or not name.startswith(HF_BLOCK_PREFIX):
        return None
    layer, _, rest = name[len(HF_BLOCK_PREFIX):].partition(".")
    stem = f"{fam.experts_module}."
    if not (layer.isdigit() and rest.startswith(stem) and rest[len(stem):] in (FUSED_GATE_UP, FUSED_DOWN)):
        return None
    ours = f"{OUR_BLOCK_PREFIX}{layer}.feed_forward.experts"
    if rest[len(stem):] == FUSED_DOWN:
        return [(f"{ours}.w2", None)]
    hidden = expert_hidden_dim(cfg)
    return [(f"{ours}.w1", (slice(None), slice(0, hidden))), (f"{ours}.w3", (slice(None), slice(hidden, 2 * hidden)))]


def _native_name(name: str, fam: Family) -> str:
    """A block tensor under transformers 5's module names (Mixtral's ``mlp.`` for its files' ``block_sparse_moe.``,
    the family's ``native_modules``) under the family's file names; other names as they are."""
    if not name.startswith(HF_BLOCK_PREFIX):
        return name
    layer, _, rest = name[len(HF_BLOCK_PREFIX):].partition(".")
    for native, stored in fam.native_modules:
        if rest.startswith(native):
            return f"{HF_BLOCK_PREFIX}{layer}.{stored}{rest[len(native):]}"
    return name


def hf_places(name: str, cfg: ModelConfig) -> list[tuple[str, slice | int | None]] | None:
    """Where one of a family's tensors goes in our model: [(our parameter, its rows of the tensor or None for all
    of it)]; [] for what is not ours to read (a derived rotary buffer, Gemma 3's vision tower); None for a name with
    no place in the model (refused by the callers, never dropped). A fused tensor (Phi-3's ``qkv_proj`` /
    ``gate_up_proj``) gives one place per part; one expert's projection (the family's ``experts``) gives its index
    (an int) in our stacked weight: the tensor is that one row of ours; transformers 5's fused ``gate_up_proj``
    (E, 2h, d) gives w1 and w3 as (all experts, rows) tuples, its ``down_proj`` w2 whole. Only that orientation is
    read (the installed transformers' ``Qwen3MoeExperts``); an (E, d, 2h) tensor fails the row check unless d = 2h."""
    fam = family(cfg.family)
    name = text_decoder_name(name, fam)
    if name is None:
        return []
    name = _native_name(name, fam)
    expert = _expert_place(name, fam)
    if expert is not None:
        return [expert]
    fused_experts = _fused_expert_places(name, fam, cfg)
    if fused_experts is not None:
        return fused_experts
    for fused, roles in fam.fused.items():
        if name.endswith(f"{fused}.weight"):
            stem, starts, places = name[: -len(f"{fused}.weight")], 0, []
            for role in roles:
                ours = from_hf(f"{stem}{PROJECTIONS[role][1]}.weight", cfg.family)
                if not ours:
                    return None
                rows = _role_rows(role, cfg)
                places.append((ours, slice(starts, starts + rows)))
                starts += rows
            return places
    ours = from_hf(name, cfg.family)
    if ours is None:
        return None
    return [] if ours == "" else [(ours, None)]


def check_fused_rows(name: str, shape: tuple[int, ...], places: list[tuple[str, slice | tuple | int | None]]) -> None:
    """A fused tensor must have exactly the rows its parts take (else the split would be silently wrong): dim 0 for
    a fused projection, dim 1 for transformers 5's fused experts (their parts are (all experts, rows) tuples)."""
    if not places or not isinstance(places[-1][1], (slice, tuple)):
        return
    dim = 1 if isinstance(places[-1][1], tuple) else 0
    parts = [r[dim] if dim else r for _, r in places]
    rows = shape[dim] if len(shape) > dim else 0
    if parts[-1].stop != rows:
        raise ConfigError(f"{name} has {rows} rows{' per expert' if dim else ''} but config.json implies "
                          f"{parts[-1].stop} ({' + '.join(str(r.stop - r.start) for r in parts)})")


def part_shape(shape: tuple[int, ...], rows: slice | tuple | None) -> tuple[int, ...]:
    """The shape of a place's part of a stored tensor of ``shape`` (``hf_places``' rows: None = all of it)."""
    if rows is None:
        return tuple(shape)
    if isinstance(rows, tuple):  # (all experts, rows): transformers 5's fused gate_up
        return (shape[0], rows[1].stop - rows[1].start, *shape[2:])
    return (rows.stop - rows.start, *shape[1:])


def join_fused(hf_tensors: dict[str, torch.Tensor], fam: Family) -> dict[str, torch.Tensor]:
    """Separate projections (Hugging Face names) stacked into the family's fused ones (the export)."""
    out = dict(hf_tensors)
    for fused, roles in fam.fused.items():
        parts = [f"{PROJECTIONS[role][1]}.weight" for role in roles]
        for name in [n for n in hf_tensors if n.endswith(parts[0])]:
            stem = name[: -len(parts[0])]
            out[f"{stem}{fused}.weight"] = torch.cat([out.pop(stem + part) for part in parts])
    return out


def split_experts(state: dict[str, torch.Tensor], fam: Family) -> dict[str, torch.Tensor]:
    """Our stacked expert weights as the family's one tensor per expert (Hugging Face names); the selection bias
    buffer (``expert_bias``) left out: no family's file holds one, and an export with a bias that moved is refused
    (``moe_bias_rate``, checked with the config)."""
    out = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        if kind == "expert_bias":
            continue
        if module.endswith("feed_forward.experts") and kind in fam.experts:
            layer = name.split(".")[1]
            for e, weight in enumerate(tensor):
                out[f"{HF_BLOCK_PREFIX}{layer}.{fam.experts_module}.{e}.{fam.experts[kind]}.weight"] = weight
        else:
            out[name] = tensor
    return out


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameters as the family's tensors (the tied head left out, as transformers saves it; experts one
    tensor each)."""
    fam = family(cfg.family)
    out = {name if name.startswith(HF_BLOCK_PREFIX) else to_hf(name, cfg.family): tensor
           for name, tensor in split_experts(state, fam).items()
           if not (cfg.tie_embeddings and name == "output.weight")}
    return join_fused(out, fam)
