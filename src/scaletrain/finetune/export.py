"""Adapters in the ecosystem's formats: a peft adapter folder beside the exported base, or one merged folder.

``save_peft_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` as peft 0.21 writes
them (the method entry's writer, finetune/peft_format.py), so ``PeftModel.from_pretrained(<the family's
class>.from_pretrained(<exported base>), <folder>)`` loads them with our logits, for every family (tested
against peft; Phi-3's fused projections get one exact adapter each). ``merge_adapters`` folds LoRA into
the weights (prompt and prefix tuning cannot be folded: their virtual tokens are extra inputs, not a change of weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from scaletrain.config import ConfigError, JobConfig
from scaletrain.finetune.base import open_base
from scaletrain.finetune.lora import LoRAExperts, LoRALinear, merge_lora
from scaletrain.finetune.method_table import method_entry
from scaletrain.finetune.prompt import PrefixAttention, PromptEmbedding, SkipPromptLinear
from scaletrain.model import Transformer


def peft_adapter(model: nn.Module, cfg: JobConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json contents, adapter tensors under peft's names) of an adapted model: its method entry's
    ``peft_adapter`` (finetune/peft_format.py)."""
    ft = cfg.finetune
    write = method_entry(ft.method).peft_adapter
    if write is None:
        raise ConfigError(f"finetune.method {ft.method!r} has no adapter to save (full fine-tuning exports the model)")
    return write(model, cfg)


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
    if method_entry(cfg.finetune.method).virtual_tokens:
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
    return not any(isinstance(m, (LoRALinear, LoRAExperts, PromptEmbedding, SkipPromptLinear, PrefixAttention))
                   for m in model.modules())
