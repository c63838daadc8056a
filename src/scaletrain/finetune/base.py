"""The base model a fine-tune starts from: a scaletrain run folder or a local Hugging Face Llama folder.

``open_base`` reads the description (model config, tokenizer, a checksum) without loading weights;
``Base.state`` loads the weights under our parameter names. The checksum identifies the exact weights, so
an adapter checkpoint can refuse a base that changed since it was trained (its own checkpoint holds only the
trainable tensors plus this reference):

- a run: the sha256 of its latest checkpoint's ``meta.json``, which itself lists the sha256 of every file
  of that checkpoint;
- a Hugging Face folder: the sha256 over ``config.json`` and every safetensors file's sha256.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from scaletrain.checkpoint.manager import CheckpointError, CheckpointManager
from scaletrain.checkpoint.run_folder import is_quantized_run, quantized_from
from scaletrain.checkpoint.state import model_tensors
from scaletrain.config import ConfigError, DataConfig, ModelConfig, load_config
from scaletrain.core.files import file_sha256
from scaletrain.data.shards import MANIFEST
from scaletrain.finetune.hf_import import hf_index, hf_model_config, read_hf_tensor, safetensors_files
from scaletrain.finetune.method_table import method_entry
from scaletrain.model import build_model


@dataclass(frozen=True)
class Base:
    kind: str  # "run" or "hf"
    path: Path  # the run folder or the Hugging Face folder
    model: ModelConfig
    tokenizer: Path  # its tokenizer.json
    sha256: str
    checkpoint: Path | None = None  # a run's checkpoint folder
    data: str = ""  # a run's data: its prepared token folder if it is still there, else its data.path

    def reference(self) -> dict:
        """What an adapter checkpoint records about its base (``meta.json``'s ``base``)."""
        return {"source": str(self.path), "kind": self.kind, "sha256": self.sha256}

    def state(self) -> Mapping[str, torch.Tensor]:
        """Every weight of the base under our parameter names, fp32 on the CPU, each read when asked for
        (``RunWeights``, ``HFWeights``), so that copying them into the model never holds a second copy of the
        whole base."""
        if self.kind == "hf":
            return HFWeights(self.path, self.model)
        return RunWeights(self.checkpoint, self.model)


class LazyWeights(Mapping):
    """Weights by name, each read only when looked up: ``_names`` holds what a read needs per name (its shape
    and dtype, or where it is stored), and subclasses read in ``__getitem__``."""

    _names: dict

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class RunWeights(LazyWeights):
    """A run checkpoint's model weights (name -> fp32 CPU tensor), each read from the checkpoint by DCP when
    it is looked up. ``load_base_and_adapters`` copies them into the live model one by one, so loading a base
    costs one tensor beyond the model itself (reading the whole base first cost a second copy of it: 27 MB
    of a 7.2M-parameter LoRA run's 126 MB peak in benchmarks/finetune.py). Each read is this process's own
    (``no_dist``): ranks holding different pipeline stages ask for different tensors, so no collective."""

    def __init__(self, checkpoint: Path, model: ModelConfig):
        meta = build_model(model, "meta")
        self.checkpoint = checkpoint
        self._names = {k: v for k, v in model_tensors([meta]).items() if not k.startswith("rope_")}

    def __getitem__(self, name: str) -> torch.Tensor:
        like = self._names[name]  # a KeyError for a name the base does not have, as a dict would
        tensor = torch.empty(like.shape, dtype=like.dtype)
        try:
            dcp.load({"model": {name: tensor}}, checkpoint_id=str(self.checkpoint), no_dist=True)
        except (Exception, CheckpointException) as exc:  # DCP wraps failures in a BaseException subclass
            raise CheckpointError(f"{self.checkpoint}: cannot read model.{name} of the base "
                                  f"({str(exc).strip().splitlines()[-1][:200]})") from None
        return tensor


class HFWeights(LazyWeights):
    """A Hugging Face folder's weights (name -> fp32 CPU tensor), each read from its safetensors file when it
    is looked up; the names, shapes and completeness are checked up front from the files' headers."""

    def __init__(self, folder: Path, model: ModelConfig):
        self._names = hf_index(folder, model)

    def __getitem__(self, name: str) -> torch.Tensor:
        return read_hf_tensor(self._names[name]).float()


def open_base(source: str) -> Base:
    """Describe ``source`` (finetune.source); a folder that is neither kind is a one-line ConfigError."""
    path = Path(source)
    if not path.is_dir():
        raise ConfigError(f"finetune.source: {source} is not a folder (a scaletrain run or a Hugging Face folder)")
    return _open(path.resolve(), *_stamp(path))


def _stamp(path: Path) -> tuple:
    """Names and modification times of the files that define a base: a changed base is read again."""
    return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in path.iterdir() if p.is_file()))


@lru_cache(maxsize=8)
def _open(path: Path, *stamp) -> Base:
    if (path / "config.toml").is_file():
        cfg = load_config(path / "config.toml")
        if cfg.finetune.source:
            raise ConfigError(f"finetune.source: {path} is itself a fine-tuned run; export it merged "
                              f"(`scaletrain export --merge --run {path}`) and fine-tune from that folder")
        if is_quantized_run(path):  # torchao's tensors in one file, no checkpoint to train from
            raise ConfigError(f"finetune.source: {path} is a quantized run (scaletrain compress --quantize); fine-tune "
                              f"the run it was quantized from ({quantized_from(path)}), then quantize the result")
        checkpoint = CheckpointManager(path / "checkpoints").latest()
        if checkpoint is None:
            raise CheckpointError(f"finetune.source: {path} has no complete checkpoint")
        tokenizer = path / "tokenizer.json"
        return Base("run", path, cfg.model, tokenizer, file_sha256(checkpoint / "meta.json"), checkpoint,
                    run_data(path, cfg.data))
    if (path / "config.json").is_file():
        model = hf_model_config(path)
        tokenizer = path / "tokenizer.json"
        if not tokenizer.is_file():
            raise ConfigError(f"finetune.source: {path} has no tokenizer.json (needed to tokenize the data as "
                              f"the base was trained)")
        digest = hashlib.sha256(file_sha256(path / "config.json").encode())
        for file in safetensors_files(path):
            digest.update(f"{file.name}:{file_sha256(file)}".encode())
        return Base("hf", path, model, tokenizer, digest.hexdigest())
    raise ConfigError(f"finetune.source: {path} has neither config.toml (a scaletrain run) nor config.json "
                      f"(a Hugging Face folder)")


def run_data(run: Path, data: DataConfig) -> str:
    """What a run trained on: its prepared token folder (data.cache_dir, else <run>/data, as the trainer
    prepares it) while it holds a manifest, else its data.path as written."""
    prepared = Path(data.cache_dir) if data.cache_dir else run / "data"
    if not prepared.is_absolute():  # relative to where it was trained: try the run's parent too
        prepared = prepared if (prepared / MANIFEST).is_file() else run.parent / prepared
    return str(prepared.resolve()) if (prepared / MANIFEST).is_file() else data.path


def resolve_finetune(cfg, announce=None):
    """``cfg`` (a JobConfig) with the [model] section and data.tokenizer taken from ``finetune.source``: a fine-tune
    has the base's shape and reads its data with the base's tokenizer. Prompt and prefix tuning place the
    real tokens after the virtual ones, so the rotary tables (derived, not learned) are lengthened to cover
    data.seq_len + finetune.virtual_tokens. Without a source, ``cfg`` unchanged."""
    ft = cfg.finetune
    if not ft.source:
        return cfg
    base = open_base(ft.source)
    model = base.model
    default = ModelConfig()
    for field in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(cfg.model, field.name), getattr(model, field.name)
        unset = mine == getattr(default, field.name)
        if field.name in ("max_seq_len", "preset", "vocab_size") or mine == theirs or unset:
            continue  # not set, or set to the base's value (a resumed run's saved config)
        raise ConfigError(f"model.{field.name}={mine!r} is set, but a fine-tune takes [model] from finetune.source "
                          f"{base.path} ({field.name}={theirs!r}); drop the model setting")
    needed = cfg.data.seq_len + method_entry(ft.method).extra_positions(ft)
    if model.max_seq_len < needed:
        model = dataclasses.replace(model, max_seq_len=needed)
    if announce is not None and cfg.model != model:
        announce(f"fine-tuning {base.path} ({base.kind}): [model] and data.tokenizer taken from it")
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, tokenizer=str(base.tokenizer)))


def with_base_data(cfg, announce=None):
    """``cfg`` (a JobConfig whose data.path was not given) fine-tuning on its base run's data: a fine-tune (a
    recovery after compression above all) goes on with what the base learnt from, where the default corpus
    would silently change the task. A Hugging Face base (no data known), or instruction tuning: unchanged."""
    if not cfg.finetune.source or cfg.finetune.instructions or cfg.finetune.preferences:
        return cfg
    base = open_base(cfg.finetune.source)
    if not base.data or base.data == cfg.data.path:
        return cfg
    if announce is not None:
        announce(f"data.path not given: fine-tuning on the base run's data, {base.data} (set data.path to choose "
                 f"other text)")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=base.data))
