"""Mixture-of-experts balancing: each method's expert load and val bpb after the same steps, through the real
``Trainer``, beside the dense model whose active feed-forward the MoE matches.

Every run is the ``nano`` shape (4 x 128) on the bundled Tiny Shakespeare (char level, seq 128, batch 16, the
default recipe's schedule, fp32, eager, one thread, the same seed and data order) for ``--steps`` steps:

- ``dense``: ``nano`` (SwiGLU 344);
- ``none``: ``nano-moe`` (8 experts x 176, top-2) without balancing (``moe_balance_coef=0``);
- ``aux``: with the Switch/GShard loss (``moe_balance_coef=0.01``, the default);
- ``aux+z``: and the router z-loss (``moe_z_loss_coef=0.001``);
- ``bias``: DeepSeek-V3's auxiliary-loss-free bias (``moe_bias_rate=0.001``, no balance loss).

Reported: the final val bpb, the median step time, and the expert load of the last quarter of the steps (the
last log window): the max/mean of each sparse layer (1 = even), their mean and worst.

    .venv/bin/python benchmarks/moe_balance.py     # ~5-10 minutes on 2 shared cores (two processes)

Writes benchmarks/out/moe_balance.json (``--out benchmarks/results/moe_balance.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import OUT_HELP, default_out, write_result  # noqa: E402  (benchmarks/launch.py)

METHODS = {
    "dense": {"model.preset": "nano"},
    "none": {"model.preset": "nano-moe", "model.moe_balance_coef": 0},
    "aux": {"model.preset": "nano-moe", "model.moe_balance_coef": 0.01},
    "aux+z": {"model.preset": "nano-moe", "model.moe_balance_coef": 0.01, "model.moe_z_loss_coef": 0.001},
    "bias": {"model.preset": "nano-moe", "model.moe_balance_coef": 0, "model.moe_bias_rate": 0.001},
}


def run(args: tuple[str, int, str]) -> tuple[str, dict]:
    """One method's run: its val bpb, step time and last window's expert load."""
    name, steps, tmp = args
    import torch

    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    run_dir = Path(tmp) / name.replace("+", "_")
    over = {**METHODS[name], "train.steps": steps, "logging.log_interval": steps // 4, "train.eval_interval": 0,
            "train.sample_tokens": 0, "train.precision": "fp32", "train.compile": "false", "train.threads": 1,
            "checkpoint.enabled": "false", "logging.progress": "off", "logging.tensorboard": "false",
            "monitor.enabled": "false", "train.run_dir": str(run_dir), "data.cache_dir": f"{tmp}/data-{name}"}
    summary = Trainer(load_config(None, {k: str(v) for k, v in over.items()})).train()  # log: the metrics file
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line][-1]
    loads = {k.split("/")[1]: v for k, v in last.items() if k.startswith("moe_max_mean_load/")}
    result = {"val_bpb": summary["final_val_bpb"], "val_loss": summary["final_val_loss"],
              "step_ms": summary["median_step_ms"], "parameters": summary["parameters"]}
    if loads:
        result.update(max_mean_load_by_layer=loads, max_mean_load_mean=sum(loads.values()) / len(loads),
                      max_mean_load_worst=max(loads.values()),
                      dropped=sum(v for k, v in last.items() if k.startswith("moe_dropped_tokens/")),
                      balance_loss=last.get("moe_balance_loss"))
    print(f"{name}: {result}", flush=True)
    return name, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=default_out("moe_balance.json"),
                        help=OUT_HELP.format(name="moe_balance.json"))
    args = parser.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Pool(2) as pool:
        results = dict(pool.map(run, [(name, args.steps, tmp) for name in METHODS]))
    result = {"benchmark": "moe_balance", "steps": args.steps, "methods": METHODS, "results": results,
              "seconds": round(time.time() - t0, 1)}
    print("| method | val bpb | ms/step | max/mean load (mean of layers) | worst layer |\n|---|---|---|---|---|")
    for name, r in results.items():
        load = (f"{r['max_mean_load_mean']:.2f} | {r['max_mean_load_worst']:.2f}" if "max_mean_load_mean" in r
                else "- | -")
        print(f"| {name} | {r['val_bpb']:.4f} | {r['step_ms']:.0f} | {load} |")
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
