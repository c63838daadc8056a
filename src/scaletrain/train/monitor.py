"""The resource monitor: a background thread that samples the machine while the training loop runs.

Every ``monitor.interval`` seconds it reads, for this process and this rank's device:

- CPU: this process's utilisation (percent of one core, so 2 busy threads read 200) and the system's
  (percent of all cores), through psutil;
- memory: the process's resident set size (RSS) and the system's available memory (psutil); on CUDA also
  ``torch.cuda`` max allocated / max reserved (the caching allocator's peaks);
- GPU (NVML through ``nvidia-ml-py``, optional): utilisation, memory used, power and temperature of this
  rank's device.

Each sample is a line of ``<run_dir>/monitor/rank<N>.jsonl`` (every rank: wall-time curves at the sampling
resolution). The training loop asks ``window()`` at each log step for the means (utilisation) and maxima
(memory) since the last log step; ``gathered_window`` gathers those over the ranks and rank 0 writes them into
``metrics.jsonl`` beside the loss. Reading NVML and psutil costs ~0.1 ms a sample, off the training thread:
``benchmarks/monitor_overhead.py`` measures what it costs the step.

The GPU parts are written against the documented NVML / torch.cuda APIs and are untested here (no GPU).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.config import MonitorConfig
from scaletrain.core.files import write_file
from scaletrain.core.invocation import invocation
from scaletrain.hardware.allocator import in_use as allocator_in_use

# The keys a window reduces by their mean (utilisations, power, temperature); the others by their maximum.
MEAN_KEYS = ("process_cpu_percent", "system_cpu_percent", "gpu_util_percent", "gpu_power_w", "gpu_temperature_c")
# Keys of ``window()`` that every rank reports (gathered into per-rank lists by ``gathered_window``).
WINDOW_KEYS = ("process_cpu_percent", "system_cpu_percent", "rss_mb", "available_mb", "gpu_util_percent",
               "gpu_memory_used_mb", "gpu_power_w", "gpu_temperature_c", "cuda_max_allocated_mb",
               "cuda_max_reserved_mb")


class _Nvml:
    """This rank's GPU through NVML (``pynvml`` from ``nvidia-ml-py``); ``None`` readings without it."""

    def __init__(self, device: torch.device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            # NVML numbers devices physically; CUDA_VISIBLE_DEVICES may renumber them for torch.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            if ids and index < len(ids) and ids[index].isdigit():
                index = int(ids[index])
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no nvidia-ml-py, no driver, a UUID in CUDA_VISIBLE_DEVICES: sample without NVML
            self.handle = None

    def read(self) -> dict[str, float]:
        if self.handle is None:
            return {}
        nvml, h, out = self.nvml, self.handle, {}
        for key, read in (("gpu_util_percent", lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                          ("gpu_memory_used_mb", lambda: nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20),
                          ("gpu_power_w", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),  # milliwatts
                          ("gpu_temperature_c", lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))):
            try:
                out[key] = float(read())
            except Exception:  # a reading this GPU does not support (power on some boards)
                pass
        return out


class ResourceMonitor:
    """Samples in a daemon thread from ``start()`` to ``stop()``; ``window()`` summarises since the last call."""

    def __init__(self, cfg: MonitorConfig, run_dir: str | Path, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.path = Path(run_dir) / "monitor" / f"rank{rank}.jsonl"
        self._lock = threading.Lock()
        self._window: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0

    def start(self) -> ResourceMonitor:
        if not self.cfg.enabled:
            return self
        try:
            import psutil
        except ImportError:  # a dependency, but a broken environment must not stop a training run
            print("warning: psutil is not installed; the resource monitor is off (pip install psutil)",
                  file=sys.stderr, flush=True)
            return self

        self._process = psutil.Process()
        self._psutil = psutil
        # The first cpu_percent(None) call only sets the reference point of the next one.
        self._process.cpu_percent(None)
        psutil.cpu_percent(None)
        self._nvml = _Nvml(self.device)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self._thread = threading.Thread(target=self._run, name="scaletrain-monitor", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> dict[str, float]:
        """One reading (called by the thread; public so a test can take one without waiting)."""
        memory = self._psutil.virtual_memory()
        out = {"process_cpu_percent": self._process.cpu_percent(None),
               "system_cpu_percent": self._psutil.cpu_percent(None),
               "rss_mb": self._process.memory_info().rss / 2**20,
               "available_mb": memory.available / 2**20}
        out.update(self._nvml.read())
        if self.device.type == "cuda":
            out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            out["cuda_max_reserved_mb"] = torch.cuda.max_memory_reserved(self.device) / 2**20
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval):
            try:
                reading = self.sample()
            except Exception as exc:  # a monitor must never take the training run down
                print(f"warning: resource monitor stopped: {exc}", file=sys.stderr, flush=True)
                return
            self._file.write(json.dumps({"time": round(time.time(), 3),
                                         **{k: round(v, 2) for k, v in reading.items()}}) + "\n")
            self._file.flush()
            with self._lock:
                self._window.append(reading)
                self.samples += 1

    def window(self) -> dict[str, float]:
        """Means (utilisation, power, temperature) and maxima (memory) of the samples since the last call;
        empty when none was taken (a log window shorter than the interval: the next window has them)."""
        with self._lock:
            taken, self._window = self._window, []
        if not taken:
            return {}
        keys = {k for reading in taken for k in reading}
        out = {}
        for key in keys:
            values = [r[key] for r in taken if key in r]
            out[key] = round(sum(values) / len(values) if key in MEAN_KEYS else max(values), 2)
        return out

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self.cfg.interval))
        self._thread = None
        self._file.close()


def gathered_window(monitor: ResourceMonitor | None, device: torch.device, world_size: int) -> dict:
    """The monitor's window as rank 0 logs it: rank 0's values, plus a per-rank list of each value where the
    ranks differ (one small all-gather; collective: every rank calls it)."""
    mine = monitor.window() if monitor is not None else {}
    if world_size == 1:
        return mine
    vector = torch.tensor([mine.get(k, float("nan")) for k in WINDOW_KEYS], dtype=torch.float64, device=device)
    every = [torch.zeros_like(vector) for _ in range(world_size)]
    dist.all_gather(every, vector)
    out = dict(mine)
    for i, key in enumerate(WINDOW_KEYS):
        values = [float(t[i]) for t in every]
        if not all(math.isnan(v) for v in values) and len({round(v, 1) for v in values}) > 1:
            out[f"{key}_per_rank"] = [None if math.isnan(v) else round(v, 2) for v in values]
    return out


def timed(batches: Iterator[Any], seconds: list[float]) -> Iterator[Any]:
    """``batches`` with the time spent producing each item added to ``seconds[0]`` (data loading, as a share
    of the step in ``metrics.jsonl``: ``data_share``)."""
    while True:
        t0 = time.perf_counter()
        try:
            item = next(batches)
        except StopIteration:
            return
        seconds[0] += time.perf_counter() - t0
        yield item


def _git_commit() -> str:
    """The commit of the scaletrain checkout this code runs from (``+dirty`` with uncommitted changes); ''
    when it is not a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return commit + ("+dirty" if commit and dirty else "")


def hardware_info(device: torch.device, world_size: int) -> dict[str, Any]:
    """What the run ran on, for the report's header."""
    info: dict[str, Any] = {"device": str(device), "world_size": world_size, "platform": platform.platform(),
                            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu"] = names[0]
    except OSError:
        pass
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):  # other work on the machine: why a step may be slower than planned
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return info


def write_run_info(run_dir: str | Path, device: torch.device, world_size: int, **extra: Any) -> Path:
    """``<run_dir>/run_info.json``: the command, git commit, hardware, torch version and start time (rank 0,
    at the start of training; ``finish_run_info`` adds the end). One record per invocation, so a resumed
    run lists each of its segments."""
    path = Path(run_dir) / "run_info.json"
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        doc = {}
    segments = doc.get("segments", [])
    segments.append({"command": invocation(), "started": round(time.time(), 3),
                     "git_commit": _git_commit(), "torch": torch.__version__, "python": platform.python_version(),
                     "allocator": allocator_in_use(),  # memory numbers depend on it (allocator.py)
                     "hardware": hardware_info(device, world_size), **extra})
    write_file(path, json.dumps({"segments": segments}, indent=1))
    return path


def finish_run_info(run_dir: str | Path, summary: dict[str, Any]) -> None:
    """Mark the last segment of ``run_info.json`` finished, with the run's summary (rank 0)."""
    path = Path(run_dir) / "run_info.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    if doc.get("segments"):
        keep = {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) or v is None}
        doc["segments"][-1].update({"finished": round(time.time(), 3), "summary": keep})
        if hasattr(os, "getloadavg"):
            doc["segments"][-1]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        write_file(path, json.dumps(doc, indent=1))
