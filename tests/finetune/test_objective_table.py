"""The objective table (finetune/objectives.py: OBJECTIVES) is what every consumer reads: an entry registered here,
and nowhere else, is installed on the model by the trainer and called by its step, logs its metrics, counts its
rows per example, refuses what it cannot run with through the job validation, and is offered by ``plan
--objective``."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from helpers.tiny import tiny_hf_base, tiny_overrides
from scaletrain.cli import main
from scaletrain.commands.plan import add_plan_arguments, plan_job
from scaletrain.config import ConfigError, FinetuneConfig, JobConfig, TrainConfig
from scaletrain.finetune import objectives as table
from scaletrain.train.validate import check_finetune

SCALE = 2.0


class _Smoothed:
    """A test-only objective: twice the next-token loss, counting the batches it scores."""

    def __init__(self, pm):
        self.vocab_limit, self.calls = pm.vocab_limit, {"train": 0, "eval": 0}
        self.model = pm.modules[0]
        pm.smoothed = self

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls["train" if self.model.training else "eval"] += 1
        return SCALE * F.cross_entropy(logits[..., :self.vocab_limit].flatten(0, 1).float(), targets.flatten())


def _install(pm, cfg, data_loss, say):
    return _Smoothed(pm).loss


def _metrics(pm, mode: str) -> dict:
    return {f"smoothed_{mode}_calls": pm.smoothed.calls[mode]}


def _refuse(cfg, world_size: int) -> None:
    if cfg.train.steps > 50:
        raise ConfigError(f"finetune.objective=smoothed trains at most 50 steps (got train.steps={cfg.train.steps})")


SMOOTHED = table.Objective("smoothed", "twice the next-token loss (a test entry)", _install, _refuse,
                           metrics=_metrics)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(table.OBJECTIVES, "smoothed", SMOOTHED)


def test_the_trainer_installs_and_steps_a_registered_objective(registered, tmp_path):
    base = tiny_hf_base(tmp_path / "base")
    runs = {}
    for objective in ("sft", "smoothed"):
        run = tmp_path / objective
        over = tiny_overrides(run, **{"train.steps": 4, "logging.log_interval": 1, "finetune.objective": objective,
                                      "optim.lr": 0.01})
        assert main(["finetune", "--from", str(base)] + [f"--{k}={v}" for k, v in over.items()
                                                         if not k.startswith("model.")]) == 0
        runs[objective] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in runs["smoothed"] if "loss" in r]
    # One scored micro-batch a step, counted by the entry's own metrics; the first step (same weights, same
    # batch) logs twice the next-token loss: the step called the entry's loss, not its own.
    assert [r["smoothed_train_calls"] for r in steps] == [1, 2, 3, 4]
    first_sft = next(r for r in runs["sft"] if "loss" in r)
    assert steps[0]["loss"] == pytest.approx(SCALE * first_sft["loss"], rel=1e-6)


def test_the_job_validation_asks_the_entry(registered):
    source = FinetuneConfig(source="some/base", objective="smoothed")
    check_finetune(JobConfig(finetune=source, train=TrainConfig(steps=50)), 1, here=False)
    with pytest.raises(ConfigError, match=r"trains at most 50 steps \(got train.steps=51\)"):
        check_finetune(JobConfig(finetune=source, train=TrainConfig(steps=51)), 1, here=False)


def test_a_name_without_an_entry_is_one_line(registered):
    with pytest.raises(ConfigError, match="finetune.objective must be one of sft, dpo, simpo, orpo, smoothed "
                                          r"\(got 'kto'\)") as err:
        table.objective_of(FinetuneConfig(objective="kto"))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="got 'distill'"):  # chosen by finetune.teacher, not by name
        table.objective_of(FinetuneConfig(objective="distill"))
    assert table.objective_of(FinetuneConfig(teacher="t")).name == "distill"


def test_plan_offers_every_configurable_entry(registered):
    """plan reads --finetune.objective as train does: a registered objective is a plan the command accepts (the
    names come from the table, not a list in commands/plan.py), the old --objective spelling reaches the same field,
    and a name outside the table is one line."""
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    for name in ("sft", "dpo", "simpo", "orpo", "smoothed"):
        args = parser.parse_args(["--finetune.method=lora", f"--finetune.objective={name}"])
        assert plan_job(args).cfg.finetune.objective == name
    assert plan_job(parser.parse_args(["--objective", "smoothed"])).cfg.finetune.objective == "smoothed"
    with pytest.raises(ConfigError, match="finetune.objective must be one of sft, dpo, simpo, orpo, smoothed"):
        plan_job(parser.parse_args(["--finetune.objective=kto"]))
