"""A fine-tune read back (the "finetuned" kind of ``checkpoint.run.load_run``, the one loader of every run,
registered here at import): its checkpoint holds only the trainable tensors and a reference to its base (checked
by checksum)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from scaletrain.checkpoint.manager import load_tensors
from scaletrain.checkpoint.run import latest_checkpoint, register_loader
from scaletrain.checkpoint.state import model_tensors, trainable_names
from scaletrain.checkpoint.training import check_base
from scaletrain.config import JobConfig
from scaletrain.finetune.base import open_base
from scaletrain.finetune.methods import FinetuneMethod
from scaletrain.model import Transformer


def build_finetuned_model(cfg: JobConfig, device: str = "cpu", adapters: dict | None = None) -> nn.Module:
    """The base of ``cfg.finetune.source`` with the method's adapters (initial values unless ``adapters``)."""
    method = FinetuneMethod(cfg.finetune, cfg.train.seed, device)  # QLoRA: 4-bit on the device it runs on
    with torch.device("meta"):
        model = Transformer(cfg.model)
    method.convert(model)  # QLoRA: the 4-bit base, never whole in fp32
    model.to_empty(device=device)
    model.init_buffers()  # the rotary tables; every parameter is written just below
    model.tie_weights()
    method.load([model], adapters)
    return model


def load_finetuned(cfg: JobConfig, checkpoint: Path, device: str = "cpu") -> nn.Module:
    """The fine-tune of ``cfg`` with ``checkpoint``'s trainable tensors over its base, frozen."""
    check_base(checkpoint, open_base(cfg.finetune.source).reference(),
               "restore that base or fine-tune again from the new one")
    model = build_finetuned_model(cfg, device)
    names = trainable_names([model])
    load_tensors(checkpoint, {"model": {k: v for k, v in model_tensors([model]).items() if k in names}})
    model.requires_grad_(False)
    return model


def load_finetuned_run(run: Path, cfg: JobConfig, device: str) -> tuple[nn.Module, Path]:
    """A fine-tuned run folder: the base + its adapters (peft / torchao only when used), from its newest
    checkpoint."""
    path = latest_checkpoint(run)
    return load_finetuned(cfg, path, device), path


register_loader("finetuned", load_finetuned_run)
