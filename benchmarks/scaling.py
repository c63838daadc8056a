"""Scaling benchmark: tokens/s and per-rank memory of every parallel strategy, 1 vs 2 ranks, one thread each.

Each strategy trains the same nano-class model (dim 128, 4 layers, 4 heads, seq 128, char-level Tiny
Shakespeare) for a few steps through the real ``Trainer`` under ``torchrun`` (gloo); the median step time
after the first steps gives tokens/s. Data-parallel strategies keep 8 sequences per rank (weak scaling: 2
ranks process twice the tokens per step); TP and PP split one batch of 8 over both ranks.

Per-rank memory is reported two ways: the model-state bytes this rank holds (parameters + AdamW moments,
local shards only; the quantity ZeRO/FSDP reduce) and the process's peak RSS (dominated here by the ~330
MB the torch runtime itself takes).

The machine's 2 cores are shared, so rounds are interleaved (every strategy once per round) and medians
over rounds are reported with the load average; compare ratios within one run, not absolute numbers.

    .venv/bin/python benchmarks/scaling.py                # ~4-6 minutes
    .venv/bin/python benchmarks/scaling.py --rounds 1 --steps 12 --only ddp,fsdp3

Writes benchmarks/out/scaling.json (``--out benchmarks/results/scaling.json`` replaces the tracked result) and
prints a markdown table.
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

MODEL = {"model.dim": 128, "model.n_layers": 4, "model.n_heads": 4, "model.ffn_hidden_dim": 344,
         "model.max_seq_len": 128, "model.vocab_size": 66, "data.seq_len": 128, "train.batch_size": 8}

# name -> (ranks, overrides)
STRATEGIES: dict[str, tuple[int, dict]] = {
    "single": (1, {}),
    "single_ac_full": (1, {"parallel.activation_checkpointing": "full"}),
    "ddp": (2, {"parallel.dp_replicate": 2}),
    "zero1": (2, {"parallel.dp_replicate": 2, "parallel.zero_stage": 1}),
    "fsdp2_zero2": (2, {"parallel.dp_shard": 2, "parallel.zero_stage": 2}),
    "fsdp2_zero3": (2, {"parallel.dp_shard": 2, "parallel.zero_stage": 3}),
    "fsdp2_zero3_ac_full": (2, {"parallel.dp_shard": 2, "parallel.activation_checkpointing": "full"}),
    "tp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": "false"}),
    "tp_sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": "true"}),
    "pp_gpipe": (2, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "parallel.pp_microbatches": 4}),
    "pp_1f1b": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "parallel.pp_microbatches": 4}),
    "pp_interleaved_1f1b": (2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b",
                                "parallel.pp_virtual_stages": 2, "parallel.pp_microbatches": 4}),
    "local_sgd_h16": (2, {"parallel.dp_replicate": 2, "parallel.low_comm": "local_sgd", "parallel.sync_every": 16}),
    "diloco_h16": (2, {"parallel.dp_replicate": 2, "parallel.low_comm": "diloco", "parallel.sync_every": 16}),
}


# -- worker: runs inside each rank ---------------------------------------------------------------------
def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def worker(name: str, steps: int, run_dir: str, cache: str, out: str) -> None:
    import torch.distributed as dist

    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    overrides = {**MODEL, **STRATEGIES[name][1], "train.steps": steps, "train.threads": 1,
                 "train.eval_interval": 0, "train.eval_batches": 1, "train.sample_tokens": 0,
                 "checkpoint.enabled": "false", "logging.progress": "off", "logging.tensorboard": "false",
                 "logging.log_interval": steps, "schedule.warmup_steps": 2, "train.run_dir": run_dir,
                 "data.cache_dir": cache}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # ours, so it outlives Trainer.train() for the gather below
    trainer = Trainer(load_config(None, {k: str(v) for k, v in overrides.items()}))
    state_bytes = _local_bytes(trainer.pm.parameters())
    inner = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeRO-1 keeps its shard's AdamW in .optim
    trainer.step()  # creates the optimizer states
    state_bytes += _local_bytes(v for s in inner.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    trainer.train()
    times = trainer.throughput.step_times[3:]  # skip warm-up steps
    from scaletrain.train.metrics import peak_memory_bytes

    mine = {"model_state_mb": state_bytes / 2**20, "peak_rss_mb": peak_memory_bytes(trainer.device) / 2**20}
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    if trainer.is_main:
        median = statistics.median(times)
        Path(out).write_text(json.dumps({
            "median_step_ms": 1000 * median, "tokens_per_step": trainer.tokens_per_step,
            "tokens_per_second": trainer.tokens_per_step / median, "per_rank": every,
            "all_reduce_calls_per_step": trainer.pm.comm.all_reduce_calls / max(trainer.state.step, 1)}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# -- launcher ----------------------------------------------------------------------------------------------
def launch(name: str, steps: int, tmp: Path) -> dict:
    ranks = STRATEGIES[name][0]
    out = tmp / f"{name}.json"
    run_ranks([str(Path(__file__).resolve()), "--worker", name, "--steps", str(steps), "--run-dir", str(tmp / name),
               "--cache", str(tmp / "data"), "--worker-out", str(out)], ranks, name, timeout=900)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated strategy names")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=default_out("scaling.json"), help=OUT_HELP.format(name="scaling.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.run_dir, args.cache, args.worker_out)
        return 0
    names = [n for n in STRATEGIES if not args.only or n in args.only.split(",")]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name in names:
                loads.append(os.getloadavg()[0])
                runs[name].append(launch(name, args.steps, Path(tmp)))
    base = statistics.median(r["tokens_per_second"] for r in runs["single"]) if "single" in runs else None
    rows = []
    for name in names:
        rs = runs[name]
        tps = statistics.median(r["tokens_per_second"] for r in rs)
        rows.append({"strategy": name, "ranks": STRATEGIES[name][0], "overrides": STRATEGIES[name][1],
                     "median_step_ms": statistics.median(r["median_step_ms"] for r in rs),
                     "tokens_per_step": rs[0]["tokens_per_step"], "tokens_per_second": tps,
                     "speedup_vs_single": tps / base if base else None,
                     "model_state_mb_per_rank": [round(x["model_state_mb"], 3) for x in rs[0]["per_rank"]],
                     "peak_rss_mb_per_rank": [round(x["peak_rss_mb"]) for x in rs[0]["per_rank"]],
                     "all_reduce_calls_per_step": rs[0]["all_reduce_calls_per_step"],
                     "rounds": [r["tokens_per_second"] for r in rs]})
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch_threads_per_rank": 1, "steps_per_run": args.steps, "rounds": args.rounds,
              "load_average_during_runs": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": MODEL, "rows": rows}
    write_result(args.out, result, indent=1)
    print("| strategy | ranks | tokens/step | tokens/s (median) | per round | vs single | model state MB/rank | "
          "peak RSS MB/rank |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        speed = f"{r['speedup_vs_single']:.2f}x" if r["speedup_vs_single"] else "-"
        print(f"| {r['strategy']} | {r['ranks']} | {r['tokens_per_step']} | {r['tokens_per_second']:,.0f} | "
              f"{' / '.join(f'{t:,.0f}' for t in r['rounds'])} | {speed} | "
              f"{' / '.join(f'{m:.2f}' for m in r['model_state_mb_per_rank'])} | "
              f"{' / '.join(map(str, r['peak_rss_mb_per_rank']))} |")
    print(f"load average during the runs: {result['load_average_during_runs']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
