"""A run folder across commands: which config a resume uses, a finished run, a model that does not fit its
checkpoint, the trained context in generation, the summary at train.stop_at_step, the preemption trigger."""

from __future__ import annotations

import os
import re
import time

import pytest

from scaletrain.cli import build_parser, main
from scaletrain.commands.train import resolve_job_config
from scaletrain.config import load_config, to_toml
from scaletrain.train.preemption import PreemptionHandler, torchrun_launcher
from scaletrain.train.trainer import Trainer


def train_argv(overrides: dict) -> list[str]:
    return ["train"] + [f"--{k}={v}" for k, v in overrides.items()]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


# -- a model that does not fit the checkpoint -------------------------------------------------------------
def test_shape_mismatch_is_one_line_and_leaves_the_run_folder_intact(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert main(train_argv(tiny(run, **{"train.steps": 2}))) == 0
    saved = (run / "config.toml").read_text()
    capsys.readouterr()

    # --resume with a config that builds another embedding: one line naming parameter, shapes and folder.
    assert main(["train", "--resume", f"--train.run_dir={run}", "--model.vocab_size=128"]) == 2
    err = one_line_error(capsys)
    assert err.startswith("CheckpointError: ") and "tok_embeddings.weight" in err
    assert "[65, 32] in the checkpoint" in err and "[128, 32]" in err
    assert f"run folder {run} " in err and "new train.run_dir" in err
    # More blocks than the checkpoint holds: a key it lacks, one line too.
    assert main(["train", "--resume", f"--train.run_dir={run}", "--model.n_layers=3"]) == 2
    err = one_line_error(capsys)
    assert "Missing key in checkpoint state_dict: model.layers.2." in err and f"run folder {run} " in err
    # The refused settings did not replace the run's record: eval still reads a config that fits.
    assert (run / "config.toml").read_text() == saved
    assert main(["eval", "--run", str(run), "--batches", "1"]) == 0
    capsys.readouterr()

    # A config.toml that no longer fits its checkpoints (another run's settings): eval and generate, one line.
    (run / "config.toml").write_text(re.sub(r"(?m)^vocab_size = 65$", "vocab_size = 128", saved, count=1))
    for argv in (["eval", "--run", str(run)], ["generate", "--run", str(run), "--max-tokens", "3"]):
        assert main(argv) == 2
        err = one_line_error(capsys)
        assert "tok_embeddings.weight is [65, 32] in the checkpoint but [128, 32]" in err


# -- generation crops at the trained context -----------------------------------------------------------
def _record_context(model, lengths: list[int]) -> None:
    model.register_forward_pre_hook(lambda module, inputs: lengths.append(inputs[0].shape[1]))


def test_generation_crops_at_the_trained_context_not_the_rotary_length(tmp_path, tiny, capsys, monkeypatch):
    """data.seq_len 16 < model.max_seq_len 32: neither `generate` nor the trainer's samples ever show the
    model more than the 16 positions it was trained on."""
    import scaletrain.infer.session as run_module  # generate's load_run (checkpoint.run's, via Session.from_run)

    run = tmp_path / "run"
    overrides = tiny(run, **{"train.steps": 2, "data.seq_len": 16, "model.max_seq_len": 32})
    assert main(train_argv(overrides)) == 0
    lengths: list[int] = []
    real_load_run = run_module.load_run

    def load_run(*args, **kwargs):
        loaded = real_load_run(*args, **kwargs)
        _record_context(loaded[1], lengths)
        return loaded

    monkeypatch.setattr(run_module, "load_run", load_run)
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "ROMEO:", "--max-tokens", "40", "--slide"]) == 0
    assert len(capsys.readouterr().out) > 40
    assert len(lengths) > 20 and max(lengths) == 16

    trainer = Trainer(load_config(None, {**overrides, "train.resume": "true"}), log=False)  # the same run folder
    lengths.clear()
    _record_context(trainer.model, lengths)
    text, note = trainer.sample(40)
    # The sample stops at the context instead of sliding past it (each slid token a whole window's forward):
    # prompt "\n" + 16 new characters, the last one read by no step, and the note says so.
    assert len(text) == 1 + 16 and note == " (16 tokens: stopped at the model's 16-token context)"
    assert lengths[0] == 1 and all(n == 1 for n in lengths[1:])  # the prompt, then one cached token a step


# -- which config a resume uses --------------------------------------------------------------------------
def _resolve(argv: list[str]):
    return resolve_job_config(build_parser().parse_args(["train", *argv]))


@pytest.fixture
def saved_run(tmp_path, tiny):
    """A run folder's config.toml as the trainer writes it (vocabulary resolved to the data's 65), and the
    recipe it came from (vocab_size 0: the data's)."""
    run = tmp_path / "run"
    run.mkdir()
    recipe = load_config(None, tiny(run))
    (run / "config.toml").write_text(to_toml(load_config(None, tiny(run, **{"model.vocab_size": 65}))))
    path = tmp_path / "recipe.toml"
    path.write_text(to_toml(recipe))
    return run, path


def test_resume_uses_the_saved_config_with_flags_on_top(saved_run):
    run, _ = saved_run
    (run / "config.toml").write_text(re.sub(r"(?m)^lr = 0.001$", "lr = 0.0005", (run / "config.toml").read_text()))
    cfg = _resolve(["--resume", f"--train.run_dir={run}", "--train.steps=80"])
    assert cfg.train.resume and cfg.optim.lr == 0.0005 and cfg.train.steps == 80 and cfg.model.vocab_size == 65
    # Without --resume the saved file plays no part.
    assert _resolve([f"--train.run_dir={run}"]).optim.lr == 0.001


def test_resume_with_the_same_recipe_is_accepted(saved_run):
    run, recipe = saved_run
    cfg = _resolve(["--resume", "--config", str(recipe), "--train.steps=80", "--train.stop_at_step=50"])
    assert cfg.train.resume and cfg.train.steps == 80 and cfg.train.stop_at_step == 50
    assert cfg.model.vocab_size == 65  # the saved, resolved one; the recipe's 0 means the same


def test_resume_with_a_different_recipe_is_refused_listing_the_fields(saved_run, capsys):
    run, recipe = saved_run
    text = re.sub(r"(?m)^lr = 0.001$", "lr = 0.002", recipe.read_text())
    recipe.write_text(re.sub(r"(?m)^dim = 32$", "dim = 64", text))
    assert main(["train", "--resume", "--config", str(recipe)]) == 2
    err = one_line_error(capsys)
    assert "model.dim (64 vs saved 32)" in err and "optim.lr (0.002 vs saved 0.001)" in err
    assert str(run / "config.toml") in err and "pass the changes as flags" in err
    # A field the flags set is the flags' business, not a difference.
    cfg = _resolve(["--resume", "--config", str(recipe), "--model.dim=32", "--optim.lr=0.002"])
    assert cfg.optim.lr == 0.002 and cfg.model.dim == 32


# -- a finished run, and train.stop_at_step ------------------------------------------------------------
def test_resume_of_a_finished_run_trains_nothing_and_says_so(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert main(train_argv(tiny(run, **{"train.steps": 3}))) == 0
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", f"--train.run_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "already complete at step 3 (train.steps = 3); raise --train.steps to continue" in out
    assert "nan" not in out.lower() and (run / "metrics.jsonl").read_text() == metrics
    assert main(["train", "--resume", f"--train.run_dir={run}", "--train.steps=5"]) == 0
    assert "done: 5 steps" in capsys.readouterr().out


def test_stop_at_step_summary_reports_the_stop(tmp_path, tiny):
    """Evaluations at 0 and 15; stopped at 20: the summary's final val loss is step 20's, not step 15's."""
    trainer = Trainer(load_config(None, tiny(tmp_path / "run", **{"train.eval_interval": 15,
                                                                    "train.stop_at_step": 20})), log=False)
    summary = trainer.train()
    assert summary["steps"] == 20
    assert [e["step"] for e in summary["evals"]] == [0, 15, 20]
    assert summary["final_val_loss"] == summary["evals"][-1]["val_loss"] != summary["evals"][-2]["val_loss"]


# -- the preemption trigger file -------------------------------------------------------------------------
def test_trigger_file_is_consumed_and_a_stale_one_ignored(tmp_path, tiny):
    trigger = tmp_path / "spot-notice"
    overrides = tiny(tmp_path / "run", **{"train.steps": 8, "checkpoint.trigger_file": trigger})

    # Left over from before this run started: ignored, and left alone.
    trigger.write_text("old notice")
    old = time.time() - 3600
    os.utime(trigger, (old, old))
    summary = Trainer(load_config(None, {**overrides, "train.run_dir": str(tmp_path / "stale")}), log=False).train()
    assert not summary["preempted"] and summary["steps"] == 8 and trigger.exists()
    trigger.unlink()

    # Written during the run: acted on at the end of that step, then deleted.
    trainer = Trainer(load_config(None, overrides), log=False)
    step = trainer.step

    def step_then_notice(**kwargs) -> dict:
        record = step(**kwargs)
        if trainer.state.step == 3:
            trigger.write_text("reclaimed in 120 s")
        return record

    trainer.step = step_then_notice
    summary = trainer.train()
    assert summary["preempted"] == f"trigger file {trigger}" and summary["steps"] == 3
    assert not trigger.exists()
    # So the resumed run goes on to the end instead of stopping again after one step.
    resumed = Trainer(load_config(None, {**overrides, "train.resume": "true"}), log=False)
    assert resumed.resume()
    summary = resumed.train()
    assert not summary["preempted"] and summary["steps"] == 8


def test_a_lost_launcher_is_a_notice_and_only_torchrun_workers_watch_theirs(monkeypatch):
    """A worker whose parent is no longer the launcher it started under stops as for SIGTERM; a process that
    torchrun did not start watches nothing (a plain run outlives the shell that started it). The real
    processes: test_resilience_dist.py::test_workers_whose_torchrun_agent_died_checkpoint_and_exit."""
    watching = PreemptionHandler(launcher=os.getppid())
    assert not watching.should_stop()
    orphaned = PreemptionHandler(launcher=os.getppid() + 1)  # re-parented: the parent is not the launcher any more
    assert orphaned.should_stop() and orphaned.reason.startswith("launcher lost")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert torchrun_launcher() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert torchrun_launcher() == (os.getppid() if os.getppid() > 1 else None)  # 1: re-parented already
