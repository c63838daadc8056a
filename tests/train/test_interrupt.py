"""Ctrl-C in the commands that write: nothing half-written is left where the next attempt would trip on it, and
the line printed says what that command leaves (not the trainer's "nothing saved since the last checkpoint").
compress is interrupted for real (SIGINT to a process held in its final fsync, tests/helpers/fault_train.py)."""

from __future__ import annotations

import signal

import pytest

from helpers.faults import finish, launch, output, run_ok, wait_for
from helpers.tiny import tiny_overrides
from scaletrain.cli import main


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("interrupt") / "base"
    assert main(["train"] + [f"--{k}={v}" for k, v in tiny_overrides(run, **{"train.steps": 2}).items()]) == 0
    return run


def _held_compress(base_run, out, go):
    first = launch(["compress", "--run", str(base_run), "--out", str(out), "--prune", "magnitude"],
                   PAUSE_IN="scaletrain.checkpoint.manager:fsync_dir", PAUSE_GO=str(go))
    wait_for(lambda: go.with_name(go.name + ".ready").exists(), first, what="the compressed run's fsync")
    return first


def test_ctrl_c_in_compress_final_fsync_leaves_nothing_and_the_rerun_works(base_run, tmp_path):
    out, go = tmp_path / "pruned", tmp_path / "go"
    first = _held_compress(base_run, out, go)
    first.send_signal(signal.SIGINT)
    assert finish(first) == 130
    text = output(first)
    assert "Traceback" not in text and "nothing saved since the last checkpoint" not in text, text
    assert "interrupted (Ctrl-C): nothing written to --out" in text
    assert not out.exists() and not (tmp_path / ".pruned.tmp").exists()
    assert "wrote" in run_ok(["compress", "--run", str(base_run), "--out", str(out), "--prune", "magnitude"])


def test_a_rerun_replaces_the_hidden_folder_a_killed_compress_left(base_run, tmp_path):
    out, go = tmp_path / "pruned", tmp_path / "go"
    first = _held_compress(base_run, out, go)
    first.kill()  # kill -9: nothing runs, the hidden folder stays
    first.wait()
    assert (tmp_path / ".pruned.tmp").is_dir() and not out.exists()
    assert "wrote" in run_ok(["compress", "--run", str(base_run), "--out", str(out), "--prune", "magnitude"])
    assert (out / "compress.json").is_file() and not (tmp_path / ".pruned.tmp").exists()


@pytest.mark.parametrize("command,where,note", [
    ("export", "scaletrain.checkpoint.export.export_hf", "interrupted (Ctrl-C): nothing exported"),
    ("prepare", "scaletrain.data.prepare._prepare", "interrupted (Ctrl-C): the output folder is not used until"),
])
def test_ctrl_c_says_what_each_command_leaves(base_run, tmp_path, capsys, monkeypatch, command, where, note):
    module, _, name = where.rpartition(".")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(f"{module}.{name}", interrupted)
    args = ["export", "--run", str(base_run), "--out", str(tmp_path / "hf")] if command == "export" else \
        ["prepare", "builtin:tinyshakespeare", "--out", str(tmp_path / "data")]
    capsys.readouterr()
    assert main(args) == 130
    err = capsys.readouterr().err
    assert err.startswith(note) and "checkpoint" not in err, err
