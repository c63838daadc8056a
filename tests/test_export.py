"""Export to Hugging Face: transformers loads the folder and gives our logits."""

from __future__ import annotations

import pytest
import torch

from scaletrain.checkpoint.run import load_run
from scaletrain.cli import main

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
