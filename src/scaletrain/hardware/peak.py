"""This machine's measured peak matmul rate, cached, for MFU (trainer) and the planner alike.

The cache is a JSON file (``$SCALETRAIN_CACHE`` or ``~/.cache/scaletrain``/calibration.json) keyed by a
fingerprint of the device, the torch version and (on a CPU) the thread count. ``scaletrain doctor`` fills it
with the planner's full calibration (``plan/calibration.py``); a training run only ever adds the numbers it
needs (the peak for MFU, the bf16/fp32 ratio for ``train.precision = auto``), and says so when it does.

One peak, whatever launched the run: ``peak_flops`` is the rate of one *device*, a GPU or one CPU core (a
single-threaded matmul timed by this process's CPU time, which other ranks or jobs sharing the cores do not
inflate), and a job's peak is that times ``devices_in_job`` (its GPUs, or every rank's threads on a CPU).
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


# The instruction-set flags that decide CPU training speed: AVX2 / AVX-512 for fp32 GEMMs, AVX512_BF16 and AMX
# for bf16 ones (without them bf16 matmuls ran ~0.02x fp32 on an AVX2 EPYC, 2-4x faster with them).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_features(cpuinfo: str | None = None) -> dict:
    """This CPU for a record: model name, the cores this process may use, logical CPUs, and which of
    ``SPEED_FLAGS`` it has (``cpuinfo``: the text of ``/proc/cpuinfo``, read when None; flags empty where the
    system does not list them)."""
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {"model": cpu_name(), "cores": host_cores(), "logical_cpus": os.cpu_count(),
            "flags": {flag: flag in flags for flag in SPEED_FLAGS} if flags else {}}


def device_fingerprint(device: torch.device | str, threads: int | None = None) -> str:
    """A key that changes when the hardware, torch or (on a CPU) the thread count changes: ``threads``, or
    torch's current count. A GPU's key has no thread count: the CPU threads do not drive its matmuls."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda|{torch.cuda.get_device_name(device)}|torch{torch.__version__}"
    return f"{device.type}|{cpu_name()}|torch{torch.__version__}|threads{threads or torch.get_num_threads()}"


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
    # One temporary file per process: ranks that measure at the same time must not write into one file
    # (a half-written one renamed into place would lose the whole cache, doctor's calibration included).
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def matmul_size(device: torch.device | str, dtype: str) -> int:
    """The square matmul a peak is measured with: 1024 on a CPU, or 256 for bf16/fp16 there, where a CPU without
    native bf16 runs them ~100x slower than fp32 and a 1024^3 one would take seconds; 8192 on a GPU, where a
    1024^3 matmul is too small to fill an H100 (measured 159 TFLOP/s bf16 of its 989, so the trainer printed an
    MFU of 105% on the first GPU check)."""
    if torch.device(device).type == "cuda":
        return 8192
    return 256 if dtype != "fp32" else 1024


def peak_flops(device: torch.device | str = "cpu", dtype: str = "fp32", remeasure: bool = False,
               log: Callable[[str], None] | None = None) -> float:
    """One device's peak FLOP/s for ``dtype`` (a GPU, or one CPU core): the cached measurement, measured once
    (~0.3 s) if missing.

    On a CPU the matmul runs on one thread, timed by this process's CPU time, and is cached under the
    one-thread fingerprint whatever the caller's thread count: the same number under any launcher (other
    ranks or jobs time-sharing the cores slow a wall clock, not this one) and the one ``doctor --clock cpu``
    writes. ``remeasure``: measure again and keep the higher of the two - for when a run achieves more than
    the cached "peak". ``log`` is told what was measured and where it was cached, so nothing lands in the
    user's home unsaid.
    """
    device = torch.device(device)
    cpu = device.type == "cpu"
    key = device_fingerprint(device, threads=1 if cpu else None)
    data = load_calibration()
    entry = data.get(key, {})
    name = f"matmul_flops_{dtype}"
    if name in entry and not remeasure:
        return float(entry[name])
    threads = torch.get_num_threads()
    if cpu:
        torch.set_num_threads(1)
    try:
        measured = measure_matmul_flops(device, dtype, n=matmul_size(device, dtype), min_seconds=0.25,
                                        timer=CLOCKS["cpu" if cpu else "wall"])
    finally:
        torch.set_num_threads(threads)
    entry[name] = max(measured, entry.get(name, 0.0))
    entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    data[key] = entry
    try:
        where = f"cached in {save_calibration(data)} (set SCALETRAIN_CACHE to keep it elsewhere)"
    except OSError as exc:
        where = f"not cached ({exc.strerror or exc})"
    if log is not None:
        what = "one core's" if cpu else "this GPU's"
        log(f"measured {what} peak {dtype} matmul rate (for MFU and train.precision=auto): "
            f"{entry[name] / 1e9:,.1f} GFLOP/s; {where}")
    return float(entry[name])


def devices_in_job(device_type: str, world_size: int, threads: int, ranks_per_host: int = 0,
                   cores_per_host: int = 0) -> int:
    """How many of ``peak_flops``'s devices a job runs on: one GPU a rank, or on a CPU one core per torch
    thread of every rank (a launcher's OMP_NUM_THREADS=1 per rank and one process with as many threads count
    the same cores), but no more than the ``cores_per_host`` of each host its ``ranks_per_host`` share (threads
    beyond the cores add no peak). The one count MFU's denominator takes, in the trainer and the planner."""
    if device_type != "cpu":
        return world_size
    threads = max(1, threads)
    if cores_per_host <= 0:
        return world_size * threads
    per_host = max(1, min(ranks_per_host or world_size, world_size))
    return -(-world_size // per_host) * min(per_host * threads, cores_per_host)


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity; the CPU count where the system has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_bf16_speedup(log: Callable[[str], None] | None = None) -> float:
    """bf16 over fp32 matmul throughput of one core of this CPU (both ``peak_flops``, so cached: the
    calibration ``doctor --clock cpu`` writes, else measured once in about half a second)."""
    return peak_flops("cpu", "bf16", log=log) / peak_flops("cpu", "fp32", log=log)


def _thread_run_delays() -> dict[str, float] | None:
    """{thread id: seconds it has spent runnable but waiting for a core} for every thread of this process
    (Linux ``/proc/self/task/*/schedstat``, field 2); None where the kernel does not report it."""
    out = {}
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                fields = Path(f"/proc/self/task/{task}/schedstat").read_text().split()
            except OSError:  # the thread ended between listdir and read
                continue
            out[task] = int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
    return out


def _busy_jiffies() -> tuple[float, float] | None:
    """(busy, total) CPU jiffies of the whole machine since boot (``/proc/stat``), or None."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class CoreContention:
    """How much of a measurement this process's threads spent waiting for a core that another process held.

    ``with CoreContention() as c: work()`` then ``c.waited`` is the summed run-queue wait of this process's
    threads divided by (wall time x torch threads): 0 on a quiet machine, ~0.5 when another busy process shares
    every core at the same priority. It is what inflates a wall-clock timing, and unlike a load average it is
    not raised by work at a lower priority (``nice``) that yields the cores. ``others`` is the share of the
    machine's CPU time that other processes used meanwhile (from /proc/stat), for the record. Both are None
    where the kernel does not report them."""

    def __enter__(self) -> CoreContention:
        self.waited: float | None = None
        self.others: float | None = None
        self._delays, self._busy = _thread_run_delays(), _busy_jiffies()
        self._t0, self._cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        delays, busy = _thread_run_delays(), _busy_jiffies()
        if self._delays is not None and delays is not None:
            waited = sum(d - self._delays.get(t, 0.0) for t, d in delays.items())
            self.waited = max(0.0, waited / (wall * max(1, torch.get_num_threads())))
        if self._busy is not None and busy is not None and busy[1] > self._busy[1]:
            machine_busy = (busy[0] - self._busy[0]) / (busy[1] - self._busy[1])  # share of all cores busy
            ours = (time.process_time() - self._cpu0) / (wall * (os.cpu_count() or 1))
            self.others = max(0.0, machine_busy - ours)
