"""Fine-tuning: start from existing weights (a run or a Hugging Face folder) and adapt them - all weights,
LoRA, QLoRA (4-bit base), prompt or prefix tuning - as transforms of the pure model (docs/finetuning.md).

The names below are loaded on first use (``scaletrain/core/lazy.py``): the entry check imports ``finetune.lora``
and the method table (``method_table``: no checkpoint code) alone, and ``base`` and ``methods`` load the
checkpoint stack and the parallel package."""

from scaletrain.core.lazy import lazy_exports

_WHERE = {"Base": "base", "open_base": "base", "resolve_finetune": "base", "parameter_counts": "methods"}
__all__ = list(_WHERE)
__getattr__ = lazy_exports(__name__, _WHERE)
