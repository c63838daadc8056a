"""``scaletrain lr-find``: the learning-rate range test (Smith 2015, "Cyclical Learning Rates", section 3.3;
the fastai / PyTorch Lightning ``lr_find`` recipe).

The job's own Trainer takes ``steps`` optimizer steps with the learning rate growing exponentially from
``start`` to ``end`` (``Trainer.lr_override``; no warmup, no decay), each on the next training batch. The loss
is smoothed with a bias-corrected exponential moving average, and the sweep stops once the smoothed loss
exceeds ``diverge`` x its minimum or, having fallen by 10%, climbs back above where it started (or a loss is
not finite): past there, larger learning rates only blow up. The second test is what stops a language model's
sweep: its loss cannot rise far above the untrained model's (log of the vocabulary), so "4 x the minimum" is
never reached.

Two suggestions are computed from the smoothed curve and both are saved; ``rule`` picks the one printed:
- ``steepest`` (the default, PyTorch Lightning's ``suggestion()``): the learning rate where the smoothed loss
  falls fastest per unit of log(lr) — the largest rate at which a step still buys the most progress;
- ``minimum``: the rate at the smoothed minimum divided by ``divisor`` (fastai's ``lr_min``; at the minimum a
  whole run sits on the edge of divergence).
The default was ``minimum`` until its suggestion on the baby recipe missed the 5-point grid's best by 2.27x;
``benchmarks/lr_find.py`` now scores both rules on that recipe and on recipes that were not used to choose.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from scaletrain.config import JobConfig
from scaletrain.core.files import write_file


@dataclasses.dataclass
class LRFindResult:
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    min_lr: float  # learning rate at the smoothed minimum
    steepest_lr: float  # learning rate where the smoothed loss falls fastest per log(lr)
    suggested_lr: float
    rule: str  # which of the two the suggestion is: steepest | minimum
    stopped: str  # why the sweep ended

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def sweep_config(cfg: JobConfig, run_dir: Path, steps: int) -> JobConfig:
    """The job as the range test runs it: ``steps`` steps, no schedule, no evaluation, no checkpoints."""
    return dataclasses.replace(
        cfg,
        schedule=dataclasses.replace(cfg.schedule, name="constant", warmup_steps=0),
        train=dataclasses.replace(cfg.train, steps=steps, stop_at_step=0, eval_interval=0, sample_tokens=0,
                                  run_dir=str(run_dir), resume=False, overwrite=True),
        checkpoint=dataclasses.replace(cfg.checkpoint, enabled=False),
        logging=dataclasses.replace(cfg.logging, progress="off"))


def lr_at_step(step: int, start: float, end: float, steps: int) -> float:
    """Exponential sweep: ``start`` at step 0, ``end`` at step ``steps - 1``."""
    return start * (end / start) ** (step / max(1, steps - 1))


RULES = ("steepest", "minimum")


def suggest(lrs: list[float], smoothed: list[float], divisor: float, rule: str = "steepest"
            ) -> tuple[float, float, float]:
    """(lr at the smoothed minimum, lr of steepest descent, the suggestion by ``rule``: the steepest point's lr
    or the minimum's / ``divisor``)."""
    i_min = min(range(len(smoothed)), key=smoothed.__getitem__)
    # Steepest: the most negative slope d(smoothed)/d(log lr) before the minimum (the early points are noise
    # around the initial loss; the slope is taken over neighbouring points).
    slopes = [(smoothed[i + 1] - smoothed[i - 1]) / math.log(lrs[i + 1] / lrs[i - 1])
              for i in range(1, max(1, i_min))]
    i_steep = 1 + min(range(len(slopes)), key=slopes.__getitem__) if slopes else i_min
    return lrs[i_min], lrs[i_steep], lrs[i_steep] if rule == "steepest" else lrs[i_min] / divisor


def diverged(value: float, first: float, best: float, diverge: float) -> str:
    """Why the sweep should stop at smoothed loss ``value`` (``first`` the first smoothed loss, ``best`` the
    lowest so far), or "" to go on."""
    if value > diverge * best:
        return f"smoothed loss {value:.3f} > {diverge:g} x minimum {best:.3f}"
    if value > first and best < 0.9 * first:  # it fell by 10%, then rose past where it started
        return f"smoothed loss {value:.3f} back above the first, {first:.3f}"
    return ""


def lr_find(cfg: JobConfig, run_dir: Path, start: float = 1e-6, end: float = 1.0, steps: int = 100,
            beta: float = 0.9, diverge: float = 4.0, divisor: float = 10.0, rule: str = "steepest", say=print
            ) -> LRFindResult:
    """Run the range test with the job's Trainer; returns the curve and the suggestion."""
    from scaletrain.train.trainer import Trainer, TrainingError

    trainer = Trainer(sweep_config(cfg, run_dir, steps), log=False)
    trainer.lr_override = lambda step: lr_at_step(step, start, end, steps)
    if rule not in RULES:
        from scaletrain.core.options import ConfigError

        raise ConfigError(f"--rule {rule!r}: choose one of {', '.join(RULES)}")
    lrs, losses, smoothed = [], [], []
    average, best, stopped = 0.0, math.inf, f"reached the end of the sweep ({end:g})"
    try:
        for step in range(steps):
            lr = lr_at_step(step, start, end, steps)
            try:
                loss = trainer.step()["loss"]
            except TrainingError:  # non-finite steps and no checkpoint to roll back to: diverged
                loss = math.nan
            if not math.isfinite(loss):
                stopped = f"the loss was not finite at lr {lr:.3g}"
                break
            average = beta * average + (1 - beta) * loss
            value = average / (1 - beta ** (step + 1))  # bias-corrected: the first values are not pulled to 0
            lrs.append(lr)
            losses.append(loss)
            smoothed.append(value)
            best = min(best, value)
            why = diverged(value, smoothed[0], best, diverge) if step > 10 else ""
            if why:
                stopped = f"diverged at lr {lr:.3g} ({why})"
                break
    finally:
        trainer.close()
    if len(lrs) < 3:
        from scaletrain.core.options import ConfigError

        raise ConfigError(f"lr-find stopped after {len(lrs)} steps ({stopped}); lower --start")
    min_lr, steepest_lr, suggested = suggest(lrs, smoothed, divisor, rule)
    return LRFindResult(lrs, losses, smoothed, min_lr, steepest_lr, suggested, rule, stopped)


def curve_table(result: LRFindResult, rows: int = 12) -> str:
    """A few points of the curve, as text."""
    every = max(1, len(result.lrs) // rows)
    lines = ["       lr   loss  smoothed"]
    for i in list(range(0, len(result.lrs), every)) + [len(result.lrs) - 1]:
        lines.append(f"{result.lrs[i]:9.2e}  {result.losses[i]:5.3f}  {result.smoothed[i]:8.3f}")
    return "\n".join(dict.fromkeys(lines))  # the last point once


def save(result: LRFindResult, out: Path, cfg_path: str) -> Path:
    path = out / "lr_find.json"
    return write_file(path, json.dumps({"config": cfg_path, **result.as_dict()}, indent=1), f"the curve {path}")
