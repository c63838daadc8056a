"""A run folder read back for evaluation, sampling and export: its config, tokenizer and latest weights.

``load_run`` is the one way to read any run: pretrained, fine-tuned (adapters over a referenced base), pruned or
quantized. Each kind's own step lives with the package that writes that kind (``finetune/run.py``,
``compress/run.py``); ``LOADERS`` names it, imported only when a run of that kind is read, so no command
imports a feature package to read a run, and reading a pretrained run imports neither."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from torch import nn

from scaletrain.checkpoint.deepspeed_format import is_deepspeed_checkpoint, load_deepspeed_weights
from scaletrain.checkpoint.manager import CheckpointError, CheckpointManager, load_tensors
from scaletrain.checkpoint.run_folder import COMPRESS_RECORD, QUANTIZED_WEIGHTS, is_quantized_run
from scaletrain.checkpoint.state import model_tensors
from scaletrain.config import ConfigError, JobConfig, load_config
from scaletrain.data.tokenizer import Tokenizer, load_tokenizer
from scaletrain.model import build_model


def run_kind(run: Path, cfg: JobConfig) -> str:
    """'quantized', 'pruned' (any compressed run that is not quantized), 'finetuned' or 'pretrained'."""
    if (run / COMPRESS_RECORD).is_file():
        return "quantized" if is_quantized_run(run) else "pruned"
    return "finetuned" if cfg.finetune.source else "pretrained"


def latest_checkpoint(run: Path) -> Path:
    """The newest complete checkpoint of ``run``, or a one-line CheckpointError."""
    path = CheckpointManager(run / "checkpoints").latest()
    if path is None:
        raise CheckpointError(f"{run}: no complete checkpoint yet")
    return path


def load_pretrained(run: Path, cfg: JobConfig, device: str) -> tuple[nn.Module, Path]:
    """A model trained from scratch (or a full fine-tune): every weight is in the checkpoint."""
    path = latest_checkpoint(run)
    model = build_model(cfg.model, device)
    # The sharded checkpoint of any layout (FSDP, TP, PP, ...) is read back as one plain model.
    if is_deepspeed_checkpoint(path):  # parallel.engine = "deepspeed": DeepSpeed's own files
        load_deepspeed_weights(path, model)
    else:
        load_tensors(path, {"model": model_tensors([model])})
    return model, path


def _load_finetuned(run: Path, cfg: JobConfig, device: str) -> tuple[nn.Module, Path]:
    from scaletrain.finetune.run import load_finetuned  # the base + its adapters (peft / torchao only when used)

    path = latest_checkpoint(run)
    return load_finetuned(cfg, path, device), path


def _load_pruned(run: Path, cfg: JobConfig, device: str) -> tuple[nn.Module, Path]:
    from scaletrain.compress.run import use_pruned_kernels  # 2:4: torchao's sparse kernels where the GPU has them

    model, path = load_pretrained(run, cfg, device)  # the zeros are in the saved weights
    use_pruned_kernels(run, model, device)
    return model, path


def _load_quantized(run: Path, cfg: JobConfig, device: str) -> tuple[nn.Module, Path]:
    from scaletrain.compress.run import load_quantized  # rebuilt with its torchao config

    return load_quantized(run, cfg, device), run / QUANTIZED_WEIGHTS


# Each kind of run -> what rebuilds its model from the folder: (model, the file or checkpoint it came from).
LOADERS: dict[str, Callable[[Path, JobConfig, str], tuple[nn.Module, Path]]] = {
    "pretrained": load_pretrained, "finetuned": _load_finetuned, "pruned": _load_pruned,
    "quantized": _load_quantized,
}


def load_run(run_dir: str | Path, device: str = "cpu", quantized_ok: bool = True
             ) -> tuple[JobConfig, nn.Module, Tokenizer, Path]:
    """(config, model in eval mode with the newest good weights, tokenizer, checkpoint path) of any run folder.
    ``quantized_ok=False`` (export): a quantized run is a one-line ConfigError naming the run it came from."""
    run = Path(run_dir)
    if not (run / "config.toml").is_file():
        raise ConfigError(f"{run}: not a run folder (no config.toml); pass the train.run_dir of a run")
    cfg = load_config(run / "config.toml")
    kind = run_kind(run, cfg)
    if kind == "quantized" and not quantized_ok:
        source = json.loads((run / COMPRESS_RECORD).read_text())["source"]
        raise ConfigError(f"{run}: is quantized (torchao tensors, which a Hugging Face Llama folder cannot hold); "
                          f"export the run it was quantized from ({source})")
    model, path = LOADERS[kind](run, cfg, device)
    model.eval()
    return cfg, model, load_tokenizer(run / "tokenizer.json"), path
