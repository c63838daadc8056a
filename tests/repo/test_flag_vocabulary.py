"""One flag vocabulary (issue 50 item 5): a job field is ``--section.field`` in every command that reads it, read by
train's own code; the spellings it replaced are accepted for one release, each with one line naming the new one."""

from __future__ import annotations

import argparse
import json

import pytest

from scaletrain.cli import main
from scaletrain.commands.plan import RENAMED_JOB_FLAGS, add_plan_arguments
from scaletrain.config import read_toml
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


# eval and compress read a saved run's job: the fields they read are --section.field flags over it (the run's model,
# tokenizer and data are what is evaluated or compressed, so they are not offered).
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from helpers.tiny import tiny_overrides

    run = tmp_path_factory.mktemp("vocabulary") / "run"
    assert main(["train"] + [f"--{k}={v}" for k, v in tiny_overrides(run, **{"train.steps": 4}).items()]) == 0
    return run


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_eval_reads_the_job_fields_it_scores_with_over_the_run(tiny_run, capsys):
    """--train.eval_batches is --batches' default (the same windows); --train.batch_size and --data.seq_len cut the
    val split otherwise; the run itself (its saved config) is untouched."""
    saved = (tiny_run / "config.toml").read_text()
    assert main(["eval", "--run", str(tiny_run)]) == 0
    default = _last_line(capsys)
    assert "2 batches x 4 x 32 tokens" in default  # the run's train.eval_batches, batch_size, seq_len
    assert main(["eval", "--run", str(tiny_run), "--train.eval_batches=3"]) == 0
    three = _last_line(capsys)
    assert main(["eval", "--run", str(tiny_run), "--batches", "3"]) == 0
    assert _last_line(capsys) == three and "3 batches x 4 x 32 tokens" in three
    assert main(["eval", "--run", str(tiny_run), "--train.batch_size=2", "--data.seq_len=16",
                 "--json", str(tiny_run.parent / "e.json")]) == 0
    line = _last_line(capsys)  # the windows scored, and training's (which these are not)
    assert "over 2 batches x 2 x 16 tokens" in line and "train.eval_batches=2 batches x 4 x 32 tokens" in line
    settings = json.loads((tiny_run.parent / "e.json").read_text())["settings"]
    assert settings["job_fields"] == {"train.batch_size": "2", "data.seq_len": "16"}
    assert (tiny_run / "config.toml").read_text() == saved


@pytest.mark.parametrize("flags,needle", [
    (["--data.seq_len=64"], "data.seq_len (64) must be <= model.max_seq_len (32)"),  # the run's model: checked
    (["--train.eval_batches=0"], "train.eval_batches must be >= 1"),
    (["--train.precision=fp64"], "train.precision"),
    (["--model.dim=8"], "unrecognized arguments: --model.dim=8"),  # the run's model is what is evaluated
    (["--tasks", "hellaswag", "--train.batch_size=2"], "--train.batch_size sets how the val split"),
])
def test_eval_job_field_errors_are_one_line(tiny_run, capsys, flags, needle):
    try:
        code = main(["eval", "--run", str(tiny_run), *flags])
    except SystemExit as exc:  # argparse's (an unknown flag), one line through cli.OneLineParser
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_compress_reads_the_job_fields_it_calibrates_and_reports_with(tiny_run, tmp_path, capsys):
    """--data.seq_len: the calibration sequences' length (the compressed run keeps the source's job); --report's
    --train.eval_batches is its --batches' default; a field the compression would not read is refused."""
    out = tmp_path / "wanda"
    assert main(["compress", "--run", str(tiny_run), "--out", str(out), "--prune", "wanda", "--data.seq_len=16",
                 "--calibration-sequences", "4"]) == 0
    assert json.loads((out / "compress.json").read_text())["calibration"]["seq_len"] == 16
    assert read_toml(out / "config.toml")["data"]["seq_len"] == 32  # still the source's
    capsys.readouterr()
    report = ["compress", "--report", str(tiny_run), str(out), "--decode-tokens", "0"]
    assert main([*report, "--train.eval_batches=1", "--train.batch_size=2"]) == 0
    by_field = capsys.readouterr().out
    assert "over 1 batches x 2 x 32 tokens" in by_field
    assert main([*report, "--batches", "1", "--train.batch_size=2"]) == 0
    assert capsys.readouterr().out == by_field
    for flags, needle in ((["--prune", "magnitude", "--data.seq_len=16"], "read by --prune wanda and structured"),
                          (["--prune", "wanda", "--train.eval_batches=3"], "sets how --report scores")):
        assert main(["compress", "--run", str(tiny_run), "--out", str(tmp_path / "x"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("command,fields", [("eval", "EVAL_JOB_FIELDS"), ("compress", "COMPRESS_JOB_FIELDS")])
def test_eval_and_compress_help_show_the_job_fields_they_read(capsys, command, fields):
    import scaletrain.compress.cli
    import scaletrain.evaluation.cli

    keys = getattr(scaletrain.evaluation.cli if command == "eval" else scaletrain.compress.cli, fields)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert all(f"--{key} " in text for key in keys), text
    assert "--model.dim" not in text
