"""GGUF export, read back with the gguf package's reader: tensor names, shapes, metadata (tokenizer, chat
template) and values (f32 exact, f16 / q8_0 within their rounding); the q/k permutation keeps attention scores;
bad input is one line and exit 2. (llama.cpp itself runs the file in benchmarks/gguf.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.tiny import tiny_overrides
from scaletrain.checkpoint.gguf import export_gguf, gguf_state, rotary_to_interleaved
from scaletrain.cli import main
from scaletrain.config import ConfigError, ModelConfig, build
from scaletrain.data.tokenizer import BPETokenizer, CharTokenizer
from scaletrain.model import PRESETS, build_model
from scaletrain.model.llama import apply_rope, rope_tables

gguf = pytest.importorskip("gguf")

CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ:\n.,!?"))


def model_and_cfg(**kw):
    cfg = build(ModelConfig, {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden_dim": 96,
                              "vocab_size": 64, "max_seq_len": 64, **kw}, presets=PRESETS)
    return build_model(cfg, seed=0), cfg


def read(path):
    reader = gguf.GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def values(t) -> np.ndarray:
    """A tensor read back as fp32 in our (rows, columns) order (GGUF lists dimensions innermost first)."""
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))


@pytest.mark.parametrize("dtype,tolerance", [("f32", 0.0), ("f16", 1e-3), ("q8_0", 2e-2)])
def test_tensors_and_metadata_round_trip(tmp_path, dtype, tolerance):
    model, cfg = model_and_cfg()  # vocab 64 > the tokenizer's 45: padding rows are not exported
    tok = CharTokenizer(CHARS)
    path = export_gguf(model, cfg, tok, tmp_path / "m.gguf", dtype)
    fields, tensors = read(path)
    assert fields["general.architecture"] == "llama"
    assert (fields["llama.block_count"], fields["llama.embedding_length"], fields["llama.attention.head_count"],
            fields["llama.attention.head_count_kv"], fields["llama.feed_forward_length"],
            fields["llama.context_length"]) == (2, 64, 4, 2, 96, 64)
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == len(CHARS)
    assert fields["tokenizer.ggml.tokens"][CHARS.index(" ")] == "Ġ"  # byte-level stand-in for a space
    assert "Assistant:" in fields["tokenizer.chat_template"]
    expected = gguf_state(model, cfg, len(CHARS))
    assert set(tensors) == set(expected) and "blk.1.attn_k.weight" in tensors and "output.weight" in tensors
    for name, array in expected.items():
        got = values(tensors[name])
        assert got.shape == array.shape, name
        quantized = array.ndim == 2 and dtype != "f32"
        assert tensors[name].tensor_type == (gguf.GGMLQuantizationType[dtype.upper()] if quantized
                                             else gguf.GGMLQuantizationType.F32)
        np.testing.assert_allclose(got, array, rtol=0, atol=tolerance * np.abs(array).max(), err_msg=name)
    wk = model.layers["1"].attention.wk.weight.detach()  # f32 values are ours, q/k rows permuted
    assert np.array_equal(expected["blk.1.attn_k.weight"], rotary_to_interleaved(wk, 2).numpy())
    assert np.array_equal(expected["token_embd.weight"], model.tok_embeddings.weight.detach()[:len(CHARS)].numpy())


def test_tied_head_and_bpe_tokenizer(tmp_path):
    model, cfg = model_and_cfg(tie_embeddings=True, vocab_size=300)
    tok = BPETokenizer.train(["the quick brown fox jumps over the lazy dog " * 50], vocab_size=300)
    fields, tensors = read(export_gguf(model, cfg, tok, tmp_path / "m.gguf"))
    assert "output.weight" not in tensors  # llama.cpp reuses token_embd
    assert fields["tokenizer.ggml.merges"] and fields["tokenizer.ggml.eos_token_id"] == tok.eos_id
    assert fields["tokenizer.ggml.token_type"][tok.eos_id] == gguf.TokenType.CONTROL
    assert "eos_token" in fields["tokenizer.chat_template"]


TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers"


@pytest.mark.slow  # ~25 s each: gguf's reader parses the 128k-152k tokens and 280k merges element by element
@pytest.mark.skipif(not (TOKENIZERS / "qwen3" / "tokenizer.json").is_file(),
                    reason="../shared/data/tokenizers not present (fresh clone)")
@pytest.mark.parametrize("family,pre,add_bos,template", [("llama3_1", "llama-bpe", True, "auto"),
                                                        ("qwen3", "qwen2", False, "auto"),
                                                        ("qwen3", "qwen2", False, "plain")])
def test_a_base_tokenizer_keeps_its_pre_tokenizer_bos_and_chat_template(tmp_path, family, pre, add_bos, template):
    """A fine-tune on Llama 3.1's or Qwen3's own tokenizer: llama.cpp must split text, put a BOS in front and
    render chats as training did (not gpt-2's split, no BOS and our plain User:/Assistant: template)."""
    from scaletrain.data.tokenizer import load_tokenizer, load_transformers_tokenizer

    folder = TOKENIZERS / family
    tok = load_tokenizer(folder / "tokenizer.json")
    model, cfg = model_and_cfg(dim=16, n_heads=2, n_kv_heads=1, ffn_hidden_dim=32, vocab_size=tok.vocab_size)
    reader = gguf.GGUFReader(str(export_gguf(model, cfg, tok, tmp_path / "m.gguf", template=template)))
    fields = {name: reader.fields[name].contents() for name in  # not the 128k tokens and 280k merges: slow to read
              ("tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")}
    fields["tokenizer.ggml.bos_token_id"] = reader.fields["tokenizer.ggml.bos_token_id"].contents() \
        if "tokenizer.ggml.bos_token_id" in reader.fields else None
    assert fields["tokenizer.ggml.pre"] == pre
    assert fields["tokenizer.ggml.add_bos_token"] is add_bos
    assert (fields.get("tokenizer.ggml.bos_token_id") == tok.bos_id) if add_bos else tok.bos_id is None
    if template == "auto":  # trained in the base's template: the GGUF carries it, as transformers renders it
        assert fields["tokenizer.chat_template"] == load_transformers_tokenizer(folder).chat_template
        assert ("<|start_header_id|>" if family == "llama3_1" else "<|im_start|>") in fields["tokenizer.chat_template"]
    else:  # finetune.chat_template = plain: trained in ours
        assert "Assistant:" in fields["tokenizer.chat_template"]


def test_an_unknown_base_pre_tokenizer_is_refused(tmp_path):
    """A Hugging Face tokenizer whose split this writer cannot name: one line, not a silent gpt-2."""
    from scaletrain.data.tokenizer import load_tokenizer

    tok = BPETokenizer.train(["the quick brown fox jumps over the lazy dog " * 50], vocab_size=300)
    tok.tok.pre_tokenizer = __import__("tokenizers").pre_tokenizers.Whitespace()  # a split llama.cpp has no name for
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    hf_tok = load_tokenizer(tmp_path / "tokenizer.json")
    model, cfg = model_and_cfg(vocab_size=300)
    with pytest.raises(ConfigError, match="convert_hf_to_gguf.py"):
        export_gguf(model, cfg, hf_tok, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_interleaved_rotary_gives_the_same_attention_scores():
    """llama.cpp rotates adjacent pairs; with the permuted wq / wk its q.k equals ours (rotate-half)."""
    torch.manual_seed(0)
    heads, hd, dim, seq = 2, 8, 16, 5
    wq, wk, x = torch.randn(heads * hd, dim), torch.randn(heads * hd, dim), torch.randn(1, seq, dim)
    cos, sin = rope_tables(hd, seq, 10000.0)
    ours_q = apply_rope((x @ wq.T).view(1, seq, heads, hd), cos, sin)
    ours_k = apply_rope((x @ wk.T).view(1, seq, heads, hd), cos, sin)

    def interleaved(w):  # llama.cpp's LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i + 1) at angle pos * theta^(-2i/hd)
        y = (x @ rotary_to_interleaved(w, heads).T).view(1, seq, heads, hd // 2, 2)
        c, s = cos[:, : hd // 2].view(1, seq, 1, hd // 2), sin[:, hd // 2:].view(1, seq, 1, hd // 2)
        return torch.stack([y[..., 0] * c - y[..., 1] * s, y[..., 0] * s + y[..., 1] * c], -1).flatten(-2)

    scores = torch.einsum("bqhd,bkhd->bhqk", ours_q, ours_k)
    torch.testing.assert_close(torch.einsum("bqhd,bkhd->bhqk", interleaved(wq), interleaved(wk)), scores,
                               rtol=1e-4, atol=1e-4)


def test_architecture_llama_cpp_does_not_know_is_refused(tmp_path):
    model, cfg = model_and_cfg(parametrization="mup", mup_base_width=32)
    with pytest.raises(ConfigError, match="not an architecture llama.cpp knows"):
        export_gguf(model, cfg, CharTokenizer(CHARS), tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


def test_bad_gguf_export_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = tiny_overrides(run, **{"train.steps": 1, "model.parametrization": "mup"})
    assert main(["train"] + [f"--{k}={v}" for k, v in overrides.items()]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert "is not an architecture llama.cpp knows" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses it before anything is read
        main(["export", "--run", str(run), "--format", "gguf", "--dtype", "q4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --dtype: invalid choice: 'q4'" in err and err.count("\n") == 1


def test_an_existing_gguf_is_kept_without_overwrite_and_a_folder_is_named(tmp_path, capsys):
    """--out EXISTING.gguf: refused (an f32 silently replaced an f16 before); --overwrite replaces it; --out a
    folder: the user's path is named, not a hidden .tmp beside it."""
    run = tmp_path / "run"
    overrides = tiny_overrides(run, **{"train.steps": 1})
    assert main(["train"] + [f"--{k}={v}" for k, v in overrides.items()]) == 0
    out = tmp_path / "m.gguf"
    export = ["export", "--run", str(run), "--format", "gguf", "--out"]
    assert main(export + [str(out), "--dtype", "f16"]) == 0
    f16 = out.read_bytes()
    capsys.readouterr()
    assert main(export + [str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"ConfigError: --out {out} exists; pass --overwrite to replace it, or choose a new file\n"
    assert out.read_bytes() == f16
    assert main(export + [str(out), "--overwrite"]) == 0 and out.read_bytes() != f16
    folder = tmp_path / "folder"
    folder.mkdir()
    capsys.readouterr()
    assert main(export + [str(folder), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"--out {folder} is a folder" in err and f"--out {folder / 'model.gguf'}" in err and ".tmp" not in err
    assert not list(folder.iterdir()) and not list(tmp_path.glob(".*.tmp"))
