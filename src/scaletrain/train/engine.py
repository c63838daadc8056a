"""What the trainer trains through: an engine builds the model + optimizer, runs one optimizer step and makes
the object that saves, resumes and rolls back the run (``parallel.engine``).

The trainer holds one engine and calls it through ``TrainingEngine`` alone, so the loop, data, schedule,
evaluation, metrics and logging are the same for every engine. ``engine_for`` picks it from the config:

- ``NativeEngine``: ``train/step.py`` (``build_parallel_training``, ``training_step``) and
  ``checkpoint/training.py:TrainingCheckpoint`` (DCP, resharding across world sizes and plans);
- ``DeepSpeedEngine`` (``train/deepspeed_engine/engine.py``): ``deepspeed.initialize`` over the same model and AdamW
  param groups, DeepSpeed's own checkpoint files inside our step folders.

A third engine is one file ``train/engine_<name>.py`` with a class of this interface, and one line in
``engine_for``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.training import TrainingCheckpoint, TrainState
from scaletrain.config import JobConfig
from scaletrain.finetune import open_base
from scaletrain.parallel import ParallelDims, ParallelModel
from scaletrain.train.deepspeed_engine.engine import DeepSpeedEngine
from scaletrain.train.step import (
    MicroBatch,
    StepFunction,
    StepOptions,
    StepResult,
    build_parallel_training,
    training_step,
)


class RunCheckpoint(Protocol):
    """Saves, resumes and rolls back one run (the model, optimizer and the small per-rank states)."""

    def save(self, blocking: bool) -> Path:
        """Write the current step's checkpoint (collective); may return before the write completes."""

    def resume(self) -> Path | None:
        """Load the newest good checkpoint; None when there is none."""

    def roll_back(self) -> Path | None:
        """Back to the last good checkpoint's weights, optimizer and counters; None when there is none."""


class TrainingEngine(Protocol):
    """One engine: build, step, checkpoint. Every method has the same signature on every engine."""

    def build(self, cfg: JobConfig, dims: ParallelDims, device: torch.device,
              vocab_limit: int | None) -> tuple[ParallelModel, torch.optim.Optimizer]:
        """The parallel model and its optimizer, initialised from ``cfg.train.seed``."""

    def step(self, pm: ParallelModel, optimizer: torch.optim.Optimizer, micro_batches: Iterator[MicroBatch],
             accum: int, options: StepOptions) -> StepResult:
        """One optimizer step over ``accum`` micro-batches (``train/step.py:StepFunction``, ``StepOptions``)."""

    def checkpoint(self, store: CheckpointManager, pm: ParallelModel, optimizer: torch.optim.Optimizer,
                   local: dict, state: TrainState, cfg: JobConfig,
                   message: Callable[[str], None]) -> RunCheckpoint:
        """What saves, resumes and rolls back this run through ``store`` (the run's step folders)."""

    def sampling_model(self, pm: ParallelModel) -> nn.Module:
        """The plain module rank 0 samples text from."""

    def describe(self) -> str | None:
        """A line for the log saying what the engine is (None: nothing worth saying)."""


class NativeEngine:
    """PyTorch's own parallelism (``parallel/``): ``train/step.py`` and ``checkpoint/training.py``."""

    def build(self, cfg: JobConfig, dims: ParallelDims, device: torch.device,
              vocab_limit: int | None) -> tuple[ParallelModel, torch.optim.Optimizer]:
        return build_parallel_training(cfg, dims, device, vocab_limit=vocab_limit)

    step: StepFunction = staticmethod(training_step)

    def checkpoint(self, store: CheckpointManager, pm: ParallelModel, optimizer: torch.optim.Optimizer,
                   local: dict, state: TrainState, cfg: JobConfig,
                   message: Callable[[str], None]) -> TrainingCheckpoint:
        """DCP through ``TrainingCheckpoint``; a fine-tune's holds only the trainable tensors plus a reference to
        its base (source and checksum)."""
        base = open_base(cfg.finetune.source).reference() if cfg.finetune.source else None
        return TrainingCheckpoint(store, pm, optimizer, local, state, cfg, store.rank, message, base=base)

    def sampling_model(self, pm: ParallelModel) -> nn.Module:
        return pm.modules[0] if len(pm.modules) == 1 else nn.ModuleList(pm.modules)

    def describe(self) -> str | None:
        return None


def engine_for(cfg: JobConfig, precision: str, store: CheckpointManager) -> TrainingEngine:
    """The engine of ``cfg.parallel.engine`` (checked by ``train/validate.py:check_runnable``; DeepSpeed itself
    is imported only when its engine builds). ``precision``:
    the resolved one (not ``auto``); ``store``: the run's checkpoints (DeepSpeed builds differently for a
    resume on another world size)."""
    if cfg.parallel.engine == "deepspeed":
        return DeepSpeedEngine(precision, store)
    return NativeEngine()
