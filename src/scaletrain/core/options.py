"""What every layer's config builds on: ``UserError`` / ``ConfigError`` and the documented field ``opt``.

They live at the bottom of the package so that the model's own config (``model/config.py``) and the
job's config tree (``config.py``) share them without the model importing anything above it.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


class UserError(Exception):
    """A problem a person can fix (config, data, checkpoint, storage, a diverged run): the CLI prints it as one
    line and exits with code 2. Each layer's error subclasses it, so the CLI catches them all without importing
    the layers (which would cost every command, ``--help`` included, the import of torch.distributed)."""


class ConfigError(UserError, ValueError):
    """A config problem a person can fix; the CLI prints it as one line and exits with code 2."""


def opt(default: Any, help: str, *, choices: tuple | None = None, ge: float | None = None,
        gt: float | None = None, le: float | None = None, lt: float | None = None) -> Any:
    """A documented config field. ``help`` is shown by ``--help`` and written by ``--print-config``."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
