"""How long a test waits for something it started: until the condition holds or the process ends.

Every wait in the suite ends as soon as what it waits for has happened (a step reached, a process exited) or the
process it watches has died (the test then fails with that process's output). The ceiling below only ends a
wait on something that hangs, so it costs nothing on a working machine and can be generous.

It is sized for a machine 5 times slower than the developers' (2 vCPU AMD EPYC, AVX2, quiet): the slowest we have
seen is about that (a fresh AVX2 EPYC under a concurrent job ran the suite in 41:46 against 16:36 quiet, 2.5x;
one training step under a concurrent job took 3-6x its quiet time), and the longest single process a test
waits for takes about 2 minutes here (a 2-rank fine-tune or parallel run, its start-up included). 5 x 120 s =
600 s. A wall-clock wait shorter than the work it covers failed on a loaded machine (issue 36: 120 s for
"step 2" of a run whose whole test took 75 s alone).
"""

from __future__ import annotations

import subprocess

SLOWER_MACHINE = 5  # the slowest machine a test must pass on, as a multiple of the developers' one
LONGEST_PROCESS_HERE_S = 120  # the longest single process a test waits for, on the developers' machine


def ceiling(seconds_here: float) -> float:
    """The most a test waits for something that takes ``seconds_here`` on the developers' machine."""
    return SLOWER_MACHINE * seconds_here


CEILING_S = ceiling(LONGEST_PROCESS_HERE_S)  # 600 s: the hang detector of every process wait


def timed_out_output(error: subprocess.TimeoutExpired) -> str:
    """What a process had written when a wait on it hit the ceiling (``subprocess.run`` keeps it on the error)."""
    parts = []
    for stream in (error.stdout, error.stderr):
        if stream:
            parts.append(stream.decode(errors="replace") if isinstance(stream, bytes) else stream)
    return "\n".join(parts)
