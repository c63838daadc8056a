"""Keep a pruned base's zeros while fine-tuning all weights (``finetune.keep_zeros``).

Every block Linear weight that is exactly zero in the base (the mask unstructured / 2:4 pruning wrote) gets a
gradient hook that zeroes its gradient there. With a zero gradient from the start, AdamW's moments stay zero
at those entries, so its update there is 0 / (0 + eps) = 0, and decoupled weight decay scales a zero to zero:
the entries stay exactly zero through every step, and the saved checkpoint keeps the pattern. Plain
(unsharded) parameters only: the rule in ``train/validate.py`` refuses tensor parallelism and FSDP.
"""

from __future__ import annotations

from torch import nn


def keep_zeros(model: nn.Module) -> int:
    """Register the gradient masks on ``model``'s block Linear weights; returns how many weights are held at 0."""
    held = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("layers.") and module.weight.requires_grad:
            mask = (module.weight.detach() != 0).to(module.weight.dtype)
            zeros = int(mask.numel() - mask.sum())
            if zeros:
                module.weight.register_hook(lambda grad, mask=mask: grad * mask)
                held += zeros
    return held

