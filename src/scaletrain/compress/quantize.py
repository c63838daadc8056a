"""Post-training quantization through torchao's ``quantize_`` (weights of the blocks' Linear layers).

Which torchao configs run depends on the machine; ``quantization_config`` picks the one for a method name
and says in one line what it used instead, or why it cannot run:

- ``int8-weight``: ``Int8WeightOnlyConfig`` (int8 weights, per-channel scales; activations stay float).
- ``int8-dynamic``: ``Int8DynamicActivationInt8WeightConfig`` (activations quantized per token at run time).
- ``int4-weight``: on CUDA ``Int4WeightOnlyConfig(group_size, int4_packing_format="tile_packed_to_4d")`` (torch's
  tinygemm kernels; the default "plain" layout needs the ``mslk`` package on CUDA as well); on the CPU that
  config does not run with torchao 0.18 (its "plain" layout needs the ``mslk`` kernel package, "tile_packed"
  needs CUDA), so ``IntxWeightOnlyConfig(torch.int4, PerGroup(group_size))``: the same int4 values and
  per-group scales, stored one value per int8 byte (no packed kernel), dequantized in the matmul.

The embedding and output head stay in float, as in torchao's LLM recipes (the head is the most
sensitive layer; on a small model it is also a large share of the parameters: see compress.json's sizes).
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.options import ConfigError

METHODS = ("int8-weight", "int8-dynamic", "int4-weight")
GROUP_SIZES = (32, 64, 128, 256)


def quantization_config(method: str, group_size: int = 128, device: str = "cpu",
                        in_features: tuple[int, ...] = ()) -> tuple[object, str]:
    """(the torchao config for ``method``, a one-line note on what runs here). A method or group size that
    cannot run is a ConfigError naming the flag."""
    try:
        from torchao.quantization import (
            Int4WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            IntxWeightOnlyConfig,
        )
        from torchao.quantization.granularity import PerGroup
    except ImportError as exc:
        raise ConfigError(f"quantization needs torchao (pip install 'scaletrain[compress]'): {exc}") from None
    if method == "int8-weight":
        return Int8WeightOnlyConfig(), "int8 weight-only (torchao Int8WeightOnlyConfig)"
    if method == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig(), \
            "int8 dynamic activation + int8 weight (torchao Int8DynamicActivationInt8WeightConfig)"
    if method != "int4-weight":
        raise ConfigError(f"--quantize {method!r}: choose one of {', '.join(METHODS)}")
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"--group-size {group_size}: int4 supports {', '.join(map(str, GROUP_SIZES))}")
    bad = sorted({f for f in in_features if f % group_size})
    if bad:
        raise ConfigError(f"--group-size {group_size} does not divide the input width {bad[0]} of a Linear "
                          f"layer: int4 is unsupported for this model at that group size; choose a group size "
                          f"that divides {bad[0]}")
    if str(device).startswith("cuda"):
        # The tinygemm layout, named: torchao 0.18's default (plain) needs the mslk kernel package on CUDA too.
        return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d"), \
            f"int4 weight-only, group {group_size} (torchao Int4WeightOnlyConfig, tinygemm kernels)"
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size)), \
        (f"int4 weight-only, group {group_size}, via torchao IntxWeightOnlyConfig: Int4WeightOnlyConfig does not "
         f"run on this CPU (its plain layout needs the mslk package, tile-packed needs CUDA), so the int4 values "
         f"are stored one per byte and dequantized per matmul (file ~int8-sized, no speed-up)")


def block_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's filter: only the transformer blocks' Linear layers (not the embedding or output head)."""
    return isinstance(module, nn.Linear) and fqn.startswith("layers.")


def quantize_model(model: nn.Module, method: str, group_size: int = 128, device: str = "cpu") -> str:
    """Quantize ``model``'s block Linears in place with torchao; returns the one-line note of what ran."""
    from torchao.quantization import quantize_

    in_features = tuple(m.in_features for n, m in model.named_modules() if block_filter(m, n))
    config, note = quantization_config(method, group_size, device, in_features)
    quantize_(model, config, filter_fn=block_filter)
    return note
