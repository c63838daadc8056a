"""Cores shared with another job (train/contention.py): the trainer measures the load with ``doctor``'s
``CoreContention``, says so in one line, runs on fewer threads when its threads would oversubscribe the
free cores (or suggests it, when the count is pinned), and takes them back once the cores are free again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.faults import write_config
from helpers.waits import CEILING_S
from scaletrain.train import contention as contention_module
from scaletrain.train.contention import (
    FAR_BEYOND,
    QUIET_SECONDS,
    TRIAL_STEPS,
    WARMUP_STEPS,
    Load,
    ThreadPolicy,
    ThreadWatch,
    choose_threads,
)


# -- the decision, from injected measurements ------------------------------------------------------------------
def test_a_quiet_machine_changes_nothing_and_says_nothing():
    choice = choose_threads(2, 2, Load(waited=0.03, others=0.1), pinned=False)
    assert (choice.threads, choice.line) == (2, "")
    assert choose_threads(2, 2, Load(None, None), pinned=False).line == ""  # no reading: nothing claimed


def test_another_job_on_one_of_two_cores_takes_one_thread_away():
    # The case: 2 threads, another job busy on one of the 2 cores.
    choice = choose_threads(2, 2, Load(waited=0.5, others=0.5), pinned=False)
    assert choice.threads == 1
    assert "other processes use 1.0 of 2 cores" in choice.line and "waited 50%" in choice.line
    assert "running on 1 thread instead of 2" in choice.line and "train.threads" in choice.line


def test_a_pinned_count_is_kept_and_the_faster_one_suggested():
    choice = choose_threads(2, 2, Load(waited=0.5, others=0.5), pinned=True)
    assert choice.threads == 2 and "train.threads=1 would likely be faster" in choice.line


def test_the_free_cores_set_the_count_on_a_big_machine():
    assert choose_threads(16, 16, Load(waited=0.4, others=0.25), pinned=False).threads == 12
    assert choose_threads(16, 16, Load(waited=0.4, others=1.0), pinned=False).threads == 1  # never 0
    # No machine-wide reading (no /proc/stat): the share of the time the threads did run.
    assert choose_threads(4, 4, Load(waited=0.5, others=None), pinned=False).threads == 2


def test_one_thread_has_nothing_to_give_up_but_the_slowness_is_said():
    choice = choose_threads(1, 2, Load(waited=0.6, others=0.9), pinned=False)
    assert choice.threads == 1 and "slower than on a quiet machine" in choice.line


def test_threads_pinned_by_config_or_environment(monkeypatch):
    from scaletrain.train.contention import threads_pinned

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert not threads_pinned(0) and threads_pinned(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads_pinned(0)


class _Reading:
    """A CoreContention stand-in with a fixed reading."""

    def __init__(self, waited: float, others: float):
        self.waited, self.others = waited, others

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_a_slow_step_looks_at_the_load_acts_and_takes_the_thread_back(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    lines: list[str] = []
    readings = []
    machine = {"reading": _Reading(waited=0.5, others=0.5)}  # another job on one of the 2 cores

    def contention():
        readings.append(1)
        return machine["reading"]

    monkeypatch.setattr(contention_module, "_decided", False)  # this process's first trainer
    monkeypatch.setattr(contention_module, "_given_up_from", None)
    try:
        watch = ThreadWatch(0, lines.append, cores=2, probe=lambda: Load(0.0, 0.0), contention=contention)
        watch.at_start()
        assert lines == [] and torch.get_num_threads() == 2  # quiet at the start
        watch.expected_seconds = 0.1
        for step in range(1, WARMUP_STEPS + 1):  # warm-up steps may be slow: not a reading of the machine
            watch.before_step()
            watch.after_step(10.0, step)
        assert readings == []
        watch.before_step()
        watch.after_step(FAR_BEYOND * 0.1 * 0.9, WARMUP_STEPS + 1)  # not far beyond: nothing
        assert readings == []
        watch.before_step()
        watch.after_step(4.7, WARMUP_STEPS + 2)  # far beyond: the next step is measured
        watch.before_step()
        watch.after_step(4.7, WARMUP_STEPS + 3)
        assert readings == [1] and torch.get_num_threads() == 1
        (line,) = lines
        assert line.startswith("steps take 4,700 ms against 100 ms estimated: the CPU is shared")
        step = WARMUP_STEPS + 4
        for step in range(step, step + 16):  # on one thread the load is read on (each 4.7-s step), said once
            watch.before_step()
            watch.after_step(4.7, step)
        assert len(readings) == 1 + 16 and len(lines) == 1 and torch.get_num_threads() == 1
        # A later trainer in this process keeps the count (no second start probe), and may take it back.
        later = ThreadWatch(0, lines.append, cores=2, probe=lambda: pytest.fail("probed twice"))
        later.at_start()
        assert torch.get_num_threads() == 1 and later.policy.baseline == 2
        # The other job ends: after QUIET_SECONDS of free cores the 2 threads are back, and they stay, faster.
        machine["reading"] = _Reading(waited=0.01, others=0.02)
        while torch.get_num_threads() == 1 and step < 200:
            step += 1
            watch.before_step()
            watch.after_step(0.256, step)
        assert torch.get_num_threads() == 2 and step * 0.256 < 200
        assert lines[-1].startswith("the cores are free again (other processes used at most 0.0 of 2 for 1")
        assert lines[-1].endswith("s): back on 2 threads from 1 (256 ms a step on 1)")
        for step in range(step + 1, step + 3 * TRIAL_STEPS):
            watch.before_step()
            watch.after_step(0.17, step)
        assert torch.get_num_threads() == 2 and len(lines) == 2 and contention_module._given_up_from is None
    finally:
        torch.set_num_threads(before)


# -- the policy over a run, from injected readings: both ways, pinned, no flapping, a failed return ------------
QUIET, BUSY_1, BUSY_2 = Load(0.02, 0.02), Load(0.33, 0.67), Load(0.5, 0.5)  # BUSY_n: on n threads, 2 busy others


def users_machine(start: float = 20.0, seconds: float = 60.0, two_threads_slower: bool = False):
    """Issue 49's 2-vCPU machine: a step 170 ms on 2 threads and 256 ms on 1 when quiet; two busy processes from
    ``start`` for ``seconds``: 743 ms on 2 threads (oversubscribed), 384 ms on 1 (2/3 of a core).
    ``two_threads_slower``: something the readings do not show makes 2 threads 500 ms a step."""

    def machine(clock: float, threads: int) -> tuple[float, Load]:
        if start <= clock < start + seconds:
            return (0.743, BUSY_2) if threads == 2 else (0.384, BUSY_1)
        return (0.5 if two_threads_slower else 0.17, QUIET) if threads == 2 else (0.256, QUIET)

    return machine


def drive(policy: ThreadPolicy, machine, steps: int, start: Load | None = None):
    """Run ``policy`` as ThreadWatch does, on ``machine(clock, threads) -> (step seconds, load meanwhile)``: a
    reading over N steps is their loads' time-weighted mean. Returns (wall seconds, [(clock, line)], counts)."""
    lines, counts, clock, read_left, span = [], [], 0.0, 0, []
    choice = policy.start(start) if start is not None else None
    if choice is not None:
        read_left = choice.read_steps
        lines += [(0.0, choice.line)] if choice.line else []
    for step in range(1, steps + 1):
        seconds, load = machine(clock, policy.threads)
        clock += seconds
        reading = None
        if read_left:
            span.append((seconds, load))
            read_left -= 1
            if not read_left:
                total = sum(s for s, _ in span)
                reading = Load(*(sum(s * getattr(x, f) for s, x in span) / total for f in ("waited", "others")))
                span = []
        choice = policy.step(seconds, step, reading)
        assert choice.threads == policy.threads
        lines += [(clock, choice.line)] if choice.line else []
        read_left = choice.read_steps or read_left
        counts.append(choice.threads)
    return clock, lines, counts


def changes(counts: list[int]) -> int:
    return sum(a != b for a, b in zip(counts, counts[1:], strict=False))


def auto_policy(pinned: bool = False) -> ThreadPolicy:
    policy = ThreadPolicy(2, 2, pinned)
    policy.expected_seconds = 0.205  # the estimate
    return policy


def test_a_minute_of_load_drops_a_thread_and_its_end_gives_it_back():
    quiet_wall, quiet_lines, quiet_counts = drive(auto_policy(), users_machine(seconds=0), 1500)
    assert quiet_lines == [] and set(quiet_counts) == {2}
    wall, lines, counts = drive(auto_policy(), users_machine(), 1500)
    (dropped_at, drop), (returned_at, back) = lines
    assert 20 < dropped_at < 22 and "running on 1 thread instead of 2" in drop
    assert drop.startswith("steps take 743 ms against 205 ms estimated: the CPU is shared")
    assert 80 + QUIET_SECONDS <= returned_at < 80 + QUIET_SECONDS + 6  # within a reading of the quiet's end
    assert back.startswith("the cores are free again") and "back on 2 threads from 1 (256 ms a step on 1)" in back
    assert changes(counts) == 2 and counts[-1] == 2
    assert wall <= 1.1 * quiet_wall + 60  # issue 49's target (before, on one thread to the end: 1.31x + 60 s)


def test_a_pinned_count_never_changes():
    wall, lines, counts = drive(auto_policy(pinned=True), users_machine(), 1500, start=BUSY_2)
    assert set(counts) == {2}
    # The start's suggestion and the slow step's, no more.
    assert len(lines) == 2 and all("train.threads=1 would likely be faster" in line for _, line in lines)


def test_a_load_that_comes_and_goes_does_not_flap():
    def alternating(on: float, off: float):
        def machine(clock: float, threads: int) -> tuple[float, Load]:
            return users_machine(start=0, seconds=on)(clock % (on + off), threads)
        return machine

    # Lulls shorter than QUIET_SECONDS (readings alternate busy and quiet): one drop, never a return.
    _, lines, counts = drive(auto_policy(), alternating(8, 8), 3000)
    assert changes(counts) == 1 and len(lines) == 1 and counts[-1] == 1
    # Lulls longer: a return, the load back within the quiet's length (a lull), the wait doubled: it settles.
    policy = auto_policy()
    wall, lines, counts = drive(policy, alternating(30, 30), 3000)
    assert changes(counts) <= 3 and policy.quiet_seconds == 2 * QUIET_SECONDS and wall > 600
    assert all(at < 120 for at, _ in lines)


def test_a_return_that_turns_out_slower_goes_back_and_waits_longer():
    policy = auto_policy()
    wall, lines, counts = drive(policy, users_machine(start=0, seconds=10, two_threads_slower=True), 3000)
    said = [line for _, line in lines]
    assert "running on 1 thread instead of 2" in said[0]
    assert said[1].startswith("the cores are free again")
    assert said[2] == (f"2 threads were slower than 1 (500 ms a step against 256 ms): back on 1 thread; the next "
                       f"return waits for {2 * QUIET_SECONDS:.0f} s of free cores")
    # Each next try after twice the wait (30, 60, 120, 240 s), then none: 5 trials of TRIAL_STEPS steps on 2 threads.
    assert [line.split(" back on ")[0][:26] for line in said[1::2]] == ["the cores are free again ("] * 5
    assert [line.split("; ")[-1] for line in said[2:-1:2]] == [f"the next return waits for {s} s of free cores"
                                                              for s in (30, 60, 120, 240)]
    assert said[-1].endswith("back on 1 thread for the rest of the run") and len(said) == 11
    dropped = counts.index(1)  # the step a slow step's reading dropped the thread
    assert dropped == WARMUP_STEPS + 1 and counts[dropped:].count(2) == 5 * TRIAL_STEPS and counts[-1] == 1


def test_on_fewer_threads_a_growing_load_takes_more_and_no_machine_reading_never_returns():
    policy = ThreadPolicy(16, 16, pinned=False)
    assert policy.start(Load(waited=0.4, others=0.25)).threads == 12
    busier = policy.step(0.1, 1, Load(waited=0.4, others=0.75))  # on 12 threads, other processes on 12 cores
    assert busier.threads == 4 and "running on 4 threads instead of 12" in busier.line and busier.read_steps == 50
    # No /proc/stat: a free core cannot be told from a busy one, so the count stays where it is.
    policy = ThreadPolicy(2, 2, pinned=False)
    assert policy.start(Load(waited=0.5, others=None)).threads == 1
    for step in range(1, 2000):
        assert policy.step(0.25, step, Load(waited=0.0, others=None)).threads == 1


# -- one real check: busy processes on the cores a run may use -------------------------------------------------
BUSY = "import time\nwhile True:\n    pass\n"


@pytest.mark.slow
def test_a_run_on_cores_busy_with_other_processes_says_so(tmp_path):
    """Two busy-loop processes and a training run, all held to the same 2 cores (CPU affinity, so the same on
    any machine with 2 cores or more): the run's 2 threads wait about half the time, far over the 25% line."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    cores = sorted(os.sched_getaffinity(0))[:2]
    pin = f"import os; os.sched_setaffinity(0, {set(cores)!r})\n"
    busy = [subprocess.Popen([sys.executable, "-c", pin + BUSY]) for _ in cores]
    try:
        config = write_config(tmp_path, steps=3, interval=0)
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's default: 2 threads
        run = [sys.executable, "-c", pin + "import sys; from scaletrain.cli import main; sys.exit(main(sys.argv[1:]))",
               "train", "--config", str(config), f"--train.run_dir={tmp_path / 'run'}"]
        proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=CEILING_S)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [line for line in (proc.stdout + proc.stderr).splitlines() if "the CPU is shared" in line]
    assert "running on 1 thread instead of 2" in line, line
