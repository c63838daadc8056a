"""ZeRO-Infinity on a CPU: DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to "NVMe" (a local
disk folder) against the same job without offload: peak resident memory (VmHWM) of the training process, and
step time. The model's fp32 optimizer state (Adam m and v plus DeepSpeed's fp32 master copy, 12 bytes a parameter)
is reported next to them.

    python benchmarks/deepspeed_nvme.py [--steps 2] [--out benchmarks/results/deepspeed_nvme.json]

Needs DeepSpeed (scaletrain[deepspeed]) and libaio (apt install libaio-dev): the async_io and cpu_adam ops compile
on first use (a small warm-up run does that first). No memory limit is enforced: RLIMIT_AS counts address space,
and the DeepSpeed process reserves ~3.5 GB of it (libraries, thread arenas) before the model exists; there are no
cgroups here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch import OUT_HELP, default_out

MODEL = {"model.vocab_size": 128, "model.dim": 1024, "model.n_layers": 20, "model.n_heads": 16,
         "model.ffn_hidden_dim": 2816, "model.max_seq_len": 64}
TINY = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.ffn_hidden_dim": 128, "model.max_seq_len": 64}


def flags(run_dir: Path, nvme: Path | None, steps: int, model: dict) -> list[str]:
    out = {**model, "data.seq_len": 64, "data.tokenizer": "char", "train.batch_size": 1, "train.steps": steps,
           "train.precision": "fp32", "train.eval_interval": 0, "train.eval_batches": 1, "train.sample_tokens": 0,
           "train.run_dir": run_dir, "checkpoint.enabled": "false", "logging.log_interval": 1,
           "logging.progress": "plain", "logging.tensorboard": "false", "parallel.engine": "deepspeed",
           "parallel.zero_stage": 3, "schedule.warmup_steps": 1}
    if nvme is not None:
        out |= {"deepspeed.offload_optimizer": "nvme", "deepspeed.offload_param": "nvme", "deepspeed.nvme_path": nvme}
    return [f"--{k}={v}" for k, v in out.items()]


# Runs `scaletrain train` in this child and prints its peak resident memory (VmHWM, kB) at the end.
CHILD = ("import sys; from scaletrain.cli import main; rc = main(sys.argv[1:]); "
         "print('VMHWM', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); "
         "print('VMRSS', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS')][0]); "
         "sys.exit(rc)")


def train(args: list[str], timeout: float) -> tuple[int, str, float, float]:
    """(exit code, output tail, wall seconds, peak resident GB of the training process)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, "train", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "2"})
    wall = time.perf_counter() - t0
    found = re.search(r"VMHWM (\d+)", proc.stdout)
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:], wall, int(found[1]) / 2**20 if found else math.nan


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=default_out("deepspeed_nvme.json"),
                   help=OUT_HELP.format(name="deepspeed_nvme.json"))
    args = p.parse_args()
    from scaletrain.config import ModelConfig
    from scaletrain.model.presets import num_params

    params = num_params(ModelConfig(**{k.split(".")[1]: v for k, v in MODEL.items()}))
    work = Path(tempfile.mkdtemp(prefix="ds-nvme-"))
    code, tail, _, _ = train(flags(work / "warm", work / "nvme-warm", 1, TINY), 900)  # compiles the ops
    assert code == 0, tail
    code, tail, wall, rss = train(flags(work / "nvme", work / "nvme", args.steps, MODEL), 3600)
    assert code == 0, tail
    steps = [json.loads(line) for line in (work / "nvme" / "metrics.jsonl").read_text().splitlines()
             if '"step_ms"' in line]
    control_code, control_tail, control_wall, control_rss = train(flags(work / "plain", None, 1, MODEL), 1800)
    shutil.rmtree(work, ignore_errors=True)
    result = {
        "parameters": params,
        "fp32_optimizer_state_gb": round(12 * params / 2**30, 2),  # Adam m + v + fp32 master, 4 bytes each
        "offload": {"steps": args.steps, "wall_s": round(wall, 1), "peak_rss_gb": round(rss, 2),
                    "step_s": [round(r["step_ms"] / 1000, 1) for r in steps],
                    "median_step_s": round(statistics.median(r["step_ms"] for r in steps) / 1000, 1),
                    "losses": [r["loss"] for r in steps]},
        "no_offload": {"exit_code": control_code, "wall_s": round(control_wall, 1), "steps": 1,
                       "peak_rss_gb": round(control_rss, 2)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
