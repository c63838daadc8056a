"""Package exports loaded on first use (PEP 562): a package's ``__init__`` names what it offers and from
which submodule, and the submodule is imported only when one of those names is asked for. ``scaletrain plan``
and the trainer's entry check import single submodules of ``parallel/`` and ``finetune/``; eager re-exports made
every such import load torch's pipelining, DTensor and DCP too (about a second of every command)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: ``where`` maps each exported name to the submodule that
    defines it. A name is looked up once; it is then set on the package, so later lookups find it directly."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
