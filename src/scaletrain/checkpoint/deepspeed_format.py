"""Checkpoints written by the DeepSpeed engine, read back as one plain model (eval, generate, export).

The trainer's step folder (``step-XXXXXXXX/`` with ``meta.json`` and per-rank small state, as for the native
engine) holds DeepSpeed's own files under ``deepspeed/`` (``engine.save_checkpoint(folder, tag="deepspeed")``):
the module states and, under ZeRO, one optimizer-state partition per rank. DeepSpeed's ``zero_to_fp32``
merges the fp32 partitions into full tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from scaletrain.checkpoint.manager import CheckpointError

TAG = "deepspeed"  # the DeepSpeed checkpoint tag (a sub-folder of the step folder)


def is_deepspeed_checkpoint(path: Path) -> bool:
    return (Path(path) / TAG).is_dir()


def load_deepspeed_weights(path: Path, model: nn.Module) -> None:
    """Full fp32 weights of a DeepSpeed checkpoint (any ZeRO stage, any number of ranks) into ``model``."""
    folder = Path(path) / TAG
    try:
        if any(folder.glob("*optim_states.pt")):  # ZeRO 1/2/3: merge the fp32 partitions
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=TAG)
        else:  # ZeRO-0: the whole module in rank 0's file
            state = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    except ImportError:
        raise CheckpointError(f"{path}: written by the deepspeed engine; reading it needs DeepSpeed "
                              f"(pip install 'scaletrain[deepspeed]')") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if set(missing) & names or unexpected:
        raise CheckpointError(f"{path}: DeepSpeed checkpoint does not fit the run's model (missing "
                              f"{sorted(set(missing) & names)[:3]}, unexpected {sorted(unexpected)[:3]})")
