"""Expert parallelism (``parallel.ep``): a mixture of experts' experts split across the data-parallel ranks.

The degree is borrowed from the data-parallel dimension, as torchtitan's dp2ep: the ep ranks are data-parallel
ranks (each reads its own rows), so ep adds no idle rank. ep divides ``parallel.dp_shard`` under FSDP2 and HSDP, or
equals ``parallel.dp_replicate`` under DDP (``ParallelDims`` refuses other layouts). In pipeline stages
(``parallel.pp``, FSDP2) the dimension is this rank's row of the (pp, dp_shard) mesh: each stage's experts are
split over the ranks that hold the same stage, and only they exchange its tokens.

- The experts' stacked weights (E, ., .) become DTensors ``Shard(0)`` on that dimension's mesh: rank r holds
  experts [r * E/ep, (r + 1) * E/ep). A checkpoint (DCP) therefore holds every expert once, and loads onto
  another ep degree or one process.
- ``GroupedExperts.forward`` (the tokens sorted by expert, its counts (E,)) is replaced on the instance by
  dispatch -> the local experts (``GroupedExperts.compute`` on the local slices) -> combine, the two moves
  ``all_to_all_single`` (torch's functional, autograd-capable collective), the counts exchanged first with
  ``dist.all_to_all_single``. The model's code is unchanged.
- The dense part is averaged over the data-parallel ranks by FSDP2 / DDP. An expert's gradient arrives through
  the all-to-all's backward as the sum over the ep ranks of each one's loss gradient: it is divided by ep in the
  backward (``_ScaleGradient``). With ep = the data-parallel degree FSDP2 / DDP ignore the experts, and that is
  the gradient of the mean loss, as the dense part's is. With ep < dp_shard (FSDP2 only) each expert is
  replicated over dp_shard / ep ranks (``expert_meshes``): FSDP2 shards it over them and averages its gradient
  there, which makes the same mean. Under HSDP (dp_replicate x dp_shard) the layout is repeated in each replica
  and the experts' FSDP2 mesh is (dp_replicate, dp_shard / ep), an HSDP mesh: FSDP2 also all-reduces their
  gradients over the replicas, as the dense part's.
- With tensor parallelism (``parallel.tp``, FSDP2; Megatron's expert TP = tp) the mesh is (dp_shard, tp) and the
  experts are split on both: ``tensor.apply_expert_tp`` first splits each expert's hidden units over tp, then the
  experts become 2-D DTensors [Shard(0), that placement] on (ep, tp), a rank holding E/ep experts' h/tp slices.
  Every tp rank routes the same (replicated) tokens, so the all-to-alls run among the ranks of one tp coordinate
  (``mesh["dp_shard"]`` is that group) and no expert is computed twice. The tp collectives wrap the exchange
  (Megatron's copy to / reduce from the tensor-parallel region, ``tensor.copy_to_tensor_parallel``): the way back
  brings each rank's rows' partial outputs, summed over tp; the rows' gradient is summed over tp in the backward.
  Both act on a rank's own (M, d) rows, whose size a pipeline's shape inference (uninitialised, different tensors
  on the tp ranks, so different routing) cannot make differ. The loss gradient reaching an expert is still the sum
  over the ep ranks of one tp coordinate: the division by ep stands, and tp needs no scale of its own.
- The expert-bias counts and the logged load are summed over the data-parallel ranks (``sum_expert_counts``),
  so every rank moves the same bias and logs the global load.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from scaletrain.model.moe import EXPERT_WEIGHTS, GroupedExperts, moe_layers
from scaletrain.parallel.tensor import copy_to_tensor_parallel, reduce_from_tensor_parallel


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; the gradient times ``scale`` in backward. One node a weight: one node for a layer's
    three was tried and saved nothing measurable (benchmarks/ep_host.py)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, grad_divisor: int) -> None:
    """Shard every sparse layer's experts of ``model`` (on the meta device, or materialized) along their first
    dimension over ``ep_mesh``'s first dimension, and route their tokens through its ranks (the module docstring).
    ``ep_mesh``: 1-D (ep), or 2-D (ep, tp) when tensor parallelism has already split each expert's hidden units
    (``tensor.apply_expert_tp``): the experts become DTensors [Shard(0), their tp placement] on it.
    ``grad_divisor``: what the experts' gradients are divided by in the backward: ep, the ranks whose losses
    their gradient sums (the module docstring)."""
    for _, layer in moe_layers(model):
        experts = layer.experts
        for name in EXPERT_WEIGHTS:
            weight = getattr(experts, name)
            setattr(experts, name, nn.Parameter(_split_experts(weight.data, ep_mesh),
                                                requires_grad=weight.requires_grad))
        experts.forward = types.MethodType(_expert_parallel_forward, experts)
        experts.ep_group, experts.ep_size = ep_mesh.get_group(0), ep_mesh.size(0)
        experts.grad_scale = 1.0 / grad_divisor


def _split_experts(weight: torch.Tensor, ep_mesh: DeviceMesh) -> DTensor:
    """A stacked weight (E, ., .) as a DTensor Shard(0) over ``ep_mesh``'s first dimension. On a 2-D (ep, tp) mesh
    ``weight`` is already a tensor-parallel DTensor (its placement on the tp mesh): this rank keeps the rows of its
    ep coordinate's experts of its tp slice, the local shard of [Shard(0), that placement]."""
    if ep_mesh.ndim == 1:
        return distribute_tensor(weight, ep_mesh, [Shard(0)], src_data_rank=None)
    ep, ep_rank = ep_mesh.size(0), ep_mesh.get_local_rank(0)
    local = weight.to_local().chunk(ep)[ep_rank].clone()  # (E/ep, ., .) of the tp slice
    return DTensor.from_local(local, ep_mesh, [Shard(0), *weight.placements], run_check=False, shape=weight.shape,
                              stride=weight.stride())


def _expert_parallel_forward(self: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (M, d): this rank's routed tokens sorted by (global) expert, ``counts`` (E,) -> (M, d), the same rows.
    Under expert tensor parallelism the tp ranks hold the same x and exchange with their own ep group (the ranks of
    their tp coordinate), the way back bringing partial outputs (each rank's h/tp slices); the tp collectives wrap
    the whole exchange, on this rank's own (M, d) rows, whose size does not depend on where they were sent (a
    pipeline's shape inference routes uninitialised, different tensors on the tp ranks)."""
    x = copy_to_tensor_parallel(self, x)
    ep, group = self.ep_size, self.ep_group
    send = counts.view(ep, -1)  # (ep, E/ep): rows for each rank's experts
    received = torch.empty_like(send)  # (ep, E/ep): rows each rank sends to this rank's experts
    dist.all_to_all_single(received, send, group=group)
    input_splits, output_splits = torch.stack([send.sum(1), received.sum(1)]).tolist()  # the one read back
    rows = all_to_all_single_autograd(x, output_splits, input_splits, group)  # (M', d) by source rank, expert
    order = _by_local_expert(received, sum(output_splits))
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    weights = [_ScaleGradient.apply(getattr(self, name).to_local(), self.grad_scale) for name in EXPERT_WEIGHTS]
    out = self.compute(rows[order], received.sum(0), *weights)  # (M', d), grouped by local expert
    # (M', d) as the rows came, by source rank: a gather by the inverse permutation (index_copy would save ``out``)
    back = out[inverse]
    return reduce_from_tensor_parallel(self, all_to_all_single_autograd(back, input_splits, output_splits, group))


def _by_local_expert(received: torch.Tensor, rows: int) -> torch.Tensor:
    """The permutation (M',) that groups the rows received, which come as blocks (source rank, local expert) of
    ``received`` (ep, E/ep) rows (``rows`` of them, read back already), by local expert, source ranks in order: each
    (expert, source) block's start in the arrival order, spread over its rows (a block transpose; no sort)."""
    blocks = received.flatten()  # (ep * E/ep,) in arrival order
    starts = (blocks.cumsum(0) - blocks).view_as(received).T.flatten()  # (E/ep * ep,): by (expert, source)
    lengths = received.T.flatten()
    shift = starts - (lengths.cumsum(0) - lengths)  # each block's arrival start less its start once grouped
    return torch.arange(rows, device=received.device) + shift.repeat_interleave(lengths, output_size=rows)


def expert_meshes(mesh: DeviceMesh, dp_dim: str, ep: int, replicas: str | None = None,
                  tp: str | None = None) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the mesh the experts are split over, the mesh FSDP2 shards and averages them over: None when ep is the whole
    ``dp_dim`` and nothing replicates them). With ep < dp_shard the dimension is unflattened into (dp_shard / ep,
    ep), torchtitan's dp_shard_mod_ep x ep: the experts are split over the inner ranks and FSDP2 shards them over
    the outer ones. ``replicas`` (HSDP's ``dp_replicate``): the whole layout is repeated over that dimension, and
    the experts' FSDP2 mesh is (replicas, dp_shard_mod_ep), an HSDP mesh whose shard dimension may be 1: FSDP2
    all-reduces the experts' gradients over the replicas, as it does the dense part's. ``tp`` (the tensor-parallel
    dimension): the experts' mesh is 2-D, (ep, tp), each expert also split over tp (``apply_ep``)."""
    dp = mesh[dp_dim]
    if dp.size() == ep and replicas is None:
        return (mesh[(dp_dim, tp)] if tp else dp), None
    outer = f"{dp_dim}_mod_ep"
    split = mesh._unflatten(dp_dim, (dp.size() // ep, ep), (outer, "ep"))
    return split[("ep", tp)] if tp else split["ep"], split[(replicas, outer)] if replicas else split[outer]


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """The expert-parallel experts of ``model`` (what FSDP2 shards over the mesh they are replicated on)."""
    return [layer.experts for _, layer in moe_layers(model) if hasattr(layer.experts, "ep_group")]


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert-parallel (sharded) expert weights of ``model``: what FSDP2 and DDP leave alone."""
    return {p for module in expert_modules(model) for p in module.parameters()}


def ignore_experts_in_ddp(model: nn.Module) -> None:
    """Before DDP wraps ``model``: its constructor would broadcast rank 0's experts over the others' and its
    all-reduce would average experts that are not replicas."""
    ignored = {id(p) for p in expert_parameters(model)}
    names = [name for name, p in model.named_parameters() if id(p) in ignored]
    if names:
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


@torch.no_grad()
def sum_expert_counts(models: list[nn.Module], names: tuple[str, ...], group: dist.ProcessGroup | None) -> None:
    """Sum the sparse layers' count buffers ``names`` (``tokens_since_update`` before the bias moves;
    ``tokens_since_log``, ``dropped_since_log`` before the load is logged) over the data-parallel ``group``
    (None: the world), in one all-reduce: every rank then holds the global counts."""
    buffers = [getattr(layer, name) for model in models for _, layer in moe_layers(model) for name in names]
    if not buffers:
        return
    flat = torch.cat([b.reshape(-1) for b in buffers])  # (n,) int64
    dist.all_reduce(flat, group=group)
    for buffer, summed in zip(buffers, flat.split([b.numel() for b in buffers])):
        buffer.copy_(summed.view_as(buffer))
