"""allocator.py:keep_freed_memory (applied by train/step.py's build on the CPU): a step's freed activations
stay with malloc instead of being re-faulted."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, resource, sys, torch
from scaletrain.hardware.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory()
faults = []
for _ in range(12):  # a step's pattern: several activation-sized tensors alive at the peak, then all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(2 * 1024 * 1024) for _ in range(8)]  # 8 x 8 MB
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sorted(faults[6:])[3], libc.mallinfo2().fordblks)  # the median of the last six rounds
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or "libc.so.6" not in str(ctypes.util.find_library("c")),
                    reason="glibc only")
def test_freed_step_memory_is_not_page_faulted_again():
    """With the thresholds raised, the 64 MB a round frees stay in malloc's free lists and later rounds take
    their pages from there. glibc's defaults mmap such blocks or trim them off the heap, but adaptively: a
    default process re-faults all 64 MB every round in some runs and almost nothing in others (both seen on
    this machine), so the kept side is what is asserted. Its first rounds after the first settle malloc's free
    lists (0-3.5 of the 8 tensors re-faulted in rounds 2 and 3, none after, in six processes of twelve rounds
    each; a fresh CI venv once re-faulted two tensors' worth on the median of rounds 2-6), so the assertion is
    on the steady state a training run's steps see: the median of rounds 7-12."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()
    applied, faults, free_bytes = out[0], int(out[1]), int(out[2])
    pages = 8 * 8 * 1024 * 1024 // 4096
    assert applied == "True"
    assert free_bytes >= 64 * 1024 * 1024  # the freed round is held by malloc, not returned to the kernel
    assert faults <= pages // 8  # 0 in the kept runs measured; a default run re-faulting: 16,352
