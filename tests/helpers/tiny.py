"""Tiny job settings that train in about a second on the bundled corpus."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The character vocabulary of the bundled Tiny Shakespeare (what a char-level base's tokenizer holds).
CHARS = sorted(set((ROOT / "src/scaletrain/assets/tinyshakespeare/input.txt").read_text(encoding="utf-8")))


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
