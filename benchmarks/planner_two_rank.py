"""The planner on two ranks: `scaletrain plan` against real 2-rank `scaletrain train` runs on this CPU.

Each row is a shape of our own (FSDP2 ZeRO-3 and ZeRO-2, DDP and ZeRO-1, tensor parallelism; fp32, a few steps, about a
minute each): the real run is launched as a user launches it,

    torchrun --standalone --nproc-per-node 2 -m scaletrain.cli train --config ROW.toml --parallel.dp_shard=2 ...

(gloo, one thread per rank), and its measured peak memory per rank (`peak_memory_mb_per_rank` in
metrics.jsonl: the resident set's high-water mark, what the machine must hold) and median step time are read
back; then `scaletrain plan --config ROW.toml --hardware auto:2 ...` is asked for the same shape with every part
of the plan pinned, and its memory per device and step are compared. Reported apart from the one-process rows
of benchmarks/planner_accuracy.py (which compares tensor bytes; this compares what a run's `done:` line says).

Targets: memory within 10%, step time within 15%. Step times measured while other jobs share the cores are
not final (the planner's step is a quiet machine's): rerun on a quiet machine for them. The calibration is
`doctor`'s: run `scaletrain doctor` and `torchrun --nproc-per-node 2 -m scaletrain.cli doctor` first (the plan
measures it if missing, slowly).

    .venv/bin/python benchmarks/planner_two_rank.py                       # every row (~8 minutes)
    .venv/bin/python benchmarks/planner_two_rank.py --rows z3-d384,ddp-d384 --steps 6
    .venv/bin/python benchmarks/planner_two_rank.py --rows held_out --steps 6 \
        --out benchmarks/results/planner_two_rank_held_out.json             # issue 36's shape (~5 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch import OUT_HELP, default_out, run_ranks, write_result  # benchmarks/launch.py

MEMORY_TARGET, TIME_TARGET = 0.10, 0.15
WARMUP_STEPS = 2  # the first steps allocate and fill caches: not in the median


@dataclass
class Row:
    name: str
    model: dict  # [model] fields
    batch: int  # sequences per rank (train.batch_size is per data-parallel rank)
    seq: int
    parallel: dict = field(default_factory=dict)  # [parallel] fields

    def config(self, steps: int) -> str:
        """The row's job TOML (fp32 as `auto` picks on an AVX2 CPU; no eval, sample or checkpoint in the steps)."""
        model = "\n".join(f"{k} = {json.dumps(v)}" for k, v in self.model.items())
        parallel = "\n".join(f"{k} = {json.dumps(v)}" for k, v in self.parallel.items())
        return (f"[model]\n{model}\nmax_seq_len = {self.seq}\n[data]\nseq_len = {self.seq}\n"
                f"[train]\nprecision = \"fp32\"\nsteps = {steps}\nbatch_size = {self.batch}\neval_interval = 0\n"
                f"eval_batches = 1\nsample_tokens = 0\n[schedule]\nwarmup_steps = 1\n"
                f"[logging]\nlog_interval = 1\nprogress = \"off\"\ntensorboard = false\n"
                f"[checkpoint]\nenabled = false\n[parallel]\n{parallel}\n")

    def plan_flags(self, hardware: str = "auto:2") -> list[str]:
        """The plan pinned to this row's layout (2 ranks of ``hardware``: this CPU, as torchrun runs them)."""
        p = self.parallel
        dp = p.get("dp_shard", 1) * p.get("dp_replicate", 1)
        zero = p.get("zero_stage", 3 if p.get("dp_shard", 1) > 1 else 0)
        return ["--hardware", hardware, f"--parallel.dp_shard={p.get('dp_shard', 1)}",
                f"--parallel.dp_replicate={p.get('dp_replicate', 1)}", f"--parallel.tp={p.get('tp', 1)}",
                "--parallel.pp=1", "--micro-batch", str(self.batch), "--global-batch", str(self.batch * dp),
                f"--parallel.zero_stage={zero}", "--parallel.activation_checkpointing=none",
                "--train.precision=fp32", "--tokens", "1e6"]


D384 = {"vocab_size": 16384, "dim": 384, "n_layers": 6, "n_heads": 6, "ffn_hidden_dim": 1024}  # 23.2M parameters
D512 = {"vocab_size": 32768, "dim": 512, "n_layers": 4, "n_heads": 8, "ffn_hidden_dim": 1408}  # 46.2M parameters
ROWS = [
    Row("z3-d384", D384, 2, 256, {"dp_shard": 2, "zero_stage": 3}),
    Row("z2-d384", D384, 2, 256, {"dp_shard": 2, "zero_stage": 2}),
    Row("ddp-d384", D384, 2, 256, {"dp_replicate": 2}),
    Row("zero1-d384", D384, 2, 256, {"dp_replicate": 2, "zero_stage": 1}),
    Row("tp-d384", D384, 2, 256, {"tp": 2}),
    Row("z3-d512-v32k", D512, 2, 256, {"dp_shard": 2, "zero_stage": 3}),
    Row("ddp-d512-v32k", D512, 2, 256, {"dp_replicate": 2}),
]
# Issue 36's shape, which none of the rows above (nor the constants fitted on them) saw: smollm2-135m blocks with
# the preset's 49,152-row vocabulary. ~13 s a step on a quiet 2-core machine: only with --rows held_out.
SMOLLM2 = {"preset": "smollm2-135m", "vocab_size": 49152}
HELD_OUT = [Row("z3-smollm2-v49k", SMOLLM2, 2, 256, {"dp_shard": 2, "zero_stage": 3})]


def measure(row: Row, steps: int, scratch: Path) -> dict:
    """Run the row under torchrun (2 ranks, gloo) and read its metrics: the worst rank's peak and the median
    step after the warm-up."""
    config = scratch / f"{row.name}.toml"
    config.write_text(row.config(steps))
    run_dir = scratch / f"run-{row.name}"
    proc = run_ranks(["-m", "scaletrain.cli", "train", "--config", str(config), f"--train.run_dir={run_dir}"], 2,
                     f"the {row.name} run")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_ms = [r["step_ms"] for r in records if "step_ms" in r and r["step"] > WARMUP_STEPS]
    peaks = [max(r["peak_memory_mb_per_rank"][i] for r in records if "peak_memory_mb_per_rank" in r)
             for i in range(2)]
    done = next((line for line in proc.stdout.splitlines() if line.startswith("done:")), "")
    return {"peak_mb_per_rank": peaks, "peak_mb": max(peaks), "step_s": statistics.median(steps_ms) / 1000,
            "steps_ms": steps_ms, "done_line": done}


def plan(row: Row, scratch: Path, hardware: str = "auto:2") -> dict:
    """`scaletrain plan` for the row (its config, written by ``measure``, and pinned layout), as a person runs it:
    the JSON's best plan. ``hardware``: auto:2 (this machine's `doctor` calibration, for the step time), or the
    catalog's cpu:2 where only the memory is wanted (no calibration needed)."""
    out = scratch / f"plan-{row.name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "scaletrain.cli", "plan", "--config", str(scratch / f"{row.name}.toml"),
               *row.plan_flags(hardware), "--json", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"plan for {row.name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    best = json.loads(out.read_text())["plans"][0]
    return {"label": best["label"], "memory": best["memory"], "time": best["time"]}


def compare(row: Row, measured: dict, planned: dict) -> dict:
    memory = planned["memory"]["total"] / 2**20
    step = planned["time"]["step"]
    return {"row": row.name, "model": row.model, "batch_per_rank": row.batch, "seq_len": row.seq,
            "parallel": row.parallel, "ranks": 2, "plan": planned["label"],
            "planned_memory_mb": memory, "measured_peak_mb": measured["peak_mb"],
            "measured_peak_mb_per_rank": measured["peak_mb_per_rank"],
            "memory_error": memory / measured["peak_mb"] - 1,
            "planned_step_s": step, "measured_step_s": measured["step_s"],
            "time_error": step / measured["step_s"] - 1, "planned_breakdown_mb": {
                k: v / 2**20 for k, v in planned["memory"].items() if isinstance(v, float)},
            "peak_phase": planned["memory"]["peak_phase"], "measured_steps_ms": measured["steps_ms"],
            "done_line": measured["done_line"], "load_average_1min": os.getloadavg()[0]}


def communication_source() -> str:
    """Where the plans' collective costs come from: this machine's 2-rank `doctor`, or the reference CPU's."""
    from scaletrain.plan.hardware_spec import parse_hardware

    os.environ["OMP_NUM_THREADS"] = "1"  # the key the plan (run with one thread per rank) reads
    import torch

    torch.set_num_threads(1)
    return parse_hardware("auto:2").hardware.calibration.get("comm_source", "?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="", help="comma-separated row names, or held_out for issue 36's shape "
                                                   "(default: every row but that one)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (median after the first "
                                                             f"{WARMUP_STEPS})")
    parser.add_argument("--out", default=default_out("planner_two_rank.json"),
                        help=OUT_HELP.format(name="planner_two_rank.json"))
    parser.add_argument("--doctor", action="store_true",
                        help="first calibrate this machine as a user would on a quiet machine: `scaletrain doctor` "
                             "(one thread, as each rank runs) and `torchrun --nproc-per-node 2 -m scaletrain.cli "
                             "doctor` (gloo's collectives, TP's and FSDP2's host overhead)")
    args = parser.parse_args()
    if args.doctor:
        run_ranks(["-m", "scaletrain.cli", "doctor"], 1, "doctor")
        run_ranks(["-m", "scaletrain.cli", "doctor"], 2, "doctor under torchrun")
    collectives = communication_source()
    names = [n for n in args.rows.split(",") if n]
    rows = [r for r in ROWS + HELD_OUT if r.name in names or (r in HELD_OUT and "held_out" in names)] if names \
        else list(ROWS)
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            measured = measure(row, args.steps, Path(tmp))
            records.append(compare(row, measured, plan(row, Path(tmp))))
            r = records[-1]
            console.print(f"{row.name:16s} memory {r['planned_memory_mb']:7.0f} MiB planned vs "
                          f"{r['measured_peak_mb']:7.0f} measured ({r['memory_error']:+.1%}); step "
                          f"{r['planned_step_s'] * 1e3:6.0f} ms vs {r['measured_step_s'] * 1e3:6.0f} "
                          f"({r['time_error']:+.1%}); load {r['load_average_1min']:.1f}")
    table = Table(title="The planner on two ranks (torchrun, gloo, 1 thread per rank, fp32): plan vs the real run")
    for col in ("row", "plan", "planned MiB", "measured MiB", "mem err", "planned ms", "measured ms", "time err"):
        table.add_column(col, justify="left" if col in ("row", "plan") else "right")
    for r in records:
        table.add_row(r["row"], r["plan"], f"{r['planned_memory_mb']:.0f}", f"{r['measured_peak_mb']:.0f}",
                      f"{r['memory_error']:+.1%}", f"{r['planned_step_s'] * 1e3:.0f}",
                      f"{r['measured_step_s'] * 1e3:.0f}", f"{r['time_error']:+.1%}")
    console.print(table)
    worst_mem = max(abs(r["memory_error"]) for r in records)
    worst_time = max(abs(r["time_error"]) for r in records)
    console.print(f"collectives: {collectives}")
    console.print(f"worst memory error {worst_mem:.1%} (target {MEMORY_TARGET:.0%}); worst step-time error "
                  f"{worst_time:.1%} (target {TIME_TARGET:.0%}; final only on a quiet machine)")
    path = write_result(args.out, {
        "what": "scaletrain plan vs real 2-rank torchrun runs (reported apart from planner_accuracy.json's "
                "one-process rows)", "targets": {"memory": MEMORY_TARGET, "time": TIME_TARGET}, "rows": records,
        "worst_memory_error": worst_mem, "worst_time_error": worst_time, "collectives": collectives,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    console.print(f"wrote {path}")
    return 0 if worst_mem <= MEMORY_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
