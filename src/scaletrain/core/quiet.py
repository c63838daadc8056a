"""Known-harmless log lines of optional libraries, dropped one by one (never a whole logger): torchao's
"Failed to load .../_C_mxfp8...so" for kernels built for other GPUs or Pythons, and torch's deprecation
notice when torchao registers an Enum with pytree. Installed once by the command line, before anything
imports torchao; every other warning of those loggers still prints."""

from __future__ import annotations

import logging
import re

# (logger name, pattern of the message) for each line dropped.
KNOWN_NOISE = (
    ("torchao", re.compile(r"^Failed to load .*_C_?[\w.-]*\.so")),
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported by torch\.compile")),
)


class _DropKnown(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_known_noise() -> None:
    """Attach the filters of ``KNOWN_NOISE`` to their loggers (idempotent)."""
    for name, pattern in KNOWN_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) and f.pattern is pattern for f in logger.filters):
            logger.addFilter(_DropKnown(pattern))
