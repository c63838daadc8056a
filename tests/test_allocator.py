"""The allocator choice of the ``scaletrain`` command (allocator.py): what each SCALETRAIN_MALLOC value preloads,
the one-line errors, and that the command re-executes itself once at most. The real preload is checked end to
end by tests/test_launch.py's reference run (its run_info.json names the allocator it ran on)."""

import os
import sys

import pytest

from scaletrain import allocator
from scaletrain.allocator import AllocatorError, choose, preload


@pytest.fixture
def installed(monkeypatch):
    """Pretend only jemalloc is installed, at a made-up path."""
    libs = {"jemalloc": "/opt/x/libjemalloc.so.2", "tcmalloc": None}
    monkeypatch.setattr(allocator, "find", lambda name: libs[name])
    return libs


def test_choices(installed, tmp_path):
    assert choose("auto") == choose("jemalloc") == installed["jemalloc"]
    assert choose("system") is None
    with pytest.raises(AllocatorError, match="tcmalloc: libtcmalloc is not installed .*apt install"):
        choose("tcmalloc")
    with pytest.raises(AllocatorError, match="choose auto, system, jemalloc, tcmalloc"):
        choose("mimalloc")
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    assert choose(str(lib)) == str(lib)
    installed["jemalloc"] = None
    assert choose("auto") is None  # nothing installed: the system's malloc, silently


def test_preload_re_executes_once_with_the_library(installed, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.setattr(allocator, "in_use", lambda: "system")
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    monkeypatch.delenv("SCALETRAIN_MALLOC", raising=False)
    monkeypatch.delenv("_SCALETRAIN_MALLOC_DONE", raising=False)
    preload(["train", "--train.steps=3"])
    ((exe, argv, env),) = calls
    assert exe == sys.executable and argv == [sys.executable, "-m", "scaletrain", "train", "--train.steps=3"]
    assert env["LD_PRELOAD"] == "/opt/x/libjemalloc.so.2 /other.so" and env["_SCALETRAIN_MALLOC_DONE"] == "1"
    monkeypatch.setenv("_SCALETRAIN_MALLOC_DONE", "1")  # the re-executed process: never again
    preload(["train"])
    monkeypatch.delenv("_SCALETRAIN_MALLOC_DONE")
    monkeypatch.setenv("SCALETRAIN_MALLOC", "system")
    preload(["train"])
    assert len(calls) == 1


def test_bad_setting_is_one_line_exit_2(tmp_path):
    import subprocess

    env = {**os.environ, "SCALETRAIN_MALLOC": "mimalloc"}
    env.pop("_SCALETRAIN_MALLOC_DONE", None)
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "plan", "--help"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("AllocatorError: SCALETRAIN_MALLOC=mimalloc: choose auto")
