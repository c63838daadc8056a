"""Import a local Hugging Face Llama folder: the reverse of ``scaletrain export`` (checkpoint/export.py).

Reads ``config.json`` into a ``ModelConfig`` and ``model.safetensors`` (or the shards listed in
``model.safetensors.index.json``) into our parameter names. Only safetensors are read: a pickled
``pytorch_model.bin`` could run code when loaded, so it is refused with what to do instead. Every
problem is one line naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from scaletrain.config import ConfigError, ModelConfig
from scaletrain.model.hf_names import from_hf

# config.json fields whose other values this model does not compute (field -> accepted values).
_REQUIRED = {"hidden_act": ("silu",), "attention_bias": (False, None), "mlp_bias": (False, None)}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read as JSON ({exc})") from None


def hf_model_config(folder: str | Path) -> ModelConfig:
    """``config.json`` of a Llama folder as our ``ModelConfig``; an unsupported architecture or field is a
    ConfigError naming it."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json (expected a Hugging Face Llama folder or a scaletrain run)")
    hf = _read_json(path)
    if hf.get("model_type") != "llama":
        raise ConfigError(f"{path}: model_type is {hf.get('model_type')!r}; only 'llama' (LlamaForCausalLM) "
                          f"can be imported")
    for key, accepted in _REQUIRED.items():
        if hf.get(key, accepted[0]) not in accepted:
            raise ConfigError(f"{path}: {key} = {hf[key]!r} is not supported (needs {accepted[0]!r})")
    rope = hf.get("rope_scaling") or {}
    params = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
    if rope_type not in ("default", None):
        raise ConfigError(f"{path}: rope scaling {rope_type!r} is not supported (plain rotary embeddings only)")
    try:
        dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or dim // n_heads)
        if head_dim % 2:
            raise ConfigError(f"{path}: head_dim {head_dim} must be even (rotary embeddings)")
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), dim=dim, n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
            head_dim=0 if head_dim * n_heads == dim else head_dim,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads), ffn_hidden_dim=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            rope_theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)))
    except KeyError as exc:
        raise ConfigError(f"{path}: missing field {exc.args[0]}") from None


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


def hf_index(folder: str | Path, cfg: ModelConfig) -> dict[str, tuple[Path, str]]:
    """Where each weight of the folder is: our name -> (safetensors file, its name there), from the files'
    headers only (no tensor is read). Checks that every parameter of ``cfg``'s model is there with its shape;
    an unknown tensor name is refused rather than dropped. A tied head points at the embedding."""
    shapes = expected_shapes(cfg)
    index: dict[str, tuple[Path, str]] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as fh:
            for hf_name in fh.keys():
                ours = from_hf(hf_name)  # the one name table (model/hf_names.py)
                if ours == "":
                    continue
                # A name the table maps but this model lacks (a bias, a block beyond n_layers) is refused too; a
                # tied model may still carry its lm_head (dropped below).
                if ours is None or (ours not in shapes and ours != "output.weight"):
                    raise ConfigError(f"{file}: tensor {hf_name} has no place in a Llama model (unsupported "
                                      f"architecture?)")
                shape = tuple(fh.get_slice(hf_name).get_shape())
                if ours in shapes and shape != shapes[ours]:
                    raise ConfigError(f"{file}: {hf_name} has shape {shape} but config.json implies "
                                      f"{shapes[ours]}")
                index[ours] = (file, hf_name)
    if cfg.tie_embeddings:
        index.pop("output.weight", None)
        shapes.pop("output.weight", None)
    missing = [name for name in shapes if name not in index]
    if missing:
        raise ConfigError(f"{folder}: weights missing for {len(missing)} parameter(s), e.g. {missing[0]} "
                          f"(config.json and the safetensors do not match)")
    if cfg.tie_embeddings:
        index["output.weight"] = index["tok_embeddings.weight"]
    return index


def read_hf_tensor(where: tuple[Path, str]) -> torch.Tensor:
    """One tensor of ``hf_index`` (as stored: dtype kept)."""
    file, hf_name = where
    with safe_open(str(file), framework="pt") as fh:
        return fh.get_tensor(hf_name)
