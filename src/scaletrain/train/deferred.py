"""No host-device sync in the training step's hot path: what a step would read back, read at the log steps.

A step reads two numbers (the loss and the gradient norm) that the NaN guard (train/guard.py), the log and the
progress line need. Reading one (``float(tensor)``, ``.item()``) waits for the GPU to finish everything queued,
so the host cannot queue the next step's kernels while this one runs: on a GPU each read costs a pipeline
drain per step. Here the step keeps them on the device (``train/step.py``'s ``DeferredGuard``) and ``DeferredReads``
reads every pending step's pair in one transfer when the trainer logs (every ``logging.log_interval`` steps,
and before an evaluation, a checkpoint and the end).

The NaN guard's decision is split in two:
- the *skip* of a non-finite step happens at once, on the device: the fused AdamW kernel takes the step's
  non-finite flag as ``found_inf`` (as the fp16 gradient scaler uses it) and leaves the weights, the moments and
  the step count untouched, so a bad batch never reaches the weights;
- the *count* (the warning, the ``skipped_update`` record, K-in-a-row rollback) happens at the next read:
  detection latency up to ``log_interval`` steps. A rollback found there goes back to the last checkpoint as
  before; the good steps taken after the K-th bad one in that window are thrown away with it.

Where the optimizer cannot skip on the device (Muon, ZeRO-1, foreach/loop AdamW, DeepSpeed) or the fp16 scaler
or the gradient noise scale reads per step anyway, the trainer uses the per-step reads as before
(``defer_reads``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from scaletrain.train.guard import NonFiniteGuard
from scaletrain.train.step import StepResult, skips_on_device


def defer_reads(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, engine_native: bool) -> bool:
    """True when the trainer's loop can leave each step's loss and norm on the device until the log step (a
    gradient-noise-scale step still reads its own: the trainer passes it the per-step guard)."""
    return engine_native and not scaler.is_enabled() and skips_on_device(optimizer)


@dataclass
class Read:
    """One step's numbers, once read: its loss, gradient norm and the guard's verdict."""

    step: int
    loss: float
    grad_norm: float
    verdict: str  # NonFiniteGuard.check's: ok, skip or rollback


class DeferredReads:
    """The loss and gradient norm of the steps since the last read, as device tensors."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def add(self, step: int, result: StepResult) -> None:
        self.pending.append((step, result.loss, result.grad_norm))

    def read(self, guard: NonFiniteGuard) -> list[Read]:
        """Every pending step's pair in one transfer (the only sync), through ``guard`` in step order; stops at
        a rollback (the steps after it are undone by it)."""
        if not self.pending:
            return []
        pairs = torch.stack([torch.stack([loss.detach().float().reshape(()), norm.detach().float().reshape(())])
                             for _, loss, norm in self.pending]).tolist()
        steps = [step for step, _, _ in self.pending]
        self.pending = []
        out = []
        for step, (loss, norm) in zip(steps, pairs):
            out.append(Read(step, loss, norm, guard.check(loss, norm)))
            if out[-1].verdict == "rollback":
                break
        return out


def settle(reads: list[Read], record: dict, step: int, log_event: Callable[[dict], None],
           message: Callable[[str], None], guard: NonFiniteGuard) -> bool:
    """Put the read numbers where the per-step path put them: ``record`` (this ``step``'s log record) gets its
    loss and norm, every skipped step its event and warning. True when the reads end in a rollback."""
    for r in reads:
        if r.step == step:
            record.update(loss=r.loss, grad_norm=r.grad_norm)
            if r.verdict != "ok":
                record["skipped_update"] = 1
        elif r.verdict != "ok":
            log_event({"step": r.step, "skipped_update": 1})
        if r.verdict != "ok":
            message(f"warning: step {r.step}: loss {r.loss} / gradient norm {r.grad_norm} is not finite; update "
                    f"skipped on the device (read at step {step}; {guard.consecutive} in a row)")
    return bool(reads) and reads[-1].verdict == "rollback"
