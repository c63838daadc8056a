"""This machine's measured peak matmul rate, cached, for MFU (trainer) and the planner alike.

The cache is a JSON file (``$SCALETRAIN_CACHE`` or ``~/.cache/scaletrain``/calibration.json) keyed by a
fingerprint of the device, the torch version and the thread count. ``scaletrain doctor`` fills it with the
planner's full calibration (``plan/calibration.py``); a training run only ever adds the one number it
needs for MFU, and says so when it does.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The clock of the microbenchmarks: wall time, or (single-threaded only) this process's CPU time, which
# other processes time-sharing the cores do not inflate.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def cache_dir() -> Path:
    """Where measurements are cached: ``$SCALETRAIN_CACHE``, else ``~/.cache/scaletrain``."""
    return Path(os.environ.get("SCALETRAIN_CACHE", Path.home() / ".cache" / "scaletrain"))


def calibration_path() -> Path:
    """The cache file of every measurement (``doctor``'s calibration and the trainer's peak)."""
    return cache_dir() / "calibration.json"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_fingerprint(device: torch.device | str) -> str:
    """A key that changes when the hardware, torch or the thread count changes."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return f"{device.type}|{name}|torch{torch.__version__}|threads{torch.get_num_threads()}"


def comm_fingerprint(device: torch.device | str) -> str:
    """Key of the communication measurements (``doctor`` under torchrun): the host, not the thread count,
    since each torchrun rank runs with its own (smaller) thread count."""
    return device_fingerprint(device).rsplit("|threads", 1)[0].replace(f"{torch.device(device).type}|",
                                                                       "comm|", 1)


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: str = "fp32", n: int = 1024,
                         min_seconds: float = 0.5, timer: Callable[[], float] = time.perf_counter) -> float:
    """Best sustained FLOP/s of an n x n x n matmul (2*n^3 FLOPs) over repeated timed batches."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up (allocator, kernel selection)
    sync()
    best, spent, reps = 0.0, 0.0, 4
    while spent < min_seconds:
        t0 = timer()
        for _ in range(reps):
            a @ b
        sync()
        dt = timer() - t0
        spent += dt
        best = max(best, reps * 2 * n**3 / dt)
    return best


def load_calibration() -> dict:
    """The whole cache ({fingerprint: entry}); empty when missing or unreadable."""
    try:
        return json.loads(calibration_path().read_text())
    except (OSError, ValueError):
        return {}


def save_calibration(data: dict) -> Path:
    """Write the whole cache atomically (concurrent readers never see half a file)."""
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def peak_flops(device: torch.device | str = "cpu", dtype: str = "fp32", remeasure: bool = False,
               log: Callable[[str], None] | None = None) -> float:
    """The device's peak FLOP/s for ``dtype``: the cached measurement, measured once (~1 s) if missing.

    ``remeasure``: measure again and keep the higher of the two - for when a run achieves more than the
    cached "peak", which happens when the first measurement ran while other work shared the cores.
    ``log`` is told what was measured and where it was cached, so nothing lands in the user's home unsaid.
    """
    key = device_fingerprint(device)
    data = load_calibration()
    entry = data.get(key, {})
    name = f"matmul_flops_{dtype}"
    if name in entry and not remeasure:
        return float(entry[name])
    entry[name] = max(measure_matmul_flops(device, dtype), entry.get(name, 0.0))
    entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    data[key] = entry
    try:
        where = f"cached in {save_calibration(data)} (set SCALETRAIN_CACHE to keep it elsewhere)"
    except OSError as exc:
        where = f"not cached ({exc.strerror or exc})"
    if log is not None:
        log(f"measured this {torch.device(device).type}'s peak {dtype} matmul rate for MFU: "
            f"{entry[name] / 1e9:,.1f} GFLOP/s; {where}")
    return float(entry[name])
