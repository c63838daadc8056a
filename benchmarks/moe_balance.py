"""Mixture-of-experts balancing: each method's expert load and val bpb after the same steps, through the real
``Trainer``, beside the dense model whose active feed-forward the MoE matches.

Every run is the ``nano`` shape (4 x 128) on the bundled Tiny Shakespeare, or with ``--data FOLDER`` a folder of
.txt prepared once at character level by benchmarks/moe_vs_dense.py's ``prepare`` (the Gutenberg Shakespeare
folder ``../shared/data/gutenberg-shakespeare``: 2% held out for validation), char level, seq 128, batch 16, the
default recipe's schedule, fp32, eager, one thread, the same seed and data order, for ``--steps`` steps; two runs
at a time side by side (``--methods`` picks which):

- ``dense``: ``nano`` (SwiGLU 344);
- ``none``: ``nano-moe`` (8 experts x 176, top-2) without balancing (``moe_balance_coef=0``);
- ``aux``: with the Switch/GShard loss (``moe_balance_coef=0.01``, the default);
- ``aux+z``: and the router z-loss (``moe_z_loss_coef=0.001``);
- ``bias``: DeepSeek-V3's auxiliary-loss-free bias (``moe_bias_rate=0.001``, no balance loss).

Reported: the final val bpb, the median step time, and the expert load of the last quarter of the steps (the
last log window): the tokens per expert and max/mean of each sparse layer (1 = even), their mean and worst (the
worst is also the overall max/mean: every layer routes as many tokens), and the dropped tokens (none without a
capacity factor, the preset's default).

    .venv/bin/python benchmarks/moe_balance.py     # ~5-10 minutes on 2 shared cores (two processes)
    .venv/bin/python benchmarks/moe_balance.py --data ../shared/data/gutenberg-shakespeare \
        --methods none,aux,aux+z,bias --steps 600 --out benchmarks/results/moe_balance_gutenberg.json  # ~9 min

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
from moe_vs_dense import prepare  # noqa: E402  (the one preparation of a data folder these benchmarks read)

METHODS = {
    "dense": {"model.preset": "nano"},
    "none": {"model.preset": "nano-moe", "model.moe_balance_coef": 0},
    "aux": {"model.preset": "nano-moe", "model.moe_balance_coef": 0.01},
    "aux+z": {"model.preset": "nano-moe", "model.moe_balance_coef": 0.01, "model.moe_z_loss_coef": 0.001},
    "bias": {"model.preset": "nano-moe", "model.moe_balance_coef": 0, "model.moe_bias_rate": 0.001},
}


def run(args: tuple[str, int, str, str]) -> tuple[str, dict]:
    """One method's run on ``data`` (a prepared folder or builtin:NAME): its val bpb, step time and last window's
    expert load."""
    name, steps, data, tmp = args
    import torch

    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    run_dir = Path(tmp) / name.replace("+", "_")
    over = {**METHODS[name], "data.path": data, "data.seq_len": 128, "train.batch_size": 16, "train.steps": steps,
            "logging.log_interval": max(1, steps // 4), "train.eval_interval": 0,
            "train.sample_tokens": 0, "train.precision": "fp32", "train.compile": "false", "train.threads": 1,
            "checkpoint.enabled": "false", "logging.progress": "off", "logging.tensorboard": "false",
            "monitor.enabled": "false", "train.run_dir": str(run_dir), "data.cache_dir": f"{tmp}/data-{name}"}
    summary = Trainer(load_config(None, {k: str(v) for k, v in over.items()})).train()  # log: the metrics file
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line][-1]
    loads = {k.split("/")[1]: v for k, v in last.items() if k.startswith("moe_max_mean_load/")}
    dropped = {k.split("/")[1]: v for k, v in last.items() if k.startswith("moe_dropped_tokens/")}
    result = {"val_bpb": summary["final_val_bpb"], "val_loss": summary["final_val_loss"],
              "step_ms": summary["median_step_ms"], "parameters": summary["parameters"]}
    if loads:
        result.update(max_mean_load_by_layer=loads, max_mean_load_mean=sum(loads.values()) / len(loads),
                      max_mean_load_worst=max(loads.values()),
                      tokens_per_expert_by_layer={k.split("/")[1]: v for k, v in last.items()
                                                  if k.startswith("moe_tokens_per_expert/")},
                      dropped_by_layer=dropped, dropped=sum(dropped.values()),
                      balance_loss=last.get("moe_balance_loss"))
    print(f"{name}: {result}", flush=True)
    return name, result


def input_problem(args: argparse.Namespace, methods: list[str]) -> str | None:
    """What is wrong with the command line, in one line (None: nothing)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        return f"--methods: unknown {', '.join(unknown)} (choose of {', '.join(METHODS)})"
    if args.data and not Path(args.data).is_dir():
        return f"--data {args.data}: no such folder (give a folder of .txt files)"
    if args.steps < 1:
        return f"--steps must be >= 1 (got {args.steps})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data", metavar="FOLDER", help="a folder of .txt to train on, prepared once at character "
                        "level (e.g. ../shared/data/gutenberg-shakespeare; default: the bundled Tiny Shakespeare)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--out", default=default_out("moe_balance.json"),
                        help=OUT_HELP.format(name="moe_balance.json"))
    args = parser.parse_args()
    methods = args.methods.split(",")
    problem = input_problem(args, methods)
    if problem:
        print(f"moe_balance: {problem}", file=sys.stderr)
        return 2
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        data, described = (prepare(tmp, Path(args.data)) if args.data else
                           ("builtin:tinyshakespeare", "Tiny Shakespeare (bundled)"))
        with mp.get_context("spawn").Pool(min(2, len(methods))) as pool:
            results = dict(pool.map(run, [(name, args.steps, data, tmp) for name in methods], chunksize=1))
    result = {"benchmark": "moe_balance", "data": described, "steps": args.steps,
              "methods": {name: METHODS[name] for name in methods}, "results": results,
              "seconds": round(time.time() - t0, 1)}
    print("| method | val bpb | ms/step | max/mean load (mean of layers) | worst layer | dropped |\n"
          "|---|---|---|---|---|---|")
    for name, r in results.items():
        load = (f"{r['max_mean_load_mean']:.2f} | {r['max_mean_load_worst']:.2f} | {r['dropped']}"
                if "max_mean_load_mean" in r else "- | - | -")
        print(f"| {name} | {r['val_bpb']:.4f} | {r['step_ms']:.0f} | {load} |")
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
