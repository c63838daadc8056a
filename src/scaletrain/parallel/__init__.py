"""Parallelism as functions over one DeviceMesh: ``dims`` (degrees -> mesh), one module per technique,
and ``parallelize`` applying them in a fixed order. See docs/parallelism.md.

The names below are loaded on first use (PEP 562), not when the package is imported: ``scaletrain plan`` and the
trainer's entry check need only ``dims``, and importing ``parallelize`` loads torch's pipelining, DTensor and
dynamo (about a second of every such command)."""

from __future__ import annotations

import importlib

# ``parallelize`` the function is imported from ``scaletrain.parallel.parallelize``: as a package attribute the
# name is the submodule's once anything imports it.
_WHERE = {"ParallelDims": "dims", "ParallelModel": "parallelize", "clip_grad_norm_": "parallelize",
          "forward_backward": "parallelize", "forward_loss": "parallelize", "global_mean": "reduce"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # found directly from now on
    return value
