"""fp8 training on GPUs with fp8 tensor cores (sm89+: Ada, Hopper, Blackwell) via ``torchao.float8``.

``train.precision = fp8``: the blocks' Linear layers become torchao ``Float8Linear`` (tensorwise dynamic
scaling: inputs, weights and gradients cast to float8 e4m3/e5m2 per matmul, ``torch._scaled_mm``), the rest
runs under bf16 autocast. The conversion is applied to the model on the meta device, before tensor
parallelism, activation checkpointing, compile and FSDP2, as torchao and torchtitan document; with FSDP2
(``parallel.dp_shard > 1``) the weights are all-gathered in float8 (``enable_fsdp_float8_all_gather``).
fp8 pays off only with ``train.compile = true`` (the casts fuse) and on large matmuls.

A training precision, applied by the converter list (train/converters.py). The filter and the refusals are
tested on the CPU; the conversion itself needs a GPU (``scripts/gpu_check.py --only fp8``, docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from scaletrain.core.options import ConfigError

# torchao's float8 tables (tensorwise recipe, H100): a Linear gains from fp8 only when its matmuls are large;
# below ~1024 in either dimension the casts cost more than the faster matmul saves. _scaled_mm needs both
# dimensions divisible by 16.
MIN_FP8_DIM = 1024


def fp8_filter(min_dim: int = MIN_FP8_DIM) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: the blocks' Linears whose in/out features are multiples of 16 and at least
    ``min_dim`` (the embedding, a non-Linear, and the output head stay in bf16, as in torchtitan)."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or not fqn.startswith("layers."):
            return False
        k, n = module.in_features, module.out_features
        return k % 16 == 0 and n % 16 == 0 and min(k, n) >= min_dim

    return keep


def check_fp8_device(device: torch.device) -> None:
    """One-line ConfigError unless ``device`` is a CUDA GPU with fp8 tensor cores (compute capability >= 8.9)."""
    if device.type != "cuda":
        raise ConfigError(f"train.precision=fp8 needs an NVIDIA GPU with fp8 tensor cores (sm89+: L4, L40, H100, "
                          f"B200); this run is on {device.type}: use bf16 or fp32")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"train.precision=fp8 needs compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                          f"{torch.cuda.get_device_name(device)} is sm{major}{minor}: use bf16")


def check_fp8_available() -> None:
    """One-line ConfigError unless torchao's float8 training is installed (checked before the run folder is
    taken: train/validate.py)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"train.precision=fp8 needs torchao (pip install 'scaletrain[compress]'): {exc}") from None


def convert_to_fp8(model: nn.Module, fsdp: bool = False, min_dim: int = MIN_FP8_DIM) -> int:
    """Swap the filtered Linears of ``model`` (on meta, before parallelize) for ``Float8Linear``; returns how many
    (0: every Linear is too small to gain, and the run is plain bf16). torchao is there: ``check_fp8_available``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    keep = fp8_filter(min_dim)
    chosen = sum(1 for fqn, m in model.named_modules() if keep(m, fqn))
    if chosen:
        convert_to_float8_training(model, module_filter_fn=keep,
                                   config=Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp))
    return chosen
