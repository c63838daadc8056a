"""The planner's mixture of experts against real steps on this CPU: predicted vs measured step time and peak memory.

Each row trains a tiny mixture of experts (and, for scale, its dense twin) in this process for a few steps of the
trainer's own step (scaletrain.plan.measure.single_process_run: forward, loss with the balancing term, backward,
clip, AdamW), one torch thread, and asks the planner (memory_breakdown, step_time) for the same numbers with the
reference CPU's calibration (hardware/reference_cpu.py: this machine's kind, one thread on the CPU clock). Targets:
memory within 10%, step time within 15%.

The machine is shared with other work: step times are medians, and the measured time is the process's CPU time
per step (what the calibration's CPU clock measured), the wall clock is recorded beside it. It also times
torch._grouped_mm against E single-expert GEMMs at a few shapes (timing.GROUPED_GEMM_CPU_SLOWDOWN's measurement).

    .venv/bin/python benchmarks/plan_moe.py --out benchmarks/results/plan_moe.json    # ~2 minutes
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py
from scaletrain.config import ModelConfig, build
from scaletrain.hardware.catalog import CATALOG, Cluster
from scaletrain.model.presets import PRESETS, active_params, num_params
from scaletrain.plan.measure import resident_extras, single_process_run
from scaletrain.plan.memory import memory_breakdown
from scaletrain.plan.timing import step_time
from scaletrain.plan.workload import Plan, Workload

MEMORY_TARGET, TIME_TARGET = 0.10, 0.15
# (name, model fields, batch, seq, activation checkpointing)
ROWS = [
    ("nano-moe-b8-t128", {"preset": "nano-moe", "vocab_size": 256}, 8, 128, "none"),
    ("nano-moe-b4-t256", {"preset": "nano-moe", "vocab_size": 256}, 4, 256, "none"),
    ("nano-moe-b8-t128-acfull", {"preset": "nano-moe", "vocab_size": 256}, 8, 128, "full"),
    ("moe-e16-top4-b8-t128", {"preset": "nano-moe", "vocab_size": 256, "moe_experts": 16, "moe_top_k": 4,
                              "moe_hidden_dim": 96}, 8, 128, "none"),
    ("nano-dense-b8-t128", {"preset": "nano", "vocab_size": 256}, 8, 128, "none"),
]


# Published MoE training throughput with its setup, against the planner's prediction for the same plan (priced only:
# the trainer cannot run expert parallelism on several ranks yet, so the prediction calls evaluate() directly).
# Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (NVIDIA's Megatron-Core MoE team), "Intra-node EP strategy":
# Qwen3-235B-A22B, 256 H100 (NVLink 4, InfiniBand 8 x 50 GB/s), BF16, sequence 4096, TP 2, EP 8, FSDP on, MBS 4,
# GBS 2048, full recompute, DeepEP dispatcher: 17.6 s a step, 276 TFLOPS a GPU.
PUBLISHED = [
    {"row": "megatron-qwen3-235b-256xh100", "preset": "qwen3-235b-a22b", "hardware": "h100-sxm", "gpus": 256,
     "seq": 4096, "global_batch": 2048, "plan": dict(dp_shard=128, tp=2, ep=8, zero_stage=3, micro_batch=4,
                                                      activation_checkpointing="full"),
     "published_step_s": 17.6, "published_tflops_per_gpu": 276},
]


def published_rows() -> list[dict]:
    """The planner's step time and TFLOPS a GPU (its FLOPs a token: flops_per_token, active experts) for each
    published row's own plan, and with the plan's ep = 1 for comparison."""
    from scaletrain.plan.search import evaluate

    out = []
    for row in PUBLISHED:
        cfg = build(ModelConfig, {"preset": row["preset"]}, presets=PRESETS)
        workload = Workload(cfg, row["seq"], row["global_batch"], 1e10, "bf16")
        cluster = Cluster(CATALOG[row["hardware"]], 8, row["gpus"] // 8)
        result = {**{k: v for k, v in row.items() if k != "plan"}, "plan": Plan(**row["plan"]).label()}
        for suffix, plan in (("", Plan(**row["plan"])), ("_ep1", Plan(**{**row["plan"], "ep": 1}))):
            candidate = evaluate(workload, plan, cluster)
            t = candidate.time
            result[f"predicted_step_s{suffix}"] = t.step
            result[f"predicted_tflops_per_gpu{suffix}"] = workload.flops_per_token * t.tokens_per_second \
                / row["gpus"] / 1e12
            result[f"predicted_all_to_all_s{suffix}"] = t.comm_detail.get("ep", 0.0)
            result[f"predicted_gib{suffix}"] = candidate.memory.total / 2**30
        result["step_error"] = row["published_step_s"] / result["predicted_step_s"] - 1  # tokens/s: planned/published
        out.append(result)
        print(f"{row['row']}: planned {result['predicted_step_s']:.1f} s a step "
              f"({result['predicted_tflops_per_gpu']:.0f} TFLOPS a GPU), published {row['published_step_s']} s "
              f"({row['published_tflops_per_gpu']}): tokens/s {result['step_error']:+.0%}")
    return out


def grouped_gemm_ratios() -> list[dict]:
    """Median seconds of torch._grouped_mm over E experts of r rows, over E times one expert's GEMM of r rows."""
    out = []
    for experts, rows, d, h in [(8, 16, 128, 176), (8, 64, 128, 176), (8, 256, 128, 176), (16, 128, 256, 256)]:
        x, w = torch.randn(experts * rows, d), torch.randn(experts, h, d)
        offsets = torch.arange(1, experts + 1, dtype=torch.int32) * rows

        def median(fn) -> float:
            fn()
            times = []
            for _ in range(7):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        grouped = median(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets))
        one = median(lambda: x[:rows] @ w[0].T)
        out.append({"experts": experts, "rows": rows, "dim": d, "hidden": h, "ratio": grouped / (one * experts)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out("plan_moe.json"), help=OUT_HELP.format(name="plan_moe.json"))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the calibration's one thread
    cluster = Cluster(CATALOG["cpu"], 1)
    rows = []
    for name, fields, batch, seq, ac in ROWS:
        cfg = build(ModelConfig, dict(fields), presets=PRESETS)
        measured = single_process_run(cfg, batch, seq, ac, steps=args.steps)
        workload, plan = Workload(cfg, seq, batch, 1e6), Plan(micro_batch=batch, activation_checkpointing=ac)
        memory = memory_breakdown(workload, plan, "cpu").tensor_total + resident_extras(cfg, batch, seq)
        predicted = step_time(workload, plan, cluster).step
        row = {"row": name, "params_total": num_params(cfg), "params_active": active_params(cfg),
               "predicted_ms": 1e3 * predicted, "measured_cpu_ms": 1e3 * measured["step_cpu_s"],
               "measured_wall_ms": 1e3 * measured["step_s"], "time_error": predicted / measured["step_cpu_s"] - 1,
               "predicted_mib": memory / 2**20, "measured_mib": measured["peak_bytes"] / 2**20,
               "memory_error": memory / measured["peak_bytes"] - 1}
        rows.append(row)
        print(f"{name:26s} time {row['predicted_ms']:7.1f} ms planned, {row['measured_cpu_ms']:7.1f} measured (cpu), "
              f"{row['measured_wall_ms']:7.1f} wall: {row['time_error']:+.1%}; memory {row['predicted_mib']:.1f} vs "
              f"{row['measured_mib']:.1f} MiB: {row['memory_error']:+.1%}")
    published = published_rows()
    ratios = grouped_gemm_ratios()
    print("grouped GEMM / E x one expert's GEMM:", ", ".join(f"{r['ratio']:.2f}" for r in ratios))
    within = all(abs(r["time_error"]) <= TIME_TARGET and abs(r["memory_error"]) <= MEMORY_TARGET for r in rows)
    write_result(args.out, {"benchmark": "plan_moe", "hardware": "cpu (reference calibration, one thread)",
                            "steps": args.steps, "rows": rows, "published": published,
                            "grouped_gemm": ratios, "all_within_targets": within,
                            "note": "machine shared with other work: medians; measured = process CPU time a step"})


if __name__ == "__main__":
    main()
