"""Pipeline parallelism with ``torch.distributed.pipelining``: split by layers, run a schedule.

The model (on the meta device) is cut into ``pp x pp_virtual_stages`` stages of equal numbers of blocks.
Stage 0 keeps the embedding, the last stage the final norm and output head; the model itself handles
missing pieces (``None``), so a stage is just the same ``Transformer`` class with fewer blocks and the
parameter names stay those of the full model (checkpoints and initialisation need no mapping).

Rank r of the pipeline owns stages r, r + pp, r + 2 pp, ... (the "loop" placement Interleaved 1F1B
expects; with one virtual stage it is simply stage r).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

# torch.distributed.pipelining is imported where a pipeline is built: it loads dynamo (a second or more of the
# start-up of every run, most of which do not pipeline).
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages owned by ``pp_rank`` (loop placement)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


def split_model(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of ``model`` holding only the blocks of ``stage`` (call on the meta device: copies are free)."""
    part = copy.deepcopy(model)
    n_layers = len(part.layers)
    per_stage = n_layers // num_stages
    keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != num_stages - 1:
        part.norm = None
        part.output = None
    return part


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them."""

    schedule: object
    stages: list  # of torch.distributed.pipelining.PipelineStage
    has_first_stage: bool
    has_last_stage: bool
    loss_scale: float = 1.0  # the factor the schedule's loss_fn multiplies each micro-batch loss by
    microbatches: int = 1  # what each step's batch is split into
    losses: list = field(default_factory=list)
    # train/loss.py:StageTerms: how the auxiliary loss terms of this rank's stages join their backward
    auxiliary: object | None = None

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward + backward of one batch split into micro-batches. Returns this rank's summed
        (already scaled) micro-batch losses if it owns the last stage, else None."""
        self.losses.clear()
        args, target = self._io(inputs, targets)
        self.schedule.step(*args, target=target, losses=self.losses if self.has_last_stage else None)
        return torch.stack([loss.detach() for loss in self.losses]).sum() if self.has_last_stage else None

    def _io(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[tuple, torch.Tensor | None]:
        """The schedule's inputs on this rank. Contiguous: the loader's windows are views of one
        (B, T + 1) buffer, and torch 2.11's PipelineStage refuses the stride (T + 1, 1) of such a view."""
        args = (inputs.contiguous(),) if self.has_first_stage else ()
        return args, targets.contiguous() if self.has_last_stage else None

    @torch.no_grad()
    def eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward only (no gradients): the mean unscaled loss over the micro-batches on the rank that owns
        the last stage, else None."""
        self.losses.clear()
        args, target = self._io(inputs, targets)
        self.schedule.eval(*args, target=target, losses=self.losses if self.has_last_stage else None)
        if not self.has_last_stage:
            return None
        return torch.stack([loss.detach() for loss in self.losses]).mean() / self.loss_scale


def build_pipeline(parts: list[nn.Module], ids: list[int], num_stages: int, pp_group, device: torch.device,
                   schedule_name: str, n_microbatches: int, loss_fn: Callable, loss_scale: float) -> Pipeline:
    """Wrap materialized stage modules in ``PipelineStage`` and build the schedule.

    ``loss_fn`` must already include the ``loss_scale`` = 1 / (micro-batches x accumulation): the schedule's own
    ``scale_grads`` is turned off because it rescales *all* accumulated gradients at the end of each step,
    which would be wrong with gradient accumulation across steps.
    """
    from torch.distributed import pipelining

    stages = [pipelining.PipelineStage(part, stage_index=i, num_stages=num_stages, device=device, group=pp_group)
              for part, i in zip(parts, ids)]
    cls = getattr(pipelining, SCHEDULES[schedule_name])
    if cls is pipelining.ScheduleInterleaved1F1B:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(schedule, stages, has_first_stage=0 in ids, has_last_stage=num_stages - 1 in ids,
                    loss_scale=loss_scale, microbatches=n_microbatches)
