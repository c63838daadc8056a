"""What one model family is, as data: the ``Family`` entry each file of this package defines.

A family (a Hugging Face ``model_type``) is options of our one decoder: its entry says how its config.json maps
onto ``ModelConfig`` and back, which tensors it names differently, which it stores fused, what a GGUF of it
writes for llama.cpp, and its published shapes (presets). The code that reads an entry is family-blind:
``model/families.py`` (config.json and tensors), ``finetune/export.py`` (peft), ``checkpoint/gguf.py``.

Nothing here imports the model or the config: ``model/config.py`` takes the family list from this package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scaletrain.core.options import ConfigError

# A ModelConfig, typed loosely: model/config.py reads this package (its family list), so nothing here imports it.
ModelConfig = Any


class Fields:
    """config.json fields with the family's class defaults; a missing required one is a one-line error."""

    def __init__(self, config: dict, defaults: dict, where: str):
        self.config, self.defaults, self.where = config, defaults, where

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


def _nothing(*_args) -> dict:
    return {}


def _every_layer(_f: Fields, n_layers: int) -> list[str]:
    return ["sliding_attention"] * n_layers


def window_field(f: Fields) -> int:
    """The sliding window a config.json asks for (``sliding_window``; 0 = none)."""
    return int(f.get("sliding_window") or 0)


def flagged_window(f: Fields) -> int:
    """A window that counts only with use_sliding_window (Qwen, SmolLM3: the published configs carry one unused)."""
    return window_field(f) if f.get("use_sliding_window") else 0


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp reads the family (its ``convert_hf_to_gguf.py`` class for the model_type).

    ``arch``: the ``gguf.MODEL_ARCH`` name the file declares; ``interleave_rotary``: llama.cpp's architecture rotates
    adjacent pairs (rope type NORM: the converter permutes q/k rows) rather than Hugging Face's halves (NEOX);
    ``norm_shift``: added to every RMSNorm gain (Gemma stores gains as offsets from 1, llama.cpp multiplies by the
    gain); ``sliding``: the architecture computes per-layer sliding windows (else a window shorter than the context is
    refused); ``metadata(writer, cfg)``: the architecture's own keys; ``refuse(cfg)``: a reason llama.cpp would
    compute this model otherwise (None when it computes ours); ``experts``: the architecture has experts (in every
    layer: ``blk.N.ffn_gate_inp``, 3-D ``ffn_{gate,up,down}_exps``) and ``renormalize`` whether it renormalises
    each token's top-k weights (llama.cpp's ``build_moe_ffn`` norm_w: fixed per architecture)."""

    arch: str
    interleave_rotary: bool = False
    sliding: bool = False
    norm_shift: float = 0.0
    experts: bool = False
    renormalize: bool = True
    metadata: Callable[[Any, ModelConfig], None] = _nothing
    refuse: Callable[[ModelConfig], str | None] = lambda cfg: None


@dataclass(frozen=True)
class Family:
    """One model family. The hooks receive the parsed config.json (``Fields``, with ``defaults``) or our
    ``ModelConfig``; what they do not say is the Llama computation."""

    model_type: str
    hf_class: str  # the causal-LM class an export names in ``architectures``
    # transformers' class defaults for the fields a config.json may leave out (save_pretrained drops them)
    defaults: dict
    activation_field: str = "hidden_act"
    activations: dict = field(default_factory=lambda: {"silu": "silu"})  # theirs -> ModelConfig.activation
    # ModelConfig fields beyond the Llama ones, from config.json (f, n_layers) -> {field: value}
    read: Callable[[Fields, int], dict] = _nothing
    # our config -> the family's own config.json fields (cfg, which layers slide) -> {field: value}
    write: Callable[[ModelConfig, list[bool]], dict] = _nothing
    window: Callable[[Fields], int] = window_field  # the sliding window config.json asks for (0 = none)
    layer_pattern: Callable[[Fields, int], list[str]] = _every_layer  # layer_types when config.json has none
    local_rope_field: str | None = None  # the local layers' rotary base field (Gemma 3)
    block_modules: dict = field(default_factory=dict)  # our module in a block -> theirs, where not Llama's
    # Hugging Face module in a block -> the projection roles (model/hf_names.PROJECTIONS) stacked in its rows
    fused: dict = field(default_factory=dict)
    # A mixture of experts stored one module per expert (``{experts_module}.{e}.{name}.weight``, e = 0..E-1):
    # our stacked GroupedExperts weight (w1, w2, w3) -> the name of that projection inside one expert; {} = the
    # family has no experts (an MoE model of it cannot be written). The router is a block_modules entry
    # (feed_forward.router). transformers 5's fused 3-D form (``{experts_module}.gate_up_proj`` / ``down_proj``)
    # is read too (model/families.py).
    experts: dict = field(default_factory=dict)
    experts_module: str = "mlp.experts"
    # transformers 5's module names in a block where the family's files name them otherwise (Mixtral's
    # ``block_sparse_moe.`` is ``mlp.`` in its fused-expert saves): ((transformers 5's prefix, the files'), ...).
    # Read either way; export writes the files' (what save_pretrained writes by default).
    native_modules: tuple = ()
    # model_types whose config.json nests this family's as text_config, and their tensor prefixes
    wrappers: tuple = ()
    wrapper_prefixes: tuple = ()  # ((their prefix, ours), ...)
    wrapper_skipped: tuple = ()  # prefixes of tensors that are not the text decoder (left out on purpose)
    gguf: GGUFLayout | None = None
    presets: dict = field(default_factory=dict)  # name -> ModelConfig fields (model/presets.py lists them)
