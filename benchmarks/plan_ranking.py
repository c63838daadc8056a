"""Does the plan search rank real runs correctly? Run candidates that really differ and compare the orders.

Two groups, each ranked by `scaletrain plan`'s search on this machine (``--hardware auto``) for one model and
global batch, each run for real:
  * one process (one core): micro-batches far apart (1, 4, 16 sequences, with gradient accumulation up to the
    global batch) x activation checkpointing none / full, plus the search's own top plan;
  * two ranks (torchrun, gloo, one core each): the search's best plan of each 2-rank layout (DDP, ZeRO-1,
    FSDP2, TP + SP, ...), through ``scaletrain.parallel.parallelize``.
Groups are not compared with each other (one core vs two). Every candidate is measured in each of
``--rounds`` interleaved rounds (round 1 runs every candidate once, then round 2, ...), so slow phases of
other jobs on the shared machine hit all candidates alike; each candidate's figure is the median over rounds
of its per-round median step time, and its noise is half the range of its per-round medians.

Verdict per group: the search's top plan (its #1: the predicted-fastest, or among plans predicted within 1% of
it the simplest / smallest) is the measured-fastest, or it is within measurement noise of it (its gap to the
measured-fastest is no larger than the larger of the two plans' noise), or it is not.

As in planner_accuracy.py, the default clock is the process's CPU time with one torch thread per process
(robust when other jobs share the cores; a 2-rank step is the slower rank's CPU time); ``--clock wall``
uses wall-clock medians.

    .venv/bin/python benchmarks/plan_ranking.py            # ~5-8 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from launch import OUT_HELP, default_out, run_ranks, write_result  # benchmarks/launch.py
from scaletrain.config import ModelConfig, build
from scaletrain.hardware.catalog import Cluster
from scaletrain.model.presets import PRESETS
from scaletrain.plan.hardware_spec import parse_hardware
from scaletrain.plan.search import Candidate, search
from scaletrain.plan.workload import Plan, Workload

SINGLE_MICRO_BATCHES = (1, 4, 16)
SINGLE_AC = ("none", "full")


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long lists (no ties expected in timings)."""
    ra = {i: r for r, i in enumerate(sorted(range(len(a)), key=a.__getitem__))}
    rb = {i: r for r, i in enumerate(sorted(range(len(b)), key=b.__getitem__))}
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1)) if n > 1 else 1.0


def single_candidates(ranked: list[Candidate]) -> list[Candidate]:
    """The search's top plan plus micro-batch {1, 4, 16} x AC {none, full}, in the search's order (which is
    predicted speed, except that plans within 1% of each other go simpler / smaller first)."""
    wanted = {c.plan.label(): c for c in ranked if c is ranked[0] or (
        c.plan.micro_batch in SINGLE_MICRO_BATCHES and c.plan.activation_checkpointing in SINGLE_AC)}
    return list(wanted.values())  # ranked order is kept: rows[0] is the search's top plan


def layout_candidates(ranked: list[Candidate]) -> list[Candidate]:
    """The best-ranked plan of each 2-rank layout (pipelines left out), in the search's order."""
    best: dict[tuple, Candidate] = {}
    for c in ranked:
        p = c.plan
        key = (p.dp_replicate, p.dp_shard, p.tp, p.zero_stage, p.sequence_parallel)
        if p.pp == 1 and p.cp == 1 and key not in best:
            best[key] = c
    return list(best.values())


def parallel_fields(plan: Plan) -> dict:
    """The ``[parallel]`` fields a 2-rank run of ``plan`` needs."""
    return {"dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "tp": plan.tp,
            "zero_stage": plan.zero_stage, "sequence_parallel": plan.sequence_parallel,
            "activation_checkpointing": plan.activation_checkpointing, "ac_every": plan.ac_every}


def run_single(cfg: ModelConfig, workload: Workload, plan: Plan, steps: int) -> dict:
    from scaletrain.plan.measure import single_process_run

    return single_process_run(cfg, workload.global_batch, workload.seq_len, plan.activation_checkpointing,
                              plan.ac_every, steps=steps, accum=plan.grad_accum(workload))


def run_two_ranks(args, workload: Workload, plan: Plan) -> dict:
    """torchrun 2 ranks of this script as workers; the step is the slower rank's."""
    spec = {"parallel": parallel_fields(plan), "batch_per_rank": workload.global_batch // plan.dp,
            "accum": plan.grad_accum(workload)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank.json"
        run_ranks([__file__, "--model", args.model, "--vocab-size", str(args.vocab_size), "--seq-len",
                   str(args.seq_len), "--steps", str(args.steps), "--worker", json.dumps(spec), "--worker-out",
                   str(out)], 2, plan.label())
        ranks = [json.loads(line) for line in out.read_text().splitlines()]
    return {"step_s": max(r["step_s"] for r in ranks), "step_cpu_s": max(r["step_cpu_s"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks)}


def worker(args) -> None:
    """One torchrun rank: measure the plan, append this rank's result as one JSON line."""
    import torch.distributed as dist

    from scaletrain.plan.measure import distributed_run

    spec = json.loads(args.worker)
    cfg = build(ModelConfig, {"preset": args.model, "vocab_size": args.vocab_size}, presets=PRESETS)
    result = distributed_run(cfg, spec["parallel"], spec["batch_per_rank"], args.seq_len, args.steps,
                             accum=spec["accum"])
    for rank in range(dist.get_world_size()):  # one writer at a time
        if rank == dist.get_rank():
            with open(args.worker_out, "a") as fh:
                fh.write(json.dumps({k: v for k, v in result.items() if k != "step_s_all"}) + "\n")
        dist.barrier()
    dist.destroy_process_group()


def verdict(rows: list[dict]) -> dict:
    """Is the search's top plan (rows[0]) the measured-fastest, or within measurement noise of it?"""
    measured = [r["measured_step_s"] for r in rows]
    best = min(range(len(rows)), key=measured.__getitem__)
    gap = measured[0] / measured[best] - 1
    noise = max(rows[0]["noise"], rows[best]["noise"])
    if best == 0:
        text = "the search's top plan is the measured-fastest"
    elif gap <= noise:
        text = (f"the search's top plan measured {gap:.1%} slower than the fastest ({rows[best]['plan']}), "
                f"within measurement noise ({noise:.1%})")
    else:
        text = (f"the search's top plan measured {gap:.1%} slower than the fastest ({rows[best]['plan']}), "
                f"more than the measurement noise ({noise:.1%})")
    return {"predicted_fastest_is_fastest": best == 0, "within_noise": best == 0 or gap <= noise,
            "gap_to_fastest": gap, "noise": noise, "measured_fastest": rows[best]["plan"],
            "spearman": spearman([r["predicted_step_s"] for r in rows], measured), "text": text}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="micro")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per candidate and round (median)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all candidates")
    parser.add_argument("--groups", default="single,two-ranks")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--out", default=default_out("planner_ranking.json"),
                        help=OUT_HELP.format(name="planner_ranking.json"))
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # one core per process; CPU time of one thread is robust to time-sharing
    if args.worker:
        worker(args)
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    cfg = build(ModelConfig, {"preset": args.model, "vocab_size": args.vocab_size}, presets=PRESETS)
    workload = Workload(cfg, args.seq_len, args.global_batch, 1e6, "fp32")
    hardware = parse_hardware("auto").hardware
    groups = {}
    if "single" in args.groups:
        groups["single"] = single_candidates(search(workload, Cluster(hardware, 1, 1)).ranked)
    if "two-ranks" in args.groups:
        groups["two-ranks"] = layout_candidates(search(workload, Cluster(hardware, 2, 1)).ranked)
    key = "step_cpu_s" if args.clock == "cpu" else "step_s"
    samples: dict[str, dict[str, list[float]]] = {g: {c.plan.label(): [] for c in cs} for g, cs in groups.items()}
    loads = []
    for round_ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for group, candidates in groups.items():
            for c in candidates:
                measured = run_single(cfg, workload, c.plan, args.steps) if group == "single" else \
                    run_two_ranks(args, workload, c.plan)
                samples[group][c.plan.label()].append(measured[key])
                console.print(f"round {round_ + 1} {group:9s} {c.plan.label():30s} predicted "
                              f"{c.time.step * 1e3:7.1f} ms  measured {measured[key] * 1e3:7.1f} ms ({args.clock})")
    loads.append(os.getloadavg()[0])

    report = {}
    for group, candidates in groups.items():
        rows = []
        for c in candidates:
            times = samples[group][c.plan.label()]
            median = statistics.median(times)
            rows.append({"plan": c.plan.label(), "micro_batch": c.plan.micro_batch,
                         "grad_accum": c.plan.grad_accum(workload), "ac": c.plan.activation_checkpointing,
                         "parallel": parallel_fields(c.plan), "predicted_step_s": c.time.step,
                         "measured_step_s": median, "round_medians_s": times,
                         "noise": (max(times) - min(times)) / 2 / median})
        v = verdict(rows)
        report[group] = {"rows": rows, **v}
        table = Table(title=f"{group}: {args.model} (vocab {args.vocab_size}), global batch {args.global_batch} x "
                            f"{args.seq_len}, {args.rounds} interleaved rounds ({args.clock} time)")
        for col in ("search rank", "plan", "pred ms", "meas ms (median)", "noise ±", "meas rank"):
            table.add_column(col)
        order = sorted(range(len(rows)), key=lambda i: rows[i]["measured_step_s"])
        for i, r in enumerate(rows):
            table.add_row(str(i + 1), r["plan"], f"{r['predicted_step_s'] * 1e3:.0f}",
                          f"{r['measured_step_s'] * 1e3:.0f}", f"{r['noise']:.1%}", str(order.index(i) + 1))
        console.print(table)
        console.print(f"{group}: {v['text']}; Spearman rank correlation {v['spearman']:.2f}")
    console.print(f"load average (1 min) at each round's start and at the end: {', '.join(f'{x:.1f}' for x in loads)}")
    write_result(args.out, {
        "workload": {"model": args.model, "vocab_size": args.vocab_size, "seq_len": args.seq_len,
                     "global_batch": args.global_batch}, "clock": args.clock, "rounds": args.rounds,
        "steps": args.steps, "load_average_1min": loads, "groups": report,
        "calibration_measured_at": hardware.calibration.get("measured_at"),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2)
    console.print(f"wrote {args.out}")
    return 0 if all(g["within_noise"] for g in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
