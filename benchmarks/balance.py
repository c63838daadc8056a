"""Load balancing across unequal workers: step time of ``parallel.balance = "throughput"`` vs equal batches.

Two gloo ranks train the same tiny model (dim 32, 2 layers, char-level Tiny Shakespeare, seq 32, micro-batch
4, 4 micro-batches per rank per step = 32 sequences a step, 60 AdamW steps) through the real ``Trainer`` in one
``torchrun`` launch of tests/helpers/slow_rank_train.py. Rank 1 is made slower: ``--slow-seconds`` before each
of its micro-batches (a slower device doing the same work later; ``--slow-threads`` can give it fewer torch threads
instead or as well). Equal and balanced runs alternate ``--repeats`` times in the same process group, so
machine load hits both alike; each run's median step time is taken, and the medians over repeats are reported,
with the split the balancer settled on and the largest relative loss difference between the two (the gradient
is the same, so the losses must agree to fp32 rounding).

    .venv/bin/python benchmarks/balance.py                  # ~1-2 minutes on 2 shared cores

Writes benchmarks/out/balance.json (``--out benchmarks/results/balance.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from launch import OUT_HELP, default_out, run_ranks, write_result  # benchmarks/launch.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from train.test_adaptive_dist import CONFIG  # noqa: E402  (the recipe the parity test trains)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow-seconds", type=float, default=0.02)
    parser.add_argument("--slow-threads", type=int, default=0)
    parser.add_argument("--out", default=default_out("balance.json"), help=OUT_HELP.format(name="balance.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = tmp / "tiny.toml"
        config.write_text(CONFIG.format(cache=tmp / "data"))
        specs = []
        for i in range(args.repeats):
            for mode in ("none", "throughput"):
                specs.append(f"{mode}{i}:parallel.balance={mode},parallel.dp_replicate=2,train.steps={args.steps},"
                             "checkpoint.enabled=false,parallel.balance_interval=5,"
                             f"train.run_dir={tmp / mode / str(i)}")
        out = tmp / "r.json"
        os.environ.update(SLOW_RANK="1", SLOW_SECONDS=str(args.slow_seconds), SLOW_THREADS=str(args.slow_threads))
        script = ROOT / "tests" / "helpers" / "slow_rank_train.py"
        run_ranks([str(script), "--config", str(config), "--out", str(out), *specs], 2, "balance benchmark")
        runs = json.loads(out.read_text())
        rows = [json.loads(line) for line in (tmp / "throughput" / "0" / "metrics.jsonl").read_text().splitlines()]
        counts = [r.get("micro_batches_per_rank") for r in rows]
        measured = [r["balance_micro_seconds"] for r in rows if "balance_micro_seconds" in r]
    equal = [runs[f"none{i}"]["median_step_ms"] for i in range(args.repeats)]
    balanced = [runs[f"throughput{i}"]["median_step_ms"] for i in range(args.repeats)]
    loss_diff = max(abs(a - b) / abs(a) for i in range(args.repeats)
                    for a, b in zip(runs[f"none{i}"]["losses"], runs[f"throughput{i}"]["losses"]))
    doc = {"setup": {"ranks": 2, "slow_rank": 1, "slow_seconds_per_micro_batch": args.slow_seconds,
                     "slow_threads": args.slow_threads, "steps": args.steps, "micro_batches_per_step": 8,
                     "micro_batch_sequences": 4, "seq_len": 32, "repeats": args.repeats,
                     "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)"},
           "equal_step_ms": statistics.median(equal), "balanced_step_ms": statistics.median(balanced),
           "speedup": round(statistics.median(equal) / statistics.median(balanced), 3),
           "equal_step_ms_each": equal, "balanced_step_ms_each": balanced,
           "final_split": next(c for c in reversed(counts) if c),
           "split_per_step_first_run": [c for c in counts if c], "micro_seconds_first_run": measured,
           "max_relative_loss_difference": loss_diff}
    write_result(args.out, doc, indent=1)
    print(f"| equal batches | {doc['equal_step_ms']:.1f} ms/step |\n| throughput balance | "
          f"{doc['balanced_step_ms']:.1f} ms/step (split {doc['final_split']}) |\n| speed-up | {doc['speedup']}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
