"""One writer per output, with train's run-folder lock (core/writer_lock.py: RunLock): two `prepare`s into
one folder, or two `export`s to one --out, at once: the second is refused in one line naming the first (its PID
and command), and the first completes. Real processes: the first is held inside its work (tests/helpers/
fault_train.py PAUSE_IN) while the second starts."""

from __future__ import annotations

import fcntl
import json
import os

from helpers.faults import finish, launch, output, run_ok, wait_for
from helpers.tiny import tiny_overrides

SOURCE = "builtin:tinyshakespeare"


def _held(args: list[str], pause_in: str, go):
    """``args`` in a process that stops at the first call of ``pause_in`` (its locks taken) until ``go`` exists."""
    first = launch(args, PAUSE_IN=pause_in, PAUSE_GO=str(go))
    wait_for(lambda: go.with_name(go.name + ".ready").exists(), first, what=f"{pause_in} reached")
    return first


def _refusal(text: str) -> str:
    (line,) = [line for line in text.splitlines() if "Error:" in line]
    return line


def test_two_prepares_into_one_folder(tmp_path):
    out, go = tmp_path / "data", tmp_path / "go"
    first = _held(["prepare", SOURCE, "--out", str(out), "--tokenizer", "char"], "scaletrain.data.prepare:_prepare", go)
    try:
        text = run_ok(["prepare", SOURCE, "--out", str(out), "--tokenizer", "bpe", "--vocab-size", "600"], expect=2)
        line = _refusal(text)
        assert line == (f"ConfigError: output folder {out} is in use by process {first.pid} (scaletrain prepare) on "
                        f"{line.split(' on ')[1].split(' (since')[0]} (since {line.split('(since ')[1]}"), line
        assert line.endswith("; wait for it to finish, stop it, or prepare into another --out")
        assert "wrote" not in text
    finally:
        go.write_text("")
    assert finish(first) == 0, output(first)
    assert "wrote" in output(first) and json.loads((out / "manifest.json").read_text())["vocab_size"] < 600


def test_two_exports_to_one_folder(tmp_path):
    run, out, go = tmp_path / "run", tmp_path / "hf", tmp_path / "go"
    run_ok(["train"] + [f"--{k}={v}" for k, v in tiny_overrides(run, **{"train.steps": 2}).items()])
    first = _held(["export", "--run", str(run), "--out", str(out)], "scaletrain.checkpoint.export:export_hf", go)
    try:
        text = run_ok(["export", "--run", str(run), "--out", str(out)], expect=2)
        line = _refusal(text)
        assert line.startswith(f"ConfigError: --out {out} is in use by process {first.pid} (scaletrain export)"), line
        assert line.endswith("or choose another --out") and "exported" not in text
    finally:
        go.write_text("")
    assert finish(first) == 0, output(first)
    assert f"to {out}" in output(first) and (out / "config.json").is_file()
    # free again once the first ended: a third export is told about the earlier export, not a lock
    assert "pass --overwrite" in _refusal(run_ok(["export", "--run", str(run), "--out", str(out)], expect=2))


def test_a_lock_beside_an_output_goes_with_it(tmp_path):
    """``one_writer(remove=True)`` (export, compress: ``.NAME.lock`` beside --out) leaves no lock file; a writer
    that opened the file before it went gets its flock but sees it is no longer the lock, and takes a new one."""
    from scaletrain.core.writer_lock import RunLock, _still_named, one_writer

    lock_file = tmp_path / ".m.gguf.lock"
    with one_writer(tmp_path, "--out m.gguf", "choose another --out", name=lock_file.name, remove=True):
        assert lock_file.is_file()
        stale = os.open(lock_file, os.O_RDWR)  # a second export that opened it before the first ended
    assert not lock_file.exists()
    try:
        fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file's lock is free ...
        assert not _still_named(stale, lock_file)  # ... and not the lock any more: acquire opens the path again
    finally:
        os.close(stale)
    lock = RunLock(tmp_path, lock_file.name)
    lock.acquire()
    assert _still_named(lock._fd, lock_file)
    lock.release(remove=True)
    assert not list(tmp_path.iterdir())
