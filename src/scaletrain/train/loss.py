"""The step's loss, in one place: what one micro-batch's forward is scored by, and its backward.

- ``cross_entropy``: the plain next-token loss on whole logits (B, T, V), a vocabulary-sharded DTensor included;
- ``loss_context``: tensor parallelism's vocabulary-parallel loss (``loss_parallel``: the softmax over V / tp
  columns a rank, never gathered);
- ``loss_chunk_rows``: whether the model's head runs by chunks of positions instead (model/loss.py holds the
  chunked kernel, which the model's forward calls);
- ``objective_loss``: the objective installed on the model (finetune/objectives.py: DPO, SimPO, ORPO,
  distillation) replaces the next-token loss on the logits; None is the next-token loss;
- auxiliary terms: a module of the model may leave extra loss terms from its forward (an MoE router's balancing
  loss, say) in ``auxiliary_loss``, a dict of name -> 0-dim tensor, each already multiplied by its coefficient;
  training adds them to the objective's loss and the step logs their means (``StepResult.auxiliary``);
  evaluation drops them, so a validation loss stays the objective's own. A module leaves its terms on every
  forward (a router's balancing loss does), under every engine: the plain path adds them here, DeepSpeed's step
  through ``with_auxiliary`` (train/deepspeed_engine/engine.py), and under pipeline parallelism each stage's terms join
  its own backward (``carry_stage_terms``).

``forward_backward`` (training) and ``forward_loss`` (evaluation) are the two callers; the pipeline's schedule
calls ``cross_entropy`` itself on the last stage (handed to ``parallelize`` as its ``loss_fn``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from scaletrain.model.loss import AUXILIARY, chunkable_head, rows_at_once
from scaletrain.model.moe import routing_counts
from scaletrain.parallel.ddp import grad_sync_context
from scaletrain.parallel.parallelize import ParallelModel, cp_context
from scaletrain.parallel.tensor import mask_padding


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
    """Mean next-token loss; logits (B, T, V) may be a vocabulary-sharded DTensor (inside ``loss_context``).

    ``vocab_limit``: the tokenizer's vocabulary when the model's is padded (``padded_vocab_size``). Logit
    columns >= it get -inf first, so padding takes no softmax mass and its output rows get zero gradient
    (the same loss as on ``logits[..., :vocab_limit]``). None, or >= V, masks nothing.
    """
    if vocab_limit is not None and vocab_limit < logits.size(-1):
        logits = mask_padding(logits, vocab_limit)
    if isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def loss_context(tp_enabled: bool):
    """``loss_parallel`` when the logits are vocabulary-sharded; must enclose the loss *and* backward."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()


def logits_loss(pm: ParallelModel, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The objective's loss on whole logits: the installed objective's (``pm.objective_loss``), else next-token."""
    if pm.objective_loss is not None:
        return pm.objective_loss(logits, targets)
    return cross_entropy(logits, targets, pm.vocab_limit)


def loss_chunk_rows(pm: ParallelModel, inputs: torch.Tensor) -> int:
    """Positions a chunk of the chunked loss for this batch, or 0 for the plain loss on the whole logits: with
    ``loss_rows`` 0, when the batch's logits fit in one chunk anyway, and where the logits must exist whole -
    tensor parallelism (its logits are vocabulary-sharded already: ``loss_parallel`` holds V / tp columns a rank,
    and the chunked product would need the head's DTensor weight), the pipeline (its schedule calls the loss on
    the last stage's output logits) and an objective of its own (distillation compares them with the teacher's,
    a preference objective sums each row's log-probabilities)."""
    model = pm.modules[0]
    if (pm.loss_rows == 0 or pm.tp_enabled or pm.pipeline is not None or pm.objective_loss is not None
            or not chunkable_head(getattr(model, "output", None))):
        return 0
    rows = rows_at_once(inputs.numel(), model.output.weight.shape[0], pm.loss_rows, inputs.device.type)
    return rows if rows < inputs.numel() else 0


def take_auxiliary(model: nn.Module) -> dict[str, torch.Tensor]:
    """The auxiliary terms the model's modules left in their last forward, summed by name, and cleared (so a
    forward that left none is not counted twice)."""
    terms: dict[str, torch.Tensor] = {}
    for module in model.modules():
        left = module.__dict__.get(AUXILIARY)
        if left:
            for name, term in left.items():
                terms[name] = term if name not in terms else terms[name] + term
            module.__dict__[AUXILIARY] = {}
    return terms


def model_loss(pm: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, autocast,
               attn_mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's forward scored by the objective: (its loss, the auxiliary terms the forward left)."""
    rows = loss_chunk_rows(pm, inputs)
    with autocast():
        if rows:  # the model returns the loss, its head run by chunks (model/loss.py)
            loss = pm.parts[0](inputs, attn_mask=attn_mask, targets=targets, vocab_limit=pm.vocab_limit,
                               loss_rows=rows)
        else:
            loss = logits_loss(pm, pm.parts[0](inputs, attn_mask=attn_mask), targets)
    return loss, take_auxiliary(pm.modules[0])


def with_auxiliary(loss: torch.Tensor, terms: dict[str, torch.Tensor], accum: float,
                   into: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """``loss`` plus the auxiliary ``terms`` (what is backpropagated); each term's share of the step (term /
    ``accum``, detached) is added into ``into`` by name (the step's mean, logged)."""
    for term in terms.values():
        if isinstance(loss, DTensor) and not isinstance(term, DTensor):
            # tensor parallelism's loss is a replicated DTensor and each rank's term the same local value: as a
            # 0-dim tensor DTensor would add it as a constant, and its backward would then mix the two kinds
            term = DTensor.from_local(term, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
        loss = loss + term
    if into is not None:
        add_shares(into, {name: term.detach() / accum for name, term in terms.items()})
    return loss


def add_shares(into: dict[str, torch.Tensor], shares: dict[str, torch.Tensor]) -> None:
    """Each share added into ``into`` under its name."""
    for name, share in shares.items():
        into[name] = share if name not in into else into[name] + share


def forward_backward(pm: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, *, accum: float, sync: bool,
                     autocast=contextlib.nullcontext, scale: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                     attn_mask: torch.Tensor | None = None,
                     auxiliary: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Forward and backward of one micro-batch; gradients accumulate in the parameters.

    Returns this micro-batch's objective loss divided by ``accum`` (None on pipeline ranks without the last
    stage). ``sync=False`` on non-final accumulation micro-steps skips DDP's all-reduce (``no_sync``).
    ``scale`` is the fp16 gradient scaler's ``scale`` (identity otherwise). ``attn_mask`` (B, 1, T, T),
    e.g. confining attention to each packed document, is not supported with pipeline stages. The auxiliary
    terms join the loss that is backpropagated; each, divided by ``accum``, is added into ``auxiliary`` (under
    the pipeline: this rank's stages' terms, already divided by the schedule's scale; ``sum_over_stages``).
    """
    if pm.pipeline is not None:
        with autocast(), loss_context(pm.tp_enabled):
            loss = pm.pipeline.step(inputs, targets)
        shares = pm.pipeline.auxiliary.take()  # StageTerms (carry_stage_terms): already scaled by the schedule's
        if auxiliary is not None:
            add_shares(auxiliary, shares)
        return loss
    with grad_sync_context(pm.parts[0], sync), cp_context(pm, inputs, targets), loss_context(pm.tp_enabled):
        loss, terms = model_loss(pm, inputs, targets, autocast, attn_mask)
        scale(with_auxiliary(loss, terms, accum, auxiliary) / accum).backward()
    return loss.detach() / accum


def forward_loss(pm: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, *,
                 autocast=contextlib.nullcontext, attn_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The loss of one batch without a backward (evaluation): the same forward as ``forward_backward``, its
    auxiliary terms dropped. None on pipeline ranks without the last stage."""
    if pm.pipeline is not None:
        with autocast(), loss_context(pm.tp_enabled):
            return pm.pipeline.eval(inputs, targets)
    with cp_context(pm, inputs, targets), loss_context(pm.tp_enabled):
        return model_loss(pm, inputs, targets, autocast, attn_mask)[0]


class _AuxiliaryBackward(torch.autograd.Function):
    """The identity on a pipeline stage's output whose backward also starts each auxiliary term's backward, with
    the gradient ``scale`` (the term's weight in the step's loss), as Megatron's ``MoEAuxLossAutoScaler`` does."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, scale: float, *terms: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(*terms)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, None, *(torch.full_like(term, ctx.scale) for term in ctx.saved_tensors))


class StageTerms:
    """The auxiliary terms of this rank's pipeline stages.

    torch's schedule calls the loss on the last stage's output only, and backpropagates every other stage from
    the gradient of its output alone, so a term a block of an earlier stage leaves is on no path to the loss.
    Each stage's output is therefore passed through ``_AuxiliaryBackward`` (a forward hook on the stage): its
    backward gives the stage's terms the gradient ``scale`` (1 / (micro-batches x accumulation), the schedule's
    loss scale), what adding them to that micro-batch's loss gives them on the plain path.

    A step's terms are those of each stage's last ``microbatches`` forwards: torch 2.13's schedule first runs
    every stage once on uninitialised tensors of the right shapes (its metadata inference, at the first step and
    after each switch between evaluation and training), whose terms are garbage. So is the routing such a
    forward counts into a mixture of experts' load (``model.moe.routing_counts``: the expert bias would move by
    it, and the logged load include it): its counts are taken back out at ``take``. ``names``: the terms the
    pipeline's stages leave, agreed once over its ranks (``sum_over_stages``)."""

    def __init__(self, scale: float, microbatches: int):
        self.scale, self.microbatches = scale, microbatches
        self.forwards: dict[int, list[dict[str, torch.Tensor]]] = {}  # id(stage) -> each forward's shares
        self.names: list[str] | None = None
        # id(stage) -> its routing count buffers, their values before the step's first forward, after each forward
        self.counts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]]]] = {}

    def before_forward(self, stage: nn.Module, _inputs) -> None:
        """A stage's forward pre-hook: at the first forward since ``take``, the routing counts it starts from."""
        if torch.is_grad_enabled() and id(stage) not in self.forwards and (buffers := routing_counts(stage)):
            self.counts[id(stage)] = (buffers, [b.clone() for b in buffers], [])

    def after_forward(self, stage: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor | None:
        """A stage's forward hook: its terms join the backward (training) or are dropped (evaluation, which runs
        without gradients: there is no backward to join)."""
        terms = take_auxiliary(stage)
        if not torch.is_grad_enabled():
            return None
        self.forwards.setdefault(id(stage), []).append(
            {name: term.detach() * self.scale for name, term in terms.items()})
        if id(stage) in self.counts:
            self.counts[id(stage)][2].append([b.clone() for b in self.counts[id(stage)][0]])
        return _AuxiliaryBackward.apply(output, self.scale, *terms.values()) if terms else None

    def take(self) -> dict[str, torch.Tensor]:
        """The shares of the micro-batches since the last take, summed by name (``forward_backward``)."""
        shares: dict[str, torch.Tensor] = {}
        for key, forwards in self.forwards.items():
            for left in forwards[-self.microbatches:]:
                add_shares(shares, left)
            extra = len(forwards) - self.microbatches  # the schedule's shape-inference forwards, first
            if extra > 0 and key in self.counts:
                buffers, before, after = self.counts[key]
                with torch.no_grad():
                    for buffer, start, end in zip(buffers, before, after[extra - 1]):
                        buffer -= end - start
        self.forwards, self.counts = {}, {}
        return shares


def carry_stage_terms(pm: ParallelModel) -> None:
    """Under pipeline parallelism, every stage's auxiliary terms join its backward (``StageTerms``); called once
    where the training is built."""
    terms = StageTerms(pm.pipeline.loss_scale, pm.pipeline.microbatches)
    pm.pipeline.auxiliary = terms
    for stage in pm.modules:
        stage.register_forward_pre_hook(functools.partial(StageTerms.before_forward, terms))
        stage.register_forward_hook(functools.partial(StageTerms.after_forward, terms))


def sum_over_stages(pm: ParallelModel, auxiliary: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's auxiliary terms of the whole pipeline (each rank holds its own stages'), the same on every
    rank of it: one all-reduce a step, and none for a model that leaves no terms. Which terms the stages leave is
    agreed once, at the first step (a module leaves its terms on every forward)."""
    if pm.pipeline is None:
        return auxiliary
    group, terms = pm.group("pp"), pm.pipeline.auxiliary
    if terms.names is None:
        every: list[list[str] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, sorted(auxiliary), group=group)
        terms.names = sorted({name for names in every for name in names})
    if not terms.names:
        return auxiliary
    unknown = set(auxiliary) - set(terms.names)
    if unknown:
        raise ValueError(f"auxiliary loss terms {sorted(unknown)} first left after the first step; a module must "
                         f"leave its terms on every forward")
    zero = torch.zeros((), device=pm.device)
    summed = torch.stack([auxiliary.get(name, zero).float() for name in terms.names])
    dist.all_reduce(summed, group=group)
    return dict(zip(terms.names, summed.unbind()))
