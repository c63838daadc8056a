"""Adapters in the ecosystem's formats: a peft adapter folder beside the exported base, or one merged folder.

``save_peft_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` as peft 0.21 writes
them, so ``PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(<exported base>), <folder>)`` loads
them (tested against peft). ``merge_adapters`` folds LoRA into the weights (prompt and prefix tuning cannot
be folded: their virtual tokens are extra inputs, not a change of weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from scaletrain.adapt.base import open_base
from scaletrain.adapt.lora import LoRALinear, merge_lora
from scaletrain.adapt.prompt import PrefixAttention, PromptEmbedding, SkipPromptLinear
from scaletrain.config import ConfigError, JobConfig
from scaletrain.model import Transformer
from scaletrain.model.config import head_width
from scaletrain.model.hf_names import hf_module_name, to_hf
from scaletrain.model.presets import kv_heads


def peft_adapter(model: nn.Module, cfg: JobConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json contents, adapter tensors under peft's names) of an adapted model."""
    ft, m = cfg.finetune, cfg.model
    common = {"task_type": "CAUSAL_LM", "base_model_name_or_path": None, "inference_mode": True,
              "revision": None}
    tensors: dict[str, torch.Tensor] = {}
    if ft.method in ("lora", "qlora"):
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                key = f"base_model.model.{to_hf(name)}"  # the module's name in transformers' Llama
                tensors[f"{key}.lora_A.weight"] = module.lora_A.detach().float().cpu().contiguous()
                tensors[f"{key}.lora_B.weight"] = module.lora_B.detach().float().cpu().contiguous()
                if module.dora:  # peft's name for DoRA's magnitude in adapter_model.safetensors
                    tensors[f"{key}.lora_magnitude_vector"] = module.lora_magnitude.detach().float().cpu().contiguous()
        config = {**common, "peft_type": "LORA", "r": ft.lora_rank, "lora_alpha": ft.lora_alpha,
                  "lora_dropout": ft.lora_dropout, "use_rslora": ft.rslora, "bias": "none", "fan_in_fan_out": False,
                  "target_modules": sorted(hf_module_name(t) for t in ft.lora_targets), "init_lora_weights": True,
                  "use_dora": ft.dora}
        return config, tensors
    prompt = {**common, "num_virtual_tokens": ft.virtual_tokens, "num_layers": m.n_layers,
              "num_transformer_submodules": 1}
    if ft.method == "prompt":
        emb = next(mod for mod in model.modules() if isinstance(mod, PromptEmbedding))
        tensors["prompt_embeddings"] = emb.prompt.detach().float().cpu().contiguous()
        return {**prompt, "peft_type": "PROMPT_TUNING", "token_dim": m.dim, "num_attention_heads": m.n_heads,
                "prompt_tuning_init": "RANDOM", "prompt_tuning_init_text": None,
                "tokenizer_name_or_path": None}, tensors
    if ft.method == "prefix":
        # peft's layout: (P, n_layers * 2 * kv_dim), per layer its key then its value.
        layers = [model.layers[str(i)].attention for i in range(m.n_layers)]
        assert all(isinstance(a, PrefixAttention) for a in layers)
        parts = [t for a in layers for t in (a.prefix_key, a.prefix_value)]
        tensors["prompt_embeddings"] = torch.cat([p.detach().float().cpu() for p in parts], dim=1).contiguous()
        kv_dim = kv_heads(m) * head_width(m)
        return {**prompt, "peft_type": "PREFIX_TUNING", "token_dim": kv_dim, "num_attention_heads": kv_heads(m),
                "encoder_hidden_size": kv_dim, "prefix_projection": False}, tensors
    raise ConfigError(f"finetune.method {ft.method!r} has no adapter to save (full fine-tuning exports the model)")


def save_peft_adapter(model: nn.Module, cfg: JobConfig, out_dir: str | Path) -> Path:
    """Write a peft adapter folder (adapter_config.json, adapter_model.safetensors)."""
    config, tensors = peft_adapter(model, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def merge_adapters(model: nn.Module, cfg: JobConfig) -> nn.Module:
    """A plain model with the adapters folded in (LoRA, and full fine-tuning as it is)."""
    if cfg.finetune.method in ("prompt", "prefix"):
        raise ConfigError(f"finetune.method={cfg.finetune.method}: virtual tokens cannot be merged into the "
                          f"weights; export without --merge (base + peft adapter folder)")
    return merge_lora(model)


@torch.no_grad()
def base_model(cfg: JobConfig) -> nn.Module:
    """The run's base as a plain fp32 model (what an unmerged adapter export ships next to the adapter)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device="cpu")
    model.init_weights()
    state = open_base(cfg.finetune.source).state()
    model.load_state_dict(state)
    return model


def is_plain(model: nn.Module) -> bool:
    """No adapter module left (what ``export_hf`` can write)."""
    return not any(isinstance(m, (LoRALinear, PromptEmbedding, SkipPromptLinear, PrefixAttention))
                   for m in model.modules())
