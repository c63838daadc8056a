"""Fine-tuning: start from existing weights (a run or a Hugging Face folder) and adapt them - all weights,
LoRA, QLoRA (4-bit base), prompt or prefix tuning - as transforms of the pure model (docs/finetuning.md).

The names below are loaded on first use (PEP 562): the entry check imports ``adapt.lora`` alone, and ``base``
and ``methods`` load the checkpoint stack and the parallel package (about a second of ``scaletrain plan``)."""

from __future__ import annotations

import importlib

_WHERE = {"Base": "base", "open_base": "base", "resolve_finetune": "base", "ADAPTER_METHODS": "methods",
          "apply_method": "methods", "load_base_and_adapters": "methods", "parameter_counts": "methods"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # found directly from now on
    return value
