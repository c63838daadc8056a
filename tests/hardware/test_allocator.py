"""The allocator choice of the ``scaletrain`` command (allocator.py): what each SCALETRAIN_MALLOC value preloads,
the one-line errors, and that the command re-executes itself once at most. The real preload is checked end to
end by tests/train/test_launch.py's reference run (its run_info.json names the allocator it ran on)."""

import os
import sys

import pytest

from helpers.waits import CEILING_S
from scaletrain.hardware import allocator
from scaletrain.hardware.allocator import AllocatorError, choose, preload


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
                          text=True, timeout=CEILING_S)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("AllocatorError: SCALETRAIN_MALLOC=mimalloc: choose auto")


RELEASE = """
import json
from pathlib import Path
import torch
from scaletrain.hardware.allocator import in_use, release_free_memory, return_freed_memory_promptly
rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20
promptly = return_freed_memory_promptly()
keep = [torch.ones(512 * 1024) for _ in range(100)]  # 200 MB in 2 MB blocks
grown = rss()
del keep
after_free = rss()
keep = [torch.ones(64 * 1024) for _ in range(800)]  # 200 MB in 256 KB blocks (glibc: from its heap)
peak = rss()
del keep
released = release_free_memory()
print(json.dumps({"allocator": in_use(), "released": released, "peak": peak, "after_release": rss(),
                  "promptly": promptly, "grown": grown, "after_free": after_free}))
"""


@pytest.mark.parametrize("name", ["system", "jemalloc"])
def test_freed_memory_goes_back_to_the_kernel_on_each_allocator(name):
    """release_free_memory hands 200 MB of freed blocks back at once, and after return_freed_memory_promptly
    a free does it by itself: on glibc (which keeps freed heap blocks) and, where installed, on jemalloc (which
    keeps freed pages up to ~10 s, longer than scaletrain prepare's batches or DeepSpeed's module-by-module
    build)."""
    import json
    import subprocess

    library = allocator.find(name) if name != "system" else None
    if name != "system" and library is None:
        pytest.skip(f"{name} is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if library:
        env["LD_PRELOAD"] = library
    proc = subprocess.run([sys.executable, "-c", RELEASE], env=env, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["allocator"] == name and r["released"] and r["promptly"], r
    assert r["after_release"] < r["peak"] - 150 and r["after_free"] < r["grown"] - 150, r
