"""``scaletrain`` as a subprocess for fault-injection tests, optionally on a "slow disk".

SLOW_FINALIZE=<seconds> delays the last part of every checkpoint save (hashing, marker, rename) so a test
can hit a save while it is in flight - with an asynchronous save, while training goes on.

PAUSE_IN=<module>:<function> with PAUSE_GO=<path>: the first call of that function writes <path>.ready and waits
until <path> exists, then runs as usual (a command held in the middle of its work, its locks taken, while a test
starts a second one).

    python tests/helpers/fault_train.py train --config tiny.toml ...
"""

from __future__ import annotations

import os
import sys
import time

from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.cli import main

DELAY = float(os.environ.get("SLOW_FINALIZE", "0"))

if DELAY:
    _finalize = CheckpointManager._finalize

    def _slow_finalize(self, *args, **kwargs):
        time.sleep(DELAY)
        return _finalize(self, *args, **kwargs)

    CheckpointManager._finalize = _slow_finalize

if os.environ.get("PAUSE_IN"):
    import importlib
    from pathlib import Path

    module_name, _, function_name = os.environ["PAUSE_IN"].partition(":")
    module, go = importlib.import_module(module_name), Path(os.environ["PAUSE_GO"])
    original = getattr(module, function_name)

    def _paused(*args, **kwargs):
        Path(f"{go}.ready").write_text(str(os.getpid()))
        deadline = time.monotonic() + 600
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return original(*args, **kwargs)

    setattr(module, function_name, _paused)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
