"""scaletrain tune / lr-find (tune/): the search space's checks, a study that continues where it stopped,
the planner's memory skip, the study page of the report, and the LR range test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.tune.lr_find import diverged, lr_find, suggest
from scaletrain.tune.space import parse_space

pytest.importorskip("optuna")
SPACE = Path(__file__).parents[1] / "fixtures" / "tune" / "space.toml"


@pytest.fixture(autouse=True)
def keep_threads():
    """The trials train on one thread (train.threads, set process-wide by the Trainer): put it back after."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def flags(overrides: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in overrides.items()]


@pytest.mark.parametrize("text, says", [
    ("", "is empty"),
    ("[optim.lr]\ntype = 'log'\nlow = 1e-2\nhigh = 1e-4\n", "low (0.01) > high (0.0001)"),
    ("[optim.lrr]\ntype = 'log'\nlow = 1e-4\nhigh = 1e-2\n", "optim.lrr is not a config field"),
    ("[optim.lr]\ntype = 'logarithmic'\nlow = 1e-4\nhigh = 1e-2\n", "type must be one of"),
    ("[optim.lr]\ntype = 'log'\nlow = 0\nhigh = 1e-2\n", "optim.lr must be > 0"),
    ("[model.dim]\ntype = 'linear'\nlow = 32\nhigh = 64\n", 'use type = "int"'),
    ("[schedule.name]\ntype = 'categorical'\nchoices = ['cosine', 'zigzag']\n", "must be one of"),
])
def test_bad_space_is_one_line_and_exit_2(tmp_path, capsys, text, says):
    space = tmp_path / "space.toml"
    space.write_text(text)
    assert main(["tune", "--space", str(space), "--trials", "2", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "t").exists()  # refused before anything is written


def test_space_kinds():
    params = parse_space({"optim": {"lr": {"type": "log", "low": 1e-4, "high": 1e-2}},
                          "model": {"n_layers": {"type": "int", "low": 1, "high": 5, "step": 2}},
                          "schedule": {"name": {"type": "categorical", "choices": ["cosine", "wsd"]}}})
    assert [(p.name, p.kind) for p in params] == [("optim.lr", "log"), ("model.n_layers", "int"),
                                                  ("schedule.name", "categorical")]
    assert params[1].contains(3) and not params[1].contains(2) and params[2].contains("wsd")


def test_study_continues_skips_what_does_not_fit_and_reports(tmp_path, tiny, capsys):
    pytest.importorskip("plotly")
    job = tiny(tmp_path / "job", **{"train.steps": 10, "train.eval_interval": 5, "train.compile": "false",
                                    "monitor.enabled": "false", "train.threads": 1})
    folder = tmp_path / "tune"
    tune = ["tune", "--space", str(SPACE), "--out", str(folder), *flags(job)]
    assert main([*tune, "--trials", "2"]) == 0
    first = json.loads((folder / "study.json").read_text())["trials"]
    assert len(first) == 2 and first[0]["baseline"] and first[0]["params"]["optim.lr"] == pytest.approx(1e-3)
    assert first[0]["state"] == "complete" and first[0]["steps"] == 10 and first[0]["intermediate"]
    # Re-running with more trials continues the same study: earlier trials kept, the count grows.
    assert main([*tune, "--trials", "3"]) == 0
    doc = json.loads((folder / "study.json").read_text())
    assert len(doc["trials"]) == 3 and doc["trials"][:2] == first
    best = load_config(folder / "best.toml")
    assert best.optim.lr == pytest.approx(doc["best"]["params"]["optim.lr"])
    assert [e for e in (folder / "trials").iterdir()]  # each trial trained in its own run folder
    # Another space for the same folder is refused (the study would mix two searches).
    other = tmp_path / "other.toml"
    other.write_text(SPACE.read_text().replace("high = 2", "high = 3"))
    assert main(["tune", "--space", str(other), "--out", str(folder), "--trials", "5", *flags(job)]) == 2
    assert "holds a study started with another space" in capsys.readouterr().err
    # The report draws the study (table, plots).
    assert main(["report", str(folder), "--out", str(tmp_path / "study.html")]) == 0
    page = (tmp_path / "study.html").read_text()
    assert "Val loss vs optim.lr" in page and "Best:" in page


def test_trials_the_planner_says_do_not_fit_are_skipped(tmp_path, tiny):
    job = tiny(tmp_path / "job", **{"train.steps": 5})
    folder = tmp_path / "tune"
    assert main(["tune", "--space", str(SPACE), "--out", str(folder), "--trials", "2", "--memory-gb", "0.001",
                 *flags(job)]) == 0
    trials = json.loads((folder / "study.json").read_text())["trials"]
    assert [t["state"] for t in trials] == ["skipped", "skipped"] and all(t["steps"] == 0 for t in trials)
    assert "the planner predicts" in trials[0]["note"] and not (folder / "trials").exists()


def test_lr_find_sweeps_to_divergence_and_suggests(tmp_path, tiny):
    cfg = load_config(None, tiny(tmp_path / "job", **{"train.compile": "false", "train.threads": 1}))
    result = lr_find(cfg, tmp_path / "lr", start=1e-4, end=10.0, steps=25)
    assert result.lrs[0] == pytest.approx(1e-4) and len(result.lrs) == len(result.smoothed)
    assert result.lrs == sorted(result.lrs)
    assert min(result.smoothed) < result.smoothed[0] - 0.3  # the loss fell somewhere in the sweep
    assert result.rule == "steepest" and result.suggested_lr == result.steepest_lr  # the default rule
    assert result.lrs[0] < result.steepest_lr <= result.min_lr < result.lrs[-1]


def test_lr_find_rules_and_stop():
    """The two suggestion rules on a known curve, and the stop: 4x the minimum, or back above the start once the
    loss has fallen (a language model's loss never reaches 4x its minimum: it saturates near log(vocab))."""
    lrs = [10.0 ** (e / 4) for e in range(-24, 1)]  # 1e-6 .. 1
    curve = [4.0 - 2.0 / (1 + math.exp(-(math.log10(lr) + 3) * 3)) for lr in lrs]  # falls fastest at 1e-3
    curve[-4:] = [2.5, 3.0, 3.5, 4.2]  # then rises after 1e-2 (the minimum, 2.0-ish, just before)
    low, steep, suggested = suggest(lrs, curve, divisor=10, rule="steepest")
    assert steep == pytest.approx(1e-3) and suggested == steep
    assert suggest(lrs, curve, divisor=10, rule="minimum")[2] == pytest.approx(low / 10)
    assert diverged(4.1, first=4.0, best=2.0, diverge=4.0).startswith("smoothed loss 4.100 back above")
    assert diverged(4.1, first=4.0, best=3.9, diverge=4.0) == ""  # noise before the loss ever fell
    assert "4 x minimum" in diverged(9.0, first=10.0, best=2.0, diverge=4.0)
    assert diverged(3.0, first=4.0, best=2.0, diverge=4.0) == ""


def test_lr_find_bad_range_is_one_line(capsys):
    assert main(["lr-find", "--start", "1", "--end", "1e-3"]) == 2
    assert "0 < --start < --end" in capsys.readouterr().err


def test_bits_per_byte_as_the_objective(tmp_path, tiny, capsys):
    """--metric val_bpb: each trial's value is its run's final val_bpb, pruning sees bpb at each
    evaluation, and the study keeps its objective (continuing it with another is refused in one line)."""
    job = tiny(tmp_path / "job", **{"train.steps": 6, "train.eval_interval": 3, "train.compile": "false",
                                    "monitor.enabled": "false", "train.threads": 1, "data.tokenizer": "bpe",
                                    "data.vocab_size": 300})
    folder = tmp_path / "tune"
    tune = ["tune", "--space", str(SPACE), "--out", str(folder), *flags(job)]
    assert main([*tune, "--trials", "2", "--metric", "val_bpb"]) == 0
    doc = json.loads((folder / "study.json").read_text())
    assert doc["objective"] == "final val bpb"
    baseline = doc["trials"][0]  # the job's own values: `scaletrain train` of the job records the same val_bpb
    assert baseline["baseline"] and list(baseline["intermediate"]) == ["3", "6"]
    assert main(["train", *flags({**job, "train.run_dir": str(tmp_path / "ref")})]) == 0
    rows = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    evals = {str(r["step"]): r for r in rows if "val_bpb" in r}
    assert baseline["value"] == pytest.approx(evals["6"]["val_bpb"], rel=1e-6)
    assert baseline["intermediate"]["3"] == pytest.approx(evals["3"]["val_bpb"], rel=1e-6)
    assert abs(baseline["value"] - evals["6"]["val_loss"]) > 0.1  # bits per byte, not the loss
    capsys.readouterr()
    assert main([*tune, "--trials", "3", "--metric", "val_loss"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was started with --metric val_bpb" in err[0], err
