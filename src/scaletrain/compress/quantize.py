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

from scaletrain.core.options import ConfigError

METHODS = ("int8-weight", "int8-dynamic", "int4-weight")
GROUP_SIZES = (32, 64, 128, 256)  # what Int4WeightOnlyConfig's tinygemm kernels (CUDA) accept
CPU_GROUP_SIZES = (8, 16) + GROUP_SIZES  # IntxWeightOnlyConfig (the CPU path) takes any group that divides a row
AUTO_GROUP_SIZE = 128  # torchao's default; --group-size 0 takes it where it divides every layer


def resolve_group_size(requested: int, in_features: tuple[int, ...], device: str = "cpu") -> tuple[int, str]:
    """(the int4 group size, a note when it is not what was asked). ``requested`` 0 = auto: 128 where it divides
    every block Linear's input width, else the largest smaller accepted size that does (the ``micro`` preset's
    SwiGLU width 688 = 43 x 16 takes 16 on the CPU). A size that cannot run is a ConfigError naming the flag."""
    accepted = GROUP_SIZES if str(device).startswith("cuda") else CPU_GROUP_SIZES
    widths = sorted(set(in_features))
    if requested:
        if requested not in accepted:
            raise ConfigError(f"--group-size {requested}: int4 on {device} supports {', '.join(map(str, accepted))} "
                              f"(0 = the largest that divides every layer)")
        bad = [f for f in widths if f % requested]
        if bad:
            fits = [g for g in accepted if all(f % g == 0 for f in widths)]
            hint = f"--group-size {max(fits)} (or 0, auto) divides them all" if fits else \
                f"no int4 group size accepted on {device} ({', '.join(map(str, accepted))}) divides it"
            raise ConfigError(f"--group-size {requested} does not divide the input width {bad[0]} of a Linear "
                              f"layer: {hint}")
        return requested, ""
    fits = [g for g in accepted if g <= AUTO_GROUP_SIZE and all(f % g == 0 for f in widths)]
    if not fits:
        raise ConfigError(f"int4 cannot quantize this model on {device}: no group size it accepts "
                          f"({', '.join(map(str, accepted))}) divides every input width ({', '.join(map(str, widths))})"
                          + ("; on the CPU a group of 8 or 16 may" if str(device).startswith("cuda") else ""))
    group = max(fits)
    if group == AUTO_GROUP_SIZE:
        return group, ""
    odd = next(f for f in widths if f % AUTO_GROUP_SIZE)
    return group, f"group size {group}, not {AUTO_GROUP_SIZE}: {AUTO_GROUP_SIZE} does not divide the input width {odd}"


def quantization_config(method: str, group_size: int = 0, device: str = "cpu",
                        in_features: tuple[int, ...] = ()) -> tuple[object, str]:
    """(the torchao config for ``method``, a one-line note on what runs here). A method or group size that
    cannot run is a ConfigError naming the flag; ``group_size`` 0 = auto (``resolve_group_size``)."""
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
    group_size, why = resolve_group_size(group_size, in_features, device)
    why = f" ({why})" if why else ""
    if str(device).startswith("cuda"):
        # The tinygemm layout, named: torchao 0.18's default (plain) needs the mslk kernel package on CUDA too.
        return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d"), \
            f"int4 weight-only, group {group_size}{why} (torchao Int4WeightOnlyConfig, tinygemm kernels)"
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size)), \
        (f"int4 weight-only, group {group_size}{why}, via torchao IntxWeightOnlyConfig: Int4WeightOnlyConfig does "
         f"not run on this CPU (its plain layout needs the mslk package, tile-packed needs CUDA), so the int4 values "
         f"are stored one per byte and dequantized per matmul (file ~int8-sized, no speed-up)")


def block_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's filter: only the transformer blocks' Linear layers (not the embedding or output head)."""
    return isinstance(module, nn.Linear) and fqn.startswith("layers.")


def block_input_widths(model: nn.Module) -> tuple[int, ...]:
    """The input widths of the Linears ``block_filter`` picks (what an int4 group size must divide)."""
    return tuple(m.in_features for n, m in model.named_modules() if block_filter(m, n))


def quantize_model(model: nn.Module, method: str, group_size: int = 0, device: str = "cpu") -> str:
    """Quantize ``model``'s block Linears in place with torchao; returns the one-line note of what ran.
    ``group_size`` (int4) 0 = auto; a saved run records the size used, so a reload quantizes alike."""
    from torchao.quantization import quantize_

    config, note = quantization_config(method, group_size, device, block_input_widths(model))
    quantize_(model, config, filter_fn=block_filter)
    return note
