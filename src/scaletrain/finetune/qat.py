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

from scaletrain.config import ConfigError, FinetuneConfig, ModelConfig
from scaletrain.model.config import head_width
from scaletrain.model.presets import ffn_hidden_dim


def check_qat(ft: FinetuneConfig, model: ModelConfig, here: bool = True) -> None:
    """``finetune.qat``'s rules on the fine-tune's model (the base's shape), checked before the run folder is
    taken (train/validate.py): torchao installed (``here``: on this machine), and an int4 group size that
    divides the input width of every block Linear (dim for q/k/v/gate/up, the heads' width for o, the SwiGLU
    hidden size for down)."""
    if not ft.qat:
        return
    if here:
        try:
            import torchao.quantization.qat  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"finetune.qat needs torchao (pip install 'scaletrain[compress]'): {exc}") from None
    widths = sorted({model.dim, model.n_heads * head_width(model), ffn_hidden_dim(model)})
    bad = [w for w in widths if w % ft.qat_group_size]
    if ft.qat == "int4-weight" and bad:
        raise ConfigError(f"finetune.qat_group_size={ft.qat_group_size} does not divide the input width {bad[0]} of "
                          f"a Linear layer; choose one that divides it")


def qat_base_config(method: str, group_size: int):
    """The torchao post-training config whose rounding the fake quantization imitates (torchao is installed:
    ``check_qat``)."""
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if method == "int4-weight":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    assert method == "int8-weight", method  # FinetuneConfig.qat's choices
    # QATConfig takes no Int8WeightOnlyConfig: the same per-row int8 grid, as Intx
    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def prepare_qat(model: nn.Module, ft: FinetuneConfig) -> int:
    """Fake-quantize ``model``'s block Linears in place (before the optimizer is built); returns how many.
    ``ft`` passed ``check_qat``."""
    if not ft.qat:
        return 0
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    def is_block_linear(module: nn.Module, fqn: str) -> bool:
        return type(module) is nn.Linear and fqn.startswith("layers.")

    count = sum(1 for name, module in model.named_modules() if is_block_linear(module, name))
    quantize_(model, QATConfig(qat_base_config(ft.qat, ft.qat_group_size), step="prepare"), filter_fn=is_block_linear)
    return count
