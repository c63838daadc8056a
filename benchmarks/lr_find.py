"""lr-find against a 5-point learning-rate grid on the baby recipe (configs/shakespeare_char_baby.toml).

``scaletrain lr-find``'s suggestion (100-step exponential sweep from 1e-6 to 1, smoothed minimum / 10) is
compared with the best learning rate of a grid of five full trainings (3e-4, 1e-3, 3e-3, 1e-2, 3e-2), each
scored by its final val loss. The recipe is shortened to ``--steps`` steps (warmup and cosine scaled with it,
eval on the recipe's 20 batches) and runs eagerly on one thread, so the whole comparison fits in minutes on
2 shared cores; ``--steps 2000`` is the full recipe.

    .venv/bin/python benchmarks/lr_find.py          # ~10 minutes on 2 shared cores

Writes benchmarks/out/lr_find.json (``--out benchmarks/results/lr_find.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import OUT_HELP, default_out  # noqa: E402  (benchmarks/launch.py)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "shakespeare_char_baby.toml"
GRID = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2]


def job(steps: int, run_dir: str, lr: float | None = None):
    from scaletrain.config import load_config

    over = {"train.steps": steps, "schedule.warmup_steps": max(1, steps // 20), "train.eval_interval": 0,
            "train.compile": "false", "train.threads": 1, "train.run_dir": run_dir, "train.overwrite": "true",
            "checkpoint.enabled": "false", "train.sample_tokens": 0, "logging.progress": "off",
            "logging.tensorboard": "false", "data.cache_dir": str(Path(run_dir).parent / "data")}
    if lr is not None:
        over["optim.lr"] = lr
    return load_config(RECIPE, {k: str(v) for k, v in over.items()})


def interpolated_best(grid: list[dict]) -> float:
    """The vertex of the parabola in log(lr) through the grid's best point and its two neighbours (the grid
    point itself at an end): where between the grid points the best lr lies."""
    from mup import best_lr  # benchmarks/mup.py: the same rule for the width sweep

    return best_lr([g["lr"] for g in grid], [g["val_loss"] for g in grid])


def summarise(found: dict, grid: list[dict], steps: int, seconds: float) -> dict:
    best = min(grid, key=lambda g: g["val_loss"])
    suggested = found["suggested_lr"]
    ratio = max(suggested, best["lr"]) / min(suggested, best["lr"])
    between = interpolated_best(grid)
    ratio_between = max(suggested, between) / min(suggested, between)
    return {"benchmark": "lr_find", "recipe": str(RECIPE.relative_to(ROOT)), "steps": steps, "lr_find": found,
            "grid": grid, "grid_best_lr": best["lr"], "grid_best_val_loss": best["val_loss"],
            "ratio_to_grid_best": ratio, "within_2x": ratio <= 2, "interpolated_best_lr": between,
            "ratio_to_interpolated_best": ratio_between,
            "steepest_ratio_to_grid_best": max(found["steepest_lr"], best["lr"])
            / min(found["steepest_lr"], best["lr"]),
            "seconds": round(seconds, 1), "machine": platform.processor() or platform.machine()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=250, help="steps of each grid run (the recipe: 2000)")
    parser.add_argument("--out", default=default_out("lr_find.json"), help=OUT_HELP.format(name="lr_find.json"))
    parser.add_argument("--summarise", default="", help="an earlier lr_find.json: recompute its summary from its "
                                                        "saved sweep and grid, training nothing")
    args = parser.parse_args()
    if args.summarise:
        old = json.loads(Path(args.summarise).read_text())
        result = summarise(old["lr_find"], old["grid"], old["steps"], old["seconds"])
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    import torch

    from scaletrain.train.trainer import Trainer
    from scaletrain.tune.lr_find import lr_find

    torch.set_num_threads(1)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        found = lr_find(job(args.steps, f"{tmp}/lr"), Path(tmp) / "lr-find", start=1e-6, end=1.0, steps=100)
        sweep_seconds = time.time() - t0
        print(f"lr-find: suggested {found.suggested_lr:.3g} (minimum {found.min_lr:.3g}; {found.stopped}) "
              f"in {sweep_seconds:.0f} s", flush=True)
        grid = []
        for lr in GRID:
            t1 = time.time()
            loss = Trainer(job(args.steps, f"{tmp}/grid-{lr:g}", lr), log=False).train()["final_val_loss"]
            grid.append({"lr": lr, "val_loss": loss, "seconds": round(time.time() - t1, 1)})
            print(f"grid lr {lr:g}: val loss {loss:.4f}", flush=True)
    summary = {"suggested_lr": found.suggested_lr, "min_lr": found.min_lr, "steepest_lr": found.steepest_lr,
               "stopped": found.stopped, "points": len(found.lrs), "seconds": round(sweep_seconds, 1)}
    result = summarise(summary, grid, args.steps, time.time() - t0)
    print(f"suggested {found.suggested_lr:.3g} vs grid best {result['grid_best_lr']:g}: "
          f"{result['ratio_to_grid_best']:.2f}x (interpolated best {result['interpolated_best_lr']:.3g})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
