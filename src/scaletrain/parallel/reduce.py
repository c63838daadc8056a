"""Values averaged across ranks (the loss a step reports, an evaluation's loss)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain.parallel.dims import ParallelDims


def global_mean(value: torch.Tensor | None, dims: ParallelDims, device: torch.device) -> torch.Tensor:
    """The loss averaged over data-parallel ranks, on every rank. Pipeline ranks without the last stage
    contribute 0; every other degree holds copies, so dividing the world sum by world / pp is the mean."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    value = torch.zeros((), device=device) if value is None else value.detach().float()
    if dims.world_size == 1:
        return value
    total = value.clone()
    dist.all_reduce(total)
    return total / (dims.world_size // dims.pp)
