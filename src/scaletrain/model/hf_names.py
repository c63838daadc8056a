"""The one table between our parameter / module names and the Hugging Face ones (Llama layout, and the few
names a family changes: ``family`` is the config.json's model_type, default "llama").

Every place that reads or writes a Hugging Face folder, a peft adapter or names a projection by its role
(``finetune.lora_targets``, tensor-parallel plans, structured pruning) goes through this module, so a model
family that names a tensor differently changes one table, not five files.

Names here are *suffixes inside a block* (``layers.<i>.`` / ``model.layers.<i>.`` stripped) or whole top-level
names. Module names have no ``.weight``/``.bias``; parameter names do.
"""

from __future__ import annotations

from scaletrain.model.family import family as family_entry

# Role (as users write it in finetune.lora_targets) -> (our module inside a block, Hugging Face module inside a
# decoder layer). The order is the order roles are listed in messages.
PROJECTIONS: dict[str, tuple[str, str]] = {
    "q": ("attention.wq", "self_attn.q_proj"),
    "k": ("attention.wk", "self_attn.k_proj"),
    "v": ("attention.wv", "self_attn.v_proj"),
    "o": ("attention.wo", "self_attn.o_proj"),
    "gate": ("feed_forward.w1", "mlp.gate_proj"),
    "up": ("feed_forward.w3", "mlp.up_proj"),
    "down": ("feed_forward.w2", "mlp.down_proj"),
}

# Our module inside a block -> the Hugging Face module inside a decoder layer, projections and norms (Llama
# layout; a family's entry in model/family/ overrides the modules it names differently).
BLOCK_MODULES: dict[str, str] = {
    **{ours: theirs for ours, theirs in PROJECTIONS.values()},
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.q_norm": "self_attn.q_norm",  # Qwen3, Gemma 3 (model.qk_norm)
    "attention.k_norm": "self_attn.k_norm",
}

# Our top-level parameter -> the Hugging Face one.
TOP_LEVEL: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

HF_BLOCK_PREFIX = "model.layers."
OUR_BLOCK_PREFIX = "layers."
# Buffers some exports carry that we derive from the config instead of reading.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def _split_param(name: str) -> tuple[str, str]:
    """'attention.wq.weight' -> ('attention.wq', 'weight')."""
    module, _, kind = name.rpartition(".")
    return module, kind


def block_modules(family: str = "llama") -> dict[str, str]:
    """Our module inside a block -> the Hugging Face one, for ``family`` (a config.json model_type): the Llama
    layout with the modules the family's entry names differently (``model/family/``, ``block_modules``)."""
    return {**BLOCK_MODULES, **family_entry(family).block_modules}


def to_hf(name: str, family: str = "llama") -> str:
    """Our parameter (or module) name -> the Hugging Face one; KeyError for a name the table does not know."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    if not name.startswith(OUR_BLOCK_PREFIX):
        raise KeyError(name)
    _, index, rest = name.split(".", 2)
    table = block_modules(family)
    if rest in table:  # a module name
        return f"{HF_BLOCK_PREFIX}{index}.{table[rest]}"
    module, kind = _split_param(rest)
    return f"{HF_BLOCK_PREFIX}{index}.{table[module]}.{kind}"


_FROM_HF_TOP = {theirs: ours for ours, theirs in TOP_LEVEL.items()}


def from_hf(name: str, family: str = "llama") -> str | None:
    """The Hugging Face parameter name -> ours; '' for a derived buffer we compute (rotary frequencies); None
    for a name the table does not know (callers refuse it rather than drop it)."""
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    if name.endswith(DERIVED_SUFFIXES):
        return ""
    if not name.startswith(HF_BLOCK_PREFIX):
        return None
    _, _, index, rest = name.split(".", 3)
    module, kind = _split_param(rest)
    ours = {theirs: ours for ours, theirs in block_modules(family).items()}.get(module)
    return f"{OUR_BLOCK_PREFIX}{index}.{ours}.{kind}" if ours else None


def block_suffix(role: str) -> str:
    """Our module inside a block for a projection role ('q' -> 'attention.wq')."""
    return PROJECTIONS[role][0]


def hf_module_name(role: str) -> str:
    """The short Hugging Face / peft module name of a role ('q' -> 'q_proj'), as in peft's target_modules."""
    return PROJECTIONS[role][1].rpartition(".")[2]
