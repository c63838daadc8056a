"""ZeRO-Infinity on a CPU, under a hard memory limit: DeepSpeed ZeRO-3 with parameters and optimizer state
offloaded to "NVMe" (a local disk folder) trains a model whose fp32 optimizer state (Adam m and v plus DeepSpeed's
fp32 master copy, 12 bytes a parameter) is larger than the memory the process may use; the same model without
offload, and with CPU offload, is OOM-killed under the same limit.

    sudo python benchmarks/deepspeed_nvme.py [--limit-gb 2] [--steps 3] [--out benchmarks/results/deepspeed_nvme.json]

The limit is a cgroup (v1 memory controller, ``memory.limit_in_bytes`` on a fresh group under
/sys/fs/cgroup/memory): the kernel kills the process tree beyond it. It counts the page cache too (reclaimable, so
it is dropped before anything is killed); there is no swap here. Reported per run: the exit code (-9 = killed),
``memory.max_usage_in_bytes``, ``memory.failcnt`` (times the limit was reached, page cache reclaimed each time),
the kernel's OOM-kill count, the process's peak resident memory (VmHWM) and the step times. Needs root (to make
the cgroup), DeepSpeed (scaletrain[deepspeed]) and libaio (apt install libaio-dev): the async_io and cpu_adam ops
compile on first use, in a small warm-up run outside the limit.
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

from launch import OUT_HELP, default_out, write_result

MODEL = {"model.vocab_size": 128, "model.dim": 1024, "model.n_layers": 20, "model.n_heads": 16,
         "model.ffn_hidden_dim": 2816, "model.max_seq_len": 64}
TINY = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.ffn_hidden_dim": 128, "model.max_seq_len": 64}
CGROUPS = Path("/sys/fs/cgroup/memory")
GB = 2**30


def flags(run_dir: Path, offload: str, nvme: Path, steps: int, model: dict) -> list[str]:
    out = {**model, "data.seq_len": 64, "data.tokenizer": "char", "train.batch_size": 1, "train.steps": steps,
           "train.precision": "fp32", "train.eval_interval": 0, "train.eval_batches": 1, "train.sample_tokens": 0,
           "train.run_dir": run_dir, "checkpoint.enabled": "false", "logging.log_interval": 1,
           "logging.progress": "plain", "logging.tensorboard": "false", "parallel.engine": "deepspeed",
           "parallel.zero_stage": 3, "schedule.warmup_steps": 1}
    if offload != "none":
        out |= {"deepspeed.offload_optimizer": offload, "deepspeed.offload_param": offload,
                "deepspeed.nvme_path": nvme}
    return [f"--{k}={v}" for k, v in out.items()]


# Runs `scaletrain train` in this child and prints its peak resident memory (VmHWM, kB) at the end.
CHILD = ("import sys; from scaletrain.cli import main; rc = main(sys.argv[1:]); "
         "print('VMHWM', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); "
         "sys.exit(rc)")


class MemoryLimit:
    """A cgroup v1 memory group with a hard limit; ``join`` (a ``preexec_fn``) moves the child into it."""

    def __init__(self, limit_bytes: int):
        self.path = CGROUPS / f"scaletrain-nvme-{os.getpid()}-{time.monotonic_ns()}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def read(self) -> dict:
        oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {"limit_gb": round(int((self.path / "memory.limit_in_bytes").read_text()) / GB, 3),
                "max_usage_gb": round(int((self.path / "memory.max_usage_in_bytes").read_text()) / GB, 3),
                "failcnt": int((self.path / "memory.failcnt").read_text()),
                "oom_kills": int(oom.get("oom_kill", -1))}

    def remove(self) -> None:
        for _ in range(50):  # the killed tree's last pages are uncharged shortly after it exits
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.2)


def train(args: list[str], timeout: float, limit_bytes: int | None) -> dict:
    """One `scaletrain train` process, inside a fresh memory cgroup when ``limit_bytes`` is given."""
    group = MemoryLimit(limit_bytes) if limit_bytes else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, "train", *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "2"},
                              preexec_fn=group.join if group else None)
        wall = time.perf_counter() - t0
        found = re.search(r"VMHWM (\d+)", proc.stdout)
        out = {"exit_code": proc.returncode, "killed": proc.returncode == -9, "wall_s": round(wall, 1),
               "peak_rss_gb": round(int(found[1]) / 2**20, 3) if found else math.nan,
               "tail": (proc.stdout + proc.stderr)[-3000:]}
        if group:
            out["cgroup"] = group.read()
    finally:
        if group:
            group.remove()
    return out


def step_times(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if '"step_ms"' in line] if path.exists() else []
    if not rows:
        return {"steps_done": 0}
    return {"steps_done": len(rows), "step_s": [round(r["step_ms"] / 1000, 1) for r in rows],
            "median_step_s": round(statistics.median(r["step_ms"] for r in rows) / 1000, 1),
            "losses": [r["loss"] for r in rows]}


def folder_gb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / GB, 3) if path.exists() else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--limit-gb", type=float, default=2.0, help="the memory limit of each training process (GiB)")
    p.add_argument("--out", default=default_out("deepspeed_nvme.json"),
                   help=OUT_HELP.format(name="deepspeed_nvme.json"))
    args = p.parse_args()
    if not os.access(CGROUPS, os.W_OK):
        print(f"needs a writable cgroup v1 memory controller at {CGROUPS} (run as root)", file=sys.stderr)
        return 2
    from scaletrain.config import ModelConfig
    from scaletrain.model.presets import num_params

    params = num_params(ModelConfig(**{k.split(".")[1]: v for k, v in MODEL.items()}))
    limit = int(args.limit_gb * GB)
    work = Path(tempfile.mkdtemp(prefix="ds-nvme-", dir=os.environ.get("NVME_DIR")))
    try:
        warm = train(flags(work / "warm", "nvme", work / "nvme-warm", 1, TINY), 1800, None)  # compiles the ops
        assert warm["exit_code"] == 0, warm["tail"]
        runs = {}
        for name, offload, steps in (("nvme", "nvme", args.steps), ("cpu_offload", "cpu", 1),
                                     ("no_offload", "none", 1)):
            runs[name] = train(flags(work / name, offload, work / f"swap-{name}", steps, MODEL), 3600, limit)
            runs[name] |= step_times(work / name)
            if offload == "nvme":
                runs[name]["nvme_folder_gb"] = folder_gb(work / f"swap-{name}")
            print(name, json.dumps({k: v for k, v in runs[name].items() if k != "tail"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert runs["nvme"]["exit_code"] == 0, runs["nvme"]["tail"]
    for run in runs.values():
        if run["exit_code"] == 0:
            run.pop("tail")
        else:  # the last lines before the kill
            run["tail"] = run["tail"].splitlines()[-3:]
    result = {"parameters": params,
              "fp32_optimizer_state_gb": round(12 * params / GB, 2),  # Adam m + v + fp32 master, 4 bytes each
              "limit_gb": round(limit / GB, 3), "batch": "1 x 64 tokens, fp32, 1 process, OMP_NUM_THREADS=2",
              **runs}
    write_result(args.out, result, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
