"""Per-block ``torch.compile``.

Every transformer block has the same code, so compiling blocks one by one (instead of the whole model)
compiles that code once and reuses it, and it composes with FSDP2 (whose hooks stay outside the compiled
region) and with pipeline stages. ``Module.compile()`` compiles in place, keeping parameter names.
"""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module) -> None:
    for block in model.layers.values():
        block.compile()
