"""NaN/Inf guard: skip updates whose loss or gradient norm is not finite; after K in a row, roll back.

The trainer asks ``check(loss, grad_norm)`` before stepping the optimizer:
  "ok"       -> step as usual;
  "skip"     -> drop this update (the gradients are zeroed), go on with the next batch;
  "rollback" -> K consecutive bad steps: the trainer reloads the last good checkpoint's weights, optimizer
                and counters but keeps the data position where it is now, so the offending window of data
                is skipped rather than replayed.

With an fp16 gradient scaler an infinite gradient norm is the scaler's normal overflow signal (it skips
the step and lowers the scale itself), so only a non-finite *loss* counts then.
"""

from __future__ import annotations

import math


class NonFiniteGuard:
    def __init__(self, rollback_after: int = 3):
        self.rollback_after = rollback_after  # 0 = skip bad steps but never roll back
        self.consecutive = 0
        self.skipped_total = 0
        self.rollbacks = 0

    def check(self, loss: float, grad_norm: float, scaler_enabled: bool = False) -> str:
        finite = math.isfinite(loss) and (scaler_enabled or math.isfinite(grad_norm))
        if finite:
            self.consecutive = 0
            return "ok"
        self.consecutive += 1
        self.skipped_total += 1
        if self.rollback_after and self.consecutive >= self.rollback_after:
            self.consecutive = 0
            self.rollbacks += 1
            return "rollback"
        return "skip"

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "skipped_total": self.skipped_total, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state["consecutive"])
        self.skipped_total = int(state["skipped_total"])
        self.rollbacks = int(state["rollbacks"])
