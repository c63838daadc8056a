"""kill -9 in the middle of a LoRA fine-tune, then --resume: bitwise the run that was never interrupted."""

from __future__ import annotations

import random

import pytest

from helpers.faults import assert_same_run, kill9_after_step, run_ok, write_config
from helpers.tiny import CHARS

STEPS, INTERVAL = 40, 5


@pytest.fixture(scope="module")
def lora_straight(tmp_path_factory):
    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import CharTokenizer
    from scaletrain.model import build_model

    folder = tmp_path_factory.mktemp("lora")
    model = ModelConfig(vocab_size=len(CHARS), dim=64, n_layers=4, n_heads=4, ffn_hidden_dim=128, max_seq_len=64)
    export_hf(build_model(model, seed=0), model, CharTokenizer(CHARS), folder / "base")
    config = write_config(folder, STEPS, INTERVAL)  # its [model] is the base's shape
    args = ["finetune", "--from", str(folder / "base"), "--config", str(config), "--finetune.lora_targets=q,v,down",
            "--optim.lr=3e-3"]
    run_ok([*args, f"--train.run_dir={folder / 'run'}"])
    return args, folder / "run"


def test_kill9_during_a_lora_finetune_then_resume_is_bitwise_exact(lora_straight, tmp_path):
    args, reference = lora_straight
    run = tmp_path / "run"
    kill_at = random.Random(0).randint(8, STEPS - 10)
    kill9_after_step(args, run, kill_at, STEPS)
    out = run_ok([*args, f"--train.run_dir={run}", "--resume"])
    assert "resumed from" in out
    assert_same_run(reference, run)  # per-step losses and every final tensor (base + adapters), bitwise
