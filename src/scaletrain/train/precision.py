"""Mixed precision: autocast context plus a gradient scaler for fp16."""

from __future__ import annotations

import contextlib

import torch

from scaletrain.config import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available (use cpu or auto)")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    """auto -> bf16 on a GPU that supports it, else fp32. fp16 needs a GPU (CPU autocast fp16 is slow)."""
    if name == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs a GPU; use fp32 (or bf16) on the CPU")
    return name


def autocast(precision: str, device: torch.device):
    """Weights stay fp32 (the optimizer's master copy); matmuls run in the low-precision dtype."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A real scaler for fp16 (its range is too narrow for small gradients); a disabled one otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
