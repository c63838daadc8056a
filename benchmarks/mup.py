"""muP width transfer: the best learning rate of an LR sweep at widths 128, 256 and 512, under the standard
parametrization and under muP (base width 128), through the real ``Trainer``.

Each point trains a small Llama (2 layers, head_dim 32 so the heads grow with the width, SwiGLU 8/3 d) on
char-level Tiny Shakespeare (seq 32, batch 8) for ``--steps`` AdamW steps (warmup 10, cosine to lr/10,
fp32, eager, one thread) from the same seed and data order, at six learning rates 5e-4 .. 1.6e-2 a factor 2
apart, and is scored by the val loss over 10 fixed batches. The best lr of a width is the vertex of a parabola
through the three grid points around the grid's minimum in log(lr) (the grid minimum itself when it sits at an
end). Reported: each width's best lr and its drift from width 128 to 512 (muP should stay within 2x, the
standard parametrization should drift).

    .venv/bin/python benchmarks/mup.py              # ~10-15 minutes on 2 shared cores (two processes)

Writes benchmarks/out/mup.json (``--out benchmarks/results/mup.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import OUT_HELP, default_out, write_result  # noqa: E402  (benchmarks/launch.py)

WIDTHS = (128, 256, 512)
HEAD_DIM = 32
LRS = [1e-3 * 2 ** k for k in range(-1, 5)]  # 5e-4 .. 1.6e-2, factor 2


def point(parametrization: str, width: int, lr: float, steps: int, tmp: str) -> float:
    """Final val loss of one (parametrization, width, lr) run."""
    import torch

    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    over = {"model.dim": width, "model.n_layers": 2, "model.n_heads": width // HEAD_DIM, "model.ffn_hidden_dim": 0,
            "model.multiple_of": 32, "model.max_seq_len": 32, "model.parametrization": parametrization,
            "model.mup_base_width": 128, "data.seq_len": 32, "train.batch_size": 8, "train.steps": steps,
            "train.eval_interval": 0, "train.eval_batches": 10, "train.sample_tokens": 0, "train.precision": "fp32",
            "train.compile": "false", "train.threads": 1, "optim.lr": lr, "schedule.warmup_steps": 10,
            "schedule.min_lr": lr / 10, "checkpoint.enabled": "false", "logging.progress": "off",
            "logging.tensorboard": "false", "monitor.enabled": "false",
            "train.run_dir": f"{tmp}/{parametrization}-{width}-{lr:.2e}", "data.cache_dir": f"{tmp}/data"}
    trainer = Trainer(load_config(None, {k: str(v) for k, v in over.items()}), log=False)
    return float(trainer.train()["final_val_loss"])


def best_lr(lrs: list[float], losses: list[float]) -> float:
    """Vertex of the parabola in log(lr) through the grid minimum and its neighbours."""
    i = min(range(len(losses)), key=losses.__getitem__)
    if i in (0, len(losses) - 1):
        return lrs[i]
    x = [math.log(lrs[j]) for j in (i - 1, i, i + 1)]
    y = [losses[j] for j in (i - 1, i, i + 1)]
    denom = (x[0] - x[1]) * (x[0] - x[2]) * (x[1] - x[2])
    a = (x[2] * (y[1] - y[0]) + x[1] * (y[0] - y[2]) + x[0] * (y[2] - y[1])) / denom
    b = (x[2] ** 2 * (y[0] - y[1]) + x[1] ** 2 * (y[2] - y[0]) + x[0] ** 2 * (y[1] - y[2])) / denom
    return math.exp(-b / (2 * a)) if a > 0 else lrs[i]


def sweep(parametrization: str, steps: int, tmp: str) -> dict:
    out = {}
    for width in WIDTHS:
        t0 = time.time()
        losses = [point(parametrization, width, lr, steps, tmp) for lr in LRS]
        out[str(width)] = {"val_loss": losses, "best_lr": best_lr(LRS, losses),
                           "grid_best_lr": LRS[min(range(len(LRS)), key=losses.__getitem__)],
                           "seconds": round(time.time() - t0, 1)}
        print(f"{parametrization} width {width}: " + " ".join(f"{lr:.1e}:{v:.3f}" for lr, v in zip(LRS, losses))
              + f" -> best lr {out[str(width)]['best_lr']:.2e}", flush=True)
    return out


def _run(args: tuple) -> tuple[str, dict]:
    return args[0], sweep(*args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default=default_out("mup.json"), help=OUT_HELP.format(name="mup.json"))
    args = parser.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Pool(2) as pool:
        results = dict(pool.map(_run, [("standard", args.steps, tmp), ("mup", args.steps, tmp)]))
    summary = {}
    for kind, by_width in results.items():
        first, last = by_width[str(WIDTHS[0])]["best_lr"], by_width[str(WIDTHS[-1])]["best_lr"]
        summary[kind] = {"best_lr_128": first, "best_lr_512": last, "drift_128_to_512": max(first, last) /
                         min(first, last), "within_2x": max(first, last) / min(first, last) <= 2}
    result = {"benchmark": "mup", "widths": list(WIDTHS), "lrs": LRS, "steps": args.steps,
              "model": {"n_layers": 2, "head_dim": HEAD_DIM, "seq_len": 32, "batch": 8, "base_width": 128},
              "results": results, "summary": summary, "seconds": round(time.time() - t0, 1),
              "machine": platform.processor() or platform.machine()}
    print("| parametrization | best lr @128 | @256 | @512 | drift 128 -> 512 |\n|---|---|---|---|---|")
    for kind in ("standard", "mup"):
        r = results[kind]
        print(f"| {kind} | " + " | ".join(f"{r[str(w)]['best_lr']:.2e}" for w in WIDTHS)
              + f" | {summary[kind]['drift_128_to_512']:.2f}x |")
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
