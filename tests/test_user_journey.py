"""Defects a new user met on the whole journey (issue 23, point 5): each bad input is one line and exit 2, and
what a command does by default is said where it is done."""

from __future__ import annotations

import logging

import pytest

from conftest import tiny_overrides
from scaletrain.cli import main

SPACE = "docs/examples/baby_space.toml"


def flags(overrides: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in overrides.items()]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 3-step char run (the compress and report inputs)."""
    run = tmp_path_factory.mktemp("journey") / "base"
    assert main(["train", *flags(tiny_overrides(run, **{"train.steps": 3}))]) == 0
    return run


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", ["compress", "report", "tune", "lr-find", "plan", "train", "prepare"])
def test_an_output_path_under_a_file_is_one_storage_error_line(command, base_run, tmp_path, capsys):
    """`--out FILE/x` (and the like) of every command that writes: one StorageError line naming the file in the
    way, exit 2; compress says it before the work (nothing quantized), prepare does not talk of free space."""
    blocker = tmp_path / "FILE"
    blocker.write_text("a file, not a folder")
    target = str(blocker / "x")
    run_flags = flags(tiny_overrides(tmp_path / "run", **{"train.steps": 2}))
    argv = {
        "compress": ["compress", "--run", str(base_run), "--out", target, "--quantize", "int8-weight"],
        "report": ["report", str(base_run), "--out", target + ".html"],
        "tune": ["tune", "--space", SPACE, "--trials", "1", "--dir", target, *run_flags],
        "lr-find": ["lr-find", "--out", target, "--steps", "10", *run_flags],
        "plan": ["plan", "--model", "nano", "--vocab-size", "65", "--hardware", "cpu:1", "--tokens", "20M",
                 "--emit", target + ".toml"],
        "train": ["train", *flags(tiny_overrides(target, **{"train.steps": 2}))],
        "prepare": ["prepare", "--source.paths", "builtin:tinyshakespeare", "--out", target],
    }[command]
    if command == "tune":
        pytest.importorskip("optuna")
    if command == "report":
        pytest.importorskip("plotly")
    assert main(argv) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("StorageError: writing "), out.err
    assert f"{blocker} is a file, not a folder; choose another path" in lines[0]
    assert "free" not in lines[0]  # the disk has room: space is not the cause
    assert "quantized" not in out.out  # compress: checked before the work
    assert blocker.read_text() == "a file, not a folder"


def test_compress_leaves_no_folder_behind_when_the_input_is_refused(base_run, tmp_path, capsys):
    out = tmp_path / "a" / "b"
    assert main(["compress", "--run", str(base_run), "--out", str(out), "--quantize", "int4-weight",
                 "--group-size", "64"]) == 2
    assert "--group-size 64 does not divide the input width 32" in one_error_line(capsys)
    assert not (tmp_path / "a").exists()


def test_binary_calibration_text_is_one_line_naming_the_file(base_run, tmp_path, capsys):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    assert main(["compress", "--run", str(base_run), "--out", str(tmp_path / "w"), "--prune", "wanda",
                 "--sparsity", "0.5", "--calibration-text", str(binary)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("DataError: ") and f"{binary}: not UTF-8 at byte 128" in line


def test_report_of_an_empty_folder_is_refused(tmp_path, capsys):
    pytest.importorskip("plotly")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "not a run folder (it holds none of config.toml" in one_error_line(capsys)
    assert not out.exists()


def test_prune_without_sparsity_says_the_default(base_run, tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["compress", "--run", str(base_run), "--out", str(out), "--prune", "magnitude"]) == 0
    said = capsys.readouterr().out
    assert "--sparsity not given: pruning 50% of the block weights (the default)" in said
    assert "50.0% of the block weights are zero" in said
    assert main(["compress", "--run", str(base_run), "--out", str(tmp_path / "p"), "--prune", "magnitude",
                 "--pattern", "2:4", "--sparsity", "0.7"]) == 2
    assert "the pattern fixes the sparsity at 50%" in one_error_line(capsys)


def test_known_torchao_noise_is_dropped_and_other_warnings_kept(caplog):
    from scaletrain.quiet import quiet_known_noise

    quiet_known_noise()
    quiet_known_noise()  # idempotent: one filter each
    assert len(logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                                             "Could not load this library")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "K")
        logging.getLogger("torchao").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_a_compress_command_prints_no_torchao_import_noise(base_run, tmp_path):
    """The real import, in a fresh process (torchao loads its .so files once per process)."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    done = subprocess.run([sys.executable, "-m", "scaletrain", "compress", "--run", str(base_run), "--out",
                           str(tmp_path / "q"), "--quantize", "int8-weight"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr
