"""Each adapter method's peft adapter: adapter_config.json's contents and the tensors under peft's names, as
peft 0.21 writes them (its ``peft_adapter`` field in finetune/method_table.py; export.py writes the folder).
``lora_adapter`` serves LoRA, DoRA and QLoRA; ``prompt_adapter`` and ``prefix_adapter`` the virtual tokens."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import ConfigError, JobConfig
from scaletrain.finetune.lora import LoRAExperts, LoRALinear, is_nf4
from scaletrain.finetune.prompt import PrefixAttention, PromptEmbedding
from scaletrain.model.config import head_width
from scaletrain.model.family import family as family_entry
from scaletrain.model.hf_names import HF_BLOCK_PREFIX, block_suffix, hf_module_name, to_hf
from scaletrain.model.presets import kv_heads

# The fields every adapter_config.json starts with.
PEFT_COMMON = {"task_type": "CAUSAL_LM", "base_model_name_or_path": None, "inference_mode": True, "revision": None}


def _lora_tensors(module: LoRALinear) -> dict[str, torch.Tensor]:
    """One adapted projection's tensors under peft's suffixes (fp32, CPU)."""
    out = {"lora_A.weight": module.lora_A, "lora_B.weight": module.lora_B}
    if module.dora:  # peft's name for DoRA's magnitude in adapter_model.safetensors
        out["lora_magnitude_vector"] = module.lora_magnitude
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


def _fused_lora(parts: list[nn.Linear], rank: int) -> dict[str, torch.Tensor]:
    """An exact adapter of a fused projection whose parts (q, k, v or gate, up, stacked in rows) each carry their
    own: lora_A the parts' A stacked (n*r, in), lora_B block-diagonal (out, n*r), so that B A = the parts' updates
    stacked; a part without an adapter gets zeros (and, under DoRA, its row norms as magnitude: scale 1)."""
    dora = any(isinstance(p, LoRALinear) and p.dora for p in parts)
    a_blocks, b_blocks, magnitudes = [], [], []
    for part in parts:
        if isinstance(part, LoRALinear):
            tensors = _lora_tensors(part)
            a_blocks.append(tensors["lora_A.weight"])
            b_blocks.append(tensors["lora_B.weight"])
            magnitudes.append(tensors.get("lora_magnitude_vector"))
        else:
            a_blocks.append(torch.zeros(rank, part.in_features))
            b_blocks.append(torch.zeros(part.out_features, rank))
            magnitudes.append(None)
        if dora and magnitudes[-1] is None:
            weight = part.weight.get_original_weight() if is_nf4(part.weight) else part.weight
            magnitudes[-1] = torch.linalg.norm(weight.detach().float().cpu(), dim=1)
    out = {"lora_A.weight": torch.cat(a_blocks).contiguous(), "lora_B.weight": torch.block_diag(*b_blocks)}
    if dora:
        out["lora_magnitude_vector"] = torch.cat(magnitudes).contiguous()
    return out


def _lora_adapter(model: nn.Module, ft, family: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the LoRA part of adapter_config.json, the tensors under peft's names) of a LoRA/DoRA model of ``family``.
    A family that stores projections fused (its entry's ``fused``: Phi-3's qkv_proj / gate_up_proj) gets one exact
    adapter per fused module, of rank n*r (``_fused_lora``), whose alpha in ``alpha_pattern`` keeps peft's scaling
    alpha / r (alpha / sqrt(r) with rsLoRA) that of the parts."""
    tensors: dict[str, torch.Tensor] = {}
    targets = {hf_module_name(t) for t in ft.lora_targets}
    rank_pattern, alpha_pattern = {}, {}
    fused = family_entry(family).fused
    fused_roles = {role for roles in fused.values() for role in roles}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear) and not any(name.endswith(block_suffix(r)) for r in fused_roles):
            key = f"base_model.model.{to_hf(name, family)}"  # the module's name in the family's class
            tensors.update({f"{key}.{suffix}": t for suffix, t in _lora_tensors(module).items()})
    for fused_module, roles in fused.items():
        if not set(roles) & set(ft.lora_targets):
            continue
        targets -= {hf_module_name(r) for r in roles}
        short = fused_module.rpartition(".")[2]
        targets.add(short)
        n = len(roles)
        rank_pattern[short] = n * ft.lora_rank
        alpha_pattern[short] = ft.lora_alpha * (n ** 0.5 if ft.rslora else n)
        for index, block in model.layers.items():
            parts = [block.get_submodule(block_suffix(r)) for r in roles]
            key = f"base_model.model.{HF_BLOCK_PREFIX}{index}.{fused_module}"
            tensors.update({f"{key}.{suffix}": t for suffix, t in _fused_lora(parts, ft.lora_rank).items()})
    config = {"peft_type": "LORA", "r": ft.lora_rank, "lora_alpha": ft.lora_alpha, "lora_dropout": ft.lora_dropout,
              "use_rslora": ft.rslora, "bias": "none", "fan_in_fan_out": False, "target_modules": sorted(targets),
              "init_lora_weights": True, "use_dora": ft.dora, "rank_pattern": rank_pattern,
              "alpha_pattern": alpha_pattern}
    return config, tensors


def lora_adapter(model: nn.Module, cfg: JobConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """LoRA / DoRA / QLoRA's adapter (peft_type LORA)."""
    if any(isinstance(m, LoRAExperts) for m in model.modules()):
        raise ConfigError("a peft adapter of the experts' stacked adapters is not written yet: export it merged "
                          "(scaletrain export --merge), or train finetune.lora_targets without gate, up, down")
    config, tensors = _lora_adapter(model, cfg.finetune, cfg.model.family)
    return {**PEFT_COMMON, **config}, tensors


def _virtual_tokens_config(cfg: JobConfig) -> dict:
    """The fields prompt and prefix tuning's adapter_config.json share."""
    return {**PEFT_COMMON, "num_virtual_tokens": cfg.finetune.virtual_tokens, "num_layers": cfg.model.n_layers,
            "num_transformer_submodules": 1}


def prompt_adapter(model: nn.Module, cfg: JobConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """Prompt tuning's adapter (peft_type PROMPT_TUNING): the virtual tokens' embeddings."""
    m = cfg.model
    emb = next(mod for mod in model.modules() if isinstance(mod, PromptEmbedding))
    tensors = {"prompt_embeddings": emb.prompt.detach().float().cpu().contiguous()}
    return {**_virtual_tokens_config(cfg), "peft_type": "PROMPT_TUNING", "token_dim": m.dim,
            "num_attention_heads": m.n_heads, "prompt_tuning_init": "RANDOM", "prompt_tuning_init_text": None,
            "tokenizer_name_or_path": None}, tensors


def prefix_adapter(model: nn.Module, cfg: JobConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """Prefix tuning's adapter (peft_type PREFIX_TUNING): peft's layout (P, n_layers * 2 * kv_dim), per layer its
    key then its value."""
    m = cfg.model
    layers = [model.layers[str(i)].attention for i in range(m.n_layers)]
    assert all(isinstance(a, PrefixAttention) for a in layers)
    parts = [t for a in layers for t in (a.prefix_key, a.prefix_value)]
    tensors = {"prompt_embeddings": torch.cat([p.detach().float().cpu() for p in parts], dim=1).contiguous()}
    kv_dim = kv_heads(m) * head_width(m)
    return {**_virtual_tokens_config(cfg), "peft_type": "PREFIX_TUNING", "token_dim": kv_dim,
            "num_attention_heads": kv_heads(m), "encoder_hidden_size": kv_dim, "prefix_projection": False}, tensors
