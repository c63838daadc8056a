"""LoRA on every expert of a mixture of experts under DDP and FSDP2 (2 gloo ranks) matches the single-process
fine-tune: losses over 5 steps and the trained adapters (the experts' stacked A / B, the router's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_finetune_dist import ddp_and_fsdp2_match, finetune_command

from helpers.tiny import CHARS
from helpers.waits import CEILING_S

pytestmark = pytest.mark.distributed


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow  # not in the default pass (README): 42 s; LoRA under DDP / FSDP2 stays (test_finetune_dist.py)
def test_expert_lora_ddp_and_fsdp2_match_single_process(tmp_path):
    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import CharTokenizer
    from scaletrain.finetune.lora import LoRAExperts
    from scaletrain.infer.load import load_run
    from scaletrain.model import build_model

    # A Mixtral of 2 layers, 4 experts (top-2) of width 32 each. The balance loss is computed on each forward's
    # rows: 2 ranks x 4 rows are not 1 x 8 rows there (as in tests/parallel/test_expert_parallel.py), so it is off
    # (a Mixtral config.json holds neither the z-loss nor the expert bias).
    cfg = ModelConfig(vocab_size=len(CHARS), dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64,
                      max_seq_len=32, family="mixtral", moe_experts=4, moe_top_k=2, moe_hidden_dim=32,
                      moe_balance_coef=0.0)
    export_hf(build_model(cfg, seed=0), cfg, CharTokenizer(CHARS), tmp_path / "base")
    common = finetune_command(tmp_path, "--finetune.lora_rank=4", "--finetune.lora_targets=q,v,gate,up,down,router")
    single = subprocess.run([sys.executable, *common, "--train.batch_size=8", f"--train.run_dir={tmp_path / 'one'}"],
                            capture_output=True, text=True, timeout=CEILING_S)
    assert single.returncode == 0, single.stderr[-3000:]
    expected = _losses(tmp_path / "one")
    _, reference, _, _ = load_run(tmp_path / "one")
    assert any(isinstance(m, LoRAExperts) for m in reference.modules())
    assert expected[-1] < expected[0]  # it trains
    ddp_and_fsdp2_match(tmp_path, common, expected, reference)
