"""Preemption: finish the current step, checkpoint within a grace period, exit with a distinct status.

Spot/preemptible instances get a notice (SIGTERM on most clouds and under SLURM's --signal, SIGUSR1 by
convention for "checkpoint and requeue", or a metadata endpoint that an agent can turn into a file).
The handler only sets a flag — never does work inside the signal handler — and the training loop asks
``should_stop()`` after each step.

Ctrl-C (SIGINT) is the same graceful stop, asked for by a person: the first one finishes the step, saves and
exits 130 (the shell's code for Ctrl-C) with the command that resumes; a second Ctrl-C stops at once
(KeyboardInterrupt), for when even the save is too long to wait for.

A lost launcher is a notice too. torchrun's agent starts each worker in a session of its own, so when the
agent dies (``kill -9``, the OOM killer, a crashed login node) nothing signals the workers: they would train
on as orphans, holding the run folder's lock (a restart is refused naming their PID) and, on a GPU, its
memory, with nobody left to restart them. A worker started by torchrun remembers its parent, the agent, and
``should_stop()`` compares ``os.getppid()`` with it after each step (one system call): once the worker has
been re-parented, the run stops as for SIGTERM - the ranks agree, the step is checkpointed, exit 75.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from scaletrain.checkpoint import CheckpointManager
from scaletrain.config import CheckpointConfig
from scaletrain.core.files import StorageError
from scaletrain.parallel.distributed import any_rank
from scaletrain.train.metrics import MetricsLogger

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again" — schedulers and wrappers can requeue on it.
PREEMPTED_EXIT_CODE = 75
# 128 + SIGINT: what a shell reports for a program stopped by Ctrl-C.
INTERRUPTED_EXIT_CODE = 130
INTERRUPTED = "SIGINT"
SAME_CTRL_C = 1.5  # seconds: SIGINTs closer than this are one Ctrl-C (see PreemptionHandler._on_signal)


def torchrun_launcher() -> int | None:
    """The PID of the torchrun agent that started this process (its parent), or None when torchrun did not
    start it. A plain process is not watched: a shell that exits (``nohup``, a closed terminal) is no reason to
    stop training."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent = os.getppid()
    return parent if parent > 1 else None  # already re-parented to init: nothing left to watch


class PreemptionHandler:
    """Catches SIGTERM/SIGUSR1 (and an optional trigger file) and remembers when the notice came."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, trigger_file: str = "", grace_seconds: float = 60.0, started: float | None = None,
                 launcher: int | None = None):
        """``started``: the run's start (``time.time()``, default now); a trigger file older than it is a
        leftover from an earlier run and ignored. ``launcher``: the parent PID to watch (``torchrun_launcher``,
        taken when the process started); None watches nothing."""
        self.trigger_file = Path(trigger_file) if trigger_file else None
        self.launcher = launcher
        self.grace_seconds = grace_seconds
        self.started = time.time() if started is None else started
        self.notice_time: float | None = None
        self.reason = ""
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionHandler:
        """Install the handlers; returns self. Python allows signal handlers only in the main thread, so
        a trainer driven from another thread relies on the trigger file alone."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.reason == INTERRUPTED and self.notice_time is not None:
            # A second Ctrl-C is Python's usual KeyboardInterrupt: stop now, without the save. Not within
            # SAME_CTRL_C seconds of the first, though: under torchrun one Ctrl-C arrives twice, from the
            # terminal (the whole process group) and forwarded by torchrun's agent a moment later.
            if time.monotonic() - self.notice_time > SAME_CTRL_C:
                raise KeyboardInterrupt
            return
        if self.notice_time is None:
            self.notice_time = time.monotonic()
            self.reason = signal.Signals(signum).name

    @property
    def interrupted(self) -> bool:
        """The stop was asked for by Ctrl-C (not a scheduler's notice)."""
        return self.reason == INTERRUPTED

    def should_stop(self) -> bool:
        """True once a signal arrived, a trigger file written since the run started exists, or the launcher
        is gone. The file is consumed (deleted) when acted on: left in place it would stop the resumed run
        after its first step."""
        if self.notice_time is None and self._fresh_trigger():
            self.notice_time = time.monotonic()
            self.reason = f"trigger file {self.trigger_file}"
            self.trigger_file.unlink(missing_ok=True)  # another rank may have consumed it already
        if self.notice_time is None and self.launcher is not None and os.getppid() != self.launcher:
            self.notice_time = time.monotonic()
            self.reason = f"launcher lost: torchrun's agent (PID {self.launcher}) is gone"
        return self.notice_time is not None

    def _fresh_trigger(self) -> bool:
        """The trigger file exists and was written after the run started (1 s of slack for file systems
        that keep whole seconds)."""
        if self.trigger_file is None:
            return False
        try:
            return self.trigger_file.stat().st_mtime >= self.started - 1.0
        except FileNotFoundError:
            return False

    def seconds_left(self) -> float:
        """Seconds of the grace period that remain (inf before any notice)."""
        if self.notice_time is None:
            return float("inf")
        return self.grace_seconds - (time.monotonic() - self.notice_time)


def stop_reason(notice: PreemptionHandler, store: CheckpointManager, device: torch.device) -> str:
    """After a step, on every rank (collective): why the run stops now, or "" to go on - a notice on any rank
    (one may reach the ranks a step apart). An asynchronous save that failed in the background on any rank is
    raised now, not at the end: that rank raises its own StorageError (``wait``), the others say where to look;
    the previous checkpoint is intact and nothing else is written."""
    stop, save_failed = any_rank(notice.should_stop(), store.background_failed(), device=device)
    if save_failed:
        store.wait()
        raise StorageError(f"an asynchronous checkpoint save failed on another rank (see its message); the previous "
                           f"checkpoint in {store.folder} is intact")
    return (notice.reason or "another rank's notice") if stop else ""


def save_on_notice(notice: PreemptionHandler, reason: str, step: int, cfg: CheckpointConfig,
                   save: Callable[[], object], logger: MetricsLogger) -> None:
    """Preempted (``reason``) after ``step``: ``save`` this step's checkpoint synchronously (when checkpoints are
    enabled), log how long it took and say how the run goes on."""
    t0 = time.perf_counter()
    if cfg.enabled:
        save()
    took, left = time.perf_counter() - t0, notice.seconds_left()
    logger.log({"step": step, "preempted": reason, "checkpoint_seconds": round(took, 3)})
    if not cfg.enabled:
        logger.message(f"stopped ({reason}) at step {step}: nothing saved (checkpoint.enabled = false)")
        return
    if reason == INTERRUPTED:  # the command says it (commands/train.py: run_train), whatever the progress mode
        return
    logger.message(f"preempted ({reason}) at step {step}: checkpoint written in {took:.1f} s"
                   + (f"; WARNING: past the {cfg.grace_seconds:.0f} s grace period"
                      if left < 0 else f", {left:.0f} s of grace left") + "; `--resume` continues")
