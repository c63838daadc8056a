"""One flag vocabulary (issue 50 item 5): a job field is ``--section.field`` in every command that reads it, read by
train's own code; the spellings it replaced are accepted for one release, each with one line naming the new one."""

from __future__ import annotations

import argparse

import pytest

from scaletrain.cli import main
from scaletrain.plan.cli import RENAMED_JOB_FLAGS, add_plan_arguments
from scaletrain.tune.cli import add_tune_arguments

BASE = ["plan", "--model.preset=nano", "--model.vocab_size=65", "--hardware", "cpu:1", "--tokens", "1M",
        "--top", "1", "--json", "-"]

GPUS = ["--hardware", "h100-sxm:8", "--model.preset=llama-8b", "--model.vocab_size=128256", "--tokens", "20B"]
# (old spelling, the same in the new vocabulary, what else the plan needs for the flag to count)
OLD_AND_NEW = [
    (["--model", "micro"], ["--model.preset=micro"], []),
    (["--vocab-size", "97"], ["--model.vocab_size=97"], []),
    (["--seq-len", "64"], ["--data.seq_len=64"], []),
    (["--precision", "fp32"], ["--train.precision=fp32"], []),
    (["--optimizer", "muon"], ["--optim.name=muon"], []),
    (["--muon-adapters"], ["--optim.muon_adapters=true"], ["--optim.name=muon", "--finetune.method=lora"]),
    (["--method", "lora"], ["--finetune.method=lora"], []),
    (["--lora-rank", "4"], ["--finetune.lora_rank=4"], ["--finetune.method=lora"]),
    (["--lora-targets", "q,v"], ["--finetune.lora_targets=q,v"], ["--finetune.method=lora"]),
    (["--virtual-tokens", "4"], ["--finetune.virtual_tokens=4"], ["--finetune.method=prompt"]),
    (["--dora"], ["--finetune.dora=true"], ["--finetune.method=lora"]),
    (["--qlora-compile", "true"], ["--finetune.qlora_compile=true"], ["--finetune.method=qlora"]),
    (["--objective", "dpo"], ["--finetune.objective=dpo"], ["--finetune.method=lora"]),
    # the pins: a [parallel] field given on the command line is kept, the search varies the rest
    (["--dp-replicate", "2"], ["--parallel.dp_replicate=2"], GPUS),
    (["--dp-shard", "4"], ["--parallel.dp_shard=4"], GPUS),
    (["--tp", "2"], ["--parallel.tp=2"], GPUS),
    (["--pp", "2"], ["--parallel.pp=2"], GPUS),
    (["--cp", "1"], ["--parallel.cp=1"], GPUS),  # cp 2: no plan of 8 H100s for this model (as before)
    (["--zero-stage", "2"], ["--parallel.zero_stage=2"], GPUS),
    (["--ac", "full"], ["--parallel.activation_checkpointing=full"], GPUS),
    (["--offload", "true"], ["--parallel.cpu_offload=true"], GPUS),
]


def test_every_renamed_plan_flag_has_a_case():
    assert sorted(old[0] for old, _, _ in OLD_AND_NEW) == sorted(old for old, _, _ in RENAMED_JOB_FLAGS)


@pytest.mark.parametrize("old,new,extra", OLD_AND_NEW, ids=[case[0][0] for case in OLD_AND_NEW])
def test_an_old_plan_spelling_plans_as_the_new_one_and_says_so(capsys, old, new, extra):
    assert main([*BASE, *extra, *new]) == 0
    new_out, new_err = capsys.readouterr()
    assert main([*BASE, *extra, *old]) == 0
    old_out, old_err = capsys.readouterr()
    assert old_out == new_out  # the same plan, as JSON
    note, rest = old_err.split("\n", 1)
    assert note == f"note: {old[0]} is deprecated and goes in the next release; use {new[0]}"
    assert rest == new_err


def test_a_job_field_plan_never_declared_is_read_as_train_reads_it(capsys):
    """Every field and choice, with train's one-line errors: --model.n_layers changes the planned model."""
    assert main([*BASE, "--model.n_layers=2"]) == 0
    two = capsys.readouterr().out
    assert main(BASE) == 0
    assert two != capsys.readouterr().out
    assert main([*BASE, "--train.precision=fp64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.precision" in err and "fp64" in err
    # the choices `--precision` lacked: fp16 on a GPU of the catalog; fp8 plans as bf16 (torchao's GEMMs)
    gpu = ["plan", "--model.preset=gpt2-124m", "--hardware", "h100-sxm:8", "--top", "1", "--json", "-"]
    assert main([*gpu, "--train.precision=fp16"]) == 0 and '"precision": "fp16"' in capsys.readouterr().out
    assert main([*gpu, "--train.precision=fp8"]) == 0 and '"precision": "bf16"' in capsys.readouterr().out


def _parse(add, argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add(parser)
    return vars(parser.parse_args(argv))


@pytest.mark.parametrize("old,new", [(["--dir", "t"], ["--out", "t"]), (["--objective", "val_bpb"],
                                                                         ["--metric", "val_bpb"])])
def test_tune_old_spellings_are_the_new_flags(capsys, old, new):
    """tune --dir is --out (every command's output folder); tune --objective is --metric (a metric, not the
    fine-tune's finetune.objective)."""
    given = ["--space", "s.toml", "--trials", "1"]
    assert _parse(add_tune_arguments, [*given, *old]) == _parse(add_tune_arguments, [*given, *new])
    assert capsys.readouterr().err == f"note: {old[0]} is deprecated and goes in the next release; use {new[0]}\n"


def test_plan_help_shows_only_the_new_vocabulary():
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    text = parser.format_help()
    assert "--finetune.objective" in text and "--train.precision" in text
    assert all(f"{old} " not in text.replace("[", " ").replace("]", " ") for old, _, _ in RENAMED_JOB_FLAGS)
