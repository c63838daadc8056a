"""Export a run to a Hugging Face Llama folder (config.json, model.safetensors, tokenizer files).

Our rotary layout is Hugging Face's rotate-half, so the weights map one to one by name; no permutation.
``transformers.LlamaForCausalLM.from_pretrained(folder)`` gives the same logits (tested to 1e-5).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from scaletrain.config import ConfigError, ModelConfig
from scaletrain.data.tokenizer import BPETokenizer, CharTokenizer, Tokenizer
from scaletrain.files import guarded_write, remove_quietly
from scaletrain.model.config import head_width
from scaletrain.model.hf_names import to_hf
from scaletrain.model.presets import ffn_hidden_dim, kv_heads


def hf_config(cfg: ModelConfig) -> dict:
    head_dim = head_width(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_dim(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": kv_heads(cfg),
        "head_dim": head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers < 5
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers >= 5
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }


def hf_state_dict(model: nn.Module, cfg: ModelConfig) -> dict:
    """Our parameter names -> Hugging Face Llama names (contiguous CPU tensors, tied head omitted).

    The embedding and output rows are cut to ``cfg.vocab_size``, which may be below the model's: a padded
    vocabulary's extra rows (``padded_vocab_size``) are never a token and are not exported."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name in ("tok_embeddings.weight", "output.weight"):
            tensor = tensor[:cfg.vocab_size]
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        try:
            key = to_hf(name)  # the one name table (model/hf_names.py)
        except KeyError:
            raise KeyError(f"no Hugging Face name for parameter {name!r}") from None
        out[key] = tensor.detach().to("cpu").contiguous()
    return out


def _char_tokenizer_as_hf(tok: CharTokenizer):
    """A character vocabulary as a Hugging Face WordLevel tokenizer that splits every character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel(vocab=dict(tok.stoi), unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    return hf


def export_hf(model: nn.Module, cfg: ModelConfig, tokenizer: Tokenizer, out_dir: str | Path) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.

    The exported vocabulary is the tokenizer's: a model padded beyond it (for tensor parallelism or a
    GPU-friendly size) loses its padding rows, so config.json and the weights match the tokenizer files."""
    if cfg.parametrization != "standard":  # LlamaForCausalLM has no logit multiplier nor 1/head_dim attention
        raise ConfigError(f"model.parametrization={cfg.parametrization} cannot be exported as a Hugging Face Llama "
                          f"(its logit and attention scales are not Llama's); only standard models export")
    if cfg.dim % cfg.n_heads:  # transformers 5's LlamaConfig validates this even when head_dim is given
        raise ConfigError(f"model.n_heads {cfg.n_heads} does not divide model.dim {cfg.dim}: transformers' LlamaConfig "
                          f"refuses that (even with head_dim {head_width(cfg)}); head-prune to a count that divides "
                          f"dim (e.g. compress --head-fraction 0.5) to export")
    if cfg.vocab_size > tokenizer.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=tokenizer.vocab_size)
    out = Path(out_dir)
    # Written into a hidden folder and renamed into place: a failed write (a full disk) leaves the previous
    # export, if any, as it was and removes the partial one (guarded_write), with one line saying why.
    tmp = out.parent / f".{out.name}.tmp"
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ConfigError(f"{out} exists and is not an earlier export (no config.json); it would be replaced: "
                          f"choose a new or empty folder with --out")
    with guarded_write(f"the export {out}", out.parent, cleanup=(tmp,),
                       needed=sum(p.numel() * p.element_size() for p in model.parameters())):
        remove_quietly(tmp)
        tmp.mkdir(parents=True)
        _write_hf(model, cfg, tokenizer, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


def _write_hf(model: nn.Module, cfg: ModelConfig, tokenizer: Tokenizer, out: Path) -> None:
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    save_file(hf_state_dict(model, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_tok = tokenizer.tok if isinstance(tokenizer, BPETokenizer) else _char_tokenizer_as_hf(tokenizer)
    hf_tok.save(str(out / "tokenizer.json"))
    special = {}
    if tokenizer.eos_id is not None:
        special["eos_token"] = hf_tok.id_to_token(tokenizer.eos_id)
    if tokenizer.bos_id is not None:
        special["bos_token"] = hf_tok.id_to_token(tokenizer.bos_id)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
         "clean_up_tokenization_spaces": False, **special}, indent=2))
