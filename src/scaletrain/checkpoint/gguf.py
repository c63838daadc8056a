"""Export a run to one GGUF file for llama.cpp and Ollama, through the ``gguf`` package (the format's reference
writer; optional extra ``scaletrain[gguf]``).

Every family with a GGUF layout in its entry (``model/family/``, ``Family.gguf``): llama (and SmolLM2), mistral,
qwen2, qwen3, gemma3, phi3, smollm3, in llama.cpp's architecture of that name, and with experts qwen3_moe
(``qwen3moe``), olmoe (``olmoe``) and mixtral (``llama`` with experts, as llama.cpp's converter writes it): each
layer's router ``ffn_gate_inp`` (kept f32) and its experts stacked 3-D (``ffn_{gate,up,down}_exps``), the expert
counts (and Qwen3-MoE's experts' width) in the metadata; routing llama.cpp would do otherwise is refused (a dense
layer, top-k renormalised where the architecture does not, shared experts, ...). The tensors are the family's Hugging
Face ones (``state_dict_to_hf``: its names, Phi-3's fused qkv / gate_up) named as llama.cpp's converter names them
(``gguf.TensorNameMap`` of the architecture, the converter's own table), with the entry's changes:
``interleave_rotary`` (llama, mistral, smollm3: llama.cpp rotates adjacent pairs (2i, 2i + 1) where we rotate
halves (i, i + hd/2), so the rows of wq and wk are permuted within each head, ``rotary_to_interleaved``, as the
converter does), ``norm_shift`` (Gemma 3's gains stored as offsets from 1: llama.cpp multiplies by the gain, so 1
is added), and the architecture's keys (``metadata``: Gemma 3's window, which layers use it and their rotary base).
What llama.cpp would compute otherwise is refused in one line (``refuse``, a sliding window where the architecture
has none, rope scaling other than linear).

Tokenizer: a byte-level BPE run is written as llama.cpp's ``gpt2`` vocabulary (tokens, merges, special-token
types and ids); a character vocabulary as a ``gpt2`` vocabulary of single byte-level characters and one merge that
can never apply, which llama.cpp encodes one character a token as we do (ASCII characters; others decode but cannot
be typed), plus an end-of-text control token (``<|endoftext|>``, its embedding and output rows zero, so its logit is
0) so that llama.cpp has an end-of-generation id rather than taking a character for one. The rows of a padded
vocabulary are not written (they are never a token), as in the Hugging Face export. A base's own tokenizer (a
Hugging Face folder: Llama 3, Qwen) is written as llama.cpp's converter writes it: ``tokenizer.ggml.pre`` the name
llama.cpp gives its pre-tokenizer (found, as ``convert_hf_to_gguf.py``'s ``get_vocab_base_pre`` finds it, by the
sha256 of the ids of one check text: ``llama-bpe``, ``qwen2``, ...), ``add_bos_token`` whether the tokenizer puts a
BOS in front (what training saw), and the chat template the run was trained in: the base's own
(``finetune.chat_template``, ``data.chat.uses_base_template``), else ours (``data.instructions.jinja_chat_template``).
A SentencePiece base (Gemma's) is refused by the pre-tokenizer check (its split has no name here).

dtypes: f32; f16 and q8_0 for the 2-D weights (the norms stay f32, as in llama.cpp's converter; a matrix
whose rows are not a multiple of q8_0's block of 32 is written f16).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from scaletrain.config import ConfigError, JobConfig, ModelConfig
from scaletrain.core.files import guarded_write, remove_quietly
from scaletrain.data.chat import uses_base_template
from scaletrain.data.instructions import jinja_chat_template
from scaletrain.data.tokenizer import BPETokenizer, HFTokenizer, Tokenizer
from scaletrain.model.config import head_width, is_moe_layer
from scaletrain.model.families import hf_config_from_model_config, state_dict_to_hf
from scaletrain.model.family import family
from scaletrain.model.hf_names import HF_BLOCK_PREFIX, PROJECTIONS
from scaletrain.model.presets import expert_hidden_dim, ffn_hidden_dim, kv_heads

DTYPES = ("f32", "f16", "q8_0")
NO_MERGE = "<|no-merge|>"
END_OF_TEXT = "<|endoftext|>"  # the end-of-generation token a character vocabulary's GGUF gets

def rotary_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """wq or wk (n_heads * hd, dim) from rotate-half row order to llama.cpp's adjacent pairs: within each head,
    rows (i, i + hd/2) become rows (2i, 2i + 1) (llama.cpp's ``LlamaModel.permute``)."""
    out_features = weight.shape[0]
    return (weight.reshape(n_heads, 2, out_features // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_state(model: nn.Module, cfg: ModelConfig, vocab_rows: int, token_rows: int | None = None
               ) -> dict[str, np.ndarray]:
    """llama.cpp name -> fp32 array (tied head omitted: llama.cpp reuses token_embd). The embedding and head keep
    ``vocab_rows`` rows, those from ``token_rows`` on zero (a token the model never learnt: the char vocabulary's
    end-of-text)."""
    import gguf

    layout = _layout(cfg)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[layout.arch.upper()], cfg.n_layers)
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("rope_")}
    q, k = (f"{PROJECTIONS[role][1]}.weight" for role in ("q", "k"))
    out = {}
    for hf_name, tensor in _hf_tensors(ours, cfg).items():
        tensor = tensor.detach().float().cpu()
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = _vocab_rows(tensor, vocab_rows, token_rows)
        if layout.interleave_rotary and hf_name.endswith(q):
            tensor = rotary_to_interleaved(tensor, cfg.n_heads)
        elif layout.interleave_rotary and hf_name.endswith(k):
            tensor = rotary_to_interleaved(tensor, kv_heads(cfg))
        if hf_name.endswith("norm.weight"):
            tensor = tensor + layout.norm_shift
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConfigError(f"--format gguf: tensor {hf_name} has no name in llama.cpp's {layout.arch}")
        out[name] = tensor.contiguous().numpy()
    return out


def _hf_tensors(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameters under the family's Hugging Face names, each layer's experts kept stacked (E, out, in) as one
    tensor named for the projection (``model.layers.N.mlp.experts.gate_proj.weight``: the name llama.cpp's
    converter gives the experts it stacks, mapped to ``blk.N.ffn_gate_exps`` by ``gguf.TensorNameMap``)."""
    fam = family(cfg.family)
    stacked = {k: v for k, v in ours.items() if k.rpartition(".")[0].endswith("feed_forward.experts")
               and k.rpartition(".")[2] in fam.experts}
    out = state_dict_to_hf({k: v for k, v in ours.items() if k not in stacked}, cfg)
    for name, tensor in stacked.items():
        layer, kind = name.split(".")[1], name.rpartition(".")[2]
        out[f"{HF_BLOCK_PREFIX}{layer}.{fam.experts_module}.{fam.experts[kind]}.weight"] = tensor
    return out


def _vocab_rows(tensor: torch.Tensor, rows: int, token_rows: int | None) -> torch.Tensor:
    """``tensor``'s first ``rows`` rows (zeros added past its end), those from ``token_rows`` on zero."""
    out = torch.zeros(rows, *tensor.shape[1:])
    keep = min(rows, tensor.shape[0], token_rows if token_rows is not None else rows)
    out[:keep] = tensor[:keep]
    return out


def _layout(cfg: ModelConfig):
    layout = family(cfg.family).gguf
    if layout is None:
        raise ConfigError(f"--format gguf: the {cfg.family} family has no llama.cpp layout here; export a Hugging "
                          f"Face folder (--format hf) and convert it with llama.cpp's convert_hf_to_gguf.py")
    return layout


# rope scaling llama.cpp computes as we do from the file's keys alone (llama3's needs a rope_freqs tensor, yarn
# per-architecture attention factors: refused rather than approximated)
GGUF_ROPE_SCALING = ("none", "linear")


def check_exportable(model: nn.Module, cfg: ModelConfig) -> None:
    """One ConfigError line when llama.cpp's architecture for the family would not compute this model."""
    if cfg.parametrization != "standard":
        raise ConfigError(f"--format gguf: model.parametrization={cfg.parametrization} is not an architecture "
                          f"llama.cpp knows (its logit and attention scales are not Llama's)")
    layout = _layout(cfg)
    why = layout.refuse(cfg)
    if why is None and cfg.rope_scaling not in GGUF_ROPE_SCALING:
        why = f"rope_scaling {cfg.rope_scaling!r} (written here: {', '.join(GGUF_ROPE_SCALING)})"
    if why is None and cfg.sliding_window and not layout.sliding and cfg.sliding_window < cfg.max_seq_len:
        why = f"sliding_window {cfg.sliding_window} (llama.cpp's {layout.arch} attends over the whole context)"
    if why is None and cfg.moe_experts:
        why = _experts_refusal(cfg, layout)
    if why is not None:
        raise ConfigError(f"--format gguf: llama.cpp's {layout.arch} would compute this {cfg.family} model otherwise: "
                          f"{why}; export a Hugging Face folder (--format hf) instead")
    kinds = {type(m).__name__ for m in model.modules()}
    adapters = kinds & {"PromptEmbedding", "PrefixAttention"}
    if adapters:
        raise ConfigError(f"--format gguf: a prompt/prefix-tuned model ({', '.join(sorted(adapters))}) is not an "
                          f"architecture llama.cpp knows; export it as a Hugging Face folder with its peft adapter "
                          f"(--format hf)")
    if "LoRALinear" in kinds or "NF4Linear" in kinds:
        raise ConfigError("--format gguf: a LoRA/QLoRA fine-tune must be merged first: add --merge")


def _experts_refusal(cfg: ModelConfig, layout) -> str | None:
    """Why llama.cpp's architecture would route or compute this model's experts otherwise (None when it computes
    ours): no experts in the architecture, a dense layer among the sparse ones, the top-k weights renormalised
    where it does not (or the reverse), or a routing option the family's config.json cannot say either (shared
    experts, sigmoid scores, capacity, ...: the Hugging Face export's own check)."""
    if not layout.experts:
        return f"{cfg.moe_experts} experts (this architecture has none)"
    dense = [i for i in range(cfg.n_layers) if not is_moe_layer(cfg, i)]
    if dense:
        return f"layer {dense[0]} without experts (every layer of llama.cpp's {layout.arch} has them)"
    if cfg.moe_renormalize != layout.renormalize:
        return (f"moe_renormalize = {cfg.moe_renormalize} (llama.cpp's {layout.arch} "
                f"{'renormalises' if layout.renormalize else 'does not renormalise'} each token's top-k weights)")
    try:
        hf_config_from_model_config(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies store)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _vocabulary(tokenizer: Tokenizer, rows: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) in llama.cpp's gpt2 form, ``rows`` long."""
    import gguf

    if isinstance(tokenizer, BPETokenizer):
        import json

        data = json.loads(tokenizer.tok.to_str())
        tokens = [tokenizer.tok.id_to_token(i) for i in range(tokenizer.vocab_size)]
        added = {t["id"]: t for t in data.get("added_tokens", [])}
        types = [_token_type(added.get(i), token) for i, token in enumerate(tokens)]
        tokens = [token.replace("\u2581", " ") if kind == gguf.TokenType.USER_DEFINED else token
                  for token, kind in zip(tokens, types)]  # the converter's pre-normalized user-defined spaces
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    else:
        byte_char = _byte_to_unicode()
        tokens = ["".join(byte_char[b] for b in c.encode("utf-8")) for c in tokenizer.chars]
        types = [gguf.TokenType.NORMAL] * len(tokens)
        # llama.cpp refuses a gpt2 vocabulary without merges; one between two multi-character strings that no
        # merge produces can never apply (symbols start as single characters), so every character stays a token
        merges = [f"{NO_MERGE} {NO_MERGE}"]
        tokens, types = tokens[:rows - 1] + [END_OF_TEXT], types[:rows - 1] + [gguf.TokenType.CONTROL]
    return tokens[:rows], [int(t) for t in types[:rows]], merges


def _token_type(added: dict | None, token: str) -> int:
    """llama.cpp's type of a byte-level BPE token, as ``convert_hf_to_gguf.py``'s ``get_vocab_base`` gives it: an
    added token is CONTROL when special or when it looks special (``does_token_look_special``: ``<|...|>``, Qwen's
    ``<|fim_prefix|>``), else USER_DEFINED (Qwen3's ``<think>``, ``<tool_call>``: llama.cpp then matches it whole
    in text, as transformers does, where a NORMAL token would be split into pieces); any other token NORMAL."""
    import gguf

    if added is None:
        return gguf.TokenType.NORMAL
    looks_special = token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or any(
        token.startswith(start) and token.endswith(end) for start, end in (("<|", "|>"), ("<\uff5c", "\uff5c>"),
                                                                           ("<unused", ">")))
    return gguf.TokenType.CONTROL if added.get("special") or looks_special else gguf.TokenType.USER_DEFINED


def special_token_ids(tokenizer: Tokenizer, rows: int, template: str) -> dict[str, int]:
    """The ids the GGUF names (``tokenizer.ggml.<kind>_token_id``), as llama.cpp's converter finds them in the
    tokenizer files (``gguf.SpecialVocab``): bos, eos and, for a base's folder, what else its tokenizer_config.json
    names (Qwen3's pad ``<|endoftext|>``); for our byte-level BPE, pad its ``<|pad|>``; for a character vocabulary,
    eos and pad the end-of-text token the GGUF adds (``END_OF_TEXT``). And eot: the token that ends an assistant
    turn in the template the run was trained in (``data.instructions.stop_ids``: Llama 3's ``<|eot_id|>``, Qwen's
    ``<|im_end|>``; our plain template: the EOS; a character vocabulary: none, "\\n\\n" text ends a turn)."""
    from scaletrain.data.tokenizer import PAD

    if _adds_end_of_text(tokenizer):
        return {"eos": rows - 1, "pad": rows - 1}
    ids = {kind: i for kind, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)) if i is not None}
    if isinstance(tokenizer, HFTokenizer):
        import gguf

        found = gguf.SpecialVocab(tokenizer.folder, n_vocab=rows).special_token_ids
        ids.update({kind: i for kind, i in found.items() if kind not in ids})
    elif isinstance(tokenizer, BPETokenizer) and tokenizer.tok.token_to_id(PAD) is not None:
        ids["pad"] = tokenizer.tok.token_to_id(PAD)
    if uses_base_template(tokenizer, template):
        from scaletrain.data.instructions import stop_ids

        ids["eot"] = stop_ids(tokenizer.folder, template)[0]
    elif tokenizer.eos_id is not None:
        ids["eot"] = tokenizer.eos_id
    return {kind: i for kind, i in ids.items() if 0 <= i < rows}


def _adds_end_of_text(tokenizer: Tokenizer) -> bool:
    """A character vocabulary has no end-of-text token: the GGUF gets one (``END_OF_TEXT``) after the characters."""
    return not isinstance(tokenizer, BPETokenizer) and tokenizer.eos_id is None


# llama.cpp's pre-tokenizer check (``convert_hf_to_gguf.py``, ``get_vocab_base_pre``; ggml-org/llama.cpp PR 6920):
# the sha256 of ``str(ids)`` of this text, encoded with the tokenizer's special tokens, names the pre-tokenizer.
PRE_TOKENIZER_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")
# The hashes of the families this writer's llama architecture carries (llama.cpp's table holds many more).
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3, 3.1, 3.2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen 1.5, 2, 2.5, 3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}


def pre_tokenizer_name(tokenizer: Tokenizer) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for ``tokenizer``: ``gpt-2`` for ours (byte-level BPE with GPT-2's
    split, or characters); for a base's Hugging Face tokenizer the name llama.cpp's converter finds by the check
    text's hash (a ConfigError when it is not one this writer knows: llama.cpp would split the text otherwise)."""
    if not isinstance(tokenizer, HFTokenizer):
        return "gpt-2"
    import hashlib

    digest = hashlib.sha256(str(tokenizer.tok.encode(PRE_TOKENIZER_CHECK_TEXT).ids).encode()).hexdigest()
    if digest not in PRE_TOKENIZERS:
        raise ConfigError(f"--format gguf: the tokenizer in {tokenizer.folder} splits text in a way this writer does "
                          f"not name for llama.cpp (check hash {digest[:12]}; known: "
                          f"{', '.join(sorted(set(PRE_TOKENIZERS.values())))}); export a Hugging Face folder "
                          f"(--format hf) and convert it with llama.cpp's convert_hf_to_gguf.py")
    return PRE_TOKENIZERS[digest]


def chat_template(tokenizer: Tokenizer, choice: str) -> str:
    """The chat template the run was trained in (``choice``: finetune.chat_template): the base's own, as
    transformers renders it, or our plain one."""
    if uses_base_template(tokenizer, choice):
        return tokenizer.transformers_tokenizer().chat_template
    return jinja_chat_template(tokenizer)


# Tensors kept f32 whatever the dtype (llama.cpp's converter's list): the router, whose scores pick the experts.
F32_TENSORS = (".ffn_gate_inp.weight",)


def _tensor(array: np.ndarray, dtype: str, name: str = ""):
    """(data, raw dtype) for ``add_tensor``: 1-D tensors and the router stay f32; the experts' 3-D tensors are
    quantized row by row as the 2-D ones."""
    import gguf

    if array.ndim == 1 or dtype == "f32" or name.endswith(F32_TENSORS):
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if dtype == "q8_0" and array.shape[-1] % 32 == 0:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), gguf.GGMLQuantizationType.F16


def gguf_target(out: str | Path, overwrite: bool) -> Path:
    """The file a GGUF export writes: ``out``, refused in one line naming it when it is a folder (a GGUF is one
    file) or an existing file without ``overwrite`` (replacing it unasked would lose the earlier export)."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; a GGUF export is one file: pass a file path such as "
                          f"--out {out / 'model.gguf'}")
    if out.exists() and not overwrite:
        raise ConfigError(f"--out {out} exists; pass --overwrite to replace it, or choose a new file")
    return out


def trained_context(cfg: JobConfig, family_base: bool) -> int:
    """The context length a GGUF names (``<arch>.context_length``, llama.cpp's n_ctx_train: its default context
    and the bound it warns past): for a fine-tune of a family base (``family_base``: a Hugging Face folder), the
    base's own (model.max_seq_len: its max_position_embeddings, as llama.cpp's converter writes it); for a run of
    ours, the sequence it trained on (data.seq_len), not model.max_seq_len (the rotary tables' reach, 4,096 by
    default), which the model never saw."""
    return cfg.model.max_seq_len if family_base else min(cfg.data.seq_len, cfg.model.max_seq_len)


def export_gguf(model: nn.Module, cfg: ModelConfig, tokenizer: Tokenizer, out: str | Path, dtype: str = "f32",
                name: str = "scaletrain", template: str = "auto", context: int | None = None) -> Path:
    """Write ``model`` as one GGUF file ``out`` (written beside it and renamed into place); ``template``: the
    run's finetune.chat_template (which chat template it was trained in); ``context``: the context length written
    (``trained_context``; default model.max_seq_len)."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    try:
        import gguf
    except ImportError:
        raise ConfigError("--format gguf needs the gguf package: pip install 'scaletrain[gguf]'") from None
    check_exportable(model, cfg)
    token_rows = min(cfg.vocab_size, tokenizer.vocab_size)  # a padded vocabulary's extra rows are never a token
    rows = token_rows + int(_adds_end_of_text(tokenizer))
    out = gguf_target(out, overwrite=True)  # the command refused an existing file before loading the run
    tmp = out.parent / f".{out.name}.tmp"
    with guarded_write(f"the GGUF file {out}", out.parent, cleanup=(tmp,),
                       needed=sum(p.numel() * p.element_size() for p in model.parameters())):
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_quietly(tmp)
        writer = gguf.GGUFWriter(str(tmp), _layout(cfg).arch)
        _write_metadata(writer, cfg, tokenizer, rows, dtype, name, template, context or cfg.max_seq_len)
        for tensor_name, array in gguf_state(model, cfg, rows, token_rows).items():
            data, raw = _tensor(array, dtype, tensor_name)
            writer.add_tensor(tensor_name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    return out


def _write_metadata(writer, cfg: ModelConfig, tokenizer: Tokenizer, rows: int, dtype: str, name: str,
                    template: str, context: int) -> None:
    import gguf

    head_dim = head_width(cfg)
    writer.add_name(name)
    writer.add_context_length(context)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(cfg.n_layers)
    # every layer sparse (the MoE architectures here): the length is the experts', as the converter writes
    # intermediate_size (Mixtral, OLMoE: the experts' width; llama.cpp's llama and olmoe size the experts by it)
    sparse = cfg.moe_experts and all(is_moe_layer(cfg, i) for i in range(cfg.n_layers))
    writer.add_feed_forward_length(expert_hidden_dim(cfg) if sparse else ffn_hidden_dim(cfg))
    if cfg.moe_experts:
        writer.add_expert_count(cfg.moe_experts)
        writer.add_expert_used_count(cfg.moe_top_k)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(kv_heads(cfg))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling_factor)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    _layout(cfg).metadata(writer, cfg)
    writer.add_vocab_size(rows)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    tokens, types, merges = _vocabulary(tokenizer, rows)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for kind, token_id in special_token_ids(tokenizer, rows, template).items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    # a BOS in front exactly when the tokenizer put one there in training (Llama 3's <|begin_of_text|>; ours, Qwen: no)
    prefix = tokenizer.prefix_ids() if isinstance(tokenizer, BPETokenizer) else []
    writer.add_add_bos_token(tokenizer.bos_id is not None and prefix[:1] == [tokenizer.bos_id])
    writer.add_chat_template(chat_template(tokenizer, template))
