"""A tune worker process: ``python -m scaletrain.tune.worker FOLDER INDEX TOTAL SETTINGS_JSON``.

Started by ``scaletrain tune --parallel K`` (``study.start_workers``); runs trials of the folder's study until
it holds TOTAL finished ones. Not meant to be started by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scaletrain.tune.study import run_worker


def main(argv: list[str]) -> int:
    folder, index, total, settings = argv
    run_worker(Path(folder), int(index), int(total), json.loads(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
