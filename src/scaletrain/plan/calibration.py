"""Measured device peaks, cached per machine so MFU and the planner use real numbers, not datasheets.

The cache is a JSON file (``$SCALETRAIN_CACHE`` or ``~/.cache/scaletrain``/calibration.json) keyed by a
fingerprint of the device, the torch version and the thread count; ``scaletrain doctor`` rewrites it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("SCALETRAIN_CACHE", Path.home() / ".cache" / "scaletrain"))


def calibration_path() -> Path:
    return cache_dir() / "calibration.json"


def device_fingerprint(device: torch.device | str) -> str:
    """A key that changes when the hardware, torch or the thread count changes."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_name()
    return f"{device.type}|{name}|torch{torch.__version__}|threads{torch.get_num_threads()}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: str = "fp32", n: int = 1024,
                         min_seconds: float = 0.5) -> float:
    """Best sustained FLOP/s of an n x n x n matmul (2*n^3 FLOPs) over repeated timed batches."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=_DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=_DTYPES[dtype])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up (allocator, kernel selection)
    sync()
    best, spent, reps = 0.0, 0.0, 4
    while spent < min_seconds:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        dt = time.perf_counter() - t0
        spent += dt
        best = max(best, reps * 2 * n**3 / dt)
    return best


def load_calibration() -> dict:
    try:
        return json.loads(calibration_path().read_text())
    except (OSError, ValueError):
        return {}


def save_calibration(data: dict) -> Path:
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)  # atomic: concurrent readers never see half a file
    return path


def peak_flops(device: torch.device | str = "cpu", dtype: str = "fp32") -> float:
    """The device's peak FLOP/s for ``dtype``: cached measurement, measured once (~1 s) if missing."""
    key = device_fingerprint(device)
    data = load_calibration()
    entry = data.get(key, {})
    if f"matmul_flops_{dtype}" not in entry:
        entry[f"matmul_flops_{dtype}"] = measure_matmul_flops(device, dtype)
        entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        data[key] = entry
        try:
            save_calibration(data)
        except OSError:
            pass  # a read-only home still gets a (re-measured) number
    return float(entry[f"matmul_flops_{dtype}"])
