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


def tiny_hf_base(folder: Path) -> Path:
    """A tiny random Llama (GQA, untied) exported as a Hugging Face folder into ``folder``, with Tiny
    Shakespeare's characters as its vocabulary: the base the fine-tuning tests adapt."""
    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import CharTokenizer
    from scaletrain.model import build_model

    cfg = ModelConfig(vocab_size=len(CHARS), dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64,
                      max_seq_len=64)
    export_hf(build_model(cfg, seed=0), cfg, CharTokenizer(CHARS), folder)
    return folder


def tiny_chatml_base(folder: Path) -> Path:
    """A tiny random Llama exported as a Hugging Face folder into ``folder``, with the ChatML fixture tokenizer
    (tests/fixtures/chatml_tokenizer) and its chat template: a base whose fine-tunes talk in a template."""
    import shutil

    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import load_tokenizer
    from scaletrain.model import build_model

    chatml = ROOT / "tests" / "fixtures" / "chatml_tokenizer"
    tokenizer = load_tokenizer(chatml / "tokenizer.json")
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden_dim=64, max_seq_len=64)
    export_hf(build_model(cfg, seed=0), cfg, tokenizer, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(chatml / name, folder / name)
    return folder
