"""Bits per byte on 2 ranks: evaluation during FSDP2 training (real gloo processes under torchrun) records the
val_bpb one process records for the same global batches, and `scaletrain eval` of the 2-rank checkpoint in one
process gives it back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import PARITY_RTOL, torchrun

pytestmark = pytest.mark.distributed

# A byte-level BPE of 300 tokens (a token is 1 to several bytes, so bpb is not loss / ln 2), 10 steps evaluated
# at 5 and 10, fp32 so that the two layouts agree to rounding.
RECIPE = """
[model]
dim = 64
n_layers = 2
n_heads = 4
ffn_hidden_dim = 128
max_seq_len = 64
[data]
seq_len = 64
tokenizer = "bpe"
vocab_size = 300
cache_dir = "{cache}"
[train]
steps = 10
batch_size = 8
eval_interval = 5
eval_batches = 3
sample_tokens = 0
seed = 7
precision = "fp32"
compile = "false"
[schedule]
warmup_steps = 2
[logging]
progress = "off"
tensorboard = false
[checkpoint]
interval = 0
"""


def evaluations(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "val_bpb" in r}


def test_fsdp2_training_records_the_val_bpb_of_one_process(tmp_path):
    config = tmp_path / "bpe.toml"
    config.write_text(RECIPE.format(cache=tmp_path / "data"))
    cli = ["-m", "scaletrain.cli", "train", "--config", str(config)]
    single = subprocess.run([sys.executable, *cli, f"--train.run_dir={tmp_path / 'single'}"], capture_output=True,
                            text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    # 2 ranks x 4 rows, parameters sharded by FSDP2 (fully_shard, ZeRO-3) = 1 process x 8 rows; evaluation windows
    # are counted in batches of train.batch_size (the rows a rank holds): 6 x 4 are the single run's 3 x 8.
    torchrun(2, *cli, f"--train.run_dir={tmp_path / 'fsdp'}", "--parallel.dp_shard=2", "--parallel.zero_stage=3",
             "--train.batch_size=4", "--train.eval_batches=6")
    one, two = evaluations(tmp_path / "single"), evaluations(tmp_path / "fsdp")
    assert sorted(one) == sorted(two) == [0, 5, 10]  # rank 0 alone logs: one record per evaluation
    for step in one:
        assert two[step]["val_bpb"] == pytest.approx(one[step]["val_bpb"], rel=PARITY_RTOL), step
        assert two[step]["val_loss"] == pytest.approx(one[step]["val_loss"], rel=PARITY_RTOL), step
    assert one[10]["val_bpb"] < one[0]["val_bpb"] - 0.3  # it learned: the numbers compared are not both noise
    assert abs(one[10]["val_bpb"] - one[10]["val_loss"] / 0.6931) > 0.3  # bytes, not tokens
    # The 2-rank run's final checkpoint, scored in one process by `scaletrain eval`: the bpb it recorded.
    from scaletrain.cli import main

    assert main(["eval", "--run", str(tmp_path / "fsdp"), "--json", str(tmp_path / "eval.json")]) == 0
    scored = json.loads((tmp_path / "eval.json").read_text())
    assert scored["bpb"] == pytest.approx(two[10]["val_bpb"], rel=PARITY_RTOL)
