"""Does the plan search rank real runs correctly? Run its top CPU candidates and compare the orders.

`scaletrain plan` on this machine (``--hardware auto``, one process) ranks every fitting
(micro-batch x activation-checkpointing) plan for one model and global batch. This script runs the top
candidates for real (the trainer's fp32 step with gradient accumulation), measures their median step
time, and reports whether the predicted-fastest plan is the measured-fastest and
the rank correlation of the two orders. Writes benchmarks/results/planner_ranking.json.

As in planner_accuracy.py, the default is one torch thread and the process's CPU time (robust when other
jobs share the cores); ``--clock wall`` uses wall-clock medians measured when a matmul probe says the
machine is quiet.

    .venv/bin/python benchmarks/plan_ranking.py            # ~1-2 minutes on a quiet machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scaletrain.config import ModelConfig, build
from scaletrain.model.presets import PRESETS
from scaletrain.plan.hardware import parse_hardware
from scaletrain.plan.measure import single_process_run, wait_for_quiet
from scaletrain.plan.search import search
from scaletrain.plan.spec import Workload

RESULTS = Path(__file__).parent / "results" / "planner_ranking.json"


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long lists (no ties expected in timings)."""
    ra = {i: r for r, i in enumerate(sorted(range(len(a)), key=a.__getitem__))}
    rb = {i: r for r, i in enumerate(sorted(range(len(b)), key=b.__getitem__))}
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1)) if n > 1 else 1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="micro")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--top", type=int, default=6, help="candidates to run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--noise", type=float, default=0.03,
                        help="measured times closer than this fraction count as a tie")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    import torch

    if args.clock == "cpu":
        torch.set_num_threads(1)  # CPU time of one thread == its wall time on a dedicated core

    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    cfg = build(ModelConfig, {"preset": args.model, "vocab_size": args.vocab_size}, presets=PRESETS)
    workload = Workload(cfg, args.seq_len, args.global_batch, 1e6, "fp32")
    cluster = parse_hardware("auto")
    result = search(workload, cluster)
    candidates = result.ranked[: args.top]
    peak = cluster.hardware.peak_flops["fp32"]
    rows = []
    key = "step_cpu_s" if args.clock == "cpu" else "step_s"
    for c in candidates:
        if args.clock == "wall":
            wait_for_quiet(peak, log=console.print)
        accum = c.plan.grad_accum(workload)
        measured = single_process_run(cfg, args.global_batch, args.seq_len, c.plan.activation_checkpointing,
                                      c.plan.ac_every, steps=args.steps, accum=accum)
        rows.append({"plan": c.plan.label(), "micro_batch": c.plan.micro_batch, "grad_accum": accum,
                     "ac": c.plan.activation_checkpointing, "predicted_step_s": c.time.step,
                     "measured_step_s": measured[key], "measured_wall_s": measured["step_s"],
                     "predicted_peak_bytes": c.memory.tensor_total, "measured_peak_bytes": measured["peak_bytes"]})
        console.print(f"{c.plan.label():28s} predicted {c.time.step * 1e3:8.1f} ms  measured "
                      f"{measured[key] * 1e3:8.1f} ms ({args.clock})")
    predicted = [r["predicted_step_s"] for r in rows]
    measured = [r["measured_step_s"] for r in rows]
    best_measured = min(measured)
    fastest_is_first = measured[0] <= best_measured * (1 + args.noise)
    rho = spearman(predicted, measured)

    table = Table(title=f"{args.model} (vocab {args.vocab_size}), global batch {args.global_batch} x {args.seq_len}: "
                        f"the search's top {len(rows)} CPU plans, run")
    for col in ("predicted rank", "plan", "pred ms", "meas ms", "measured rank"):
        table.add_column(col)
    order = sorted(range(len(rows)), key=measured.__getitem__)
    for i, r in enumerate(rows):
        table.add_row(str(i + 1), r["plan"], f"{r['predicted_step_s'] * 1e3:.1f}", f"{r['measured_step_s'] * 1e3:.1f}",
                      str(order.index(i) + 1))
    console.print(table)
    console.print(f"predicted-fastest is the measured-fastest (within {args.noise:.0%}): {fastest_is_first}; "
                  f"Spearman rank correlation {rho:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workload": {"model": args.model, "vocab_size": args.vocab_size,
                                                       "seq_len": args.seq_len, "global_batch": args.global_batch},
                                          "rows": rows, "predicted_fastest_is_fastest": fastest_is_first,
                                          "spearman": rho, "noise_tolerance": args.noise, "clock": args.clock,
                                          "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
    console.print(f"wrote {args.out}")
    return 0 if fastest_is_first else 1


if __name__ == "__main__":
    sys.exit(main())
