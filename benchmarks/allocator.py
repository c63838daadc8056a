"""glibc's malloc against jemalloc (what the ``scaletrain`` command preloads where installed: src/scaletrain/
allocator.py) on the default training job and on a LoRA fine-tune, side by side: each run a fresh process,
the two allocators interleaved round by round, medians reported.

    python benchmarks/allocator.py [--rounds 3] [--steps 60] [--out benchmarks/results/allocator.json]

Per run: the median step time and the peak resident memory training added (peak RSS minus the RSS before the
trainer was built, after the libraries a first model build imports). Needs jemalloc installed
(``apt install libjemalloc2``); needs no ../shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launch import (  # benchmarks/launch.py (the script's folder is on sys.path)
    OUT_HELP,
    ROOT,
    default_out,
    write_result,
)
from scaletrain.hardware.allocator import find

COMMON = {"train.eval_interval": "0", "train.sample_tokens": "0", "logging.progress": "off",
          "logging.tensorboard": "false", "checkpoint.interval": "0", "train.threads": "1", "train.overwrite": "true"}
# The default job as `scaletrain train` runs it (bundled Tiny Shakespeare, the default model and batch), and a
# LoRA fine-tune of its result (all seven projections, rank 4) - the case where glibc's fragmentation is the
# largest share of the peak.
JOBS = {"train_default": {}, "finetune_lora": {"finetune.method": "lora", "finetune.lora_rank": "4",
                                                  "finetune.lora_targets": "q,k,v,o,gate,up,down"}}

CHILD = """
import dataclasses, json, resource, sys
from pathlib import Path
from scaletrain.hardware.allocator import in_use
from scaletrain.config import load_config
from scaletrain.model import build_model
from scaletrain.train.trainer import Trainer
rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * 4096
cfg = load_config(None, json.loads(sys.argv[1]))
build_model(dataclasses.replace(cfg.model, vocab_size=128), "meta")  # the first build's imports, in the baseline
before = rss()
summary = Trainer(cfg, log=False).train()
print(json.dumps({"allocator": in_use(), "median_step_ms": summary["median_step_ms"],
                  "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / 2**20}))
"""


def one(overrides: dict, preload: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides)], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"a run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=default_out("allocator.json"), help=OUT_HELP.format(name="allocator.json"))
    args = parser.parse_args()
    jemalloc = find("jemalloc")
    if jemalloc is None:
        raise SystemExit("jemalloc is not installed (apt install libjemalloc2): nothing to compare")
    work = Path(tempfile.mkdtemp(prefix="allocator-"))
    base = {**COMMON, "train.steps": str(args.steps), "train.run_dir": str(work / "base")}
    one(base, None)  # the fine-tunes' base: the default job's weights after --steps steps
    runs: dict[str, dict[str, list[dict]]] = {job: {"glibc": [], "jemalloc": []} for job in JOBS}
    for round_ in range(args.rounds):
        for job, extra in JOBS.items():
            over = {**COMMON, "train.steps": str(args.steps), "train.run_dir": str(work / "run"), **extra}
            if extra:
                over["finetune.source"] = str(work / "base")
            for name, lib in (("glibc", None), ("jemalloc", jemalloc)):
                r = one(over, lib)
                assert r["allocator"] == ("system" if lib is None else "jemalloc"), r
                runs[job][name].append(r)
                print(f"round {round_ + 1} {job:16s} {name:8s} {r['median_step_ms']:7.1f} ms/step  "
                      f"peak +{r['peak_mb']:6.1f} MB", flush=True)
    summary = {}
    for job, by in runs.items():
        med = {name: {"median_step_ms": statistics.median(r["median_step_ms"] for r in rs),
                      "peak_mb": statistics.median(r["peak_mb"] for r in rs)} for name, rs in by.items()}
        summary[job] = {**med, "step_time_ratio_jemalloc_over_glibc": med["jemalloc"]["median_step_ms"]
                        / med["glibc"]["median_step_ms"],
                        "peak_ratio_jemalloc_over_glibc": med["jemalloc"]["peak_mb"] / med["glibc"]["peak_mb"]}
    print(f"\n{'job':16s} {'allocator':9s} {'ms/step':>8s} {'peak MB':>8s}")
    for job, s in summary.items():
        for name in ("glibc", "jemalloc"):
            print(f"{job:16s} {name:9s} {s[name]['median_step_ms']:8.1f} {s[name]['peak_mb']:8.1f}")
    write_result(args.out, {"steps": args.steps, "rounds": args.rounds, "jemalloc": jemalloc, "common": COMMON,
                            "jobs": JOBS, "runs": runs, "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
