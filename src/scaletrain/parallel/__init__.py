"""Parallelism as functions over one DeviceMesh: ``dims`` (degrees -> mesh), one module per technique,
and ``parallelize`` applying them in a fixed order. See docs/parallelism.md."""

from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.parallelize import ParallelModel, clip_grad_norm_, forward_backward, forward_loss, parallelize
from scaletrain.parallel.reduce import global_mean

__all__ = ["ParallelDims", "ParallelModel", "parallelize", "clip_grad_norm_",
           "forward_backward", "forward_loss", "global_mean"]
