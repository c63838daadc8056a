"""What expert parallelism costs a step on 2 gloo ranks of this CPU, and where it goes (issue 51).

Two parts, each in a fresh pair of torchrun ranks (one torch thread each, launch.run_ranks):

- ``collectives``: the exchanges of one sparse block under ep = 2 (parallel/expert.py) timed alone, ROUNDS rounds of
  CALLS calls, medians: the counts' ``dist.all_to_all_single`` of an (ep, E/ep) int64 table with its read back to the
  host, the rows' ``all_to_all_single_autograd`` forward (issued and waited on) and its backward (one more
  all-to-all), at two sizes of nano-moe's rows (ROW_SIZES x dim 128 fp32, split unevenly as routing does), and the
  4-byte all-reduce doctor's ``collective_latency_s`` measures. Process CPU time (both gloo threads included) and
  the wall clock, per call. The fixed CPU cost of one all-to-all (the fit's intercept over the two sizes) is
  timing.GLOO_ALL_TO_ALL_HOST_S's measurement.
- ``steps``: the trainer's step (plan.measure.distributed_run's build + training_step) on nano-moe, b8 t128, under DDP
  and FSDP2 at ep 1 and 2, its median CPU and wall time a step per rank; then one step under torch.profiler, the
  main thread's self time grouped (all-to-all, all-reduce and FSDP2's collectives, the ep path's permutations,
  DTensor's wrappers, the rest): the attribution docs/planning.md writes down.

    .venv/bin/python benchmarks/ep_host.py --out benchmarks/results/ep_host.json          # ~2 minutes
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

import torch

from launch import OUT_HELP, append_rank_result, default_out, run_ranks, write_result  # benchmarks/launch.py

ROUNDS, CALLS, DIM = 9, 20, 128
ROW_SIZES = (256, 2048)  # nano-moe at b8 t128 routes 1,024 tokens x top-2 = 2,048 rows a rank a layer
LAYOUTS = {"ddp": {"dp_replicate": 2}, "ddp-ep2": {"dp_replicate": 2, "ep": 2},
           "fsdp2": {"dp_shard": 2, "zero_stage": 3}, "fsdp2-ep2": {"dp_shard": 2, "zero_stage": 3, "ep": 2}}
# profiler op names (self time, main thread) by what they are; anything else is "rest"
GROUPS = {
    "all_to_all": ("c10d::alltoall_base_", "_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor",
                   "GeneratedBackwardFor__c10d_functional_all_to_all_single", "_c10d_functional_autograd::"),
    "all_reduce_and_fsdp_collectives": ("c10d::allreduce_", "c10d::_allgather_base_", "c10d::_reduce_scatter_base_",
                                        "c10d::allgather_", "c10d::reduce_scatter_", "FSDP::", "fsdp::"),
    "ep_permutations": ("aten::index", "aten::index_copy", "aten::repeat_interleave", "aten::cumsum",
                        "aten::index_select", "aten::index_add_", "aten::stack", "aten::_local_scalar_dense"),
    "dtensor_wrappers": ("_ToTorchTensor", "_FromTorchTensor", "PythonSubclass", "_ScaleGradient"),
}


def timed(fn, calls: int = CALLS, between=None) -> tuple[float, float]:
    """(CPU, wall) seconds of one call of ``fn``: ROUNDS rounds of ``calls`` calls after a warm-up, medians.
    ``between``: untimed work before each call (the step's compute between its collectives: caches cold, gloo's
    threads asleep, as in a step; back to back the same all-to-all costs about half the CPU)."""
    import torch.distributed as dist

    fn()
    cpu, wall = [], []
    for _ in range(ROUNDS):
        dist.barrier()
        spent = [0.0, 0.0]
        for _ in range(calls):
            if between is not None:
                between()
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            spent[0] += time.process_time() - c0
            spent[1] += time.perf_counter() - w0
        cpu.append(spent[0] / calls)
        wall.append(spent[1] / calls)
    return statistics.median(cpu), statistics.median(wall)


def collectives_worker() -> dict:
    """One rank of the ``collectives`` part: {name: [cpu_s, wall_s] per call}."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    rank, group = dist.get_rank(), dist.group.WORLD
    counts = torch.tensor([[300, 200, 250, 274], [260, 240, 280, 244]]).roll(rank, 0)  # (ep, E/ep) uneven
    out: dict[str, list[float]] = {}
    a, b = torch.randn(2048, DIM), torch.randn(DIM, 4 * DIM)

    def compute() -> None:  # ~2 ms of one core: a sparse block's expert GEMM between two exchanges
        (a @ b).relu_()

    def counts_exchange() -> list:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        return torch.stack([counts.sum(1), received.sum(1)]).tolist()

    out["counts_exchange"] = list(timed(counts_exchange, between=compute))
    one = torch.ones(1)
    out["all_reduce_4_bytes"] = list(timed(lambda: dist.all_reduce(one, group=group), between=compute))
    for rows in ROW_SIZES:
        kept = rows * 11 // 20  # 55% of a rank's rows stay, 45% go: routing's unevenness
        send = [kept, rows - kept] if rank == 0 else [rows - kept, kept]
        received = send  # rank 0 gets its own 55% and rank 1's 45%, and the mirror
        x = torch.randn(rows, DIM, requires_grad=True)

        def forward() -> torch.Tensor:
            y = all_to_all_single_autograd(x, received, send, group)
            return y * 1  # the first use waits for it, as rows[order] does

        out[f"all_to_all_forward_{rows}_rows"] = list(timed(forward, between=compute))
        grad = torch.randn(rows, DIM)
        graphs = [forward() for _ in range(ROUNDS * CALLS + 1)]  # backward each graph once
        out[f"all_to_all_backward_{rows}_rows"] = list(timed(lambda: graphs.pop().backward(grad), between=compute))
        out[f"all_to_all_bytes_sent_{rows}_rows"] = [send[1 - rank] * DIM * 4, rows * DIM * 4]  # leaving, all
    return out


def profiled_groups(step, steps: int = 2) -> dict[str, float]:
    """Milliseconds of the main thread's self time a step by GROUPS over ``steps`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    totals = dict.fromkeys([*GROUPS, "rest"], 0.0)
    for event in prof.key_averages():
        group = next((g for g, names in GROUPS.items() if event.key.startswith(names)), "rest")
        totals[group] += event.self_cpu_time_total / 1e3 / steps
    return totals


def steps_worker(layout: str, steps: int) -> dict:
    """One rank of the ``steps`` part for ``layout``: its median CPU and wall time a step, the profiled groups."""
    from scaletrain.config import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, build
    from scaletrain.model.presets import PRESETS
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.parallel.distributed import init_distributed
    from scaletrain.train.precision import autocast
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    env = init_distributed("cpu")
    model = build(ModelConfig, {"preset": "nano-moe", "vocab_size": 256}, presets=PRESETS)
    cfg = JobConfig(model=model, parallel=ParallelConfig(**LAYOUTS[layout]), optim=OptimConfig(),
                    train=TrainConfig(seed=0))
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(cfg.parallel, env.world_size),
                                            torch.device("cpu"))
    gen = torch.Generator().manual_seed(1000 * pm.dp_rank)
    inputs, targets = (torch.randint(0, 256, (8, 128), generator=gen) for _ in range(2))
    options = StepOptions(grad_clip=1.0, autocast=lambda: autocast("fp32", torch.device("cpu")))

    def step() -> float:
        return training_step(pm, optimizer, iter([(inputs, targets, None)]), 1, options).loss

    cpu, wall = timed(step, calls=1) if steps else (0.0, 0.0)
    return {"layout": layout, "step_cpu_ms": 1e3 * cpu, "step_wall_ms": 1e3 * wall,
            "profiled_self_ms": profiled_groups(step)}


def run_part(args: list[str]) -> list[dict]:
    """The part's two ranks' results (one JSON line each)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.jsonl"
        run_ranks([__file__, *args, "--worker-out", str(out)], 2, " ".join(args))
        return [json.loads(line) for line in out.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out("ep_host.json"), help=OUT_HELP.format(name="ep_host.json"))
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="collectives,steps",
                        help="comma-separated: collectives, steps; the other is kept from --out where it exists")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        import torch.distributed as dist

        if args.worker == "collectives":
            from scaletrain.parallel.distributed import init_distributed

            init_distributed("cpu")
            result = {"rank": dist.get_rank(), **collectives_worker()}
        else:
            result = {"rank": int(os.environ["RANK"]), **steps_worker(args.worker, ROUNDS)}
        append_rank_result(args.worker_out, result)
        return
    parts = set(args.parts.split(","))
    old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    result: dict = {"benchmark": "ep_host", "hardware": "cpu (this machine, 2 gloo ranks, one thread each)",
                    "rounds": ROUNDS, "calls": CALLS, "load_average_1min": {}}
    if isinstance(old.get("load_average_1min"), dict):
        result["load_average_1min"] = old["load_average_1min"]
    for part, run in (("collectives", collectives_part), ("steps", steps_part)):
        if part in parts:
            load = os.getloadavg()[0]
            result.update(run())
            result["load_average_1min"][part] = [load, os.getloadavg()[0]]
        else:
            result.update({k: old[k] for k in PART_KEYS[part] if k in old})
    write_result(args.out, result)


PART_KEYS = {"collectives": ("collectives", "all_to_all_fit"), "steps": ("steps",)}


def collectives_part() -> dict:
    """The ``collectives`` part's ranks, and the fixed CPU cost of one all-to-all: the intercept through the two
    sizes (the busiest rank's, forward and backward), and that less the 4-byte all-reduce's (the latency the
    planner already charges every collective)."""
    rows = run_part(["--worker", "collectives"])
    for name in rows[0]:
        if name != "rank" and not name.startswith("all_to_all_bytes"):
            print(f"{name:34s} " + "  ".join(f"rank {r['rank']}: {1e3 * r[name][0]:.3f} ms cpu, "
                                              f"{1e3 * r[name][1]:.3f} wall" for r in rows))
    latency = max(r["all_reduce_4_bytes"][0] for r in rows)
    fits = {}
    for direction in ("forward", "backward"):
        cpu = [max(r[f"all_to_all_{direction}_{n}_rows"][0] for r in rows) for n in ROW_SIZES]
        nbytes = [max(r[f"all_to_all_bytes_sent_{n}_rows"][0] for r in rows) for n in ROW_SIZES]
        per_byte = (cpu[1] - cpu[0]) / (nbytes[1] - nbytes[0])
        fixed = cpu[0] - per_byte * nbytes[0]
        fits[direction] = {"fixed_cpu_s": fixed, "cpu_s_per_byte": per_byte, "fixed_over_latency_s": fixed - latency}
        print(f"all-to-all {direction}: {1e3 * fixed:.3f} ms fixed ({1e3 * (fixed - latency):.3f} over the 4-byte "
              f"all-reduce), {per_byte * 1e9:.3f} ns a byte leaving the rank")
    return {"collectives": rows, "all_to_all_fit": fits}


def steps_part() -> dict:
    """The ``steps`` part: each layout's ranks."""
    steps = {layout: run_part(["--worker", layout]) for layout in LAYOUTS}
    for layout, ranks in steps.items():
        for r in ranks:
            print(f"{layout:10s} rank {r['rank']}: {r['step_cpu_ms']:.1f} ms cpu, {r['step_wall_ms']:.1f} wall; "
                  "profiled " + ", ".join(f"{k} {v:.1f}" for k, v in r["profiled_self_ms"].items()))
    return {"steps": steps}

if __name__ == "__main__":
    sys.exit(main())
