"""Export a run to a Hugging Face folder of its family's own class (config.json, model.safetensors, tokenizer files).

The config is the family's (``model/families.py``: ``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
``Gemma3ForCausalLM``, ...), the tensors under the family's names (Phi-3's q/k/v and gate/up joined again), so
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` builds that class and gives the same logits (tested
to 1e-4 per family). Our rotary layout is Hugging Face's rotate-half: no permutation.

A fine-tune of a Hugging Face folder keeps what belongs to its base and not to the weights: the token ids of its
config.json (``bos_token_id``, ``eos_token_id``, ``pad_token_id``), its ``generation_config.json``, its vocabulary
size (a published vocabulary is often larger than its tokenizer's) and its tokenizer files as they were (the
chat template included).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from scaletrain.checkpoint.run_folder import COMPRESS_RECORD
from scaletrain.config import ConfigError, JobConfig, ModelConfig, load_config
from scaletrain.core.files import guarded_write, remove_quietly
from scaletrain.data.tokenizer import BPETokenizer, CharTokenizer, HFTokenizer, Tokenizer
from scaletrain.model.config import head_width
from scaletrain.model.families import hf_config_from_model_config, state_dict_to_hf
from scaletrain.model.family import WRAPPERS, family

# What a base's config.json says about its tokenizer rather than its weights: carried over to the export.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_CONFIG = "generation_config.json"


def hf_base_folder(run: str | Path, cfg: JobConfig) -> Path | None:
    """The Hugging Face folder the run at ``run`` (config ``cfg``) comes from, while it is there: its
    ``finetune.source``, or for a compressed run that of the run it was compressed from; None for a run trained
    from scratch or from a scaletrain run."""
    source = cfg.finetune.source
    record = Path(run) / COMPRESS_RECORD
    if not source and record.is_file():
        origin = Path(json.loads(record.read_text(encoding="utf-8")).get("source") or "")
        if (origin / "config.toml").is_file():
            source = load_config(origin / "config.toml").finetune.source
    folder = Path(source) if source else None
    if folder is None or (folder / "config.toml").is_file() or not (folder / "config.json").is_file():
        return None
    return folder


def hf_config(cfg: ModelConfig, tokenizer: Tokenizer | None = None, base: Path | None = None) -> dict:
    """The family's config.json for ``cfg``: every field its class reads, the token ids of ``base``'s config.json
    (else the tokenizer's BOS/EOS), fp32 weights."""
    out = {**hf_config_from_model_config(cfg), "torch_dtype": "float32"}
    if base is not None:
        base_config = json.loads((base / "config.json").read_text(encoding="utf-8"))
        if base_config.get("model_type") in WRAPPERS:  # a multimodal checkpoint: its ids may sit in text_config
            base_config = {**base_config.get("text_config", {}), **base_config}
        out.update({k: base_config[k] for k in TOKEN_ID_FIELDS if k in base_config})
    elif tokenizer is not None:
        out.update({k: v for k, v in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id))
                    if v is not None})
    return out


def hf_state_dict(model: nn.Module, cfg: ModelConfig) -> dict:
    """Our parameters as the family's tensors (contiguous CPU tensors, tied head omitted, Phi-3's fused).

    The embedding and output rows are cut to ``cfg.vocab_size``, which may be below the model's: a padded
    vocabulary's extra rows (``padded_vocab_size``) are never a token and are not exported."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name in ("tok_embeddings.weight", "output.weight"):
            tensor = tensor[:cfg.vocab_size]
        state[name] = tensor.detach().to("cpu").contiguous()
    try:
        return state_dict_to_hf(state, cfg)  # the one name table (model/hf_names.py), per family
    except KeyError as exc:
        raise KeyError(f"no Hugging Face name for parameter {exc.args[0]!r}") from None


def _char_tokenizer_as_hf(tok: CharTokenizer):
    """A character vocabulary as a Hugging Face WordLevel tokenizer that splits every character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel(vocab=dict(tok.stoi), unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    return hf


def export_hf(model: nn.Module, cfg: ModelConfig, tokenizer: Tokenizer, out_dir: str | Path,
              base: Path | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and the tokenizer's other files.

    Without ``base`` the exported vocabulary is the tokenizer's: a model padded beyond it (for tensor parallelism
    or a GPU-friendly size) loses its padding rows, so config.json and the weights match the tokenizer files. With
    ``base`` (the Hugging Face folder a run was fine-tuned from, ``hf_base_folder``) the vocabulary is the base's,
    as are the token ids and ``generation_config.json``."""
    if cfg.parametrization != "standard":  # the families' classes have no logit multiplier nor 1/head_dim attention
        raise ConfigError(f"model.parametrization={cfg.parametrization} cannot be exported as a Hugging Face "
                          f"{family(cfg.family).hf_class} (its logit and attention scales are not the family's); "
                          f"only standard models export")
    if cfg.dim % cfg.n_heads:  # transformers 5's LlamaConfig validates this even when head_dim is given
        raise ConfigError(f"model.n_heads {cfg.n_heads} does not divide model.dim {cfg.dim}: transformers' LlamaConfig "
                          f"refuses that (even with head_dim {head_width(cfg)}); head-prune to a count that divides "
                          f"dim (e.g. compress --head-fraction 0.5) to export")
    if base is None and cfg.vocab_size > tokenizer.vocab_size:
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
        _write_hf(model, cfg, tokenizer, tmp, base)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


def _write_hf(model: nn.Module, cfg: ModelConfig, tokenizer: Tokenizer, out: Path, base: Path | None) -> None:
    (out / "config.json").write_text(json.dumps(hf_config(cfg, tokenizer, base), indent=2))
    save_file(hf_state_dict(model, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    if base is not None and (base / GENERATION_CONFIG).is_file():
        shutil.copyfile(base / GENERATION_CONFIG, out / GENERATION_CONFIG)
    if isinstance(tokenizer, HFTokenizer):  # a Hugging Face folder's tokenizer: its files as they are
        tokenizer.save(out / "tokenizer.json")
        return
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
