"""The C memory allocator of a run: jemalloc (or tcmalloc) where one is installed, instead of glibc's malloc.

A training step frees and re-allocates the same few hundred activation-sized blocks every step, interleaved
with gradients and optimizer state that live longer, and glibc's heap fragments under that pattern. Measured
side by side (docs/training.md, benchmarks/allocator.py and benchmarks/finetune.py): on jemalloc the default
job's steps are 12% shorter and its peak resident memory 11% lower; a LoRA fine-tune's peak is 25-31% lower
(7.2M-parameter base: 82 against 119 MiB; its live tensors peak at ~59 MiB). PyTorch's own CPU launcher
(``torch.backends.xeon.run_cpu``) preloads tcmalloc or jemalloc for the same reason.

An allocator is chosen when a process starts, so the ``scaletrain`` command (and ``python -m scaletrain``)
re-executes itself once with ``LD_PRELOAD`` set, before anything heavy is imported; the processes it starts
(torchrun's workers, tune's trials) inherit it. ``SCALETRAIN_MALLOC`` says which:

- ``auto`` (default): jemalloc if installed, else tcmalloc, else the system's malloc, silently;
- ``system``: never preload (glibc, tuned by ``keep_freed_memory`` below);
- ``jemalloc`` / ``tcmalloc``: that one, or a one-line error when it is not installed;
- a path to an allocator's shared library.

Library code (``from scaletrain... import``, ``python -m scaletrain.cli``) is never re-executed. Install:
``apt install libjemalloc2`` (Debian/Ubuntu), ``dnf install jemalloc``, ``conda install jemalloc``.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
from pathlib import Path

from scaletrain.core.options import UserError

ENV = "SCALETRAIN_MALLOC"
_DONE = "_SCALETRAIN_MALLOC_DONE"  # set in the re-executed process: never twice
LIBRARIES = {"jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
             "tcmalloc": ("libtcmalloc.so.4", "libtcmalloc_minimal.so.4", "libtcmalloc.so")}


class AllocatorError(UserError):
    """SCALETRAIN_MALLOC names an allocator that is not installed."""


def _search_dirs() -> list[Path]:
    dirs = [Path(sys.prefix) / "lib"]
    if os.environ.get("CONDA_PREFIX"):
        dirs.append(Path(os.environ["CONDA_PREFIX"]) / "lib")
    return dirs + [Path(p) for p in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                                     "/usr/lib", "/usr/local/lib")]


def find(name: str) -> str | None:
    """The path of allocator ``name`` (jemalloc, tcmalloc) where it is installed, else None."""
    for folder in _search_dirs():
        for filename in LIBRARIES[name]:
            if (folder / filename).is_file():
                return str(folder / filename)
    found = ctypes.util.find_library(name)  # the linker cache (ldconfig) knows other places
    return found if found and found in LIBRARIES[name] else None


def choose(setting: str) -> str | None:
    """The library to preload for a ``SCALETRAIN_MALLOC`` value; None: the system's malloc."""
    if setting == "system":
        return None
    if setting == "auto":
        return find("jemalloc") or find("tcmalloc")
    if setting in LIBRARIES:
        path = find(setting)
        if path is None:
            raise AllocatorError(f"{ENV}={setting}: lib{setting} is not installed (apt install "
                                 f"{'libjemalloc2' if setting == 'jemalloc' else 'libgoogle-perftools4'}); "
                                 f"or set {ENV}=auto or system")
        return path
    if Path(setting).is_file():
        return setting
    raise AllocatorError(f"{ENV}={setting}: choose auto, system, jemalloc, tcmalloc or the path of a shared library")


def chosen_name() -> str:
    """The allocator the ``scaletrain`` command runs on here (``SCALETRAIN_MALLOC``, else auto): jemalloc,
    tcmalloc, system, or custom (a library path); system where the setting names a missing one."""
    try:
        library = choose(os.environ.get(ENV, "auto").strip() or "auto")
    except AllocatorError:
        return "system"
    if library is None:
        return "system"
    return next((name for name in LIBRARIES if f"lib{name}" in Path(library).name), "custom")


def torchrun_worker_name() -> str:
    """The allocator a ``torchrun ... -m scaletrain.cli`` worker started from this environment runs on: torchrun
    and its workers are not re-executed (library code never is), so only an allocator this environment already
    preloads (``LD_PRELOAD``, which they inherit) serves them; else the system's malloc."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    return next((name for name in LIBRARIES if f"lib{name}" in preloaded), "system")


def launch_note(ranks: int) -> str:
    """One line for the plan: which malloc a run of ``ranks`` processes on this machine gets, and why."""
    if ranks <= 1:
        name = chosen_name()
        return (f"{name}: what the `scaletrain` command preloads here ({ENV}=auto)" if name != "system" else
                "the system's malloc (glibc): no jemalloc or tcmalloc is installed here (or " + ENV + "=system)")
    name = torchrun_worker_name()
    if name != "system":
        return f"{name}: preloaded in this environment (LD_PRELOAD), which torchrun's workers inherit"
    hint = f"; LD_PRELOAD={find('jemalloc')} torchrun ... puts them on jemalloc" if find("jemalloc") else ""
    return ("the system's malloc (glibc) for `torchrun -m scaletrain.cli` workers: they are not re-executed onto "
            f"jemalloc as the `scaletrain` command is{hint}")


@functools.cache  # fixed for the life of a process (and its forks): read once, not at every data batch
def in_use() -> str:
    """Which allocator this process runs on: jemalloc, tcmalloc or system (from its mapped libraries)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return next((name for name in LIBRARIES if f"lib{name}" in maps), "system")


def preload(argv: list[str]) -> None:
    """Re-execute ``python -m scaletrain argv`` with the chosen allocator preloaded (see the module docstring);
    returns when there is nothing to do. Linux only (other systems have no LD_PRELOAD to set)."""
    if not sys.platform.startswith("linux") or os.environ.get(_DONE) or in_use() != "system":
        return
    library = choose(os.environ.get(ENV, "auto").strip() or "auto")
    if library is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env[_DONE] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "scaletrain", *argv], env)


_ARENAS_ALL = 4096  # jemalloc's MALLCTL_ARENAS_ALL: "arena.4096.*" addresses every arena


def _process_symbol(name: str):
    """``name`` from the libraries this process has loaded (a preloaded allocator's exports), else None."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def _jemalloc_ctl(name: str, value: int | None = None) -> bool:
    """jemalloc's ``mallctl(name, NULL, NULL, newp, newlen)``: a command (``value`` None) or an ssize_t setting."""
    mallctl = _process_symbol("mallctl")
    if mallctl is None:
        return False
    if value is None:
        return mallctl(name.encode(), None, None, None, ctypes.c_size_t(0)) == 0
    new = ctypes.c_ssize_t(value)
    return mallctl(name.encode(), None, None, ctypes.byref(new), ctypes.c_size_t(ctypes.sizeof(new))) == 0


def _jemalloc_arenas() -> int:
    """jemalloc's ``arenas.narenas``: how many arenas exist (0 where it cannot be read)."""
    mallctl = _process_symbol("mallctl")
    count, size = ctypes.c_uint(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))
    if mallctl is None or mallctl(b"arenas.narenas", ctypes.byref(count), ctypes.byref(size), None, 0) != 0:
        return 0
    return count.value


def release_free_memory() -> bool:
    """Hand the memory this process's allocator holds free back to the kernel, now: glibc's ``malloc_trim``,
    jemalloc's purge of every arena, tcmalloc's ``ReleaseFreeMemory`` (each about a millisecond). For code that
    bounds its resident memory between batches (``scaletrain prepare``'s workers). False where it cannot."""
    kind = in_use()
    if kind == "jemalloc":
        return _jemalloc_ctl(f"arena.{_ARENAS_ALL}.purge")
    if kind == "tcmalloc":
        release = _process_symbol("MallocExtension_ReleaseFreeMemory")
        if release is not None:
            release()
        return release is not None
    trim = _process_symbol("malloc_trim")  # glibc only
    return bool(trim is not None and (trim(0) or True))


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest on 64-bit (DEFAULTGLIBC_MMAP_THRESHOLD_MAX)


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory a training step frees for the next step, instead of handing it back
    to the kernel and page-faulting it in again (zeroed) on the next step.

    By default glibc serves blocks above a dynamic threshold with a fresh ``mmap`` and trims the heap top when
    more than twice that threshold is free; a step's activations and logits (megabytes each, freed at every
    backward) cross both, so each step re-faulted ~20 MB (about 5,000 page faults, ~9 ms of a 360 ms step of a
    4M-parameter model on one thread, measured in docs/compression.md) while a slightly smaller model did not.
    Raising both thresholds (mmap: glibc's 32 MB maximum; trim: 1 GiB) keeps them. Process-wide and idempotent;
    a no-op (False) where the C library is not glibc, or where jemalloc / tcmalloc serves malloc (the
    ``scaletrain`` command preloads one where installed; glibc also fragments its heap under a training step,
    and always mmaps blocks over 32 MB). Called by ``train/step.py: build_parallel_training`` on the CPU."""
    mallopt = _process_symbol("mallopt") if in_use() == "system" else None
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
                and mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def return_freed_memory_promptly() -> bool:
    """From now on, give freed blocks back to the kernel when they are freed rather than keeping them for reuse:
    for a process under a tight memory limit (DeepSpeed's ZeRO-3 offload builds a model module by module). glibc:
    blocks over 1 MB get their own mappings (``M_MMAP_THRESHOLD``); jemalloc: no delay before purging dirty
    pages, in every arena and in arenas made later. False where it cannot (tcmalloc, another libc)."""
    kind = in_use()
    if kind == "jemalloc":  # the default for arenas made later, then each existing arena's own setting
        done = all([_jemalloc_ctl(f"arenas.{pages}_decay_ms", 0) for pages in ("dirty", "muzzy")])
        for i in range(_jemalloc_arenas()):  # slots not yet in use refuse the setting; they take the default
            for pages in ("dirty", "muzzy"):
                _jemalloc_ctl(f"arena.{i}.{pages}_decay_ms", 0)
        return done
    if kind == "tcmalloc":
        return False
    mallopt = _process_symbol("mallopt")
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, 1 << 20))  # 1 MB
