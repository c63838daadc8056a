"""Parallelism as functions over one DeviceMesh: ``dims`` (degrees -> mesh), one module per technique,
and ``parallelize`` applying them in a fixed order. See docs/parallelism.md.

The names below are loaded on first use (``scaletrain/core/lazy.py``): ``scaletrain plan`` and the trainer's entry
check need only ``dims``, and importing ``parallelize`` loads torch's pipelining, DTensor and dynamo."""

from scaletrain.core.lazy import lazy_exports

# ``parallelize`` the function is imported from ``scaletrain.parallel.parallelize``: as a package attribute the
# name is the submodule's once anything imports it.
_WHERE = {"ParallelDims": "dims", "ParallelModel": "parallelize", "clip_grad_norm_": "parallelize",
          "global_mean": "reduce"}
__all__ = list(_WHERE)
__getattr__ = lazy_exports(__name__, _WHERE)
