"""``[profile]``: torch.profiler over a window of training steps.

The trainer calls ``step()`` after each optimizer step. With ``profile.enabled`` the profiler skips
``wait`` steps, traces ``warmup`` steps it throws away, and records ``active`` steps; then it writes

- ``<run_dir>/profile/rank<N>.pt.trace.json``: a Chrome trace per rank (chrome://tracing, Perfetto,
  TensorBoard's profiler plugin; ``torch.profiler`` writes it through ``export_chrome_trace``);
- ``<run_dir>/profile/top_ops_rank<N>.txt`` and ``.json``: the operators ranked by self time (CUDA time on
  a GPU, CPU time otherwise), printed by rank 0;
- on CUDA with ``profile.memory_snapshot``: ``memory_snapshot_rank<N>.pickle`` of the allocator's history
  over the window (drop it on https://pytorch.org/memory_viz), and one on out-of-memory. Written against
  the documented ``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot`` API; untested here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from scaletrain.config import ProfileConfig


class StepProfiler:
    """A no-op unless ``cfg.enabled``; otherwise ``torch.profiler.profile`` on the step schedule."""

    def __init__(self, cfg: ProfileConfig, run_dir: str | Path, rank: int, device: torch.device,
                 say: Callable[[str], None] = print):
        self.cfg, self.rank, self.device, self.say = cfg, rank, device, say
        self.dir = Path(run_dir) / "profile"
        self.trace_path = self.dir / f"rank{rank}.pt.trace.json"
        self.prof: profile | None = None
        self.done = False
        self.cuda = device.type == "cuda"

    def start(self) -> StepProfiler:
        if not self.cfg.enabled:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        c = self.cfg
        self.prof = profile(activities=activities, record_shapes=c.record_shapes,
                            schedule=schedule(wait=c.wait, warmup=c.warmup, active=c.active, repeat=1),
                            on_trace_ready=self._ready)
        if self.cuda and c.memory_snapshot:
            self._start_memory_history()
        self.prof.start()
        return self

    def step(self) -> None:
        """After each optimizer step: advance the profiler's schedule."""
        if self.prof is not None and not self.done:
            self.prof.step()

    def stop(self) -> None:
        """End of training (or an error): close the profiler; a window cut short is still written."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        if not self.done:
            prof.stop()  # calls on_trace_ready when the active window had begun
        if self.cuda and self.cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _ready(self, prof: profile) -> None:
        self.done = True
        prof.export_chrome_trace(str(self.trace_path))
        by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=by, row_limit=self.cfg.top)
        (self.dir / f"top_ops_rank{self.rank}.txt").write_text(table)
        (self.dir / f"top_ops_rank{self.rank}.json").write_text(json.dumps(top_operators(prof, self.cfg.top,
                                                                                          self.cuda), indent=1))
        if self.cuda and self.cfg.memory_snapshot:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_snapshot_rank{self.rank}.pickle"))
        if self.rank == 0:
            self.say(f"profile of steps {self.cfg.wait + self.cfg.warmup + 1}-"
                     f"{self.cfg.wait + self.cfg.warmup + self.cfg.active}: top operators by "
                     f"{'self CUDA' if self.cuda else 'self CPU'} time (trace: {self.trace_path})\n{table}")

    def _start_memory_history(self) -> None:
        """Record allocations from the start (so the snapshot shows what was live when the window opened), and
        dump a snapshot when the allocator runs out of memory."""
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        path = self.dir / f"memory_snapshot_oom_rank{self.rank}.pickle"

        def on_oom(device, alloc, device_alloc, device_free):  # the observer's documented signature
            torch.cuda.memory._dump_snapshot(str(path))

        try:
            torch._C._cuda_attach_out_of_memory_observer(on_oom)
        except AttributeError:  # a build without the observer hook: snapshots on schedule only
            pass


def top_operators(prof: profile, top: int, cuda: bool = False) -> list[dict]:
    """The ``top`` operators by self time (microseconds, summed over the active steps), largest first."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    total = sum(getattr(e, key, 0.0) for e in events) or 1.0
    return [{"name": e.key, "self_us": round(getattr(e, key, 0.0), 1), "calls": e.count,
             "share": round(getattr(e, key, 0.0) / total, 4)} for e in events[:top]]
