"""The optimizer table (train/optimizer.py: OPTIMIZERS) is what every consumer reads: an entry registered here, and
nowhere else, is built by the trainer, checked by the job validation, offered by ``plan --optimizer`` and charged
by the planner's memory and time models from its own fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from torch import nn

from scaletrain.commands.plan import add_plan_arguments, plan_job, planned_optimizer
from scaletrain.config import ConfigError, FinetuneConfig, JobConfig, ModelConfig, OptimConfig, TrainConfig
from scaletrain.plan.finetune import finetune_memory
from scaletrain.plan.hardware_spec import parse_hardware
from scaletrain.plan.memory import memory_breakdown, muon_matrix_params, stage_params
from scaletrain.plan.report import breakdown_table, optimizer_text
from scaletrain.plan.search import Candidate
from scaletrain.plan.timing import step_time
from scaletrain.plan.workload import Plan, Workload
from scaletrain.train import optimizer as table
from scaletrain.train.validate import check_optimizer

MODEL = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=128, max_seq_len=64)


def _sgd(model: nn.Module, groups: list[dict], cfg: OptimConfig, device: torch.device, kernel: dict):
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9)


def _refuse_long_runs(cfg: JobConfig) -> str | None:
    return f"optim.name=sgd trains at most 100 steps (got train.steps={cfg.train.steps})" \
        if cfg.train.steps > 100 else None


# SGD with momentum: one fp32 buffer a parameter (half AdamW's), on every parameter, no Newton-Schulz.
SGD = table.OptimizerEntry("sgd", "SGD with momentum, one buffer per parameter", _sgd, refusal=_refuse_long_runs,
                           state_bytes=4, states_label="momentum")
# A matrix optimizer without state on its matrices (AdamW on the rest), orthogonalizing like Muon.
STATELESS = table.OptimizerEntry("stateless", "no state on the blocks' matrices{adapters}", _sgd, state_bytes=0,
                                 matrices=True, orthogonalizes=True)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(table.OPTIMIZERS, "sgd", SGD)
    monkeypatch.setitem(table.OPTIMIZERS, "stateless", STATELESS)


def test_the_trainer_builds_and_validates_a_registered_entry(registered):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    built = table.build_optimizer(model, OptimConfig(name="sgd", lr=0.5), torch.device("cpu"))
    assert type(built) is torch.optim.SGD and built.defaults["momentum"] == 0.9
    assert [len(g["params"]) for g in built.param_groups] == [1, 3]  # the entry's default groups: decay or not
    check_optimizer(JobConfig(optim=OptimConfig(name="sgd"), train=TrainConfig(steps=100)))
    with pytest.raises(ConfigError, match=r"trains at most 100 steps \(got train.steps=101\)"):
        check_optimizer(JobConfig(optim=OptimConfig(name="sgd"), train=TrainConfig(steps=101)))
    with pytest.raises(ConfigError, match="optim.muon_momentum applies to optim.name=muon only"):
        check_optimizer(JobConfig(optim=OptimConfig(name="sgd", muon_momentum=0.9)))


def test_a_name_without_an_entry_is_one_line_everywhere():
    with pytest.raises(ConfigError, match="optim.name: no optimizer 'sgd' \\(there are adamw, muon") as err:
        check_optimizer(JobConfig(optim=OptimConfig(name="sgd")))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not 'sgd'"):
        Workload(MODEL, 64, 8, 1e6, optimizer="sgd")


def test_plan_offers_every_entry(registered):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    for name in table.OPTIMIZERS:  # --optim.name, as train reads it: every entry, the test-only ones too
        assert planned_optimizer(plan_job(parser.parse_args([f"--optim.name={name}"]))) == (name, False)
    assert {"adamw", "muon", "sgd", "stateless"} <= set(table.OPTIMIZERS)
    workload = Workload(MODEL, 64, 8, 1e6, optimizer="stateless", muon_adapters=True)
    assert optimizer_text(workload) == "stateless (no state on the blocks' matrices, LoRA's lora_A / lora_B too)"


def test_the_planner_charges_each_entry_its_own_state_bytes_and_step(registered):
    plan = Plan(micro_batch=8)
    adamw = Workload(MODEL, 64, 8, 1e6)
    memory = {name: memory_breakdown(dataclasses.replace(adamw, optimizer=name), plan, "cpu")
              for name in ("adamw", "sgd", "stateless", "muon")}
    assert memory["adamw"].optimizer == stage_params(MODEL, 1, 1) * table.ADAMW_STATE_BYTES
    assert memory["sgd"].optimizer == memory["adamw"].optimizer / 2  # 4 bytes a parameter, every parameter
    matrices = muon_matrix_params(MODEL, MODEL.n_layers) * table.ADAMW_STATE_BYTES
    assert memory["stateless"].optimizer == pytest.approx(memory["adamw"].optimizer - matrices)  # none on matrices
    assert memory["muon"].optimizer == pytest.approx(memory["adamw"].optimizer - matrices / 2)
    cluster = parse_hardware("h100-sxm:1")
    times = {name: step_time(dataclasses.replace(adamw, optimizer=name), plan, cluster)
             for name in ("sgd", "stateless")}
    assert times["sgd"].newton_schulz == 0 < times["stateless"].newton_schulz  # orthogonalizes: Newton-Schulz
    full = FinetuneConfig(method="full")
    tuned = {name: finetune_memory(dataclasses.replace(adamw, optimizer=name), plan, full)["optimizer_state_bytes"]
             for name in ("adamw", "sgd", "stateless")}
    assert tuned["sgd"] == tuned["adamw"] / 2 and tuned["stateless"] == pytest.approx(tuned["adamw"] - matrices)
    best = Candidate(plan=plan, memory=memory["sgd"], time=times["sgd"])
    rows = breakdown_table(best, "sgd").columns[0]._cells
    assert "optimizer states (momentum)" in rows
