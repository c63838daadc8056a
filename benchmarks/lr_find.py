"""lr-find against a 5-point learning-rate grid, on the baby recipe and on two variants of it.

For each recipe, ``scaletrain lr-find``'s 100-step exponential sweep (1e-6 to 1) is compared with the best
learning rate of a grid of five full trainings (3e-4, 1e-3, 3e-3, 1e-2, 3e-2), each scored by its final val
loss. Both of lr-find's rules are scored: ``steepest`` (the default: where the smoothed loss falls fastest)
and ``minimum`` (the smoothed minimum's lr / 10, the default until it missed on the baby recipe by 2.27x).

The recipes (``RECIPES``): the baby recipe (configs/shakespeare_char_baby_adamw.toml) — the one the default rule
was changed after — and two that were not looked at before the change: the same recipe with the 4x larger
``micro`` model (dim 256), and with a 512-token BPE tokenizer instead of characters. Each is shortened to
``--steps`` steps (warmup and cosine scaled with it, eval on the recipe's 20 batches) and runs eagerly on one
thread, so the comparison fits in ~30 minutes on 2 shared cores; ``--steps 2000`` is the full recipe.

    .venv/bin/python benchmarks/lr_find.py [--recipes baby,micro,bpe]

Writes benchmarks/out/lr_find.json (``--out benchmarks/results/lr_find.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import OUT_HELP, default_out, write_result  # noqa: E402  (benchmarks/launch.py)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "shakespeare_char_baby_adamw.toml"
GRID = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
RECIPES = {  # name -> overrides of the baby recipe
    "baby": {},
    "micro": {"model.preset": "micro"},  # dim 256, 4 blocks: 4x the parameters, the same data
    "bpe": {"data.tokenizer": "bpe", "data.vocab_size": 512},  # ~2.3 characters a token, 64 tokens a sequence
}
RULES = ("steepest", "minimum")


def job(steps: int, run_dir: str, recipe: dict, lr: float | None = None):
    from scaletrain.config import load_config

    over = {"train.steps": steps, "schedule.warmup_steps": max(1, steps // 20), "train.eval_interval": 0,
            "train.compile": "false", "train.threads": 1, "train.run_dir": run_dir, "train.overwrite": "true",
            "checkpoint.enabled": "false", "train.sample_tokens": 0, "logging.progress": "off",
            "logging.tensorboard": "false", "data.cache_dir": str(Path(run_dir).parent / "data"), **recipe}
    if lr is not None:
        over["optim.lr"] = lr
    return load_config(RECIPE, {k: str(v) for k, v in over.items()})


def interpolated_best(grid: list[dict]) -> float:
    """The vertex of the parabola in log(lr) through the grid's best point and its two neighbours (the grid
    point itself at an end): where between the grid points the best lr lies."""
    from mup import best_lr  # benchmarks/mup.py: the same rule for the width sweep

    return best_lr([g["lr"] for g in grid], [g["val_loss"] for g in grid])


def ratio(a: float, b: float) -> float:
    return max(a, b) / min(a, b)


def one_recipe(name: str, steps: int, tmp: str) -> dict:
    """lr-find and the grid on one recipe; both rules' suggestions and their distance from the grid's best."""
    from scaletrain.train.trainer import Trainer
    from scaletrain.tune.lr_find import lr_find

    t0 = time.time()
    found = lr_find(job(steps, f"{tmp}/{name}/lr", RECIPES[name]), Path(tmp) / name / "lr-find", start=1e-6,
                    end=1.0, steps=100)
    suggestions = {"steepest": found.steepest_lr, "minimum": found.min_lr / 10}
    print(f"{name}: lr-find steepest {found.steepest_lr:.3g}, minimum/10 {found.min_lr / 10:.3g} "
          f"({found.stopped}) in {time.time() - t0:.0f} s", flush=True)
    grid = []
    for lr in GRID:
        t1 = time.time()
        loss = Trainer(job(steps, f"{tmp}/{name}/grid-{lr:g}", RECIPES[name], lr), log=False).train()["final_val_loss"]
        grid.append({"lr": lr, "val_loss": loss, "seconds": round(time.time() - t1, 1)})
        print(f"{name}: grid lr {lr:g}: val loss {loss:.4f}", flush=True)
    best = min(grid, key=lambda g: g["val_loss"])
    between = interpolated_best(grid)
    return {"overrides": RECIPES[name], "min_lr": found.min_lr, "stopped": found.stopped, "points": len(found.lrs),
            "suggestions": suggestions, "grid": grid, "grid_best_lr": best["lr"],
            "grid_best_val_loss": best["val_loss"], "interpolated_best_lr": between,
            "ratio_to_grid_best": {r: ratio(v, best["lr"]) for r, v in suggestions.items()},
            "ratio_to_interpolated_best": {r: ratio(v, between) for r, v in suggestions.items()},
            "seconds": round(time.time() - t0, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=250, help="steps of each grid run (the recipe: 2000)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"which of {', '.join(RECIPES)}")
    parser.add_argument("--out", default=default_out("lr_find.json"), help=OUT_HELP.format(name="lr_find.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    recipes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.recipes.split(","):
            recipes[name] = one_recipe(name, args.steps, tmp)
    within = {r: {n: v["ratio_to_grid_best"][r] <= 2 for n, v in recipes.items()} for r in RULES}
    result = {"benchmark": "lr_find", "recipe": str(RECIPE.relative_to(ROOT)), "steps": args.steps,
              "default_rule": "steepest", "recipes": recipes, "within_2x": within,
              "worst_ratio": {r: max(v["ratio_to_grid_best"][r] for v in recipes.values()) for r in RULES},
              "seconds": round(time.time() - t0, 1), "machine": platform.processor() or platform.machine()}
    print(f"{'recipe':8s} {'grid best':>9s} " + " ".join(f"{r + ' (ratio)':>20s}" for r in RULES))
    for name, v in recipes.items():
        print(f"{name:8s} {v['grid_best_lr']:9.1e} " + " ".join(
            f"{v['suggestions'][r]:11.2e} ({v['ratio_to_grid_best'][r]:4.2f}x)" for r in RULES))
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
