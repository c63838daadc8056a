"""A compressed model as a run folder, read back by eval, generate, export and ``finetune --from``.

A pruned model (unstructured, 2:4 or structured) is a plain run folder: ``config.toml`` (the source's, with
the new [model] section after structured pruning), ``tokenizer.json`` and one checkpoint written by the
same ``CheckpointManager`` the trainer uses, so every command reads it as it reads a trained run. The zeros
of unstructured / 2:4 pruning are in the saved weights (they are the mask).

A quantized model's weights are torchao tensor subclasses, which DCP does not write; they are saved with
``torch.save`` in ``quantized/model.pt`` (``compress.json`` names the method), and ``load_quantized`` rebuilds
the model, quantizes it with the same config and assigns the saved tensors. Both kinds are read through
``checkpoint.run.load_run``, which calls this module's step for its kind (registered here, at import).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.checkpoint.run import load_pretrained, register_loader
from scaletrain.checkpoint.run_folder import COMPRESS_RECORD as RECORD
from scaletrain.checkpoint.run_folder import QUANTIZED_WEIGHTS as QUANTIZED
from scaletrain.checkpoint.state import model_tensors
from scaletrain.compress.prune import use_sparse_kernels
from scaletrain.compress.quantize import quantize_model
from scaletrain.config import ConfigError, FinetuneConfig, JobConfig, ModelConfig, to_toml
from scaletrain.core.files import guarded_write, remove_quietly
from scaletrain.data.run_data import data_cache_dir
from scaletrain.data.tokenizer import HF_TOKENIZER_FILES
from scaletrain.model import Transformer


def write_run(out: str | Path, source: str | Path, cfg: JobConfig, model_cfg: ModelConfig, model: nn.Module,
              record: dict, quantized: bool = False) -> Path:
    """Write the compressed ``model`` as a run folder ``out`` (refused when ``out`` holds anything)."""
    out, source = Path(out), Path(source)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: exists and is not empty; choose a new folder")
    ckpt = CheckpointManager(source / "checkpoints").latest()
    step = int(CheckpointManager.read_meta(ckpt)["step"]) if ckpt is not None else 0
    new = dataclasses.replace(
        cfg, model=model_cfg, finetune=FinetuneConfig(),  # a plain model now (a full fine-tune's weights)
        train=dataclasses.replace(cfg.train, run_dir=str(out), resume=False, overwrite=False, stop_at_step=0),
        # The source's prepared data: the compressed run evaluates on the same split without preparing it again.
        data=dataclasses.replace(cfg.data, cache_dir=str(data_cache_dir(cfg, source).resolve())))
    record = {"source": str(source.resolve()), "source_checkpoint": str(ckpt) if ckpt else None, **record}
    # Written into a hidden folder beside --out and renamed into place last: an interruption (Ctrl-C, a full disk)
    # leaves no half-written --out to refuse the next attempt, which also replaces a hidden folder left by a kill.
    tmp = out.parent / f".{out.name}.tmp"
    with guarded_write(f"the compressed run {out}", out.parent, cleanup=(tmp,), needed=state_bytes(model)):
        remove_quietly(tmp)
        tmp.mkdir(parents=True)
        _write_files(tmp, source, new, model, step, record, quantized)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    return out


def _write_files(folder: Path, source: Path, cfg: JobConfig, model: nn.Module, step: int, record: dict,
                 quantized: bool) -> None:
    """The compressed run's files into ``folder``: config, tokenizer, weights (a checkpoint, or torchao's
    quantized tensors) and the record of what was done (written last)."""
    (folder / "config.toml").write_text(to_toml(cfg))
    shutil.copyfile(source / "tokenizer.json", folder / "tokenizer.json")
    for name in HF_TOKENIZER_FILES:  # a Hugging Face tokenizer's other files: its chat template, special tokens
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    if quantized:
        (folder / QUANTIZED).parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v for k, v in model.state_dict().items() if not k.startswith("rope_")}, folder / QUANTIZED)
    else:
        manager = CheckpointManager(folder / "checkpoints", keep_last=1)
        manager.save(step, {"model": model_tensors([model])}, {}, {"compressed_from": record["source"]})
        manager.close()
    record["weight_bytes"] = state_bytes(model)
    (folder / RECORD).write_text(json.dumps(record, indent=2))


def check_output(out: str | Path) -> None:
    """Refuse, before any work, an ``out`` that is not a new or empty folder, or whose path cannot be written (a
    parent that is a file, a folder not writable: one StorageError line). The folder is made to see that it can
    be, and what this made is removed again (``write_run`` makes it), so a later refusal leaves nothing behind."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; choose a new folder")
    if out.exists():
        return
    made = out  # the outermost folder this makes
    while not made.parent.exists() and made.parent != made.parent.parent:
        made = made.parent
    with guarded_write(f"the compressed run {out}", out):
        out.mkdir(parents=True)
    remove_quietly(made)  # empty folders only, all made here


def use_pruned_kernels(run: Path, model: nn.Module, device: str) -> None:
    """A 2:4-pruned run on sm80+ GPUs: torchao's 2:4 kernels; elsewhere (and for other patterns) the dense
    weights, zeros included."""
    if json.loads((run / RECORD).read_text()).get("prune", {}).get("pattern") == "2:4":
        use_sparse_kernels(model, device)


def load_quantized(run: Path, cfg: JobConfig, device: str = "cpu") -> nn.Module:
    """A quantized run's model: built from config.toml, quantized with the record's torchao config, and the
    saved tensors assigned (a file that does not fit the config is a one-line ConfigError)."""
    record = json.loads((run / RECORD).read_text())
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    model.init_weights()  # the rotary tables; every weight is assigned from the file below
    quant = record["quantize"]
    quantize_model(model, quant["method"], quant.get("group_size", 128), device)
    state = torch.load(run / QUANTIZED, map_location=device, weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.startswith("rope_")]
    if missing or unexpected:
        raise ConfigError(f"{run / QUANTIZED}: does not match the model of config.toml (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    model.tie_weights()
    return model


def state_bytes(model: nn.Module) -> int:
    """The size of ``model``'s weights as one ``torch.save`` file (tied tensors once, quantized tensors in their
    stored form): the same measure for the original and every variant (a training checkpoint also holds the
    optimizer's moments, which a compressed run does not keep)."""
    buf = io.BytesIO()
    torch.save({k: v for k, v in model.state_dict().items() if not k.startswith("rope_")}, buf)
    return buf.tell()


def load_pruned_run(run: Path, cfg: JobConfig, device: str) -> tuple[nn.Module, Path]:
    """A pruned run folder: read as a trained one (the zeros are in the saved weights), then 2:4's kernels."""
    model, path = load_pretrained(run, cfg, device)
    use_pruned_kernels(run, model, device)
    return model, path


def load_quantized_run(run: Path, cfg: JobConfig, device: str) -> tuple[nn.Module, Path]:
    """A quantized run folder: rebuilt with its torchao config."""
    return load_quantized(run, cfg, device), run / QUANTIZED


register_loader("pruned", load_pruned_run)
register_loader("quantized", load_quantized_run)
