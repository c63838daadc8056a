"""The two functions everything that trains calls: build a parallelized model + optimizer from a config,
and run one optimizer step.

The trainer, the planner's measurements (``plan/measure.py``, ``scaletrain doctor``) and the parity tests
all go through these, so what the planner measures is what the trainer runs, and a change to the step
reaches every one of them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from scaletrain.config import JobConfig
from scaletrain.hardware.allocator import keep_freed_memory
from scaletrain.model import Transformer
from scaletrain.model.moe import update_expert_bias
from scaletrain.model.mup import width_mult
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.compile import compile_enabled
from scaletrain.parallel.parallelize import ParallelModel, clip_grad_norm_, parallelize
from scaletrain.train.converters import build_converters
from scaletrain.train.loss import carry_stage_terms, cross_entropy, forward_backward, sum_over_stages
from scaletrain.train.optimizer import build_parallel_optimizer

# (inputs (B, T), targets (B, T), attention mask (B, 1, T, T) or None), already on the device.
MicroBatch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def build_parallel_training(cfg: JobConfig, dims: ParallelDims, device: torch.device, mesh: object | None = None,
                            vocab_limit: int | None = None) -> tuple[ParallelModel, torch.optim.Optimizer]:
    """Model on the meta device -> converters (train/converters.py) -> ``parallelize`` (split, shard,
    materialize, init) -> converters after parallelize -> optimizer.

    ``mesh`` defaults to ``dims.build_mesh`` (needs the process group when the world size is > 1). The
    weights are the same seeded initialisation in every layout (``cfg.train.seed``). ``vocab_limit``: the
    tokenizer's vocabulary when ``cfg.model.vocab_size`` is padded beyond it (masked out of the loss)."""
    if device.type == "cpu":
        keep_freed_memory()
    with torch.device("meta"):
        model = Transformer(cfg.model)
    converters = build_converters(cfg, dims, device)  # fp8, fine-tuning, QAT, ... (train/converters.py)
    converters.convert(model)
    mesh = dims.build_mesh(device.type) if mesh is None else mesh
    pm = parallelize(model, dims, cfg.parallel, mesh=mesh, model_cfg=cfg.model, device=device, seed=cfg.train.seed,
                     compile=compile_enabled(cfg), compile_mode=cfg.train.compile_mode,
                     grad_accum_steps=cfg.train.grad_accum_steps, vocab_limit=vocab_limit,
                     init_weights=not converters.loads_weights,  # a fine-tune's weights come from its base
                     loss_fn=lambda logits, targets: cross_entropy(logits, targets, vocab_limit))
    pm.loss_rows = cfg.train.loss_chunk_rows  # the chunked loss (model/loss.py): -1 auto, 0 off
    if pm.pipeline is not None:
        carry_stage_terms(pm)  # every stage's auxiliary loss terms join its backward (train/loss.py)
    converters.after_parallelize(pm)
    # Frozen weights (fine-tuning) are left out of the optimizer: no gradients, no optimizer state.
    lora_plus = cfg.finetune.lora_plus_ratio if cfg.finetune.source else 1.0  # validate: lora/qlora only
    return pm, build_parallel_optimizer(pm, cfg.optim, device, dims.zero_stage, width_mult(cfg.model), lora_plus)


@dataclass(frozen=True)
class StepOptions:
    """How one optimizer step runs, besides its model, optimizer and micro-batches: the step signature every engine
    shares (``training_step``, ``train/deepspeed_engine/engine.py``, ``train/engine.py:TrainingEngine.step``).

    ``before_update(loss, grad_norm)`` runs between the gradient and the update; returning False skips the update
    (the gradients are still cleared); a ``DeferredGuard`` reads nothing back. ``scaler``: the fp16 gradient
    scaler (None or disabled otherwise). ``loss_divisor`` (default: the step's ``accum``): what each micro-batch's
    loss is divided by; with ranks that run different numbers of micro-batches (``parallel.balance``,
    train/adaptive.py) it is the step's micro-batches over the data-parallel ranks, so the averaged gradient is
    the mean over all of them. ``micro_grad_sq``: when a list, the squared norm of each unsynchronised
    micro-batch's own mean-loss gradient is appended (the gradient noise scale's small batch; costs a copy of the
    gradients per micro-batch)."""

    grad_clip: float  # the global gradient norm is clipped to this; 0 = no clipping
    autocast: Callable = contextlib.nullcontext
    scaler: torch.amp.GradScaler | None = None
    before_update: Callable[[float, float], bool] | None = None
    loss_divisor: float | None = None
    micro_grad_sq: list[float] | None = None


# The one step signature: (model, optimizer, micro-batches, how many of them, options) -> the step's result.
StepFunction = Callable[[ParallelModel, torch.optim.Optimizer, Iterator[MicroBatch], int, StepOptions],
                        "StepResult"]


@dataclass
class StepResult:
    loss: float | torch.Tensor  # mean loss of the step (over data-parallel ranks, unless replicas train
    # independently); a 0-dim tensor on the device when the step was ``DeferredGuard`` (read it at a log step)
    grad_norm: float | torch.Tensor  # global gradient norm before clipping (a tensor when ``DeferredGuard``)
    updated: bool  # False when ``before_update`` refused the update (e.g. a non-finite loss)
    # The step's mean of each auxiliary loss term the model left (train/loss.py; this rank's), {} when none.
    auxiliary: dict[str, float] = field(default_factory=dict)


class DeferredGuard:
    """``before_update`` for a step that reads nothing back to the host: a step whose loss or gradient norm is
    not finite is skipped on the device instead (``nonfinite_flag`` as the fused optimizer's ``found_inf``), and
    the loss and norm stay tensors for the trainer to read at its next log step (train/deferred.py).
    ``before_step`` runs between the gradient and the update (e.g. waiting for an asynchronous save's copy)."""

    def __init__(self, before_step: Callable[[], None] = lambda: None):
        self.before_step = before_step

    def __call__(self, loss: float, grad_norm: float) -> bool:  # a step that reads anyway: always update
        self.before_step()
        return True


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer`` can skip an update on the device from a flag tensor: a fused ``torch.optim.AdamW``
    (its kernel takes ``found_inf``, as the gradient scaler uses it, and leaves weights, moments and the step
    count untouched when it is set). Muon, ZeRO-1's wrapper, foreach/loop AdamW and DeepSpeed's cannot."""
    return type(optimizer) is torch.optim.AdamW and all(g.get("fused") for g in optimizer.param_groups)


def nonfinite_flag(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 on the device when the loss or the gradient norm is NaN/Inf, else 0.0 (no read back)."""
    finite = torch.isfinite(loss.detach().float()) & torch.isfinite(grad_norm.detach().float())
    return (~finite).float().to(grad_norm.device)


def training_step(pm: ParallelModel, optimizer: torch.optim.Optimizer, micro_batches: Iterator[MicroBatch],
                  accum: int, options: StepOptions) -> StepResult:
    """Accumulate gradients over ``accum`` micro-batches, clip, and update once (``StepOptions``: how).

    Data-parallel gradients are synchronised only on the final micro-batch (DDP ``no_sync`` before); with
    low-communication training they are not synchronised at all (replicas meet in ``pm.replicas``). With a
    ``DeferredGuard`` as ``before_update``, an optimizer that ``skips_on_device`` and no scaler, a non-finite
    step's update is skipped on the device and the result holds tensors (other optimizers: read and always
    updated, as with None)."""
    grad_clip, autocast, scaler = options.grad_clip, options.autocast, options.scaler
    before_update, micro_grad_sq = options.before_update, options.micro_grad_sq
    divisor = accum if options.loss_divisor is None else options.loss_divisor
    scale = scaler.scale if scaler is not None else (lambda x: x)
    loss_sum, auxiliary = None, {}
    for micro in range(accum):
        inputs, targets, mask = next(micro_batches)
        sync = micro == accum - 1
        before = _grads(pm) if micro_grad_sq is not None and not sync else None
        loss = forward_backward(pm, inputs, targets, accum=divisor, sync=sync, autocast=autocast,
                                scale=scale, attn_mask=mask, auxiliary=auxiliary)
        if before is not None:
            micro_grad_sq.append(_delta_sq(pm, before) * divisor ** 2)
        if loss is not None:  # None on pipeline ranks that do not hold the last stage
            loss_sum = loss if loss_sum is None else loss_sum + loss
    auxiliary = sum_over_stages(pm, auxiliary)  # under the pipeline: every stage's terms, on every rank
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = grad_clip if grad_clip > 0 else math.inf
    norm = clip_grad_norm_(pm.parameters(), max_norm, pm.group("pp"), foreach=True)
    loss_t = pm.replicas.step_loss(loss_sum, pm.dims, pm.device)
    if isinstance(before_update, DeferredGuard) and (scaler is None or not scaler.is_enabled()) \
            and skips_on_device(optimizer):
        # No host-device sync: the update is skipped on the device when the step is not finite.
        before_update.before_step()
        nonfinite = nonfinite_flag(loss_t, norm)
        _update(optimizer, None, nonfinite)
        pm.sum_expert_counts("tokens_since_update")  # every rank moves the same bias (parallel/expert.py)
        update_expert_bias(pm.modules, keep=1.0 - nonfinite)  # a skipped step moves no bias either
        return StepResult(loss_t, norm, True, auxiliary_means(auxiliary))
    grad_norm, loss_value = float(norm), float(loss_t)  # the step's two reads back (before_update's inputs)
    updated = before_update(loss_value, grad_norm) if before_update is not None else True
    _update(optimizer, scaler, None, skip=not updated)
    pm.sum_expert_counts("tokens_since_update")  # the tokens of every data-parallel rank (parallel/expert.py)
    update_expert_bias(pm.modules, keep=updated)  # a mixture of experts' selection bias (model/moe.py); nothing for
    # a dense model; a skipped step (the guard's verdict) moves it no more than the weights
    return StepResult(loss_value, grad_norm, updated, auxiliary_means(auxiliary))


def _update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
            found_inf: torch.Tensor | None, skip: bool = False) -> None:
    """The step's one ``optimizer.step()``: through the fp16 scaler when there is one (its ``update`` runs
    whether or not the step is skipped), with ``found_inf`` when the device decides whether to skip (a fused
    AdamW leaves everything untouched when it is set); then the gradients are cleared."""
    if not skip:
        if found_inf is not None:
            optimizer.found_inf = found_inf
        try:
            (scaler.step if scaler is not None else lambda opt: opt.step())(optimizer)
        finally:
            if found_inf is not None:
                del optimizer.found_inf
    if scaler is not None:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def auxiliary_means(auxiliary: dict[str, torch.Tensor]) -> dict[str, float]:
    """The auxiliary terms' step means, read back (only for a model that leaves any)."""
    return {name: float(term) for name, term in auxiliary.items()}


def _grads(pm: ParallelModel) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in pm.parameters()]


def _delta_sq(pm: ParallelModel, before: list[torch.Tensor | None]) -> float:
    """Squared norm of what the last micro-batch added to the (local, unsynchronised) gradients."""
    total = 0.0
    for p, old in zip(pm.parameters(), before):
        if p.grad is not None:
            delta = p.grad.detach().float() - (0 if old is None else old.float())
            total += float(delta.pow(2).sum())
    return total
