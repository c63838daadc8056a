"""The ``scaletrain`` command this process runs, as ``cli.main`` received it (for run_info.json).

A module of its own, with no imports beyond the standard library, so that ``cli.main`` can record it for every
command without loading torch; a call from Python (``main(["train", ...])``) has a sys.argv of its own program
(pytest's, a notebook kernel's), which is why the arguments are recorded rather than read back from sys.argv."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

_COMMAND: list[str] | None = None


def record_invocation(argv: list[str]) -> None:
    """Remember the ``scaletrain`` arguments this process runs (``cli.main`` calls it)."""
    global _COMMAND
    _COMMAND = list(argv)


def invocation() -> str:
    """'scaletrain train --config ...' as run: the arguments ``cli.main`` got, else this process's own."""
    if _COMMAND is not None:
        return shlex.join(["scaletrain", *_COMMAND])
    program = Path(sys.argv[0]).name
    if program in ("__main__.py", "cli.py"):  # python -m scaletrain / torchrun -m scaletrain.cli
        program = "scaletrain"
    return shlex.join([program, *sys.argv[1:]])
