"""Model converters (train/converters.py): one list from the config, in the build's order; and the rules of
the converters refused by ``check_runnable`` before the run folder exists (exit 2, one line)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from scaletrain.checkpoint.export import export_hf
from scaletrain.cli import main
from scaletrain.config import ConfigError, JobConfig, ModelConfig
from scaletrain.data.tokenizer import CharTokenizer
from scaletrain.model import build_model
from scaletrain.parallel import ParallelDims
from scaletrain.train.validate import check_runnable

CHARS = sorted(set((Path(__file__).resolve().parents[2] / "src/scaletrain/assets/tinyshakespeare/input.txt")
                   .read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A tiny Llama as a Hugging Face folder: dim 32, ffn 48 (QAT group sizes that divide one, not the other)."""
    cfg = ModelConfig(vocab_size=len(CHARS), dim=32, n_layers=2, n_heads=4, ffn_hidden_dim=48, max_seq_len=32)
    folder = tmp_path_factory.mktemp("base")
    export_hf(build_model(cfg, seed=0), cfg, CharTokenizer(CHARS), folder)
    return folder


def _finetune(hf_base, run, tiny, **extra) -> list[str]:
    over = {k: v for k, v in tiny(run, **{"train.steps": 2, **extra}).items() if not k.startswith("model.")}
    return ["finetune", "--from", str(hf_base)] + [f"--{k}={v}" for k, v in over.items()]


def test_converters_follow_the_build_order(hf_base):
    from scaletrain.finetune.methods import FinetuneMethod
    from scaletrain.train.converters import (
        Float8Training,
        KeepZeros,
        QuantizationAware,
        TrainingObjective,
        build_converters,
    )

    cfg = JobConfig()
    dims = ParallelDims.from_config(cfg.parallel, 1)
    pretrain = build_converters(cfg, dims, "cpu")
    assert list(pretrain.items) == [] and not pretrain.loads_weights
    ft = dataclasses.replace(cfg.finetune, source=str(hf_base), method="full", teacher=str(hf_base), qat="int8-weight",
                             keep_zeros=True)
    job = dataclasses.replace(cfg, finetune=ft, train=dataclasses.replace(cfg.train, precision="fp8"))
    built = build_converters(job, dims, "cpu")
    assert [type(c) for c in built.items] == [Float8Training, FinetuneMethod, TrainingObjective, QuantizationAware,
                                              KeepZeros]
    assert built.items[2].objective.name == "distill"  # finetune.teacher's entry (finetune/objectives.py)
    assert built.loads_weights


@pytest.mark.parametrize("extra, message", [
    ({"finetune.method": "full", "finetune.freeze_blocks": 3},
     "finetune.freeze_blocks (3) exceeds the base's 2 blocks"),
    ({"finetune.method": "full", "finetune.qat": "int4-weight", "finetune.qat_group_size": 32},
     "finetune.qat_group_size=32 does not divide the input width 48"),
    ({"finetune.lora_targets": "q,attn"}, "unknown target(s) attn"),
])
def test_converter_rules_refuse_before_the_run_folder(hf_base, tmp_path, tiny, capsys, extra, message):
    """Refused by check_runnable (once at build time, after the run folder was locked): no run folder is made."""
    run = tmp_path / "run"
    assert main(_finetune(hf_base, run, tiny, **extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not run.exists()


@pytest.mark.parametrize("precision, module, message", [
    ("fp8", "torchao.float8", "train.precision=fp8 needs torchao"),
    ("fp32", "torchao.quantization.qat", "finetune.qat needs torchao"),
])
def test_missing_torchao_is_refused_by_the_entry_check(hf_base, monkeypatch, precision, module, message):
    """fp8 and QAT need torchao: ``check_runnable`` says so (it once surfaced only while building the model);
    the planner (``here=False``, another machine) does not ask this machine's installation."""
    from scaletrain.finetune import resolve_finetune

    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` raise ImportError
    cfg = JobConfig()
    cfg = resolve_finetune(dataclasses.replace(
        cfg, finetune=dataclasses.replace(cfg.finetune, source=str(hf_base), method="full",
                                          qat="int8-weight" if precision == "fp32" else ""),
        train=dataclasses.replace(cfg.train, precision=precision)))
    with pytest.raises(ConfigError, match=message):
        check_runnable(cfg, 1, "cuda", precision)
    check_runnable(cfg, 1, "cuda", precision, here=False)
