"""Export to Hugging Face: transformers loads the folder and gives our logits."""

from __future__ import annotations

import pytest
import torch

from scaletrain.cli import main
from scaletrain.infer.load import load_run

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("extra", [
    {},  # char tokenizer, untied, MHA
    {"data.tokenizer": "bpe", "data.vocab_size": 300, "model.tie_embeddings": "true", "model.n_heads": 4,
     "model.n_kv_heads": 2},
    {"model.vocab_size": 66},  # a model padded beyond the 65-character tokenizer: exported with 65 rows
])
def test_export_matches_transformers(tmp_path, tiny, capsys, extra):
    run = tmp_path / "run"
    over = tiny(run, **{"train.steps": 5, **extra})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    cfg, model, tok, _ = load_run(run)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    hf.eval()
    text = "ROMEO:\nBut soft, what light\n"
    ids = torch.tensor([tok.encode(text)])
    assert hf.config.vocab_size == tok.vocab_size == hf.get_input_embeddings().weight.shape[0]
    with torch.no_grad():
        ours = model(ids)[..., :tok.vocab_size]  # a padded model's extra columns are not a token
        theirs = hf(ids).logits
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (ours - theirs).abs().max()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("dtype", ["q8_0", "f16"])
def test_a_gguf_dtype_for_a_hugging_face_export_is_refused(tmp_path, capsys, dtype):
    """--dtype is GGUF's: a Hugging Face export asked for q8_0 wrote float32 without a word."""
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tmp_path / "no-run-needed"), "--out", str(out), "--dtype", dtype]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ConfigError: --dtype {dtype} is for --format gguf") and err.count("\n") == 1
    assert not out.exists()
