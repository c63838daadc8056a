"""Data parallel with replicated weights: DDP, plus ZeRO-1 (optimizer states sharded) on top of it.

DDP is applied *after* the weights are materialized and initialised, because its constructor broadcasts
rank 0's weights (the FSDP and TP transforms, in contrast, run on the meta device).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


@dataclass
class CommCounter:
    """All-reduce calls and bytes a data-parallel mode issued (to compare DDP with local SGD / DiLoCo)."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0

    def add(self, tensor: torch.Tensor) -> None:
        self.all_reduce_calls += 1
        self.all_reduce_bytes += tensor.numel() * tensor.element_size()


def _counting_allreduce_hook(counter, bucket):  # no annotations: DDP checks them, and ours are strings
    """DDP's default all-reduce (average over the group), counted per gradient bucket."""
    counter.add(bucket.buffer())
    return default_hooks.allreduce_hook(None, bucket)


def apply_ddp(model: nn.Module, group: dist.ProcessGroup, device: torch.device,
              counter: CommCounter | None = None) -> DistributedDataParallel:
    """Wrap a materialized model in DDP over ``group``; gradients are averaged across it.

    ``gradient_as_bucket_view`` lets grads live inside the communication buckets (no second copy).
    ``broadcast_buffers=False``: the only buffers are the rotary tables, derived from the config and
    identical everywhere, so broadcasting them before every forward would be pure overhead.
    ``static_graph`` is left off so activation checkpointing and ``no_sync`` both keep working.
    """
    ddp = DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True, broadcast_buffers=False,
                                  device_ids=[device.index] if device.type == "cuda" else None)
    if counter is not None:
        ddp.register_comm_hook(counter, _counting_allreduce_hook)
    return ddp


def grad_sync_context(model: nn.Module, sync: bool):
    """``no_sync()`` on a non-final micro-step of gradient accumulation: gradients accumulate locally and
    are all-reduced once, on the final micro-step. Anything else (FSDP2 keeps reduce-scattering each
    micro-step so gradients stay sharded, i.e. ZeRO-2/3 memory) runs unchanged."""
    if isinstance(model, DistributedDataParallel) and not sync:
        return model.no_sync()
    return contextlib.nullcontext()


def build_zero1_optimizer(param_groups: list[dict], group: dist.ProcessGroup, **adamw_kwargs):
    """ZeRO stage 1: each rank keeps AdamW states only for its share of the parameters and broadcasts
    its updated parameters after the step (torch's ``ZeroRedundancyOptimizer``)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    adamw_kwargs.pop("fused", None)  # the per-rank AdamW sees only a subset; foreach/loop kernels only
    first, *rest = param_groups
    zero = ZeroRedundancyOptimizer(first["params"], optimizer_class=torch.optim.AdamW, process_group=group,
                                   weight_decay=first["weight_decay"], **adamw_kwargs)
    for extra in rest:
        zero.add_param_group(dict(extra))
    return zero
