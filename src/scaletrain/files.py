"""Small file helpers shared by data, checkpoints and export (the bottom layer: no scaletrain imports)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte blocks (constant memory for any size)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
