"""Shared fixtures: a tiny job config that trains in a second on bundled data."""

from __future__ import annotations

import os

import pytest

# Keep the measured-peak cache out of the user's home during tests.
os.environ.setdefault("SCALETRAIN_CACHE", os.path.join(os.path.dirname(__file__), ".cache"))


def tiny_overrides(run_dir, **extra) -> dict[str, str]:
    """Dotted overrides for a ~50k-parameter model on Tiny Shakespeare (char level)."""
    base = {
        "model.dim": "32", "model.n_layers": "2", "model.n_heads": "2", "model.ffn_hidden_dim": "96",
        "model.max_seq_len": "32", "data.seq_len": "32", "train.batch_size": "4",
        "train.steps": "40", "train.eval_interval": "0", "train.eval_batches": "2", "train.sample_tokens": "0",
        "schedule.warmup_steps": "5", "train.run_dir": str(run_dir), "logging.progress": "off",
        "logging.tensorboard": "false", "checkpoint.interval": "0", "data.cache_dir": str(run_dir) + "-data",
        # The tests compare losses to fp32 rounding; auto would pick bf16 on a CPU whose bf16 matmuls measure fast.
        "train.precision": "fp32",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return base


@pytest.fixture
def tiny():
    return tiny_overrides
