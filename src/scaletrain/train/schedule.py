"""Learning-rate schedules as pure functions of the step: nothing to checkpoint but the step itself."""

from __future__ import annotations

import math

from scaletrain.config import ScheduleConfig


def lr_at(step: int, peak_lr: float, total_steps: int, cfg: ScheduleConfig) -> float:
    """Learning rate for the update that takes the model from ``step`` to ``step + 1`` completed steps.

    warmup: linear from peak/warmup up to peak over ``warmup_steps`` (never 0, so step 0 learns);
    cosine: half-cosine from peak to min_lr by ``decay_steps`` (default: total), then min_lr;
    linear: straight line from peak to min_lr; constant: peak;
    wsd (warmup-stable-decay): peak until the last ``wsd_decay_fraction`` of the steps, then linear to min_lr.
    """
    if step < cfg.warmup_steps:
        return peak_lr * (step + 1) / cfg.warmup_steps
    end_lr = decay_end_lr(peak_lr, cfg)
    decay_end = cfg.decay_steps or total_steps
    if cfg.name == "constant":
        return peak_lr
    if cfg.name == "wsd":
        decay_start = max(cfg.warmup_steps, int(decay_end * (1 - cfg.wsd_decay_fraction)))
        if step < decay_start:
            return peak_lr
        progress = min(1.0, (step - decay_start) / max(1, decay_end - decay_start))
        return peak_lr + (end_lr - peak_lr) * progress
    if step >= decay_end:
        return end_lr
    progress = (step - cfg.warmup_steps) / max(1, decay_end - cfg.warmup_steps)
    if cfg.name == "linear":
        return peak_lr + (end_lr - peak_lr) * progress
    return end_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - end_lr)


def decay_end_lr(peak_lr: float, cfg: ScheduleConfig) -> float:
    """Where the decay ends: ``schedule.min_lr``, or a tenth of the peak when it is -1 (the default), so the
    default schedule fits any ``optim.lr`` (a fine-tune's 2e-5 as well as pretraining's 1e-3)."""
    return cfg.min_lr if cfg.min_lr >= 0 else peak_lr / 10


# Runs of at most this many steps check that a command works (most documented runs: 3, 4, 6, 10 or 20 steps);
# where their learning rate ends does not matter, and a warning on each would teach people to ignore it.
SMOKE_STEPS = 20


def warmup_warning(total_steps: int, peak_lr: float, cfg: ScheduleConfig) -> str:
    """One warning line when the learning rate never reaches optim.lr because the warmup outlasts the run (the
    default 100 warmup steps in a 60-step run), else "". Not for a warmup that ends on the last step (that step
    runs at optim.lr) nor for a run of at most ``SMOKE_STEPS`` steps."""
    if cfg.warmup_steps <= total_steps or total_steps <= SMOKE_STEPS:
        return ""
    reached = lr_at(total_steps - 1, peak_lr, total_steps, cfg)
    return (f"warning: schedule.warmup_steps={cfg.warmup_steps} is longer than train.steps={total_steps}: the "
            f"learning rate only rises, to {reached:.3g} ({reached / peak_lr:.0%} of optim.lr={peak_lr:g}) at the "
            f"last step; set --schedule.warmup_steps to at most {total_steps} to reach optim.lr")
