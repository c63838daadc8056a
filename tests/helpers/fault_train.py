"""``scaletrain`` as a subprocess for fault-injection tests, optionally on a "slow disk".

SLOW_FINALIZE=<seconds> delays the last part of every checkpoint save (hashing, marker, rename) so a test
can hit a save while it is in flight - with an asynchronous save, while training goes on.

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

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
