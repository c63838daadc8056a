"""Any run folder read back, whatever wrote it: ``checkpoint/run.py:load_run`` with every kind of run registered.

``checkpoint/`` sits below the packages that write the other kinds of run (fine-tuned: ``finetune/``; pruned and
quantized: ``compress/``), so each registers its kind's loader where it lives (``checkpoint.run.register_loader``,
at import). This module imports those registrations once, for every command that reads a run (eval, export,
generate, chat, serve, ``eval --tasks``), so none of them imports a feature package to read one. ``compress``
reads runs through ``checkpoint.run.load_run`` itself, with its own kinds and finetune's registered (it sits below
this package: importing it would close a circle, compress -> infer -> compress)."""

from __future__ import annotations

import scaletrain.compress.run  # noqa: F401  registers the "pruned" and "quantized" kinds
import scaletrain.finetune.run  # noqa: F401  registers the "finetuned" kind
from scaletrain.checkpoint.run import load_run

__all__ = ["load_run"]
