"""Context parallelism: the sequence is split across ``cp`` ranks and attention is computed with ring
communication, through torch's ``context_parallel`` API.

torch's implementation has no CPU path (there is no sharding strategy for the CPU flash-attention
kernel), so on a machine without a GPU this refuses with a clear error up front.
"""

from __future__ import annotations

import torch

from scaletrain.config import ConfigError


def check_context_parallel_supported(device: torch.device) -> None:
    """One-line error instead of a NotImplementedError deep inside DTensor dispatch."""
    if device.type != "cuda":
        raise ConfigError(f"parallel.cp > 1 (context parallelism) is not supported on this device "
                          f"({device.type}): torch implements it for GPU attention kernels only; use parallel.cp=1")


def context_parallel_context(cp_mesh, buffers: list[torch.Tensor], seq_dims: list[int]):
    """Shard ``buffers`` (inputs, targets, rotary tables) along their sequence dims for the enclosed
    forward and backward, and run SDPA as ring attention over ``cp_mesh``."""
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims)
