"""The fine-tuning method table (finetune/method_table.py: METHODS) is what every consumer reads: a method registered
here, and nowhere else, is applied by the trainer's converter, trained, checked by the job validation, offered by
``plan --method`` and charged by the planner from its own fields (as tests/train/test_optimizer_table.py proves for the
optimizer table)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from torch import nn

from helpers.tiny import tiny_hf_base
from scaletrain.commands.plan import add_plan_arguments, plan_job
from scaletrain.config import ConfigError, FinetuneConfig, JobConfig, ModelConfig, ParallelConfig, load_config
from scaletrain.finetune import method_table as table
from scaletrain.finetune.methods import parameter_counts
from scaletrain.model import Transformer
from scaletrain.model.presets import block_vector_params
from scaletrain.plan.finetune import finetune_memory, trainable_parameters
from scaletrain.plan.workload import Plan, Workload
from scaletrain.train.validate import check_finetune

MODEL = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=128, max_seq_len=64)


def _train_norms(model: nn.Module, ft: FinetuneConfig) -> None:
    """Only the RMSNorm gains train (a BitFit-like method): every other weight frozen."""
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.requires_grad_(True)


def _norm_parameters(cfg: ModelConfig, ft: FinetuneConfig) -> int:
    return cfg.n_layers * block_vector_params(cfg) + cfg.dim  # each block's norms, and the final one


def _refuse_long_runs(cfg: JobConfig, world_size: int) -> str | None:
    return f"finetune.method=norms trains at most 100 steps (got train.steps={cfg.train.steps})" \
        if cfg.train.steps > 100 else None


NORMS = table.MethodEntry("norms", _train_norms, _norm_parameters, refusal=_refuse_long_runs)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(table.METHODS, "norms", NORMS)


def _job(**fields) -> JobConfig:
    cfg = JobConfig(model=MODEL, train=dataclasses.replace(JobConfig().train, steps=100),
                    finetune=FinetuneConfig(source="base", method="norms"))
    return dataclasses.replace(cfg, **fields)


def test_the_converter_applies_the_entry_and_the_planner_counts_what_trains(registered):
    with torch.device("meta"):
        model = Transformer(MODEL)
    ft = FinetuneConfig(method="norms")
    table.method_entry("norms").apply(model, ft)  # what the converter (finetune/methods.py:FinetuneMethod) runs
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(name.endswith("norm.weight") for name in trained)
    assert parameter_counts([model])[0] == trainable_parameters(MODEL, ft)  # the trainer's modules, the planner's sum
    memory = finetune_memory(Workload(MODEL, 64, 8, 1e6), Plan(micro_batch=2), ft)
    assert memory["trainable_parameters"] == trainable_parameters(MODEL, ft) and memory["method"] == "norms"


def test_the_job_validation_reads_the_entry(registered):
    check_finetune(_job(), world_size=1, here=False)
    with pytest.raises(ConfigError, match=r"trains at most 100 steps \(got train.steps=101\)"):
        check_finetune(_job(train=dataclasses.replace(JobConfig().train, steps=101)), world_size=1, here=False)
    with pytest.raises(ConfigError, match="finetune.method=norms runs with data parallelism"):
        check_finetune(_job(parallel=ParallelConfig(tp=2)), world_size=2, here=False)
    with pytest.raises(ConfigError, match="finetune.lora_plus_ratio=2 scales the LoRA B"):
        check_finetune(_job(finetune=FinetuneConfig(source="base", method="norms", lora_plus_ratio=2.0)),
                       world_size=1, here=False)
    assert table.packs_instructions(_job())  # no virtual tokens: its examples share rows


def test_a_name_without_an_entry_is_one_line():
    with pytest.raises(ConfigError, match=r"finetune.method: no fine-tuning method 'norms' \(there are full, lora"):
        table.method_entry("norms")


def test_plan_offers_every_entry():
    """plan reads --finetune.method as train does (issue 50's one vocabulary): every entry of the table is a plan
    the command accepts, and the old --method spelling still reaches the same field."""
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    for name in table.METHODS:
        job = plan_job(parser.parse_args(["--model.preset", "nano", "--model.vocab_size", "65",
                                          f"--finetune.method={name}"]))
        assert job.cfg.finetune.method == name and job.given("finetune.method")
    assert plan_job(parser.parse_args(["--method", "lora"])).cfg.finetune.method == "lora"


def test_the_config_offers_the_tables_methods():
    """config.py sits below the table (it cannot import it): its choices are held equal to the table here."""
    field = next(f for f in dataclasses.fields(FinetuneConfig) if f.name == "method")
    assert tuple(field.metadata["choices"]) == tuple(table.METHODS)


def test_a_registered_method_trains_only_what_its_entry_unfreezes(registered, tmp_path, tiny):
    from scaletrain.train.trainer import Trainer

    base = tiny_hf_base(tmp_path / "base")
    over = {k: v for k, v in tiny(tmp_path / "run", **{"train.steps": 2, "checkpoint.enabled": "false"}).items()
            if not k.startswith("model.")}  # the model comes from the base
    cfg = load_config(None, {**over, "finetune.source": str(base)})
    cfg = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, method="norms"))  # not a config choice
    trainer = Trainer(cfg, log=False)
    model = trainer.pm.modules[0]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.step()
    trainer.step()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    trainer.close()
    assert changed and all(name.endswith("norm.weight") for name in changed)
