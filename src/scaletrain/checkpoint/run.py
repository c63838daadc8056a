"""A run folder read back for evaluation, sampling and export: its config, tokenizer and latest weights.

``load_run`` is the one way to read any run: pretrained, fine-tuned (adapters over a referenced base), pruned or
quantized. Each kind's own step lives with the package that writes that kind, a layer above this one
(``finetune/run.py``, ``compress/run.py``), and is registered in ``LOADERS`` there, at import
(``register_loader``): this module imports no feature package. ``infer/load.py`` is the ``load_run`` commands
call, with every kind registered."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from torch import nn

from scaletrain.checkpoint.deepspeed_format import is_deepspeed_checkpoint, load_deepspeed_weights
from scaletrain.checkpoint.manager import CheckpointError, CheckpointManager, load_tensors
from scaletrain.checkpoint.run_folder import COMPRESS_RECORD, is_quantized_run
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


# What rebuilds a run's model from its folder: (run, its config, device) -> (model, the file or checkpoint it came
# from).
RunLoader = Callable[[Path, JobConfig, str], tuple[nn.Module, Path]]
# Each kind of run -> its loader; "finetuned", "pruned" and "quantized" are registered by the packages that write
# them (register_loader).
LOADERS: dict[str, RunLoader] = {"pretrained": load_pretrained}


def register_loader(kind: str, loader: RunLoader) -> None:
    """Read runs of ``kind`` (one of ``run_kind``'s answers) with ``loader``: called by the package that writes
    that kind, when it is imported."""
    LOADERS[kind] = loader


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
    if kind not in LOADERS:  # a caller that did not go through infer/load.py
        raise ConfigError(f"{run}: is a {kind} run, and no loader of {kind} runs is registered; read it with "
                          f"scaletrain.infer.load.load_run")
    model, path = LOADERS[kind](run, cfg, device)
    model.eval()
    return cfg, model, load_tokenizer(run / "tokenizer.json"), path
