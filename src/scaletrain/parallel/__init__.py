"""Parallelism as functions over one DeviceMesh: ``dims`` (degrees -> mesh), one module per technique,
and ``parallelize`` applying them in a fixed order. See docs/parallelism.md."""

from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.parallelize import (ParallelModel, build_parallel_optimizer, clip_grad_norm_,
                                             forward_backward, global_mean, parallelize)

__all__ = ["ParallelDims", "ParallelModel", "parallelize", "build_parallel_optimizer", "clip_grad_norm_",
           "forward_backward", "global_mean"]
