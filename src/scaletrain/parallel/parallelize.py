"""``parallelize``: apply every configured technique to an unmodified model, in one fixed order.

Order (each step's reason in brackets):
  1. pipeline split     [cut the meta model into stages first: everything below applies per stage]
  2. tensor/sequence    [DTensor plans need the plain nn.Linear/RMSNorm modules, before any wrapping]
     expert parallel    [experts split over the data-parallel ranks (parallel/expert.py): after TP, whose
                         expert slices it splits again, before FSDP2 and DDP, which then leave them alone]
  3. activation ckpt    [wraps block forwards; must see the TP-converted blocks]
  4. torch.compile      [after AC so recomputation is compiled too, before FSDP hooks; the whole model
                         when nothing hooks into its blocks (no PP, TP, AC, FSDP or DDP), else per block]
  5. FSDP2 / HSDP       [shards the (possibly TP-sharded) parameters over the data-parallel mesh]
  6. materialize + init [to_empty + the single-process weights, identical for every layout]
  7. DDP / ZeRO-1 / low-communication   [DDP broadcasts real weights, so it comes after init]
  8. pipeline schedule  [PipelineStage needs materialized stage modules]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import ModelConfig, ParallelConfig
from scaletrain.model.config import has_local_rope
from scaletrain.parallel.activation_checkpoint import apply_ac
from scaletrain.parallel.compile import apply_compile, compiles_whole_model
from scaletrain.parallel.context import context_parallel_context
from scaletrain.parallel.ddp import CommCounter, apply_ddp
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.expert import (
    apply_ep,
    expert_meshes,
    expert_modules,
    expert_parameters,
    ignore_experts_in_ddp,
    sum_expert_counts,
)
from scaletrain.parallel.fsdp import apply_fsdp
from scaletrain.parallel.init import materialize
from scaletrain.parallel.low_comm import LowCommSync, ReplicaSync
from scaletrain.parallel.pipeline import Pipeline, build_pipeline, split_model, stage_ids
from scaletrain.parallel.tensor import apply_tp


@dataclass
class ParallelModel:
    """The result of ``parallelize``: this rank's model part(s) and how to drive them."""

    parts: list[nn.Module]  # what to call (DDP-wrapped when DDP is on); one entry unless pipelined
    dims: ParallelDims
    mesh: object | None
    device: torch.device = torch.device("cpu")
    pipeline: Pipeline | None = None
    replicas: ReplicaSync = field(default_factory=ReplicaSync)  # how data-parallel replicas stay together
    comm: CommCounter = field(default_factory=CommCounter)
    dp_rank: int = 0
    vocab_limit: int | None = None  # the tokenizer's vocabulary when the model's is padded (train/loss.py)
    loss_rows: int = -1  # the chunked loss's positions a chunk (model/loss.py): -1 auto, 0 the whole logits
    # The objective's loss on whole logits, installed once where the training is built (finetune/objectives.py);
    # None: the next-token cross-entropy, which may run by chunks (train/loss.py).
    objective_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    experts: bool = False  # a mixture of experts (model.moe_experts): the same on every rank, whatever its stages
    # A mixture of experts' data-parallel ranks of this rank's pipeline / tensor coordinate (dp_replicate x
    # dp_shard), what its counts are summed over (``sum_expert_counts``); None: the world is that group.
    dp_group: dist.ProcessGroup | None = None

    @property
    def modules(self) -> list[nn.Module]:
        """The parts without a DDP wrapper (for state dicts, optimizer groups, sampling)."""
        return [p.module if isinstance(p, nn.parallel.DistributedDataParallel) else p for p in self.parts]

    @property
    def tp_enabled(self) -> bool:
        return self.dims.tp > 1

    @property
    def sharded(self) -> bool:
        """True when no rank holds the whole model as plain tensors (FSDP, TP, PP, CP or EP)."""
        return self.dims.dp_shard > 1 or self.dims.tp > 1 or self.dims.pp > 1 or self.dims.cp > 1 or self.dims.ep > 1

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def sum_expert_counts(self, *names: str) -> None:
        """A mixture of experts' count buffers ``names`` summed over the data-parallel ranks (parallel/expert.py);
        nothing in one process or for a dense model. Every data-parallel rank calls it (``check_moe_runnable``
        keeps a mixture of experts to data, expert, tensor and pipeline parallelism: without a pipeline or tensor
        parallelism the world is the data-parallel group; with them, ``dp_group``)."""
        if self.dims.dp_size > 1:
            sum_expert_counts(self.modules, names, self.dp_group)

    def gather_over_stages(self, record: dict) -> dict:
        """A mixture of experts' logged load (``model.moe.expert_load``: each rank has its own stages' layers)
        merged over the pipeline, the worst layer's ``moe_max_mean_load`` recomputed; ``record`` as it is without
        a pipeline. Every pipeline rank calls it (it gathers)."""
        if self.pipeline is None or not self.experts:  # a dense pipeline gathers nothing
            return record
        every: list[dict | None] = [None] * self.dims.pp
        dist.all_gather_object(every, record, group=self.group("pp"))
        merged = {k: v for part in every for k, v in part.items()}
        worst = [v for k, v in merged.items() if k.startswith("moe_max_mean_load/")]
        if worst:
            merged["moe_max_mean_load"] = max(worst)
        return merged

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of one mesh dimension (None when that degree is 1)."""
        if self.mesh is None or name not in self.dims.mesh_shape:
            return None
        return self.mesh[name].get_group()


def _dp_mesh(mesh, dims: ParallelDims):
    """The sub-mesh FSDP shards over: dp_shard (x cp, whose ranks must also average gradients),
    with dp_replicate in front for HSDP."""
    shard_dims = [d for d in ("dp_shard", "cp") if d in dims.mesh_shape]
    if len(shard_dims) == 2:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        shard_dims = ["dp_shard_cp"]
    names = (["dp_replicate"] if "dp_replicate" in dims.mesh_shape else []) + shard_dims
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def _expert_count_group(mesh, dims: ParallelDims, model_cfg: ModelConfig) -> dist.ProcessGroup | None:
    """A mixture of experts' count group (``ParallelModel.dp_group``) when the world also holds other stages or
    tensor-parallel copies: the data-parallel dimension's group, under HSDP the flattened (dp_replicate, dp_shard)
    mesh's (over dp_shard alone HSDP 2 x 2 x TP 2 drifted 1.2e-2 from one process), created here, where every rank
    builds its mesh alike (a new group is a collective). None: the world is the data-parallel group."""
    if not (model_cfg.moe_experts and dims.dp_size > 1 and (dims.pp > 1 or dims.tp > 1)):
        return None
    names = [name for name in ("dp_replicate", "dp_shard") if name in dims.mesh_shape]
    dp = mesh[names[0]] if len(names) == 1 else mesh[tuple(names)]._flatten("dp_moe_counts")
    return dp.get_group()


def _dp_rank(mesh, dims: ParallelDims) -> int:
    rank = 0
    for name in ("dp_replicate", "dp_shard"):
        if name in dims.mesh_shape:
            rank = rank * dims.mesh_shape[name] + mesh[name].get_local_rank()
    return rank


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, *, mesh, model_cfg: ModelConfig,
                device: torch.device, seed: int, compile: bool = False, grad_accum_steps: int = 1,
                compile_mode: str = "default", vocab_limit: int | None = None, init_weights: bool = True,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> ParallelModel:
    """Apply the configured parallelism to ``model`` (built on the meta device) and materialize it.

    ``vocab_limit``: the tokenizer's vocabulary when ``model_cfg.vocab_size`` is padded beyond it; the
    loss masks the padding columns out (train/loss.py). ``init_weights=False``: the weights are left
    uninitialised for the caller to write (a fine-tune's base; ``init.materialize``). ``loss_fn(logits,
    targets)``: the loss the pipeline's schedule calls on the last stage (needed with ``dims.pp`` > 1)."""
    pp_ids = [0]
    parts = [model]
    if dims.pp > 1:  # 1. pipeline split
        num_stages = dims.pp * cfg.pp_virtual_stages
        pp_ids = stage_ids(mesh["pp"].get_local_rank(), dims.pp, cfg.pp_virtual_stages)
        parts = [split_model(model, i, num_stages) for i in pp_ids]
    # The experts' meshes, built once for every stage of this rank: within its pipeline coordinate, the ep ranks
    # the experts are split over, and (ep < dp_shard, or HSDP's replicas) those FSDP2 shards / averages them over.
    hsdp = dims.dp_shard > 1 and dims.dp_replicate > 1
    # With tensor parallelism the experts' mesh is (ep, tp): each expert's hidden units stay split over tp.
    ep_mesh, replicated_over = (expert_meshes(mesh, "dp_shard" if dims.dp_shard > 1 else "dp_replicate", dims.ep,
                                              replicas="dp_replicate" if hsdp else None,
                                              tp="tp" if dims.tp > 1 else None)
                                if dims.ep > 1 else (None, None))
    for part in parts:
        if dims.tp > 1:  # 2. tensor (+ sequence) parallel
            apply_tp(part, mesh["tp"], sequence_parallel=cfg.sequence_parallel)
        if ep_mesh is not None:  # 2b. expert parallel, over the data-parallel dimension it borrows (x tp)
            apply_ep(part, ep_mesh, grad_divisor=dims.ep)
        apply_ac(part, cfg.activation_checkpointing, cfg.ac_every)  # 3.
        if compile:  # 4.
            apply_compile(part, whole_model=compiles_whole_model(dims, cfg), mode=compile_mode)
        if dims.dp_shard > 1 or dims.cp > 1:  # 5. FSDP2 (HSDP with dp_replicate > 1)
            apply_fsdp(part, _dp_mesh(mesh, dims), reshard_after_forward=dims.zero_stage == 3,
                       param_dtype=cfg.param_dtype, cpu_offload=cfg.cpu_offload,
                       ignored_params=expert_parameters(part) if replicated_over is None else None,
                       experts=(expert_modules(part), replicated_over) if replicated_over is not None else None)
    materialize(parts, model_cfg, device, seed, distributed=dims.world_size > 1, weights=init_weights)  # 6.

    pm = ParallelModel(parts=parts, dims=dims, mesh=mesh, device=device,
                       dp_rank=_dp_rank(mesh, dims) if mesh is not None else 0, vocab_limit=vocab_limit,
                       experts=bool(model_cfg.moe_experts), dp_group=_expert_count_group(mesh, dims, model_cfg))
    replicate = pm.group("dp_replicate")
    if replicate is not None and dims.dp_shard == 1:  # 7. replicated data parallel
        if cfg.low_comm != "none":
            pm.replicas = LowCommSync(parts[0], cfg.low_comm, cfg.sync_every, replicate, cfg.outer_lr,
                                      cfg.outer_momentum, counter=pm.comm)
        else:
            for part in parts:
                ignore_experts_in_ddp(part)
            pm.parts = [apply_ddp(part, replicate, device, counter=pm.comm) for part in parts]
    if dims.pp > 1:  # 8. pipeline schedule
        if loss_fn is None:
            raise ValueError("parallelize: a pipeline needs the loss_fn its schedule calls on the last stage")
        n_micro = dims.pp_microbatches(cfg)
        scale = 1.0 / (n_micro * grad_accum_steps)

        def scaled_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return loss_fn(logits, targets) * scale

        pm.pipeline = build_pipeline(pm.parts, pp_ids, dims.pp * cfg.pp_virtual_stages, pm.group("pp"), device,
                                     cfg.pp_schedule, n_micro, scaled_loss, scale)
    return pm


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                    foreach: bool = True) -> torch.Tensor:
    """Global gradient-norm clipping across any mix of plain and DTensor gradients and pipeline stages.

    DTensor gradients on different meshes (e.g. TP weights on dp x tp, replicated norms on dp) cannot be
    combined in one foreach call, so the norm is computed per mesh, made full, then combined; pipeline
    stages hold disjoint parameters, so their squared norms are summed over the pp group.
    """
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for key, ps in groups.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=params[0].device)
    if pp_group is not None:
        total = total ** 2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    for ps in groups.values():
        one_by_one = [p for p in ps if _foreach_mul_skips(p.grad)] if foreach else []
        if one_by_one:
            torch.nn.utils.clip_grads_with_norm_(one_by_one, max_norm, total, foreach=False)
            ps = [p for p in ps if not _foreach_mul_skips(p.grad)]
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=foreach)
    return total


# torch 2.11's DTensor does not list the in-place ``_foreach_mul_`` among the ops linear in a Partial (pending
# sum) input, so it redistributes such an input to a temporary Replicate tensor (an all-reduce), scales that and
# leaves the tensor itself unscaled, silently. Under sequence parallelism the norm weights' gradients are
# Partial, so clipping skipped them. ``Tensor.mul_`` keeps Partial and is right: there those gradients are
# clipped one by one. torch 2.13 registers ``_foreach_mul_`` as linear (2.12 not checked).
_FOREACH_MUL_KEEPS_PARTIAL = torch.__version__ >= "2.13"


def _foreach_mul_skips(grad: torch.Tensor) -> bool:
    """Whether ``torch._foreach_mul_`` would leave ``grad`` unscaled (a Partial DTensor on torch < 2.13)."""
    from torch.distributed.tensor import DTensor, Partial

    return (not _FOREACH_MUL_KEEPS_PARTIAL and isinstance(grad, DTensor)
            and any(isinstance(pl, Partial) for pl in grad.placements))


def cp_context(pm: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor):
    """Shard the batch and the rotary tables along the sequence for context parallelism (GPU only)."""
    if pm.dims.cp == 1:
        return contextlib.nullcontext()
    module = pm.modules[0]
    tables = [module.rope_cos, module.rope_sin]
    if has_local_rope(module.cfg):  # Gemma 3's local layers read tables of their own: sharded the same way
        tables += [module.rope_cos_local, module.rope_sin_local]
    return context_parallel_context(pm.mesh["cp"], [inputs, targets, *tables], [1, 1] + [0] * len(tables))
