"""Materialize a parallelized model from the meta device with the *same* weights a single process gets.

Every rank builds the reference model (``build_model(cfg, "cpu", seed)``, the single-process path) and
keeps the slice each of its parameters owns (``distribute_tensor(..., src_data_rank=None)`` slices
locally, no communication). So initial weights do not depend on the parallel layout: a run on 1, 2 or 8
ranks starts from identical weights, which is what makes parity checks and layout changes possible.
(Random init directly on sharded DTensors would not be: on CPU every shard would draw the same numbers.)

Cost: one full fp32 copy of the model in host memory per rank during start-up; for models where that
is too much, start from a checkpoint instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from scaletrain.config import ModelConfig
from scaletrain.model import build_model


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


@torch.no_grad()
def copy_full_into(part: nn.Module, full: dict[str, torch.Tensor], names: list[str] | None = None) -> None:
    """Copy full (unsharded) tensors into ``part``'s parameters and buffers, sharded or not (only ``names``
    when given)."""
    for name, tensor in _named_tensors(part).items():
        if names is not None and name not in names:
            continue
        source = full[name]
        if isinstance(tensor, DTensor):
            shard = distribute_tensor(source.to(tensor.device, tensor.dtype), tensor.device_mesh, tensor.placements,
                                      src_data_rank=None).to_local()
            tensor.to_local().copy_(shard)
        else:
            tensor.copy_(source)


def materialize(parts: list[nn.Module], model_cfg: ModelConfig, device: torch.device, seed: int,
                distributed: bool, weights: bool = True) -> None:
    """Allocate ``parts`` (built on meta) on ``device`` and initialise them.

    A single unsplit, unsharded model is initialised in place (exactly ``build_model``); anything split or
    sharded copies from the reference model so every layout starts from the same weights. ``weights=False``
    (a fine-tune, whose every parameter is written from its base right after): the buffers only - no random
    initialisation and no reference model, which was a whole second copy of the model on every rank.
    """
    for part in parts:
        part.to_empty(device=device)
    if not weights:
        torch.manual_seed(seed)  # every layout leaves the global generator in the same state
        for part in parts:
            part.init_buffers()
            tie = getattr(part, "tie_weights", None)  # to_empty lost a tie made on the meta device (see below)
            if tie is not None:
                tie()
        return
    if not distributed:
        (part,) = parts
        torch.manual_seed(seed)
        part.init_weights()
        return
    reference = build_model(model_cfg, "cpu", seed=seed)
    full = _named_tensors(reference)
    for part in parts:
        # Adapter tensors (finetune/: LoRA, prompts) are not in the plain reference; the fine-tuning build fills
        # them, with the base weights, right after parallelize.
        copy_full_into(part, full, names=[name for name in _named_tensors(part) if name in full])
        # to_empty gave each module's parameters new tensors, so a tie made on the meta device (the output head
        # sharing the embedding's matrix, model.tie_embeddings) is lost unless made again (init_weights does it
        # on the single-process path); FSDP2 keeps its shared parameters tied by itself (then a no-op). Without
        # it, DDP / ZeRO-1 ranks trained an untied head and embedding that a checkpoint saved as one matrix.
        tie = getattr(part, "tie_weights", None)
        if tie is not None:
            tie()
