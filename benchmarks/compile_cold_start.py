"""The first-run cost of torch.compile on the baby recipe: whole-model vs regional (per-block) compile, with an
empty inductor cache (a fresh machine) and a warm one, against eager.

Each measurement is a fresh process: build the recipe's trainer, time its first training step (the compile, or
the cache load) and the median of 30 steps after 10 more. "fresh": TORCHINDUCTOR_CACHE_DIR is a new empty
folder; "warm": the same folder again. Regional compilation compiles each TransformerBlock (the blocks share
their code, so one graph serves every layer; the embedding and head run eagerly), as parallelize does under
DDP / FSDP2; here it is forced on a single process. Wall and process CPU seconds (this process and its
compiler children; inductor compiles in-process, TORCHINDUCTOR_COMPILE_THREADS=1) are both recorded: on a
shared machine the CPU seconds are the steadier figure.

    python benchmarks/compile_cold_start.py [--rounds 2] [--out benchmarks/results/compile_cold_start.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "shakespeare_char_baby_adamw.toml"
MODES = ("whole", "regional", "eager")


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def probe(mode: str, run_dir: str) -> dict:
    """In this (fresh) process: the first step's wall / CPU seconds and the median step after it."""
    import scaletrain.parallel.parallelize as parallelize
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    if mode == "regional":
        whole = parallelize.apply_compile
        parallelize.apply_compile = lambda model, whole_model=False: whole(model, whole_model=False)
    cfg = load_config(str(RECIPE), {"train.compile": str(mode != "eager").lower(), "train.run_dir": run_dir,
                                    "checkpoint.enabled": "false", "monitor.enabled": "false",
                                    "logging.tensorboard": "false"})
    trainer = Trainer(cfg, log=False)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    trainer.step()
    first_s, first_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    walls, cpus = [], []
    for _ in range(40):
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        trainer.step()
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_seconds() - cpu0)
    return {"mode": mode, "first_step_s": first_s, "first_step_cpu_s": first_cpu,
            "step_ms": 1000 * statistics.median(walls[10:]), "step_cpu_ms": 1000 * statistics.median(cpus[10:])}


def child(mode: str, cache: Path, scratch: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    run_dir = tempfile.mkdtemp(dir=scratch)
    out = subprocess.run([sys.executable, __file__, "--probe", mode, run_dir], env=env, capture_output=True,
                         text=True, check=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--probe", nargs=2, metavar=("MODE", "RUN_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=default_out("compile_cold_start.json"),
                        help=OUT_HELP.format(name="compile_cold_start.json"))
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe)))
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="compile-cold-"))
    runs = []
    try:
        for index in range(args.rounds):
            for mode in MODES if index % 2 == 0 else reversed(MODES):
                cache = Path(tempfile.mkdtemp(dir=scratch))
                for state in ("fresh", "warm") if mode != "eager" else ("none",):
                    runs.append({"round": index, "cache": state, **child(mode, cache, scratch)})
                    print(json.dumps(runs[-1]), flush=True)
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = {}
    for mode in MODES:
        for state in ("fresh", "warm", "none"):
            mine = [r for r in runs if r["mode"] == mode and r["cache"] == state]
            if mine:
                rows[f"{mode}_{state}"] = {k: statistics.median(r[k] for r in mine)
                                           for k in ("first_step_s", "first_step_cpu_s", "step_ms", "step_cpu_ms")}
    write_result(args.out, {"benchmark": "compile_cold_start", "recipe": str(RECIPE.relative_to(ROOT)),
                            "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2), "rows": rows,
                            "runs": runs}, indent=2)
    print(f"\n{'':16s} {'first step s':>12s} {'(cpu s)':>8s} {'step ms':>8s} {'(cpu ms)':>9s}")
    for name, row in rows.items():
        print(f"{name:16s} {row['first_step_s']:12.1f} {row['first_step_cpu_s']:8.1f} {row['step_ms']:8.1f} "
              f"{row['step_cpu_ms']:9.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
