"""Full (unsharded) model and optimizer state of a parallel run, for the rank-0 checkpoint writer.

Until checkpoints move to DCP (one file per rank, written in parallel), a distributed run gathers the
full state onto CPU with torch's ``torch.distributed.checkpoint.state_dict`` API and rank 0 writes it
in the single-process format, so ``scaletrain eval/generate`` and single-process resumes keep working.
Every function here is collective: all ranks must call it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from scaletrain.config import ConfigError
from scaletrain.parallel.parallelize import ParallelModel

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _single_module(pm: ParallelModel) -> nn.Module:
    if len(pm.modules) != 1:
        raise ConfigError("checkpoints with parallel.pp > 1 need per-stage (DCP) checkpoints, which are not "
                          "implemented yet; set checkpoint.enabled=false")
    return pm.modules[0]


def gather_model_state(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """The full model state dict on CPU (complete on rank 0; collective for sharded models)."""
    return get_model_state_dict(_single_module(pm), options=FULL)


def gather_optimizer_state(pm: ParallelModel, optimizer) -> dict:
    """The full optimizer state (complete on rank 0)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)  # each rank sends its shard of the AdamW states
        return optimizer.state_dict() if dist.get_rank() == 0 else {}
    return get_optimizer_state_dict(_single_module(pm), optimizer, options=FULL)


def load_model_state(pm: ParallelModel, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (read by every rank) into this rank's shards."""
    module = _single_module(pm)
    if module.cfg.tie_embeddings and "output.weight" not in state:  # safetensors stores a tied tensor once
        state = {**state, "output.weight": state["tok_embeddings.weight"]}
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(pm: ParallelModel, optimizer, state: dict) -> None:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(_single_module(pm), optimizer, state, options=StateDictOptions(full_state_dict=True))


class Held:
    """A stateful stand-in: hands the checkpoint manager a prepared dict, or keeps the one it loads."""

    def __init__(self, state: dict | None = None):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state
