"""Cores shared with another job: notice it, say so, run on the cores that are free, and take them back.

On 2 cores shared with another busy job, a default CPU run's 2 torch threads oversubscribe them: an OpenMP
parallel region waits for its slowest thread, and a thread without a core stalls the whole step (issue 36: 4.7 s
a step against the 182 ms estimated; a books run 6.5 s/step with 2 threads, 1.4 s with OMP_NUM_THREADS=1).

The measurement is ``doctor``'s (``peak.CoreContention``: how long this process's threads waited for a core,
and how much of the machine other processes used), taken at the start around a short matmul probe (~0.2 s,
only when there are threads to give up), around one step when the steps run far beyond the estimate, and, while
the run has given threads up, over back-to-back spans of about LOOK_SECONDS of steps (/proc read at a span's
ends, under 1 ms: no work added to the steps). The decisions are ``ThreadPolicy``'s, a pure object: readings
in, counts out.

Fewer threads are *chosen*, not only suggested, when ``train.threads`` is 0 (auto) and the process did not
inherit an ``OMP_NUM_THREADS``: oversubscription costs several times the step (4.6x above). A load that passes
(a browser's minute) must not cost the rest of the run (issue 49: ~1,300 steps at 256 ms on one thread against
170 ms on two after a 60-s spike), so the count returns once the cores have been free for QUIET_SECONDS, and a
return that turns out slower goes back. A pinned count (``train.threads=N`` or ``OMP_NUM_THREADS``) is never
changed: the line suggests the count instead.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from scaletrain.hardware.peak import CoreContention, measure_matmul_flops

CONTENDED_WAIT = 0.25  # this process's threads waited for a core more than this share of the time: contended
FAR_BEYOND = 3.0  # a step this many times its estimate makes the trainer look at the load again
PROBE_SECONDS = 0.2  # the start's probe: a small matmul on every torch thread, timed under CoreContention
WARMUP_STEPS = 3  # the first steps allocate, compile and fill caches: not a measure of the machine
LOOK_SECONDS = 5.0  # on fewer threads than before: one reading spans about this many seconds of steps
QUIET_SECONDS = 15.0  # the cores free for this long (readings in a row) before the threads return
MAX_QUIET_SECONDS = 240.0  # the longest wait after returns that failed (it doubles each time; then no more)
TRIAL_STEPS = 5  # steps timed after a return: their median against the fewer threads' decides whether it stays
_decided = False  # the start's probe ran in this process (ThreadWatch.at_start)
_given_up_from: int | None = None  # the count before this process's threads were given up (a later trainer's)


@dataclass(frozen=True)
class Load:
    """One ``CoreContention`` reading: ``waited`` (share of the time this process's threads waited for a core)
    and ``others`` (share of all cores other processes used); None where the kernel does not say."""

    waited: float | None
    others: float | None


@dataclass(frozen=True)
class ThreadChoice:
    """What the trainer does about the load: ``threads`` to run on (== the current count: no change), ``line``,
    the one line that says why (empty when nothing is worth saying), and ``read_steps``: measure the load over
    the next this many steps and hand the reading in after the last of them (0: no reading wanted)."""

    threads: int
    line: str
    read_steps: int = 0


def cores_available() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_cores(threads: int, cores: int, load: Load) -> int:
    """The cores other processes leave this run (at least 1): from their machine-wide share, or without one
    (no /proc/stat) the share of the time this process's ``threads`` did run."""
    if load.others is not None:
        return max(1, round(cores - load.others * cores))
    return max(1, round(threads * (1 - (load.waited or 0.0))))


def choose_threads(threads: int, cores: int, load: Load, pinned: bool, why: str = "") -> ThreadChoice:
    """The torch thread count for ``load``: fewer when other processes hold cores this run's threads need.

    ``threads``: the current count; ``cores``: the cores this process may use; ``pinned``: the person set the
    count (``train.threads`` or ``OMP_NUM_THREADS``), then it is only suggested; ``why``: what prompted the
    look (a slow step), for the line."""
    if load.waited is None or load.waited <= CONTENDED_WAIT:
        return ThreadChoice(threads, "")
    others_cores = (load.others or 0.0) * cores
    free = free_cores(threads, cores, load)
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
    return ThreadChoice(free, f"{head}: running on {free} thread{'s' * (free > 1)} instead of {threads} until "
                              f"the cores free again (oversubscribed threads stall each other; train.threads=N "
                              f"pins the count)")


class ThreadPolicy:
    """The torch thread count, following the load both ways: readings in, decisions out (no clock, no torch,
    no /proc: its time is the sum of the step seconds it is given).

    At the full count (``baseline``), a step far beyond the estimate asks for one step's reading, once until a
    return re-arms it; contended, the count drops to the free cores (``choose_threads``). On fewer threads,
    readings follow each other, about LOOK_SECONDS of steps each: ``quiet_seconds`` of readings in a row that
    leave the baseline's cores free return the count to the baseline, and the next TRIAL_STEPS steps decide
    whether it stays (their median under the fewer threads' median in the quiet: else back, and the next
    return waits twice as long). A load back within as long as the quiet had lasted (a lull, not its end)
    doubles the wait too: a load that comes and goes makes the count settle, not flap. ``pinned``: never
    changed (a drop's line suggests the count)."""

    def __init__(self, threads: int, cores: int, pinned: bool, given_up_from: int | None = None):
        """``threads``: the count now; ``given_up_from``: the count before an earlier trainer in this process
        gave threads up (this one may take them back)."""
        self.threads, self.cores, self.pinned = threads, cores, pinned
        self.baseline = threads if pinned else max(threads, given_up_from or 0)
        self.expected_seconds: float | None = None  # the step's estimate, set by the trainer once it has one
        self.quiet_seconds = QUIET_SECONDS
        self._looked = False  # at the baseline: the slow-step check asked for its reading
        self._awaiting = False  # a reading was asked for and has not come in
        self._clock = 0.0  # the seconds of the steps seen so far
        self._window: list[float] = []  # the step seconds the pending reading spans
        self._quiet: list[float] = []  # the step seconds under this run of quiet readings
        self._quiet_others = 0.0  # the most of the cores other processes used in those readings
        self._trial: list[float] | None = None  # the step seconds since a return, while it is on trial
        self._returned: tuple[float, float, int] | None = None  # (clock at the return, quiet seconds, from)
        self._reference = 0.0  # the fewer threads' median step in the quiet before a return

    def start(self, load: Load) -> ThreadChoice:
        """The start's probe ``load``: the count to begin with."""
        return self._drop(choose_threads(self.threads, self.cores, load, self.pinned), 0.0)

    def step(self, seconds: float, step: int, load: Load | None = None) -> ThreadChoice:
        """A step's wall ``seconds`` (``step``: its number) and, when it ended a reading asked for, its ``load``."""
        self._clock += seconds
        if load is not None:
            self._awaiting = False
        if self._trial is not None:
            return self._judge_return(seconds)
        if self.threads < self.baseline:
            return self._on_fewer(seconds, load)
        if load is not None:
            why = f"steps take {seconds * 1000:,.0f} ms against {self.expected_seconds * 1000:,.0f} ms estimated: "
            return self._drop(choose_threads(self.threads, self.cores, load, self.pinned, why), seconds)
        if (not self._looked and not self._awaiting and self.expected_seconds and step > WARMUP_STEPS
                and seconds > FAR_BEYOND * self.expected_seconds):
            self._looked = True
            return ThreadChoice(self.threads, "", self._read(1))
        return ThreadChoice(self.threads, "")

    def _drop(self, choice: ThreadChoice, seconds: float) -> ThreadChoice:
        """``choice`` taken; fewer threads start the readings that look for the cores to free."""
        if choice.threads >= self.threads:
            return choice
        if self._returned is not None and self._clock - self._returned[0] <= self._returned[1]:
            self._back_off()  # the quiet that returned the threads was a lull
        self._returned, self.threads = None, choice.threads
        self._window, self._quiet, self._quiet_others = [], [], 0.0
        return replace(choice, read_steps=self._read(self._span([seconds])))

    def _on_fewer(self, seconds: float, load: Load | None) -> ThreadChoice:
        """On fewer threads than the baseline: a reading in, judged; the next asked for."""
        self._window.append(seconds)
        if load is None:
            return ThreadChoice(self.threads, "", 0 if self._awaiting else self._read(self._span(self._window)))
        window, self._window = self._window, []
        if self._leaves_baseline_free(load):
            self._quiet += window
            self._quiet_others = max(self._quiet_others, (load.others or 0.0) * self.cores)
            if sum(self._quiet) >= self.quiet_seconds:
                return self._return()
        else:
            self._quiet, self._quiet_others = [], 0.0
            choice = choose_threads(self.threads, self.cores, load, self.pinned)
            if choice.threads < self.threads:  # the load grew (a big machine): fewer still
                return self._drop(choice, seconds)
        return ThreadChoice(self.threads, "", self._read(self._span(window)))

    def _leaves_baseline_free(self, load: Load) -> bool:
        """Whether ``load`` (read on fewer threads) leaves the baseline's threads their cores: without the
        machine-wide share a free core cannot be told from a busy one, so never."""
        return (load.others is not None and (load.waited or 0.0) <= CONTENDED_WAIT
                and free_cores(self.threads, self.cores, load) >= self.baseline)

    def _return(self) -> ThreadChoice:
        quiet = sum(self._quiet)
        self._reference = statistics.median(self._quiet)
        self._returned, fewer = (self._clock, quiet, self.threads), self.threads
        self.threads, self._trial, self._quiet = self.baseline, [], []
        return ThreadChoice(self.threads, f"the cores are free again (other processes used at most "
                                          f"{self._quiet_others:.1f} of {self.cores} for {quiet:.0f} s): back on "
                                          f"{self.threads} threads from {fewer} ({self._reference * 1000:,.0f} ms a "
                                          f"step on {fewer})")

    def _judge_return(self, seconds: float) -> ThreadChoice:
        """The steps after a return: faster than the fewer threads were, it stays (and the slow-step check is
        armed again for the next load); else back to the fewer, and the next return waits twice as long (after
        MAX_QUIET_SECONDS, none: a run that 5 returns found slower keeps its fewer threads)."""
        self._trial.append(seconds)
        if len(self._trial) < TRIAL_STEPS:
            return ThreadChoice(self.threads, "")
        trial, self._trial = statistics.median(self._trial), None
        if trial < self._reference:
            self._looked = False
            return ThreadChoice(self.threads, "")
        fewer, waited_longest = self._returned[2], self.quiet_seconds >= MAX_QUIET_SECONDS
        self._back_off()
        self._returned, self.threads = None, fewer
        self._window, self._quiet_others = [], 0.0
        head = (f"{self.baseline} threads were slower than {fewer} ({trial * 1000:,.0f} ms a step against "
                f"{self._reference * 1000:,.0f} ms): back on {fewer} thread{'s' * (fewer > 1)}")
        if waited_longest:  # slower after the longest wait too: the fewer threads are this machine's count now
            self.quiet_seconds = math.inf
            return ThreadChoice(fewer, f"{head} for the rest of the run", self._read(self._span([seconds])))
        return ThreadChoice(fewer, f"{head}; the next return waits for {self.quiet_seconds:.0f} s of free cores",
                            self._read(self._span([seconds])))

    def _back_off(self) -> None:
        self.quiet_seconds = min(2 * self.quiet_seconds, MAX_QUIET_SECONDS)

    def _read(self, steps: int) -> int:
        """Ask for a reading over the next ``steps`` steps."""
        self._awaiting = True
        return steps

    @staticmethod
    def _span(step_seconds: list[float]) -> int:
        """Steps in a reading of about LOOK_SECONDS, from the steps' median (1 without a measure)."""
        median = statistics.median(step_seconds) if step_seconds else 0.0
        return max(1, round(LOOK_SECONDS / median)) if median > 0 else 1


def threads_pinned(configured: int) -> bool:
    """Whether the person chose the thread count: ``train.threads`` set, or ``OMP_NUM_THREADS`` inherited."""
    return configured > 0 or bool(os.environ.get("OMP_NUM_THREADS"))


def probe_load(seconds: float = PROBE_SECONDS) -> Load:
    """``CoreContention`` around a small matmul on every torch thread: busy threads are what wait for a core."""
    with CoreContention() as contention:
        measure_matmul_flops("cpu", "fp32", n=256, min_seconds=seconds)
    return Load(contention.waited, contention.others)


class ThreadWatch:
    """The trainer's view of core contention on a CPU: ``at_start()`` before the first step, ``before_step()``
    and ``after_step()`` around each step. It takes the readings ``ThreadPolicy`` asks for, says its lines
    (``say``) and applies its counts with ``torch.set_num_threads``."""

    def __init__(self, configured_threads: int, say: Callable[[str], None], cores: int | None = None,
                 probe: Callable[[], Load] = probe_load, contention: Callable[[], CoreContention] = CoreContention):
        """``probe`` (the start's reading) and ``contention`` (the steps') are the real measurements; a test
        passes its own."""
        self.policy = ThreadPolicy(torch.get_num_threads(), cores or cores_available(),
                                   threads_pinned(configured_threads), _given_up_from)
        self.say, self.probe, self.contention = say, probe, contention
        self._read_left = 0  # steps left in the reading the policy asked for
        self._contention: CoreContention | None = None

    @property
    def expected_seconds(self) -> float | None:
        """The step's estimate (the slow-step check's yardstick), set by the trainer once it has one."""
        return self.policy.expected_seconds

    @expected_seconds.setter
    def expected_seconds(self, seconds: float | None) -> None:
        self.policy.expected_seconds = seconds

    def at_start(self) -> None:
        """Probe the load when there are threads to give up (one thread has nothing to choose: the slow-step
        check still says when the machine is busy). Once per process: a later trainer in it (tune's trials, a
        test comparing two runs bitwise) keeps the count the first one chose rather than a new reading's."""
        global _decided
        if _decided:
            return
        _decided = True
        if torch.get_num_threads() > 1:
            self._apply(self.policy.start(self.probe()))

    def before_step(self) -> None:
        """Start the reading the policy asked for (it spans this step and the next ``read_steps - 1``)."""
        if self._read_left and self._contention is None:
            self._contention = self.contention().__enter__()

    def after_step(self, seconds: float, step: int) -> None:
        """A step's wall time, with the reading it ends (if any), to the policy; its decision applied."""
        load = None
        if self._contention is not None:
            self._read_left -= 1
            if self._read_left == 0:
                self._contention.__exit__(None, None, None)
                load = Load(self._contention.waited, self._contention.others)
                self._contention = None
        self._apply(self.policy.step(seconds, step, load))

    def _apply(self, choice: ThreadChoice) -> None:
        global _given_up_from
        if choice.line:
            self.say(choice.line)
        if choice.read_steps:
            self._read_left = choice.read_steps
        if choice.threads != torch.get_num_threads():
            torch.set_num_threads(choice.threads)
        policy = self.policy
        _given_up_from = policy.baseline if policy.threads < policy.baseline else None
