"""Load a finished (or running) run folder for evaluation and sampling."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.checkpoint import CheckpointError, CheckpointManager
from scaletrain.checkpoint.manager import load_tensors
from scaletrain.checkpoint.state import model_tensors
from scaletrain.config import ConfigError, JobConfig, load_config
from scaletrain.data.tokenizer import Tokenizer, load_tokenizer
from scaletrain.model import build_model


def load_run(run_dir: str | Path, device: str = "cpu") -> tuple[JobConfig, nn.Module, Tokenizer, Path]:
    """(config, model with the newest good checkpoint's weights, tokenizer, checkpoint path)."""
    run = Path(run_dir)
    if not (run / "config.toml").is_file():
        raise ConfigError(f"{run}: not a run folder (no config.toml); pass the train.run_dir of a run")
    cfg = load_config(run / "config.toml")
    path = CheckpointManager(run / "checkpoints").latest()
    if path is None:
        raise CheckpointError(f"{run}: no complete checkpoint yet")
    model = build_model(cfg.model, device)
    # The sharded checkpoint of any layout (FSDP, TP, PP, ...) is read back as one plain model.
    load_tensors(path, {"model": model_tensors([model])})
    model.eval()
    return cfg, model, load_tokenizer(run / "tokenizer.json"), path


@torch.no_grad()
def token_loss(model: nn.Module, tokens: torch.Tensor, seq_len: int, batch_size: int = 16) -> tuple[float, int]:
    """Mean next-token loss over every full window of ``seq_len + 1`` tokens (stride seq_len).
    Returns (loss, tokens scored)."""
    n_windows = (tokens.numel() - 1) // seq_len
    if n_windows < 1:
        raise ConfigError(f"the text has {tokens.numel()} tokens, fewer than one window of {seq_len + 1}")
    total, count = 0.0, 0
    for first in range(0, n_windows, batch_size):
        idx = torch.arange(first, min(first + batch_size, n_windows)) * seq_len
        rows = torch.stack([tokens[i:i + seq_len + 1] for i in idx.tolist()])  # (b, T+1)
        logits = model(rows[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum"))
        count += rows[:, 1:].numel()
    return total / count, count


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
