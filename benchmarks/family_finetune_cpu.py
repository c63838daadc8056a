"""Fine-tuning a family base on this CPU: the step's CPU time against the planner's, and where the time goes
(issue 54, item 3).

    python benchmarks/family_finetune_cpu.py [--out benchmarks/results/family_finetune_cpu.json]
        [--rows qwen2.5-0.5b:lora:256,...] [--profile]

Each row is a random base of a published family shape (``model/presets.py``) with fewer layers (the head, the
vocabulary and every block's shape are the published ones; only the depth is cut so a row stays under a couple
of minutes of CPU), exported to a temporary Hugging Face folder and fine-tuned in a fresh process with the
trainer's own step (``build_parallel_training`` + ``training_step`` under the trainer's bf16 autocast, what
``precision auto`` picks on this AMX CPU), one torch thread, batch 1. Measured: the median **process CPU time**
(``time.thread_time``) of steps 2..N, which other jobs time-sharing the cores do not inflate; planned:
``finetune_step_time`` with ``--hardware auto``'s one-thread calibration (``scaletrain doctor --clock cpu``).

``--profile`` also runs one step under torch.profiler (record_shapes) and sorts every operator's self time into
buckets by what it is (the head's forward and input-gradient GEMMs, its weight cast, the loss's elementwise
work over the vocabulary, the frozen blocks' GEMMs, LoRA's rank-r GEMMs, the weight casts of the blocks,
attention, QLoRA's NF4 dequantization, the rest), scaled to the step's CPU time (the profiler reads the wall
clock: on a shared machine each bucket is its share of the profiled step times the CPU-timed step), beside the
planner's breakdown of the same step (``finetune_cpu_breakdown``).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

# preset:method:seq:layers. Layers cut to keep a row under ~2 minutes of CPU.
ROWS = ("qwen2.5-0.5b:lora:256:4", "qwen2.5-0.5b:qlora:256:4", "qwen2.5-0.5b:lora:1024:4",
        "qwen2.5-0.5b:qlora:1024:4", "llama-3.2-1b:lora:256:2", "llama-3.2-1b:qlora:1024:2",
        "smollm2-135m:lora:256:8", "smollm2-135m:qlora:1024:8", "gemma-3-270m:lora:256:6",
        "gemma-3-270m:qlora:1024:6")
STEPS = 6


def bucket(name: str, shapes: list, cfg, rank: int) -> str:
    """What one profiled operator is, from its name and input shapes."""
    vocab, dims = cfg.vocab_size, [tuple(s) for s in shapes if isinstance(s, list | tuple) and s]
    flat = [x for s in dims for x in s if isinstance(x, int)]
    if "dequant" in name.lower() or "nf4" in name.lower():
        return "nf4 dequant"
    if name in ("aten::mm", "aten::addmm", "aten::bmm"):
        two = [s for s in dims if len(s) == 2]
        if any(vocab in s for s in two):
            return "head fwd gemm" if two[0][-1] != vocab else "head input-grad gemm"
        if rank in flat:
            return "lora gemm"
        return "base gemm"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if vocab in flat:
        if name == "aten::copy_" and len(dims[0]) == 2 and dims[0][0] == vocab:
            return "head weight cast"
        return "loss elementwise (vocab)"
    if name == "aten::copy_" and dims and len(dims[0]) == 2:
        return "block weight cast"
    return "other"


def profile_buckets(step, cfg, rank: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    out: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        out[bucket(event.name, event.input_shapes, cfg, rank)] += event.self_cpu_time_total / 1e6
    del torch
    return dict(out)


def planned(spec: str) -> dict:
    """The planner's step for the row ``spec`` (``--hardware auto``, one thread, bf16, batch 1) and its parts."""
    from scaletrain.config import FinetuneConfig, ModelConfig
    from scaletrain.model.presets import PRESETS
    from scaletrain.plan.finetune import finetune_cpu_breakdown, finetune_step_time
    from scaletrain.plan.hardware_spec import parse_hardware
    from scaletrain.plan.workload import Plan, Workload

    preset, method, seq, layers = spec.split(":")
    model = ModelConfig(**{**PRESETS[preset], "n_layers": int(layers), "max_seq_len": max(int(seq), 1024)})
    workload = Workload(model=model, seq_len=int(seq), global_batch=1, train_tokens=int(seq), precision="bf16")
    cluster, ft = parse_hardware("auto"), FinetuneConfig(method=method)
    return {"planned_step_s": finetune_step_time(workload, Plan(micro_batch=1), cluster, ft)["step_seconds"],
            "planned_breakdown": finetune_cpu_breakdown(workload, Plan(micro_batch=1), cluster, ft)}


def measure(spec: str, profile: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    from tokenizers import Tokenizer, models

    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import FinetuneConfig, JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
    from scaletrain.data.tokenizer import BPETokenizer
    from scaletrain.model import build_model
    from scaletrain.model.presets import PRESETS
    from scaletrain.parallel import ParallelDims
    from scaletrain.train.precision import autocast
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    preset, method, seq, layers = spec.split(":")
    seq, layers = int(seq), int(layers)
    model = ModelConfig(**{**PRESETS[preset], "n_layers": layers, "max_seq_len": max(seq, 1024)})
    with tempfile.TemporaryDirectory() as tmp:
        tok = BPETokenizer(Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(model.vocab_size)},
                                                      unk_token="t0")))
        export_hf(build_model(model, seed=0), model, tok, tmp)
        ft = FinetuneConfig(source=tmp, method=method)
        cfg = JobConfig(model=model, optim=OptimConfig(), train=TrainConfig(seed=0, precision="bf16"), finetune=ft)
        pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1),
                                                torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    micro = [tuple(torch.randint(0, model.vocab_size, (1, seq), generator=gen) for _ in range(2)) + (None,)]
    options = StepOptions(grad_clip=1.0, autocast=lambda: autocast("bf16", torch.device("cpu")))

    def step():
        return training_step(pm, optimizer, iter(micro), 1, options).loss

    times = []
    for _ in range(STEPS):
        t0 = time.thread_time()
        step()
        times.append(time.thread_time() - t0)
    measured = statistics.median(times[1:])
    row = {"preset": preset, "method": method, "seq_len": seq, "n_layers": layers, "vocab_size": model.vocab_size,
           "dim": model.dim, "step_cpu_s": times, "measured_step_cpu_s": measured,
           "best_step_cpu_s": min(times[1:]), **planned(spec)}
    row["error"] = row["planned_step_s"] / measured - 1
    if profile:
        raw = profile_buckets(step, model, ft.lora_rank)
        total = sum(raw.values())
        row["profiled_wall_s"] = total
        row["measured_breakdown"] = {k: v / total * measured for k, v in sorted(raw.items(), key=lambda kv: -kv[1])}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--rows", default=",".join(ROWS), help="preset:method:seq:layers, comma-separated")
    parser.add_argument("--profile", action="store_true", help="also a profiled step's buckets")
    parser.add_argument("--replan", default="", help="a previous result JSON: keep its measurements, plan its rows "
                                                     "again (after a calibration or a change to plan/)")
    parser.add_argument("--out", default=default_out("family_finetune_cpu.json"),
                        help=OUT_HELP.format(name="family_finetune_cpu.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.profile)))
        return 0
    import os
    import platform

    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    previous = {f"{r['preset']}:{r['method']}:{r['seq_len']}:{r['n_layers']}": r
                for r in json.loads(open(args.replan).read())["rows"]} if args.replan else {}
    if previous:
        import torch

        torch.set_num_threads(1)  # the one-thread calibration
    for spec in list(previous) or [s.strip() for s in args.rows.split(",") if s.strip()]:
        if spec in previous:
            row = {**previous[spec], **planned(spec)}
            row["error"] = row["planned_step_s"] / row["measured_step_cpu_s"] - 1
        else:
            cmd = [sys.executable, __file__, "--one", spec] + (["--profile"] if args.profile else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{spec:28s} measured {row['measured_step_cpu_s']:6.2f} s CPU  planned {row['planned_step_s']:6.2f} s  "
              f"error {100 * row['error']:+6.1f}%", flush=True)
        for key in ("measured_breakdown", "planned_breakdown"):
            if key in row:
                print(f"    {key}: " + ", ".join(f"{k} {v:.3f}" for k, v in row[key].items()), flush=True)
    errors = [abs(r["error"]) for r in rows]
    result = {"machine": platform.processor() or platform.machine(), "threads": 1, "clock": "process CPU time",
              "batch": 1, "steps": STEPS, "precision": "bf16 (autocast)", "date": time.strftime("%Y-%m-%d"),
              "rows": rows, "max_abs_error": max(errors), "median_abs_error": statistics.median(errors)}
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
