"""``[profile]``: torch.profiler over a window of training steps.

The trainer calls ``step()`` after each optimizer step. With ``profile.enabled`` the profiler skips
``wait`` steps, traces ``warmup`` steps it throws away, and records ``active`` steps; then it writes

- ``<run_dir>/profile/rank<N>.pt.trace.json``: a Chrome trace per rank (chrome://tracing, Perfetto,
  TensorBoard's profiler plugin; ``torch.profiler`` writes it through ``export_chrome_trace``);
- ``<run_dir>/profile/top_ops_rank<N>.txt`` and ``.json``: the operators ranked by self time (CUDA time on
  a GPU, CPU time otherwise), printed by rank 0;
- ``<run_dir>/profile/breakdown_rank<N>.json``: where a step's time goes (``breakdown``): GPU kernel time
  against the step's span (the gaps are launch overhead and host waits), kernels by kind (matmuls, attention,
  head and loss, optimizer, the rest), the attention operator chosen, the optimizer step's host time, and the
  host-device syncs per step;
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
        parts = breakdown(json.loads(self.trace_path.read_text()))
        (self.dir / f"breakdown_rank{self.rank}.json").write_text(json.dumps(parts, indent=1))
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


# Kernel kinds by name (cuBLAS / CUTLASS / nvjet GEMMs, flash / memory-efficient / cuDNN attention, the head's
# softmax and loss, the optimizer's multi-tensor kernels; inductor's Triton kernels carry the fused ops' names).
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "attn")),
                ("loss_head", ("softmax", "nll", "cross_entropy", "crossentropy")),
                ("optimizer", ("adam", "multi_tensor", "foreach")),
                ("matmul", ("gemm", "cutlass", "nvjet", "sm90_xmma", "matmul", "mm_")),
                ("memcpy_memset", ("memcpy", "memset")))
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lower for k in keys)), "other")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _top_level_reads(host: list[dict]) -> int:
    """``aten::_local_scalar_dense`` calls made by the program (``.item()``, ``float(t)``), not by another
    operator's own kernel (a CPU fused AdamW reads each parameter's step count inside its kernel: no sync)."""
    ops = [e for e in host if e.get("cat") == "cpu_op"]
    reads = [e for e in ops if e["name"] == "aten::_local_scalar_dense"]
    others = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in ops  # .item() is aten::item around the read
              if e["name"] not in ("aten::_local_scalar_dense", "aten::item")]
    return sum(not any(a <= r["ts"] and r["ts"] + r.get("dur", 0.0) <= b for a, b in others) for r in reads)


def breakdown(trace: dict) -> dict:
    """Where the profiled steps' time went, per step (milliseconds), from a Chrome trace of torch.profiler:

    - ``step_ms``: the ProfilerStep spans (host time from one step's start to the next);
    - ``kernel_ms`` (summed) and ``gpu_busy_ms`` (time at least one kernel runs) against ``gpu_span_ms`` (first
      kernel start to last kernel end); ``launch_gap_share`` = 1 - busy / span: the GPU waiting for the host
      (launch overhead, syncs, data) inside the step;
    - ``kernel_ms_by_kind``: matmuls, attention, loss_head, optimizer, memcpy_memset, other;
    - ``attention_ops``: the scaled_dot_product_attention backends the host called (flash, efficient, cuDNN,
      math, the CPU's), with calls per step; ``top_attention_kernels``;
    - ``optimizer_step_host_ms``: the optimizer's ``step`` on the host;
    - ``syncs_per_step``: the program's reads of a tensor's value (``aten::_local_scalar_dense`` outside any
      other operator: .item(), float(), bool()) and CUDA synchronize calls. On a CPU trace the kernel fields are 0."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    n = max(len(steps), 1)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_kind: dict[str, float] = {}
    for k in kernels:
        kind = "memcpy_memset" if k.get("cat") != "kernel" else kernel_kind(k["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + k.get("dur", 0.0)
    intervals = [(k["ts"], k["ts"] + k.get("dur", 0.0)) for k in kernels]
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) if intervals else 0.0
    busy = _union_us(intervals)
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")]
    attention: dict[str, int] = {}
    for e in host:
        name = e["name"]
        if e.get("cat") == "cpu_op" and ("scaled_dot_product" in name or "flash_attention" in name
                                         or "efficient_attention" in name or "cudnn_attention" in name):
            attention[name] = attention.get(name, 0) + 1
    attn_kernels: dict[str, float] = {}
    for k in kernels:
        if k.get("cat") == "kernel" and kernel_kind(k["name"]) == "attention":
            attn_kernels[k["name"]] = attn_kernels.get(k["name"], 0.0) + k.get("dur", 0.0)
    optimizer = [e for e in host if str(e["name"]).startswith("Optimizer.step#")]
    reads = _top_level_reads(host)
    syncs = sum(e["name"] in SYNC_CALLS for e in host)
    ms = 1000.0
    return {"profiled_steps": len(steps), "step_ms": round(sum(e["dur"] for e in steps) / n / ms, 3),
            "kernels_per_step": round(sum(k.get("cat") == "kernel" for k in kernels) / n, 1),
            "kernel_ms": round(sum(k.get("dur", 0.0) for k in kernels) / n / ms, 3),
            "gpu_busy_ms": round(busy / n / ms, 3), "gpu_span_ms": round(span / n / ms, 3),
            "launch_gap_share": round(1 - busy / span, 4) if span else None,
            "kernel_ms_by_kind": {k: round(v / n / ms, 3) for k, v in sorted(by_kind.items())},
            "attention_ops": {k: round(v / n, 2) for k, v in sorted(attention.items())},
            "top_attention_kernels": [k for k, _ in sorted(attn_kernels.items(), key=lambda kv: -kv[1])[:3]],
            "optimizer_step_host_ms": round(sum(e["dur"] for e in optimizer) / n / ms, 3),
            "syncs_per_step": {"value_reads": round(reads / n, 2), "cuda_synchronize_calls": round(syncs / n, 2)}}
