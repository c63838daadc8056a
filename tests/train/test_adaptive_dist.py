"""parallel.balance = "throughput" on 2 real gloo ranks, one made slower (tests/helpers/slow_rank_train.py): the slow
rank takes fewer micro-batches, every step's loss and gradient norm equal a single process's on the same global
batch (1e-5 relative), and a resume keeps the saved split."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers.faults import HELPERS, TORCHRUN, env
from helpers.waits import CEILING_S
from scaletrain.config import load_config
from scaletrain.train.adaptive import split_counts
from scaletrain.train.trainer import Trainer

CONFIG = """
[model]
dim = 32
n_layers = 2
n_heads = 2
ffn_hidden_dim = 96
max_seq_len = 32
[data]
seq_len = 32
cache_dir = "{cache}"
[train]
precision = "fp32"
steps = 8
batch_size = 4
grad_accum_steps = 4
eval_interval = 0
eval_batches = 2
sample_tokens = 0
threads = 1
[schedule]
warmup_steps = 2
[logging]
log_interval = 1
progress = "off"
tensorboard = false
[checkpoint]
interval = 4
[monitor]
enabled = false
[parallel]
balance_interval = 2
"""


def records(run) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.mark.distributed
def test_throughput_balance_matches_one_process_and_resumes_its_split(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(cache=tmp_path / "data"))
    single, balanced = tmp_path / "single", tmp_path / "balanced"
    # The reference: one process, the same 8 micro-batches of 4 sequences a step (data prepared once, here).
    Trainer(load_config(config, {"train.grad_accum_steps": "8", "train.run_dir": str(single)})).train()
    common = f"parallel.balance=throughput,parallel.dp_replicate=2,train.run_dir={balanced}"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", str(HELPERS / "slow_rank_train.py"), "--config",
           str(config), "--out", str(tmp_path / "r.json"), f"part1:{common},train.stop_at_step=4",
           f"part2:{common},train.resume=true"]
    proc = subprocess.run(cmd, env=env(SLOW_RANK="1", SLOW_SECONDS="0.05"), capture_output=True, text=True,
                          timeout=CEILING_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = records(single), records(balanced)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for s in a:
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-5), f"step {s}"
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=1e-5), f"step {s}"
    counts = {s: b[s]["micro_batches_per_rank"] for s in b}
    assert counts[1] == [4, 4] and all(sum(c) == 8 for c in counts.values())
    assert counts[8][1] < counts[8][0], f"the slowed rank 1 did not get fewer micro-batches: {counts}"
    # Step 4's re-measurement chose step 5's split; the checkpoint at step 4 carried it over the restart.
    assert counts[5] == split_counts(8, b[4]["balance_micro_seconds"])
