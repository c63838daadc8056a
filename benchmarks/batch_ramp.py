"""Batch-size ramp vs a fixed batch on the baby recipe (configs/shakespeare_char_baby_adamw.toml, shortened).

Both runs train the nano model on char-level Tiny Shakespeare from the same initialisation and data order,
one process, fp32, ``--steps`` AdamW steps with the recipe's cosine schedule (warm-up scaled to the shorter
run), validation every ``--eval-every`` steps. Fixed: 12 sequences x 4 micro-batches = 48 sequences every step.
Ramp: Megatron's ``batch.ramp_start = 12``, ``ramp_increment = 12`` up to 48 over ``--ramp-samples`` sequences,
LR scaled by sqrt(B / 48) during the ramp (batch.lr_scaling = "sqrt"). The noise scale B_simple is measured on
the fixed run every 10 steps. Reported: each run's val-loss curve against optimizer steps and against sequences
consumed, the first evaluation at which the ramp run reaches the fixed run's final val loss (steps and
sequences), and the last B_simple.

    .venv/bin/python benchmarks/batch_ramp.py               # a few minutes on 2 shared cores

Writes benchmarks/out/batch_ramp.json (``--out benchmarks/results/batch_ramp.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from launch import OUT_HELP, default_out, write_result
from scaletrain.config import load_config
from scaletrain.train.adaptive import BatchRamp
from scaletrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def train(overrides: dict, run_dir: Path) -> dict:
    cfg = load_config(ROOT / "configs" / "shakespeare_char_baby_adamw.toml",
                      {k: str(v) for k, v in overrides.items()} | {"train.run_dir": str(run_dir)})
    t0 = time.perf_counter()
    summary = Trainer(cfg).train()
    seconds = time.perf_counter() - t0
    ramp = BatchRamp(cfg.batch, cfg.train.batch_size * cfg.train.grad_accum_steps)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gns = [r["gns_b_simple"] for r in rows if "gns_b_simple" in r]
    return {"evals": [{"step": e["step"], "sequences": ramp.samples_before(e["step"]), "val_loss": e["val_loss"]}
                      for e in summary["evals"]],
            "final_val_loss": summary["final_val_loss"], "seconds": round(seconds, 1),
            "sequences": ramp.samples_before(cfg.train.steps), "b_simple_last": gns[-1] if gns else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--ramp-samples", type=int, default=4800)
    parser.add_argument("--out", default=default_out("batch_ramp.json"), help=OUT_HELP.format(name="batch_ramp.json"))
    args = parser.parse_args()
    common = {"train.steps": args.steps, "train.eval_interval": args.eval_every, "train.eval_batches": 10,
              "train.compile": "false", "train.threads": 1, "train.sample_tokens": 0, "train.grad_accum_steps": 4,
              "schedule.warmup_steps": max(1, args.steps // 20), "checkpoint.enabled": "false",
              "logging.progress": "off", "logging.log_interval": 10, "logging.tensorboard": "false",
              "monitor.enabled": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        common["data.cache_dir"] = str(tmp / "data")
        fixed = train(common | {"batch.noise_scale_interval": 10}, tmp / "fixed")
        ramp = train(common | {"batch.ramp_start": 12, "batch.ramp_increment": 12,
                               "batch.ramp_samples": args.ramp_samples, "batch.lr_scaling": "sqrt"}, tmp / "ramp")
    target = fixed["final_val_loss"]
    reached = next((e for e in ramp["evals"] if e["val_loss"] <= target), None)
    doc = {"setup": {"recipe": "configs/shakespeare_char_baby_adamw.toml", "steps": args.steps,
                     "full_global_batch": 48, "ramp": [12, 12, args.ramp_samples], "lr_scaling": "sqrt",
                     "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)"},
           "fixed": fixed, "ramp": ramp,
           "ramp_reaches_fixed_final": reached,
           "verdict": ("the ramp reaches the fixed run's final val loss at step {step} ({sequences} sequences)"
                       .format(**reached) if reached else
                       "the ramp does not reach the fixed run's final val loss within the same optimizer steps")}
    write_result(args.out, doc, indent=1)
    print(json.dumps({k: doc[k] for k in ("verdict",)}), fixed["final_val_loss"], ramp["final_val_loss"],
          fixed["b_simple_last"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
