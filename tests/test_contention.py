"""Cores shared with another job (train/contention.py): the trainer measures the load with ``doctor``'s
``CoreContention``, says so in one line, and runs on fewer threads when its threads would oversubscribe the
free cores (or suggests it, when the count is pinned)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.faults import write_config
from helpers.waits import CEILING_S
from scaletrain.train import contention as contention_module
from scaletrain.train.contention import FAR_BEYOND, WARMUP_STEPS, Load, ThreadWatch, choose_threads


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


def test_a_slow_step_looks_at_the_load_once_and_acts(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    lines: list[str] = []
    readings = []

    def contention():
        readings.append(1)
        return _Reading(waited=0.5, others=0.5)

    monkeypatch.setattr(contention_module, "_decided", False)  # this process's first trainer
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
        for step in range(WARMUP_STEPS + 4, WARMUP_STEPS + 20):  # once only
            watch.before_step()
            watch.after_step(4.7, step)
        assert readings == [1] and len(lines) == 1
        # A later trainer in this process keeps the count: no second start probe.
        ThreadWatch(0, lines.append, cores=2, probe=lambda: pytest.fail("probed twice")).at_start()
    finally:
        torch.set_num_threads(before)


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
