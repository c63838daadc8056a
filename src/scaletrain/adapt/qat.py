"""Quantization-aware fine-tuning (``finetune.qat``): torchao fake-quantization of the blocks' Linear weights.

``QATConfig(base, step="prepare")`` swaps each block ``nn.Linear`` for torchao's ``FakeQuantizedLinear``, which
keeps the same ``weight`` parameter (same name, same tensor: the optimizer, checkpoints and export see a plain
model) and rounds it to the target grid in the forward, with a straight-through gradient; the model learns
weights that survive the rounding. The run's checkpoint holds float weights: quantize them for real with
``scaletrain compress --run RUN --quantize int4-weight --group-size G`` (the same grid: ``base`` below is the
config ``compress/quantize.py`` uses on the CPU; on CUDA it uses the tinygemm int4 layout, whose asymmetric
grid differs slightly).
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import ConfigError, FinetuneConfig


def qat_base_config(method: str, group_size: int):
    """The torchao post-training config whose rounding the fake quantization imitates."""
    try:
        from torchao.quantization import IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerAxis, PerGroup
    except ImportError as exc:
        raise ConfigError(f"finetune.qat needs torchao (pip install 'scaletrain[compress]'): {exc}") from None
    if method == "int4-weight":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    if method == "int8-weight":  # QATConfig takes no Int8WeightOnlyConfig: the same per-row int8 grid, as Intx
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    raise ConfigError(f"finetune.qat={method!r}: choose int4-weight or int8-weight")


def prepare_qat(model: nn.Module, ft: FinetuneConfig) -> int:
    """Fake-quantize ``model``'s block Linears in place (before the optimizer is built); returns how many."""
    if not ft.qat:
        return 0
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith("layers.")]
    bad = sorted({m.in_features for _, m in linears if m.in_features % ft.qat_group_size})
    if ft.qat == "int4-weight" and bad:
        raise ConfigError(f"finetune.qat_group_size={ft.qat_group_size} does not divide the input width {bad[0]} of "
                          f"a Linear layer; choose one that divides it")
    quantize_(model, QATConfig(qat_base_config(ft.qat, ft.qat_group_size), step="prepare"),
              filter_fn=lambda m, fqn: type(m) is nn.Linear and fqn.startswith("layers."))
    return len(linears)
