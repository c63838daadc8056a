"""Elastic world size: a run that gains a node and loses it again, beside an uninterrupted run.

Two ``torchrun --nnodes=1:2 --rdzv-backend=c10d`` agents on localhost train the tiny model of
tests/train/test_elastic.py (dim 32, 2 layers, char-level Tiny Shakespeare, 8 sequences a step, a checkpoint every
step): agent A starts alone (1 rank, 2 micro-batches a step), agent B joins at ``--join-at`` (2 ranks, 1
micro-batch each), B is killed ``--run-two`` steps later (A goes on alone). The same steps are trained by one
plain process. Written: both loss curves, the world size of each step, the events, the largest relative loss
difference, and the wall time of the elastic run (on a shared machine most of it is process start-up and the
rendezvous rounds).

    .venv/bin/python benchmarks/elastic.py                  # 2-4 minutes on 2 shared cores

Writes benchmarks/out/elastic.json (``--out benchmarks/results/elastic.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

from launch import OUT_HELP, default_out, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from train.test_elastic import GLOBAL_BATCH, data_cursors, elastic_run, reference_run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--join-at", type=int, default=5)
    parser.add_argument("--run-two", type=int, default=8)
    parser.add_argument("--out", default=default_out("elastic.json"), help=OUT_HELP.format(name="elastic.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "elastic").mkdir()
        (tmp / "reference").mkdir()
        got = elastic_run(tmp / "elastic", args.steps, join_at=args.join_at, run_two=args.run_two)
        want = reference_run(tmp / "reference", args.steps)
        cursors = data_cursors(tmp / "elastic" / "run")
    got.pop("log")
    doc = {"setup": {"agents": "torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d (localhost)",
                     "steps": args.steps, "global_batch_sequences": GLOBAL_BATCH, "seq_len": 32,
                     "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)"},
           "elastic": got, "uninterrupted_losses": want,
           "max_relative_loss_difference": max(abs(a - b) / b for a, b in zip(got["losses"], want)),
           "steps_on_two_ranks": sum(r == 2 for r in got["ranks"]),
           "checkpoint_cursors_equal_step_x_batch": all(c == s * GLOBAL_BATCH for s, c in cursors.items()),
           "checkpoints_checked": len(cursors)}
    write_result(args.out, doc, indent=1)
    print("| step | ranks | elastic loss | uninterrupted loss |\n|---|---|---|---|")
    for s, r, a, b in zip(got["steps"], got["ranks"], got["losses"], want):
        print(f"| {s} | {r} | {a:.5f} | {b:.5f} |")
    print(f"max relative difference {doc['max_relative_loss_difference']:.2e}, {got['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
