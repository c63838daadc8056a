"""Cores shared with another job: notice it, say so, and run on the cores that are free.

On 2 cores shared with another busy job, a default CPU run's 2 torch threads oversubscribe them: an OpenMP
parallel region waits for its slowest thread, and a thread without a core stalls the whole step (issue 36: 4.7 s
a step against the 182 ms estimated; a books run 6.5 s/step with 2 threads, 1.4 s with OMP_NUM_THREADS=1).

The measurement is ``doctor``'s (``peak.CoreContention``: how long this process's threads waited for a core,
and how much of the machine other processes used), taken twice: at the start around a short matmul probe
(~0.2 s, only when there are threads to give up), and around one step when the steps run far beyond the
estimate. The decision is ``choose_threads``, a pure function of those numbers.

Fewer threads are *chosen*, not only suggested, when ``train.threads`` is 0 (auto) and the process did not
inherit an ``OMP_NUM_THREADS``: oversubscription costs several times the step (4.6x above), while giving up a
thread that later frees costs at most the share that thread had; a pinned count (``train.threads=N`` or
``OMP_NUM_THREADS``) is kept and the line suggests the count instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scaletrain.peak import CoreContention, measure_matmul_flops

CONTENDED_WAIT = 0.25  # this process's threads waited for a core more than this share of the time: contended
FAR_BEYOND = 3.0  # a step this many times its estimate makes the trainer look at the load again
PROBE_SECONDS = 0.2  # the start's probe: a small matmul on every torch thread, timed under CoreContention
WARMUP_STEPS = 3  # the first steps allocate, compile and fill caches: not a measure of the machine
_decided = False  # the start's probe ran in this process (ThreadWatch.at_start)


@dataclass(frozen=True)
class Load:
    """One ``CoreContention`` reading: ``waited`` (share of the time this process's threads waited for a core)
    and ``others`` (share of all cores other processes used); None where the kernel does not say."""

    waited: float | None
    others: float | None


@dataclass(frozen=True)
class ThreadChoice:
    """What the trainer does about the load: ``threads`` to run on (== the current count: no change) and
    ``line``, the one line that says why (empty on a quiet machine)."""

    threads: int
    line: str


def cores_available() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose_threads(threads: int, cores: int, load: Load, pinned: bool, why: str = "") -> ThreadChoice:
    """The torch thread count for ``load``: fewer when other processes hold cores this run's threads need.

    ``threads``: the current count; ``cores``: the cores this process may use; ``pinned``: the person set the
    count (``train.threads`` or ``OMP_NUM_THREADS``), then it is only suggested; ``why``: what prompted the
    look (a slow step), for the line."""
    if load.waited is None or load.waited <= CONTENDED_WAIT:
        return ThreadChoice(threads, "")
    others_cores = (load.others or 0.0) * cores
    if load.others is not None:
        free = max(1, round(cores - others_cores))
    else:  # no machine-wide reading: the cores this process did get
        free = max(1, round(threads * (1 - load.waited)))
    seen = (f"other processes use {others_cores:.1f} of {cores} cores" if load.others is not None
            else f"{cores} cores")
    head = (f"{why}the CPU is shared: {seen} and this process's {threads} thread{'s' * (threads > 1)} waited "
            f"{load.waited:.0%} of the time for a core")
    if threads <= free:
        return ThreadChoice(threads, f"{head}; steps run slower than on a quiet machine (fewer threads would not "
                                     f"help: {threads} for {free} free core{'s' * (free > 1)})")
    if pinned:
        return ThreadChoice(threads, f"{head}: {threads} threads oversubscribe them; train.threads={free} would "
                                     f"likely be faster")
    return ThreadChoice(free, f"{head}: running on {free} thread{'s' * (free > 1)} instead of {threads} "
                              f"(oversubscribed threads stall each other; train.threads=N pins the count)")


def threads_pinned(configured: int) -> bool:
    """Whether the person chose the thread count: ``train.threads`` set, or ``OMP_NUM_THREADS`` inherited."""
    return configured > 0 or bool(os.environ.get("OMP_NUM_THREADS"))


def probe_load(seconds: float = PROBE_SECONDS) -> Load:
    """``CoreContention`` around a small matmul on every torch thread: busy threads are what wait for a core."""
    with CoreContention() as contention:
        measure_matmul_flops("cpu", "fp32", n=256, min_seconds=seconds)
    return Load(contention.waited, contention.others)


class ThreadWatch:
    """The trainer's view of core contention on a CPU: ``at_start()`` before the first step, ``after_step()``
    with each step's seconds. Each says at most one line (``say``) and may call ``torch.set_num_threads``."""

    def __init__(self, configured_threads: int, say: Callable[[str], None], cores: int | None = None,
                 probe: Callable[[], Load] = probe_load, contention: Callable[[], CoreContention] = CoreContention):
        """``probe`` (the start's reading) and ``contention`` (the step's) are the real measurements; a test
        passes its own."""
        self.pinned = threads_pinned(configured_threads)
        self.say, self.probe, self.contention = say, probe, contention
        self.cores = cores or cores_available()
        self.expected_seconds: float | None = None  # the step's estimate, set by the trainer once it has one
        self.looked_again = False
        self._measure_next = False
        self._contention: CoreContention | None = None

    def at_start(self) -> None:
        """Probe the load when there are threads to give up (one thread has nothing to choose: the slow-step
        check still says when the machine is busy). Once per process: a later trainer in it (tune's trials, a
        test comparing two runs bitwise) keeps the count the first one chose rather than a new reading's."""
        global _decided
        if _decided:
            return
        _decided = True
        if torch.get_num_threads() > 1:
            self._apply(choose_threads(torch.get_num_threads(), self.cores, self.probe(), self.pinned))

    def before_step(self) -> None:
        """Start the one step's measurement the slow-step check asked for."""
        if self._measure_next:
            self._contention = self.contention().__enter__()

    def after_step(self, seconds: float, step: int) -> None:
        """A step's wall time: far beyond the estimate (after the first steps' warm-up), measure the next step's
        load once; with that measurement, decide."""
        if self._contention is not None:
            self._contention.__exit__(None, None, None)
            load = Load(self._contention.waited, self._contention.others)
            self._contention, self._measure_next = None, False
            why = f"steps take {seconds * 1000:,.0f} ms against {self.expected_seconds * 1000:,.0f} ms estimated: "
            self._apply(choose_threads(torch.get_num_threads(), self.cores, load, self.pinned, why))
            return
        if (not self.looked_again and self.expected_seconds and step > WARMUP_STEPS
                and seconds > FAR_BEYOND * self.expected_seconds):
            self.looked_again = self._measure_next = True

    def _apply(self, choice: ThreadChoice) -> None:
        if choice.line:
            self.say(choice.line)
        if choice.threads != torch.get_num_threads():
            torch.set_num_threads(choice.threads)

