"""Before the first step the planner's memory estimate is checked against this machine's memory (plan/memory_check.py):
a job that cannot fit is refused in one line (not ended by the OOM killer, nor by the allocator's traceback),
and a job that fits is never refused, down to a machine with just its measured peak."""

from __future__ import annotations

import pytest

from helpers.tiny import tiny_hf_base
from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.plan import memory_check as fit
from scaletrain.train.trainer import Trainer


def _args(over: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in over.items()]


def _one_line_refusal(capsys) -> str:
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "done:" not in out
    return err


def test_a_batch_that_cannot_fit_is_refused_before_the_first_step(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert main(["train"] + _args(tiny(run, **{"train.batch_size": 100_000_000}))) == 2
    err = _one_line_refusal(capsys)
    assert err.startswith("ConfigError: this job needs about") and "TB per process" in err, err
    assert "host RAM available" in err and "--train.batch_size=" in err and "--train.grad_accum_steps=" in err
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    suggested = int(err.split("--train.batch_size=")[1].split()[0])
    assert 1 <= suggested < 100_000_000 and suggested & (suggested - 1) == 0  # a power of two that fits


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    return tiny_hf_base(tmp_path_factory.mktemp("base"))


def _lora_args(hf_base, run, tiny, rank: int) -> list[str]:
    over = {k: v for k, v in tiny(run, **{"train.steps": 2, "finetune.lora_rank": rank}).items()
            if not k.startswith("model.")}  # the model is the base's
    return ["finetune", "--from", str(hf_base)] + _args(over)


def test_a_lora_rank_that_cannot_fit_is_refused_naming_the_rank(hf_base, tmp_path, tiny, capsys):
    """Rank 10,000,000 on a 32-wide base: ~1.1e10 adapter weights (the allocator's traceback today)."""
    assert main(_lora_args(hf_base, tmp_path / "run", tiny, 10_000_000)) == 2
    err = _one_line_refusal(capsys)
    assert "this job needs about" in err and "lower finetune.lora_rank (10,000,000)" in err, err


def test_the_issue_lora_rank_on_a_small_machine(hf_base, tmp_path, tiny, capsys, monkeypatch):
    """The issue's lora_rank=100000 (45M adapter weights on this 32-wide base, 1.4 GB measured peak) on a
    machine with 512 MiB free."""
    monkeypatch.setattr(fit, "available_bytes", lambda device: (2.0**29, "host RAM available"))
    assert main(_lora_args(hf_base, tmp_path / "run", tiny, 100_000)) == 2
    err = _one_line_refusal(capsys)
    assert "but 536.9 MB is host RAM available" in err and "finetune.lora_rank (100,000)" in err, err


@pytest.mark.parametrize("config", [None, "configs/shakespeare_char_baby.toml"])
def test_the_default_and_documented_cpu_runs_are_not_refused(config):
    cfg = load_config(config, {"model.vocab_size": "65"})  # what the bundled corpus gives
    for precision in ("fp32", "bf16"):
        assert fit.memory_refusal(cfg, precision, fit.torch.device("cpu")) is None


def test_a_machine_with_just_the_measured_peak_is_not_refused(tmp_path, tiny):
    """The margin's side that matters most: the tiny run's measured peak resident memory as all the memory
    there is, and it still runs; a tenth of its estimate, and it is refused."""
    cfg = load_config(None, tiny(tmp_path / "run", **{"train.steps": 3}))
    trainer = Trainer(cfg, log=False)
    try:
        summary = trainer.train()
        resolved, precision, device, dims = trainer.cfg, trainer.precision, trainer.device, trainer.dims
    finally:
        trainer.close()
    peak = summary["peak_memory_mb"] * 2**20
    assert fit.memory_refusal(resolved, precision, device, dims, available=peak) is None
    estimate = fit.estimated_bytes(resolved, precision, "cpu", dims)
    assert fit.memory_refusal(resolved, precision, device, dims, available=estimate / 10) is not None
