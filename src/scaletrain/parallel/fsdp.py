"""Sharded data parallel with FSDP2 (``fully_shard``): ZeRO-2-like and ZeRO-3, HSDP, mixed precision,
CPU offload.

How this maps to the ZeRO paper's stages (honestly):
- ZeRO-3 = ``reshard_after_forward=True``: parameters, gradients and optimizer states are all sharded;
  each block's parameters are all-gathered for its forward and again for its backward.
- "ZeRO-2-like" = ``reshard_after_forward=False``: gradients and optimizer states are sharded and the
  gathered parameters are *kept* from forward to backward (one all-gather per step instead of two).
  Unlike ZeRO-2, parameters are still sharded at rest (after backward), so memory is never worse.

Each transformer block is its own FSDP unit (communication of block i+1 overlaps compute of block i);
the root unit holds the embedding, the final norm and the output head.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fsdp_policies(param_dtype: str, cpu_offload: bool) -> dict:
    """Keyword arguments for ``fully_shard``: gathered params in ``param_dtype``, gradients reduced in fp32
    (bf16 reductions lose precision across many ranks); sharded state optionally kept on the CPU."""
    kwargs: dict = {"mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)}
    if cpu_offload:
        # Pinned host memory needs an accelerator; without one the default policy fails on a CPU-only machine.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return kwargs


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool, param_dtype: str = "fp32",
               cpu_offload: bool = False, ignored_params: set[nn.Parameter] | None = None,
               experts: tuple[list[nn.Module], DeviceMesh] | None = None) -> nn.Module:
    """Shard every block, then the root, over ``dp_mesh`` (1-D: FSDP; 2-D replicate x shard: HSDP).

    Works on the meta device and on top of tensor parallelism (the DTensor params gain a dp dimension).
    ``ignored_params``: left unsharded and unreduced (expert-parallel experts, already split over the same ranks).
    ``experts``: expert-parallel expert modules and the part of the data-parallel ranks they are replicated over
    (parallel/expert.py; 2-D under HSDP: the replicas x the rest of the shard group): each sharded there first, its
    own unit, so its gradient is averaged over those ranks.
    """
    kwargs = fsdp_policies(param_dtype, cpu_offload)
    for module in experts[0] if experts else ():
        fully_shard(module, mesh=experts[1], reshard_after_forward=reshard_after_forward, **kwargs)
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    return model
