"""LoRA under DDP and FSDP2 (2 gloo ranks) matches the single-process fine-tune: losses and adapter weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import PARITY_RTOL, torchrun
from helpers.tiny import CHARS
from helpers.waits import CEILING_S

pytestmark = pytest.mark.distributed


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_lora_ddp_and_fsdp2_match_single_process(tmp_path):
    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import CharTokenizer
    from scaletrain.infer.load import load_run
    from scaletrain.model import build_model

    cfg = ModelConfig(vocab_size=len(CHARS), dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64,
                      max_seq_len=32)
    export_hf(build_model(cfg, seed=0), cfg, CharTokenizer(CHARS), tmp_path / "base")
    common = finetune_command(tmp_path, "--finetune.lora_targets=q,k,v,o,gate,up,down")
    single = subprocess.run([sys.executable, *common, "--train.batch_size=8", f"--train.run_dir={tmp_path / 'one'}"],
                            capture_output=True, text=True, timeout=CEILING_S)
    assert single.returncode == 0, single.stderr[-3000:]
    expected = _losses(tmp_path / "one")
    _, reference, _, _ = load_run(tmp_path / "one")
    ddp_and_fsdp2_match(tmp_path, common, expected, reference)


def finetune_command(tmp_path, *extra: str) -> list[str]:
    """``scaletrain finetune`` of ``tmp_path/base``: 5 fp32 steps of sequence 32, every loss logged, no evaluation
    or samples on the way (``extra``: the method's own flags)."""
    return ["-m", "scaletrain.cli", "finetune", "--from", str(tmp_path / "base"), "--data.seq_len=32",
            f"--data.cache_dir={tmp_path / 'data'}", "--train.steps=5", "--train.eval_interval=0",
            "--train.eval_batches=1", "--train.sample_tokens=0", "--logging.progress=off",
            "--logging.tensorboard=false", "--logging.log_interval=1", "--train.precision=fp32",
            "--schedule.warmup_steps=2", "--optim.lr=0.01", *extra]


def ddp_and_fsdp2_match(tmp_path, common: list[str], expected: list[float], reference) -> None:
    """The fine-tune ``common`` under 2-rank DDP and FSDP2 (4 rows a rank): 5 losses equal ``expected`` and every
    trained parameter ``reference``'s (the one-process run) within PARITY_RTOL."""
    from scaletrain.infer.load import load_run

    for name, plan in (("ddp", "--parallel.dp_replicate=2"), ("fsdp", "--parallel.dp_shard=2")):
        torchrun(2, *common, "--train.batch_size=4", plan, f"--train.run_dir={tmp_path / name}")
        got = _losses(tmp_path / name)
        assert len(got) == len(expected) == 5
        assert max(abs(a - b) / b for a, b in zip(got, expected)) < PARITY_RTOL, (name, got, expected)
        _, model, _, _ = load_run(tmp_path / name)
        # The trained adapters agree to fp32 summation-order noise (AdamW divides each gradient element by
        # its own running scale, so single elements near zero may differ more; the whole tensor may not).
        for (key, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
            relative = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-12))
            assert relative < PARITY_RTOL, (name, key, relative)
