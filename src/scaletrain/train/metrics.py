"""Step metrics (loss, tokens/s, MFU, memory) to a terminal, a JSONL file and TensorBoard; ``Throughput``
measures the loop (step and data times, tokens/s, MFU against the job's peak, the stalls)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import LoggingConfig
from scaletrain.hardware.peak import devices_in_job, host_cores, peak_flops
from scaletrain.parallel.distributed import any_rank, rank_zero_value


def peak_memory_bytes(device: torch.device) -> int:
    """Max allocated tensor memory on a GPU; peak resident set size of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def per_rank_peak_memory_mb(device: torch.device, world_size: int) -> list[float]:
    """Every rank's peak memory in MiB (one small all-gather; collective), so rank 0 can log them all."""
    mine = torch.tensor([peak_memory_bytes(device) / 2**20], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    return [round(float(t), 1) for t in every]


def mfu(flops_per_token: float, tokens_per_second: float, job_peak_flops: float) -> float:
    """Model FLOPs utilisation, the one definition the trainer's progress and ``done:`` lines, the report and
    ``plan`` print: the model's training FLOPs per token (``finetune/flops.py:trained_flops_per_token``: a
    fine-tune's frozen weights without their weight gradient) times the job's tokens/s, over the job's peak
    FLOP/s (``Throughput.job_peak_flops``, the planner's ``timing.job_peak_flops``: one device's measured peak
    times ``devices_in_job``). Nothing of how the job was launched enters it."""
    return flops_per_token * tokens_per_second / job_peak_flops


class StepClock:
    """Each step's wall time without a host-device sync per step.

    On a CPU: ``time.perf_counter`` around the step. On CUDA the host only queues a step's kernels, so its
    clock stops long before the GPU does; instead of synchronising after every step (a pipeline drain per step)
    a timing event is recorded on the stream before and after each step's work, and the times are read when
    asked (``times``: the log steps), after waiting for the last event only. A step's time is then the GPU's
    from reaching the step's first event to finishing its last kernel: the step's wall time in steady state,
    including the GPU's idle gaps while the host is behind."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._times: list[float] = []
        self._pending: list[tuple[object, object]] = []  # (start, end) events not read yet
        self._start: object = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start, end))
        else:
            self._times.append(time.perf_counter() - self._start)

    def last(self) -> float:
        """The last step's seconds (on CUDA this waits for it: for the CPU-only thread watch and tests)."""
        return self.times()[-1]

    def times(self) -> list[float]:
        """Every step's seconds so far (on CUDA: one wait, for the last pending event)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self._times.extend(a.elapsed_time(b) / 1000 for a, b in self._pending)
            self._pending = []
        return self._times


class Throughput:
    """How fast the training loop runs and where its time goes: every step's wall time and wait for data,
    tokens/s and MFU against the job's measured peak, and the stalls (seconds spent evaluating, sampling and
    checkpointing) against the loop's wall time."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, device: torch.device, precision: str,
                 world_size: int, rank: int, log: Callable[[str], None]):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.device, self.world_size, self.rank, self.log = device, world_size, rank, log
        self._peak_dtype = "bf16" if precision == "bf16" else "fp32"
        self.peak_flops = self.job_peak_flops()
        self._peak_remeasured = False
        self.clock = StepClock(device)
        self.data_times: list[float] = []  # seconds of each step spent waiting for batches (monitor.timed)
        self.stall_seconds = {"eval": 0.0, "sample": 0.0, "checkpoint": 0.0}
        self.loop_seconds = 0.0

    def job_peak_flops(self, remeasure: bool = False) -> float:
        """The job's peak FLOP/s, MFU's denominator (docs/training.md): one device's measured peak
        (``peak.peak_flops``, a GPU or one CPU core; rank 0's number on every rank) times the devices the
        job runs on (``devices_in_job``). Collective under torchrun: every rank calls it."""
        per_device = peak_flops(self.device, self._peak_dtype, remeasure, log=self.log) if self.rank == 0 else 0.0
        # torchrun's LOCAL_WORLD_SIZE ranks share this host's cores; one process has them to itself
        devices = devices_in_job(self.device.type, self.world_size, torch.get_num_threads(),
                                 int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)), host_cores())
        return rank_zero_value(per_device, self.device) * devices

    @property
    def step_times(self) -> list[float]:
        """Every step's wall time (``StepClock.times``: read on CUDA at the log steps, not per step)."""
        return self.clock.times()

    @step_times.setter
    def step_times(self, seconds: list[float]) -> None:  # tests and tools that bring their own times
        self.clock.times()
        self.clock._times = list(seconds)

    def record(self, steps: int) -> dict:
        """Median step time, tokens/s, MFU, peak memory (every rank's too) and the data-wait share of the last
        ``steps`` steps, for the log. Collective under torchrun: every rank calls it."""
        recent = self.step_times[-steps:]
        step_s = statistics.median(recent)
        tokens_per_second = self.tokens_per_step / step_s
        if not self._peak_remeasured and \
                any_rank(mfu(self.flops_per_token, tokens_per_second, self.peak_flops) > 1, device=self.device)[0]:
            # Above the cached "peak" (on any rank): it was measured on a busy machine. Measure again, once.
            self._peak_remeasured = True
            self.peak_flops = self.job_peak_flops(remeasure=True)
        per_rank = {"peak_memory_mb_per_rank": per_rank_peak_memory_mb(self.device, self.world_size)} \
            if self.world_size > 1 else {}
        return {"step_ms": 1000 * step_s, "tokens_per_second": tokens_per_second,
                "mfu": mfu(self.flops_per_token, tokens_per_second, self.peak_flops),
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20, **per_rank,
                "data_share": sum(self.data_times[-len(recent):]) / sum(recent)}

    def median(self) -> dict:
        """The whole run's median step time, tokens/s and MFU (NaN before any step)."""
        median_s = statistics.median(self.step_times or [float("nan")])
        return {"median_step_ms": 1000 * median_s, "tokens_per_second": self.tokens_per_step / median_s,
                "mfu": mfu(self.flops_per_token, self.tokens_per_step / median_s, self.peak_flops)}

    @contextlib.contextmanager
    def stall(self, cause: str) -> Iterator[None]:
        """Count the block's wall time as a stall of ``cause`` (eval, sample, checkpoint): the summary's share."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stall_seconds[cause] += time.perf_counter() - t0

    def stalls(self) -> dict:
        """Seconds of the training loop spent evaluating, sampling and checkpointing (rank 0's), and their share
        of the loop's wall time (``stall_share``; NaN before ``train`` has run)."""
        total = sum(self.stall_seconds.values())
        return {"loop_seconds": self.loop_seconds, "stall_seconds": dict(self.stall_seconds),
                "stall_share": total / self.loop_seconds if self.loop_seconds else float("nan")}


class MetricsLogger:
    """Writes every record to ``metrics.jsonl``; shows a live bar on a terminal or plain lines."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, start_step: int = 0,
                 enabled: bool = True):
        self.enabled = enabled
        self.cfg = cfg
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.tb = None
        if enabled and cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional (`pip install scaletrain[monitor]`)
                self.tb = None
        mode = cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "off"
        self.progress = None
        if self.mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, record: dict) -> None:
        """A metrics record; must contain ``step``."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            self._to_tensorboard(record)
        if "loss" in record:
            info = (f"loss {record['loss']:.4f} | {record['step_ms']:.1f} ms/step | "
                    f"{record['tokens_per_second']:,.0f} tok/s | MFU {100 * record['mfu']:.1f}%")
            if "reward_accuracy" in record:  # a preference objective's pairs (finetune/preference.py)
                info += f" | reward acc {record['reward_accuracy']:.2f} margin {record['reward_margin']:.3f}"
            if self.progress is not None:  # the live bar: also memory, and the ETA (TimeRemainingColumn)
                self.progress.update(self.task, completed=record["step"],
                                     info=f"{info} | mem {record['peak_memory_mb']:.0f} MB")
            elif self.mode == "plain":
                print(f"step {record['step']:>6} | {info} | lr {record['lr']:.2e} | "
                      f"mem {record['peak_memory_mb']:.0f} MB", flush=True)

    def _to_tensorboard(self, record: dict) -> None:
        """Every number of ``record`` as a scalar at its step; a per-rank list as one scalar per rank."""
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "time"):
                self.tb.add_scalar(key, value, record["step"])
            elif isinstance(value, list) and key.endswith("_per_rank"):  # the resource monitor's per rank
                for rank, v in enumerate(value):
                    if isinstance(v, (int, float)):
                        self.tb.add_scalar(f"{key[:-len('_per_rank')]}/rank{rank}", v, record["step"])

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def message(self, text: str) -> None:
        """A line for people (eval results, samples), printed above the bar."""
        if not self.enabled or self.mode == "off":
            return
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
