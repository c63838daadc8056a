"""Tensor parallelism (Megatron-style, via DTensor ``parallelize_module``) and sequence parallelism.

Per block: q/k/v and the SwiGLU w1/w3 are split by output columns (each rank owns a slice of the heads
and of the hidden units), ``wo`` and ``w2`` by input rows, so each attention / MLP costs one reduction.
The embedding is split by vocabulary rows; the output head by vocabulary columns, and its logits stay
sharded for ``loss_parallel`` (the softmax is computed without ever gathering the full vocabulary).

With sequence parallelism the norms (and the residual stream between blocks) are split along the
sequence: the reductions become reduce-scatter + all-gather pairs, and activation memory drops by tp. A sparse
feed-forward (mixture of experts) all-gathers its sequence shard and routes the replicated tokens, as without
sequence parallelism; its output returns to the shard as a local slice (``_sparse_sequence_parallel``).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from scaletrain.model.hf_names import PROJECTIONS, block_suffix
from scaletrain.model.moe import EXPERT_WEIGHTS, GroupedExperts, MoEFeedForward

# Projections split by input rows (their outputs are partial sums, reduced once); the others by output columns.
ROW_SPLIT = ("o", "down")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> nn.Module:
    """Split ``model`` (a full model or one pipeline stage) over ``tp_mesh`` in place."""
    residual = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream (B, T, d)
    top: dict = {}
    if model.tok_embeddings is not None:
        # Output stays a DTensor so the model reads the *global* sequence length for its rotary tables.
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                                use_local_output=False)
    elif sequence_parallel:
        # A later pipeline stage receives its sequence shard as a plain tensor: view it as the DTensor
        # it is, again so the model sees the global sequence length.
        top[""] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                     use_local_output=False)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    for name, style in top.items():
        parallelize_module(model if name == "" else model.get_submodule(name), tp_mesh, style)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_wait_collective)

    for block in model.layers.values():
        sparse = isinstance(block.feed_forward, MoEFeedForward)
        plan: dict = {
            # Enter each block with a plain local tensor (the residual stream then stays local; mixing a
            # DTensor residual with local branch outputs would fail). Hence use_local_output=True.
            "": PrepareModuleInput(input_layouts=(residual, None, None, None),
                                   desired_input_layouts=(residual, None, None, None), use_local_output=True),
            "attention": PrepareModuleInput(input_layouts=(residual, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            # a sparse feed-forward computes on the local (replicated) tokens (parallel/expert.py)
            "feed_forward": (_sparse_sequence_parallel() if sparse and sequence_parallel else
                             PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),),
                                                use_local_output=sparse)),
        }
        for role in PROJECTIONS:  # the projections by role (model/hf_names.py)
            if sparse and block_suffix(role).startswith("feed_forward."):
                continue  # its experts: apply_expert_tp below
            plan[block_suffix(role)] = (RowwiseParallel(output_layouts=residual) if role in ROW_SPLIT
                                        else ColwiseParallel())
        if block.attention.q_norm is not None:
            # Qwen3 / Gemma 3 q/k norms act over head_dim on each rank's own heads, (B, T, H/tp, hd): the heads
            # dimension is the shard, the weights are replicated and their gradients summed over the ranks.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        norms = _residual_norms(block)
        if sequence_parallel:
            # The pre-norms' outputs go to the sublayers' input plans as DTensors; a post norm's is added to the
            # plain local residual, so it returns its local sequence shard.
            plan.update({name: SequenceParallel(use_local_output=name.endswith("post_norm")) for name in norms})
        for name, style in plan.items():
            parallelize_module(block if name == "" else block.get_submodule(name), tp_mesh, style)
        if sparse:
            apply_expert_tp(block.feed_forward, tp_mesh)
        if not sequence_parallel:
            for name in norms:
                replicate_module(block.get_submodule(name), tp_mesh)
    if model.norm is not None and not sequence_parallel:
        replicate_module(model.norm, tp_mesh)
    return model


def _sparse_sequence_parallel() -> PrepareModuleInputOutput:
    """A sparse feed-forward under sequence parallelism: its input, the sequence shard (B, T/tp, d), all-gathered
    over tp into the replicated tokens that ``apply_expert_tp`` routes (as without sequence parallelism, so the
    router's terms and counts are the full batch's on every rank, once); its output, replicated after the experts'
    all-reduce, cut back to this rank's sequence chunk (a local slice). The backward: the output gradient
    all-gathered; the input's is replicated already (the experts' and shared experts' input gradients are summed
    over tp, the router's is computed alike on every rank), so the all-gather's backward is a local slice too.
    Cost: one all-gather more each way than the replicated layout (Megatron reduce-scatters instead of the
    all-reduce; here the experts' output is in expert order, and the router's weights need the summed output)."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)


def _wait_collective(module: nn.Module, inputs, output: DTensor) -> DTensor:
    """The embedding's output with its all-reduce (or reduce-scatter) waited for, in eager code, before a compiled
    block sees it. RowwiseParallel's asynchronous collective leaves an ``AsyncCollectiveTensor`` inside the
    DTensor; AOTAutograd unwraps such a wrapper only at a graph's top level, so a block that graph-breaks (a
    mixture of experts' data-dependent routing) hands eager code a view typed as one and then meets a plain
    tangent for it in the backward ("Expected a AsyncCollectiveTensor tangent but got a plain Tensor").
    ``wait_tensor`` is differentiable; the wait costs nothing, the block's first op would wait anyway."""
    local = output.to_local()
    if not isinstance(local, AsyncCollectiveTensor):
        return output
    return DTensor.from_local(wait_tensor(local), output.device_mesh, output.placements, run_check=False,
                              shape=output.shape, stride=output.stride())


def _residual_norms(block: nn.Module) -> list[str]:
    """The norms of a block that read or write the residual stream (B, T, d): the two before the sublayers, and
    Gemma 3's two after them (``post_norms``), which take the row-split projections' reduced outputs. Under
    sequence parallelism each is split along the sequence like the residual; otherwise it is replicated."""
    names = ["attention_norm", "ffn_norm"]
    return names + (["attention_post_norm", "ffn_post_norm"] if getattr(block, "post_norms", False) else [])


def replicate_module(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make a module's parameters Replicate DTensors that compute on plain full inputs.

    Without sequence parallelism the norms are not split, but their weights must still be DTensors:
    optimizers' foreach kernels and FSDP cannot mix DTensor and plain parameters in one model.
    """

    def to_replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(mod.named_parameters(recurse=False)):
            dparam = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            mod.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

    def inputs_as_dtensor(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor)
                     and not isinstance(x, DTensor) else x for x in inputs)

    def output_as_local(mod, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    distribute_module(module, tp_mesh, to_replicate, inputs_as_dtensor, output_as_local)


class _CopyToTensorParallel(torch.autograd.Function):
    """The identity forward; the gradient summed over the tensor-parallel ranks in backward (each rank's experts
    hold a slice of the hidden units, so each gives a partial gradient of their input: Megatron's "copy to the
    tensor-parallel region")."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The experts' partial outputs summed over the tensor-parallel ranks; the (replicated) gradient passes
    through in backward (Megatron's "reduce from the tensor-parallel region", as RowwiseParallel's output)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


# Each expert's hidden units split over the tensor-parallel ranks, as the dense SwiGLU's: w1, w3 (E, h, d) by
# their rows h, w2 (E, d, h) by its columns.
TP_SHARDS = {"w1": Shard(1), "w3": Shard(1), "w2": Shard(2)}


def apply_expert_tp(feed_forward: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism of one sparse feed-forward (``MoEFeedForward``) on a 1-D ``tp_mesh`` (under sequence
    parallelism its input is all-gathered first, ``_sparse_sequence_parallel``): every rank routes the same
    (replicated) tokens; each expert's hidden units are split over the ranks (``TP_SHARDS``, the dense
    feed-forward's column / row split), computed on the local slices by
    ``GroupedExperts.compute`` and summed over the ranks once, at the experts' output; the router's weights are
    replicated (its scores are the same on every rank), the shared experts split as the dense feed-forward.
    The model's code is unchanged: the experts' forward is replaced on the instance, as ``apply_ep`` does."""
    experts = feed_forward.experts
    for name, placement in TP_SHARDS.items():
        weight = getattr(experts, name)
        sharded = distribute_tensor(weight.data, tp_mesh, [placement], src_data_rank=None)
        setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
    experts.forward = types.MethodType(_tensor_parallel_forward, experts)
    experts.tp_group = tp_mesh.get_group()
    replicate_module(feed_forward.router, tp_mesh)
    if feed_forward.shared_experts is not None:
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(feed_forward.shared_experts, tp_mesh, plan)


def _tensor_parallel_forward(self: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (M, d): the routed tokens sorted by expert (the same on every tensor-parallel rank) -> (M, d)."""
    rows = copy_to_tensor_parallel(self, x)
    partial = self.compute(rows, counts, *(getattr(self, name).to_local() for name in EXPERT_WEIGHTS))
    return reduce_from_tensor_parallel(self, partial)


def copy_to_tensor_parallel(experts: GroupedExperts, x: torch.Tensor) -> torch.Tensor:
    """x (M, d), the rows a tensor-parallel rank's experts (``apply_expert_tp``) take, as it is; its gradient summed
    over the tp ranks in the backward. ``x`` itself without expert tensor parallelism."""
    group = getattr(experts, "tp_group", None)
    return x if group is None else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(experts: GroupedExperts, partial: torch.Tensor) -> torch.Tensor:
    """The experts' partial outputs (M, d), from their local slices of the hidden units, summed over the
    tensor-parallel ranks (``apply_expert_tp``); ``partial`` itself without expert tensor parallelism."""
    group = getattr(experts, "tp_group", None)
    return partial if group is None else _ReduceFromTensorParallel.apply(partial, group)


def mask_padding(logits: torch.Tensor, vocab_limit: int) -> torch.Tensor:
    """``logits`` with the columns >= ``vocab_limit`` at -inf, out of place (the caller's tensor is kept).

    A vocabulary-sharded DTensor stays sharded: the (V,) additive mask is a Replicate DTensor on the same
    mesh, which DTensor's pointwise add slices to each rank's columns without communication (gathering the
    full vocabulary is what ``loss_parallel`` exists to avoid)."""
    vocab = logits.size(-1)
    mask = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
    mask[vocab_limit:] = float("-inf")
    if isinstance(logits, DTensor):
        mask = DTensor.from_local(mask, logits.device_mesh, [Replicate()] * logits.device_mesh.ndim,
                                  run_check=False)
    return logits + mask
