"""Low-communication data parallelism: DDP vs local SGD vs DiLoCo at equal tokens, 2 ranks (gloo).

All three train the tiny recipe of ``test_diloco_reaches_ddp_loss_with_h_times_fewer_all_reduces``
(``low_comm_recipe`` in tests/parallel/test_parallel_dist.py: dim 64, 4 layers, 4 heads, char-level Tiny
Shakespeare, seq 64, 8 sequences per rank, 200 AdamW steps, warm-up 20) from the same initialisation
and the same data order, through the real ``Trainer``, in one ``torchrun`` launch of
tests/helpers/dist_train.py. Only the data-parallel mode differs:

- DDP: gradients all-reduced every step (DDP's bucketed all-reduce, counted by a comm hook);
- local SGD, H = 10: weights averaged every 10 steps;
- DiLoCo, H = 10: pseudo-gradients averaged every 10 steps, outer Nesterov SGD (lr 0.7, momentum 0.9).

Reported: the final validation loss (over ``--eval-batches`` fixed batches of 8 x 64 tokens; the test
uses 2, more here for a steadier number), its ratio to DDP's, and the all-reduce calls and bytes each
mode issued. Each extra ``--seeds`` entry trains the three again from another init and data order.

    .venv/bin/python benchmarks/low_comm.py                 # ~1-2 minutes per seed on 2 shared cores
    .venv/bin/python benchmarks/low_comm.py --seeds 7,8,9

Writes benchmarks/out/low_comm.json (``--out benchmarks/results/low_comm.json`` replaces the tracked result)
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from launch import (  # benchmarks/launch.py (the script's folder is on sys.path)
    OUT_HELP,
    default_out,
    run_ranks,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from parallel.test_parallel_dist import low_comm_recipe  # noqa: E402  (the recipe the DiLoCo test trains)

SYNC_EVERY = 10
COMMON = {"parallel.dp_replicate": 2, "checkpoint.enabled": "false", "logging.log_interval": 50}
# name -> overrides on top of the recipe and COMMON
MODES: dict[str, dict] = {
    "ddp": {},
    "local_sgd": {"parallel.low_comm": "local_sgd", "parallel.sync_every": SYNC_EVERY},
    "diloco": {"parallel.low_comm": "diloco", "parallel.sync_every": SYNC_EVERY, "parallel.outer_lr": 0.7,
               "parallel.outer_momentum": 0.9},
}


def run_seed(seed: int, eval_batches: int, tmp: Path) -> dict:
    """One torchrun launch (2 ranks) training DDP, local SGD and DiLoCo in turn; rank 0's summaries."""
    config = tmp / "tiny.toml"
    config.write_text(low_comm_recipe(tmp / "data"))
    out = tmp / f"seed{seed}.json"
    specs = []
    for name, overrides in MODES.items():
        every = {**COMMON, **overrides, "train.seed": seed, "train.eval_batches": eval_batches,
                 "train.run_dir": tmp / f"{name}-{seed}"}
        specs.append(f"{name}:" + ",".join(f"{k}={v}" for k, v in every.items()))
    script = ROOT / "tests" / "helpers" / "dist_train.py"
    run_ranks([str(script), "--config", str(config), "--out", str(out), *specs], 2, f"seed {seed}", timeout=1800)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="7", help="comma-separated train.seed values (7 is the test's)")
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--out", default=default_out("low_comm.json"), help=OUT_HELP.format(name="low_comm.json"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            result = run_seed(seed, args.eval_batches, Path(tmp))
            for name in MODES:
                r = result[name]
                runs[name].append({"seed": seed, "steps": r["steps"], "final_val_loss": r["final_val_loss"],
                                   "all_reduce_calls": r["all_reduce_calls"], "all_reduce_bytes": r["all_reduce_bytes"],
                                   "median_step_ms": r["median_step_ms"], "losses": r["losses"]})
    ddp_by_seed = {r["seed"]: r["final_val_loss"] for r in runs["ddp"]}
    rows = []
    for name in MODES:
        rs = runs[name]
        ratios = [r["final_val_loss"] / ddp_by_seed[r["seed"]] for r in rs]
        rows.append({"mode": name, "overrides": MODES[name], "seeds": seeds,
                     "final_val_loss_mean": statistics.fmean(r["final_val_loss"] for r in rs),
                     "ratio_to_ddp_mean": statistics.fmean(ratios), "ratio_to_ddp_per_seed": ratios,
                     "all_reduce_calls": rs[0]["all_reduce_calls"], "all_reduce_bytes": rs[0]["all_reduce_bytes"],
                     "runs": rs})
    result = {
        "command": "python benchmarks/low_comm.py " + " ".join(sys.argv[1:]),
        "recipe": "low_comm_recipe in tests/parallel/test_parallel_dist.py (dim 64, 4 layers, 4 heads, ffn 128, "
                  "char-level Tiny Shakespeare, seq 64, 8 sequences/rank, 200 steps, warm-up 20); 2 ranks, gloo",
        "sync_every": SYNC_EVERY, "eval_batches": args.eval_batches,
        "tokens_per_run": 200 * 2 * 8 * 64, "seconds": round(time.time() - t0, 1),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average_end": os.getloadavg()},
        "rows": rows,
    }
    write_result(args.out, result, indent=1)
    print(f"seeds {seeds}, {args.eval_batches} val batches, {result['tokens_per_run']:,} tokens per run\n")
    print("| mode | final val loss | vs DDP | all-reduce calls | bytes all-reduced |")
    print("|---|---|---|---|---|")
    for row in rows:
        per_seed = " / ".join(f"{r['final_val_loss']:.3f}" for r in row["runs"])
        print(f"| {row['mode']} | {per_seed} | {row['ratio_to_ddp_mean']:.3f}x | {row['all_reduce_calls']} | "
              f"{row['all_reduce_bytes'] / 1e6:.1f} MB |")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
