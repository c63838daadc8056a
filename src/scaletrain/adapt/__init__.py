"""Fine-tuning: start from existing weights (a run or a Hugging Face folder) and adapt them - all weights,
LoRA, QLoRA (4-bit base), prompt or prefix tuning - as transforms of the pure model (docs/finetuning.md)."""

from scaletrain.adapt.base import Base, open_base, resolve_finetune
from scaletrain.adapt.methods import ADAPTER_METHODS, apply_method, load_base_and_adapters, parameter_counts

__all__ = ["ADAPTER_METHODS", "Base", "apply_method", "load_base_and_adapters", "open_base", "parameter_counts",
           "resolve_finetune"]
