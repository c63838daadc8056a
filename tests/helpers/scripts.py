"""Import a benchmark script (``benchmarks/NAME.py``) as a module, with its folder on ``sys.path`` while it loads,
as when it runs (the benchmarks import their shared ``launch`` module by name)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_benchmark(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
