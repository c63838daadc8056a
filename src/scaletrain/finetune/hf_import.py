"""Import a local Hugging Face folder of a supported family (model/families.py): the reverse of ``scaletrain
export`` (checkpoint/export.py).

Reads ``config.json`` into a ``ModelConfig`` and ``model.safetensors`` (or the shards listed in
``model.safetensors.index.json``) into our parameter names. Only safetensors are read: a pickled
``pytorch_model.bin`` could run code when loaded, so it is refused with what to do instead. Every
problem is one line naming the file and the field.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from scaletrain.config import ConfigError, ModelConfig
from scaletrain.model.families import check_fused_rows, hf_places, model_config_from_hf, part_shape

# Where one of our parameters is in a Hugging Face folder: (safetensors file, tensor name, rows of it or None);
# a stacked expert weight is a list of them, one per expert in order; a buffer no family stores is
# (None, "", its shape), read as zeros.
HFPlace = "tuple[Path | None, str, slice | tuple | None] | list[tuple[Path, str, None]]"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read as JSON ({exc})") from None


@contextlib.contextmanager
def _open_safetensors(file: Path):
    """``safe_open`` of ``file``; a truncated or damaged file (its header does not match its size) is a
    ConfigError naming it, not safetensors' own traceback."""
    try:
        with safe_open(str(file), framework="pt") as fh:
            yield fh
    except SafetensorError as exc:
        raise ConfigError(f"{file}: not a readable safetensors file ({exc}); it is truncated or damaged (an "
                          f"interrupted download?): download or export it again") from None


def hf_model_config(folder: str | Path) -> ModelConfig:
    """``config.json`` of a Hugging Face folder of a supported family (model/families.py: Llama, Mistral, Qwen2/3,
    Gemma 3, Phi-3, SmolLM) as our ``ModelConfig``; what we do not compute is a ConfigError naming the field."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json (expected a Hugging Face model folder or a scaletrain run)")
    return model_config_from_hf(_read_json(path), path)


def safetensors_files(folder: str | Path) -> list[Path]:
    """The weight files of a folder: the shards of ``model.safetensors.index.json``, or ``model.safetensors``."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ConfigError(f"{index}: shard {missing[0]} is missing")
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ConfigError(f"{folder}: only pickled weights (*.bin/*.pt), which can run code when loaded; convert "
                          f"them to safetensors first (transformers: model.save_pretrained(out, "
                          f"safe_serialization=True))")
    raise ConfigError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of our model for ``cfg`` and its shape (the model built on the meta device)."""
    from scaletrain.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def family_absent_buffers(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The persistent buffers of our model that no family's file holds, and their shapes: each sparse layer's
    expert selection bias, zeros at import (transformers' routers have none)."""
    from scaletrain.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(b.shape) for name, b in model.state_dict().items() if name.endswith(".expert_bias")}


def hf_index(folder: str | Path, cfg: ModelConfig) -> dict[str, HFPlace]:
    """Where each weight of the folder is: our name -> (safetensors file, its name there, its rows or None), from
    the files' headers only (no tensor is read). Checks that every parameter of ``cfg``'s model is there with its
    shape; an unknown tensor name is refused rather than dropped. A tied head points at the embedding."""
    shapes = expected_shapes(cfg)
    index: dict[str, HFPlace] = {}
    experts: dict[str, dict[int, tuple[Path, str, None]]] = {}  # our stacked weight -> expert -> its tensor
    for file in safetensors_files(folder):
        with _open_safetensors(file) as fh:
            for hf_name in fh.keys():
                places = hf_places(hf_name, cfg)  # the one name table (model/hf_names.py), per family
                # A name the table maps but this model lacks (a bias, a block beyond n_layers) is refused too; a
                # tied model may still carry its lm_head (dropped below).
                if places is None or any(ours not in shapes and ours != "output.weight" for ours, _ in places):
                    raise ConfigError(f"{file}: tensor {hf_name} has no place in a {cfg.family} model (another "
                                      f"architecture?)")
                shape = tuple(fh.get_slice(hf_name).get_shape())
                check_fused_rows(f"{file}: {hf_name}", shape, places)
                for ours, rows in places:
                    if isinstance(rows, int):  # one expert of our stacked weight (E, out, in)
                        if ours in shapes and (not rows < shapes[ours][0] or shape != shapes[ours][1:]):
                            raise ConfigError(f"{file}: {hf_name} has shape {shape} (expert {rows}) but config.json "
                                              f"implies {shapes[ours][0]} experts of {shapes[ours][1:]}")
                        experts.setdefault(ours, {})[rows] = (file, hf_name, None)
                        continue
                    if ".experts." in ours and ours in shapes and shape[:1] != shapes[ours][:1]:  # fused (E, ...)
                        raise ConfigError(f"{file}: {hf_name} holds {shape[0] if shape else 0} experts but "
                                          f"config.json implies {shapes[ours][0]} (an expert missing?)")
                    part = part_shape(shape, rows)
                    if ours in shapes and part != shapes[ours]:
                        raise ConfigError(f"{file}: {hf_name} has shape {shape} but config.json implies "
                                          f"{shapes[ours]}{'' if rows is None else ' for ' + ours}")
                    index[ours] = (file, hf_name, rows)
    for ours, found in experts.items():
        lacking = [e for e in range(shapes[ours][0]) if e not in found]
        if lacking:
            raise ConfigError(f"{folder}: expert {lacking[0]} of {ours} is missing ({len(found)} of "
                              f"{shapes[ours][0]} experts' tensors found; an incomplete download?)")
        index[ours] = [found[e] for e in range(shapes[ours][0])]
    if cfg.tie_embeddings:
        index.pop("output.weight", None)
        shapes.pop("output.weight", None)
    missing = [name for name in shapes if name not in index]
    if missing:
        raise ConfigError(f"{folder}: weights missing for {len(missing)} parameter(s), e.g. {missing[0]} "
                          f"(config.json and the safetensors do not match)")
    if cfg.tie_embeddings:
        index["output.weight"] = index["tok_embeddings.weight"]
    if cfg.moe_experts:
        index.update({name: (None, "", shape) for name, shape in family_absent_buffers(cfg).items()})
    return index


def read_hf_tensor(where: HFPlace) -> torch.Tensor:
    """One tensor of ``hf_index`` (as stored: dtype kept); a part of a fused tensor reads only its rows; a stacked
    expert weight is its experts' tensors stacked."""
    if isinstance(where, list):
        return torch.stack([read_hf_tensor(one) for one in where])
    file, hf_name, rows = where
    if file is None:  # a buffer the family does not store (family_absent_buffers): its shape in ``rows``
        return torch.zeros(rows)
    with _open_safetensors(file) as fh:
        if rows is None:
            return fh.get_tensor(hf_name)
        if isinstance(rows, tuple):  # transformers 5's fused experts: every expert's rows
            return fh.get_slice(hf_name)[:, rows[1].start:rows[1].stop]
        return fh.get_slice(hf_name)[rows.start:rows.stop]
