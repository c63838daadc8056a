"""Model converters: every change made to the pure model before it trains, listed from the config in one place
(``build_converters``) and applied in one loop (torchtitan's ``build_model_converters`` idea, reduced to what
our build needs).

A converter has two steps, around ``parallelize`` (which splits, shards and materializes the model):

- ``convert(model)``: on the meta-device model, before ``parallelize``: swap modules (fp8 Linears, LoRA),
  freeze weights, hold out what must not be materialized (QLoRA's 4-bit base);
- ``after_parallelize(pm)``: on the materialized ``ParallelModel``, before the optimizer is built: write
  weights (the fine-tune's base and adapters), install hooks (distillation, QAT, gradient masks).

The list's order is the build's order, the same for both steps: fp8 -> the fine-tuning method on its base ->
the objective (distillation, a preference loss) -> quantization-aware training -> keep the base's zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from scaletrain.config import FinetuneConfig, JobConfig
from scaletrain.finetune.masks import keep_zeros
from scaletrain.finetune.methods import FinetuneMethod
from scaletrain.finetune.objectives import Objective, objective_of
from scaletrain.finetune.qat import prepare_qat
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.distributed import say
from scaletrain.parallel.parallelize import ParallelModel
from scaletrain.train.fp8 import convert_to_fp8
from scaletrain.train.loss import cross_entropy


class Converter(Protocol):
    def convert(self, model: nn.Module) -> None:
        """Change the meta-device model in place, before ``parallelize``."""

    def after_parallelize(self, pm: ParallelModel) -> None:
        """Finish on the materialized, parallelized model, before the optimizer is built."""


class BeforeOnly:
    """A converter with nothing to do after ``parallelize``."""

    def after_parallelize(self, pm: ParallelModel) -> None:
        pass


class AfterOnly:
    """A converter that leaves the meta model alone (it acts on the real weights)."""

    def convert(self, model: nn.Module) -> None:
        pass


@dataclass
class Float8Training(BeforeOnly):
    """``train.precision = fp8``: the blocks' Linears become torchao ``Float8Linear`` before TP / AC / compile /
    FSDP (train/fp8.py)."""

    fsdp: bool  # FSDP2 all-gathers the weights in float8

    def convert(self, model: nn.Module) -> None:
        convert_to_fp8(model, fsdp=self.fsdp)


@dataclass
class TrainingObjective(AfterOnly):
    """The objective's own loss (finetune/objectives.py: distillation's teacher, a preference loss and DPO's
    reference), installed once as ``pm.objective_loss``, on the loaded base and adapters."""

    objective: Objective
    cfg: JobConfig

    def after_parallelize(self, pm: ParallelModel) -> None:
        def data_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return cross_entropy(logits, targets, pm.vocab_limit)

        pm.objective_loss = self.objective.install(pm, self.cfg, data_loss, say)


@dataclass
class QuantizationAware(AfterOnly):
    """``finetune.qat``: fake-quantized block weights, on the loaded base (finetune/qat.py)."""

    ft: FinetuneConfig

    def after_parallelize(self, pm: ParallelModel) -> None:
        prepare_qat(pm.modules[0], self.ft)


class KeepZeros(AfterOnly):
    """``finetune.keep_zeros``: a pruned base's zeros held by gradient masks (finetune/masks.py)."""

    def after_parallelize(self, pm: ParallelModel) -> None:
        keep_zeros(pm.modules[0])


@dataclass
class Converters:
    """The converters of a job, in order. ``loads_weights``: one of them writes every weight after
    ``parallelize`` (a fine-tune's base), so ``parallelize`` skips the random initialisation."""

    items: Sequence[Converter]
    loads_weights: bool = False

    def convert(self, model: nn.Module) -> None:
        for converter in self.items:
            converter.convert(model)

    def after_parallelize(self, pm: ParallelModel) -> None:
        for converter in self.items:
            converter.after_parallelize(pm)


def build_converters(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> Converters:
    """The one list of what changes the model for ``cfg`` (its rules are checked by train/validate.py)."""
    items: list[Converter] = []
    if cfg.train.precision == "fp8":
        items.append(Float8Training(fsdp=dims.dp_shard > 1))
    ft = cfg.finetune
    if ft.source:  # fine-tuning: freeze / add adapters on the meta model, then load the base (docs/finetuning.md)
        items.append(FinetuneMethod(ft, cfg.train.seed, device))
        items.append(TrainingObjective(objective_of(ft), cfg))  # distillation, a preference loss, or none
        if ft.qat:
            items.append(QuantizationAware(ft))
        if ft.keep_zeros:
            items.append(KeepZeros())
    return Converters(items, loads_weights=bool(ft.source))
