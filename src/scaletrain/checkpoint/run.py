"""A run folder read back for evaluation, sampling and export: its config, tokenizer and latest weights."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from scaletrain.checkpoint.deepspeed_format import is_deepspeed_checkpoint, load_deepspeed_weights
from scaletrain.checkpoint.manager import CheckpointError, CheckpointManager, load_tensors
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
    if is_deepspeed_checkpoint(path):  # parallel.engine = "deepspeed": DeepSpeed's own files
        load_deepspeed_weights(path, model)
    else:
        load_tensors(path, {"model": model_tensors([model])})
    model.eval()
    return cfg, model, load_tokenizer(run / "tokenizer.json"), path
