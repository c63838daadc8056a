"""Mixed precision: autocast context plus a gradient scaler for fp16."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from scaletrain.config import ConfigError
from scaletrain.hardware.peak import cpu_bf16_speedup
from scaletrain.parallel.distributed import rank_zero_value
from scaletrain.train.fp8 import check_fp8_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available (use cpu or auto)")
    return torch.device(name)


# auto picks bf16 on a CPU whose bf16 matmuls measure at least this much faster than fp32: autocast's casts
# and bf16's coarser rounding need a clear win (an AVX-512 BF16 core measures ~2x, an AVX2-only one ~0.01x).
BF16_MIN_SPEEDUP = 1.5


def resolve_precision(name: str, device: torch.device, log: Callable[[str], None] | None = None,
                      measure: bool = True) -> tuple[str, str]:
    """``(precision, why)``: an explicit name as given (fp16 needs a GPU: CPU autocast fp16 is slow); auto ->
    bf16 on a GPU that supports it, and on a CPU bf16 when this CPU's bf16 matmul throughput, measured once and
    cached (``hardware.cpu_bf16_speedup``; ``log`` hears of a measurement), is at least ``BF16_MIN_SPEEDUP``
    times fp32's, else fp32. ``why`` is the reason for the log line, e.g. "precision auto -> fp32: bf16
    matmul measured 0.01x fp32 on this CPU"; empty for an explicit name. ``measure=False``: a provisional
    fp32 on a CPU without measuring, for a rank that takes rank 0's decision once the process group exists."""
    if name == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs a GPU; use fp32 (or bf16) on the CPU")
    if name == "fp8":  # torchao Float8Linear (train/fp8.py): a GPU with fp8 tensor cores, else one line
        check_fp8_device(device)
    if name != "auto":
        return name, ""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "precision auto -> bf16: this GPU supports bf16"
        return "fp32", "precision auto -> fp32: this GPU has no bf16 support"
    if not measure:
        return "fp32", ""
    speedup = cpu_bf16_speedup(log)
    chosen = "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"
    ratio = f"{speedup:.2g}" if speedup < 10 else f"{speedup:.0f}"  # 0.01, 2.3, 16: never 1.6e+01
    return chosen, (f"precision auto -> {chosen}: bf16 matmul measured {ratio}x fp32 on this CPU "
                    f"(bf16 from {BF16_MIN_SPEEDUP}x)")


def agree_on_precision(precision: str, why: str, device: torch.device) -> tuple[str, str]:
    """``(precision, why)`` of rank 0 on every rank, for ``train.precision = auto`` under torchrun: only rank 0
    measured, before the process group existed, and ranks must not train in different precisions.
    Collective: every rank calls it."""
    chosen = "bf16" if rank_zero_value(float(precision == "bf16"), device) else "fp32"
    return (precision, why) if chosen == precision else (chosen, f"precision auto -> {chosen}: rank 0's measurement")


def autocast(precision: str, device: torch.device):
    """Weights stay fp32 (the optimizer's master copy); matmuls run in the low-precision dtype."""
    if precision == "fp32":
        return contextlib.nullcontext()
    # fp8: the Float8Linear layers cast their own matmuls; everything else runs in bf16.
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "fp8" else DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A real scaler for fp16 (its range is too narrow for small gradients); a disabled one otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
