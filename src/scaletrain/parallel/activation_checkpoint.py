"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

``full`` wraps every block, ``selective`` every ``ac_every``-th block (a memory / recompute trade-off in
between). The block's ``forward`` is wrapped in place rather than the module replaced by a wrapper
module, so parameter names (and therefore checkpoints, optimizer groups and initialisation) do not change.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        # Non-reentrant: works with FSDP2/DTensor hooks, keyword arguments and inputs without grad.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_ac(model: nn.Module, mode: str, every: int = 2) -> int:
    """Wrap the blocks of ``model`` for ``mode`` in {none, selective, full}; returns how many were wrapped."""
    if mode == "none":
        return 0
    wrapped = 0
    for name, block in model.layers.items():
        if mode == "full" or int(name) % every == 0:
            block.forward = _checkpointed(block.forward)
            wrapped += 1
    return wrapped
