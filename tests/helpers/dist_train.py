"""Run several short trainings through ``Trainer`` in one torchrun process group (used by the tests and
the scaling benchmark). Each run is ``name:key=value,key=value`` (dotted config overrides on top of
``--config``); rank 0 writes ``{name: summary + loss curve}`` as JSON.

    torchrun --standalone --nproc-per-node 2 tests/helpers/dist_train.py --config c.toml --out r.json \\
        "ddp:parallel.dp_replicate=2" "diloco:parallel.dp_replicate=2,parallel.low_comm=diloco"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from scaletrain.config import load_config
from scaletrain.train.trainer import Trainer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # shared by every run; each Trainer reuses it
    results = {}
    for spec in args.runs:
        name, _, rest = spec.partition(":")
        overrides = {"logging.progress": "off", **dict(kv.split("=", 1) for kv in rest.split(",") if kv)}
        cfg = load_config(args.config, overrides)
        trainer = Trainer(cfg)  # logs (metrics.jsonl) on rank 0 only
        if cfg.train.resume:
            assert trainer.resume(), f"{name}: nothing to resume"
        summary = trainer.train()
        metrics = Path(cfg.train.run_dir) / "metrics.jsonl"
        if not dist.is_initialized() or dist.get_rank() == 0:
            records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            summary["losses"] = [r["loss"] for r in records if "loss" in r]
            summary["per_rank_memory_mb"] = next((r["peak_memory_mb_per_rank"] for r in reversed(records)
                                                  if "peak_memory_mb_per_rank" in r), None)
            results[name] = summary
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
