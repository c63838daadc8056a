"""One validation loss: `scaletrain eval` prints the val_loss a run recorded for its checkpoint (the same windows,
the same precision, the same arithmetic), for a pretraining run, a LoRA fine-tune and instruction data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers.tiny import tiny_hf_base
from scaletrain.cli import main
from scaletrain.infer.load import load_run
from scaletrain.train.evaluate import score_run

ROOT = Path(__file__).resolve().parents[2]
CHARS = sorted(set((ROOT / "src/scaletrain/assets/tinyshakespeare/input.txt").read_text(encoding="utf-8")))
INSTRUCTIONS = Path(__file__).parents[1] / "fixtures" / "instructions.jsonl"


def last_record(run: Path) -> dict:
    """The run's last evaluation record in metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" in r][-1]


def last_val_loss(run: Path) -> float:
    return last_record(run)["val_loss"]


def eval_line(run: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["eval", "--run", str(run)]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def assert_eval_is_recorded(run: Path, capsys, windows: str) -> None:
    """The printed line carries the recorded val_loss in training's log format, and the number the command
    computes equals the recorded float exactly: the same model weights, windows and ops on one process."""
    recorded = last_val_loss(run)
    line = eval_line(run, capsys)
    assert line.startswith(f"val loss {recorded:.4f}, perplexity {math.exp(recorded):.2f}, bpb "), line
    assert f"bpb {last_record(run)['val_bpb']:.4f} over " in line, line
    assert windows in line and "precision fp32" in line
    cfg, model, tokenizer, _ = load_run(run)
    score = score_run(cfg, model, tokenizer, say=lambda _: None)
    assert score.loss == recorded and score.score.bpb == last_record(run)["val_bpb"]


def test_eval_prints_the_val_loss_the_run_recorded(tmp_path, tiny, capsys):
    """A few steps, evaluated and checkpointed at the last one; train.eval_batches 3 of 4 windows each, spread
    over the val split (not its first 12 windows: the old eval's, which gave another number)."""
    run = tmp_path / "run"
    over = tiny(run, **{"train.steps": 4, "train.eval_batches": 3})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    assert_eval_is_recorded(run, capsys, "over 3 batches x 4 x 32 tokens, evenly spread over the val split")
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--batches", "1"]) == 0  # fewer batches: still spread, said so
    assert "over 1 batches x 4 x 32 tokens, evenly spread" in capsys.readouterr().out


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A tiny random Llama as a Hugging Face folder, with Tiny Shakespeare's characters as its vocabulary."""
    return tiny_hf_base(tmp_path_factory.mktemp("base"))


def _finetune(base: Path, run: Path, tiny, **extra) -> list[str]:
    over = {k: v for k, v in tiny(run, **{"train.steps": 4, **extra}).items() if not k.startswith("model.")}
    return ["finetune", "--from", str(base)] + [f"--{k}={v}" for k, v in over.items()]


def test_eval_of_a_lora_finetune_is_its_recorded_val_loss(hf_base, tmp_path, tiny, capsys):
    run = tmp_path / "lora"
    assert main(_finetune(hf_base, run, tiny, **{"finetune.method": "lora"})) == 0
    assert_eval_is_recorded(run, capsys, "over 2 batches x 4 x 32 tokens, evenly spread over the val split")


def test_eval_of_an_instruction_finetune_scores_its_held_out_examples(hf_base, tmp_path, tiny, capsys):
    run = tmp_path / "instruct"
    extra = {"finetune.method": "lora", "finetune.instructions": str(INSTRUCTIONS), "data.seq_len": 64,
             "data.val_fraction": 0.2}
    assert main(_finetune(hf_base, run, tiny, **extra)) == 0
    assert_eval_is_recorded(run, capsys, "the first held-out instruction examples in file order")
