"""DPO under DDP and FSDP2 (2 gloo ranks) matches the single-process run: LoRA with its reference through the
disabled adapters, and full fine-tuning with its reference log-probabilities precomputed (every rank the same)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import PARITY_RTOL, torchrun
from helpers.tiny import tiny_hf_base
from helpers.waits import CEILING_S

pytestmark = pytest.mark.distributed

FIXTURE = Path(__file__).parents[1] / "fixtures" / "preferences.jsonl"


def _steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"reward_margin"' in line]


@pytest.mark.parametrize("method", ["lora", pytest.param("full", marks=pytest.mark.slow)])  # full: slow tier
def test_dpo_ddp_and_fsdp2_match_single_process(tmp_path, method):
    from scaletrain.infer.load import load_run

    base = tiny_hf_base(tmp_path / "base")
    common = ["-m", "scaletrain.cli", "finetune", "--from", str(base), "--data.seq_len=72", "--train.steps=4",
              f"--finetune.preferences={FIXTURE}", "--finetune.objective=dpo", f"--finetune.method={method}",
              "--data.val_fraction=0.25", "--train.eval_interval=0", "--train.sample_tokens=0",
              "--logging.progress=off", "--logging.tensorboard=false", "--logging.log_interval=1",
              "--train.precision=fp32", "--schedule.warmup_steps=1", "--optim.lr=0.01", "--finetune.beta=0.5"]
    single = subprocess.run([sys.executable, *common, "--train.batch_size=4", f"--train.run_dir={tmp_path / 'one'}"],
                            capture_output=True, text=True, timeout=CEILING_S)
    assert single.returncode == 0, single.stderr[-3000:]
    expected = _steps(tmp_path / "one")
    _, reference, _, _ = load_run(tmp_path / "one")
    for name, plan in (("ddp", "--parallel.dp_replicate=2"), ("fsdp", "--parallel.dp_shard=2")):
        torchrun(2, *common, "--train.batch_size=2", plan, f"--train.run_dir={tmp_path / name}")
        got = _steps(tmp_path / name)
        assert len(got) == len(expected) == 4
        for a, b in zip(got, expected):
            for key in ("loss", "logps_chosen", "logps_rejected"):
                assert abs(a[key] - b[key]) <= PARITY_RTOL * abs(b[key]), (name, key, a, b)
            # a reward is beta x a difference of two log-probs of ~-100: fp32 noise of those, not of the reward
            for key in ("reward_chosen", "reward_rejected"):
                assert abs(a[key] - b[key]) <= 0.5 * PARITY_RTOL * abs(b["logps_chosen"]), (name, key, a, b)
        assert [r["reward_accuracy"] for r in got] == [r["reward_accuracy"] for r in expected]
        _, model, _, _ = load_run(tmp_path / name)
        for (key, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
            relative = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-12))
            assert relative < PARITY_RTOL, (name, key, relative)
