"""Counting the aten ops a piece of model code dispatches (the per-op overhead the time model charges on a CPU).

Apart from ``plan/measure.py`` (which builds whole training steps, and so imports the trainer's parallel stack):
the calibration and the time model need only this, and ``scaletrain plan`` must not pay for DTensor or DCP."""

from __future__ import annotations

from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode


def count_aten_ops(fn: Callable[[], object]) -> int:
    """Number of aten ops ``fn`` dispatches (forward and autograd backward)."""

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n
