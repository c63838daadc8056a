"""Each adapter method's peft adapter: adapter_config.json's contents and the tensors under peft's names, as
peft 0.21 writes them (its ``peft_adapter`` field in finetune/method_table.py; export.py writes the folder).
``lora_adapter`` serves LoRA, DoRA and QLoRA; ``prompt_adapter`` and ``prefix_adapter`` the virtual tokens."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import ConfigError, JobConfig
from scaletrain.finetune.lora import ROUTER, LoRAExperts, LoRALinear, is_nf4
from scaletrain.finetune.prompt import PrefixAttention, PromptEmbedding
from scaletrain.model.config import head_width
from scaletrain.model.families import FUSED_DOWN, FUSED_GATE_UP
from scaletrain.model.family import family as family_entry
from scaletrain.model.hf_names import HF_BLOCK_PREFIX, block_modules, block_suffix, hf_module_name, to_hf
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
    alpha / r (alpha / sqrt(r) with rsLoRA) that of the parts. A mixture of experts' adapters (the experts', the
    router's) are peft's ``target_parameters`` (``_expert_adapter``)."""
    tensors: dict[str, torch.Tensor] = {}
    targets = {hf_module_name(t) for t in ft.lora_targets if t != ROUTER}
    rank_pattern, alpha_pattern = {}, {}
    fused = family_entry(family).fused
    fused_roles = {role for roles in fused.values() for role in roles}
    skipped = tuple(block_suffix(r) for r in fused_roles) + (ROUTER_MODULE,)
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear) and not name.endswith(skipped):
            key = f"base_model.model.{to_hf(name, family)}"  # the module's name in the family's class
            tensors.update({f"{key}.{suffix}": t for suffix, t in _lora_tensors(module).items()})
    if any(isinstance(m, LoRAExperts) for m in model.modules()) or ROUTER in ft.lora_targets:
        # A mixture of experts: peft 0.21 reads gate_proj / up_proj / down_proj (Mixtral's w1 / w2 / w3, gate) in
        # target_modules as transformers 4's per-expert modules and remaps them onto the fused experts, so a dense
        # block's feed-forward (Qwen3-MoE's mlp_only_layers) goes in target_parameters as its 2-D weight
        # (``_expert_adapter``); target_modules keeps the attention's modules that are adapted.
        targets = {name.rpartition(".")[2] for name in _adapted_modules(model, family, feed_forward=False)}
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
    parameters = _expert_adapter(model, ft, family, tensors)
    if parameters:
        config.update(target_parameters=parameters["targets"], lora_dropout=0.0)
        rank_pattern.update(parameters["rank_pattern"])
        alpha_pattern.update(parameters["alpha_pattern"])
    return config, tensors


# The router's module inside one of our blocks (the role ``router``).
ROUTER_MODULE = "feed_forward.router"
# transformers 5's fused expert parameters (model/families.py), in the order its experts modules (Qwen3MoeExperts,
# OlmoeExperts, MixtralExperts) define them, and our stacked weights each holds in its rows: gate_up_proj (E, 2h, d)
# = [w1; w3] an expert, down_proj (E, d, h) = w2. peft wraps a module's targeted parameters in that order, each
# ParamWrapper around the one before, so an earlier one's tensors sit one ``base_layer.`` deeper per later one.
EXPERT_PARAMETERS = ((FUSED_GATE_UP, ("w1", "w3")), (FUSED_DOWN, ("w2",)))


def _adapted_modules(model: nn.Module, family: str, feed_forward: bool) -> list[str]:
    """The Hugging Face modules inside a decoder layer (``mlp.gate_proj``) of the adapted projections (not the
    router) that are in the feed-forward (``feed_forward``) or not."""
    names = {to_hf(name, family).split(".", 3)[3] for name, m in model.named_modules()
             if isinstance(m, LoRALinear) and not name.endswith(ROUTER_MODULE)
             and (".feed_forward." in name) == feed_forward}
    return sorted(names)


def _in_memory(module: str, fam) -> str:
    """A module inside a decoder layer under the family's file names -> transformers 5's (Mixtral's
    ``block_sparse_moe.`` is ``mlp.`` in memory, its ``native_modules``): peft adapts the loaded model's modules."""
    for native, stored in fam.native_modules:
        if module.startswith(stored):
            return native + module[len(stored):]
    return module


def _stacked_expert_lora(experts: LoRAExperts, keys: tuple[str, ...], rank: int) -> dict[str, torch.Tensor]:
    """One fused expert parameter's peft tensors, exact: per expert e, A_e = the parts' A stacked (n r, in) and B_e
    block-diagonal (n out, n r), so that B_e A_e = the parts' updates stacked in rows (a part without an adapter
    gets zeros); then peft's ParamWrapper layout (its ``get_delta_factors``): lora_A (E n r, in), expert-major,
    and lora_B (n out, n r E) with the expert index fastest: lora_B[o, j E + e] = B_e[o, j]."""
    a_blocks, b_blocks = [], []
    for key in keys:
        n_experts, out_features, in_features = experts.weight_shape(key)
        if key in experts.adapters:
            adapter = experts.adapters[key]
            a_blocks.append(adapter.lora_A.detach().float().cpu())  # (E, r, in)
            b_blocks.append(adapter.lora_B.detach().float().cpu())  # (E, out, r)
        else:
            a_blocks.append(torch.zeros(n_experts, rank, in_features))
            b_blocks.append(torch.zeros(n_experts, out_features, rank))
    a = torch.cat(a_blocks, dim=1)  # (E, n r, in)
    b = torch.stack([torch.block_diag(*(block[e] for block in b_blocks)) for e in range(a.shape[0])])  # (E, n out, n r)
    return {"lora_A.weight": a.reshape(-1, a.shape[-1]).contiguous(),
            "lora_B.weight": b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()}


def _expert_adapter(model: nn.Module, ft, family: str, tensors: dict[str, torch.Tensor]) -> dict | None:
    """The experts' and the router's adapters as peft's ``target_parameters`` (peft 0.21's documented way for
    transformers 5's 3-D experts, ``lora.ParamWrapper``); their tensors added to ``tensors``. None: neither adapted.
    gate and up share one fused parameter: one adapter of rank 2r (``_stacked_expert_lora``) whose alpha keeps
    the parts' scaling. peft's ParamWrapper takes no DoRA: refused in one line."""
    experts = {name: m for name, m in model.named_modules() if isinstance(m, LoRAExperts)}
    routers = {name: m for name, m in model.named_modules()
               if isinstance(m, LoRALinear) and name.endswith(ROUTER_MODULE)}
    if not experts and not routers:
        return None
    fam = family_entry(family)
    if not fam.experts:
        raise ConfigError(f"model.family = {family} has no Hugging Face class with experts to load a peft adapter "
                          f"onto (our own MoE model): export it merged (scaletrain export --merge)")
    if ft.dora:
        raise ConfigError("finetune.dora on the experts or the router has no peft adapter (peft's target_parameters "
                          "take no DoRA): export it merged (scaletrain export --merge)")
    targets, rank_pattern, alpha_pattern = set(), {}, {}
    experts_module = _in_memory(fam.experts_module, fam)
    for name, module in experts.items():
        index = name.split(".")[1]
        chosen = [(p, keys) for p, keys in EXPERT_PARAMETERS if set(keys) & set(module.adapters)]
        for position, (parameter, keys) in enumerate(chosen):
            nesting = "base_layer." * (len(chosen) - 1 - position)
            key = f"base_model.model.{HF_BLOCK_PREFIX}{index}.{experts_module}.{nesting}"
            tensors.update({key + suffix: t for suffix, t in _stacked_expert_lora(module, keys, ft.lora_rank).items()})
            target = f"{experts_module}.{parameter}"
            targets.add(target)
            if len(keys) > 1:
                rank_pattern[target] = len(keys) * ft.lora_rank
                alpha_pattern[target] = ft.lora_alpha * (len(keys) ** 0.5 if ft.rslora else len(keys))
    router_module = _in_memory(block_modules(family)[ROUTER_MODULE], fam)
    for name, module in routers.items():  # the router's 2-D weight: a ParamWrapper of one "expert", B A as a Linear's
        key = f"base_model.model.{HF_BLOCK_PREFIX}{name.split('.')[1]}.{router_module}"
        tensors.update({f"{key}.{suffix}": t for suffix, t in _lora_tensors(module).items()})
        targets.add(f"{router_module}.weight")
    targets.update(f"{_in_memory(module, fam)}.weight" for module in _adapted_modules(model, family, feed_forward=True))
    return {"targets": sorted(targets), "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}


def lora_adapter(model: nn.Module, cfg: JobConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """LoRA / DoRA / QLoRA's adapter (peft_type LORA)."""
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
