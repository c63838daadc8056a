"""Time to a target validation loss: the baby char recipe, AdamW and Muon, fresh and warm inductor cache.

Each run is a whole `scaletrain train` process (start-up, data preparation, compile, training, evals, samples,
checkpoints), timed from its launch. "fresh": TORCHINDUCTOR_CACHE_DIR is a new empty folder, as on a fresh
machine; "warm": the same folder again right after, as on a second run. Rounds alternate the optimizers' order
(AdamW first, then Muon first, ...), and the table gives medians over the rounds.

The target is nanoGPT's final validation loss on this recipe, 1.886 at step 2000 (../shared/BASELINES.md).
nanoGPT itself cannot be fetched here, so its side is BASELINES.md's measured figures: 91 s for the whole
2000-step run (the time at which it reaches 1.886) and 41.4 ms per iteration. Because these shared machines'
speed drifts with load, each round also times a nanoGPT-layout step (GPT-2 blocks, same size, eager, the
layout benchmarks/shakespeare_char.py compares against) in its own process, and the table also gives the
ratios with nanoGPT's 91 s scaled by that step's slowdown against 41.4 ms ("load-adjusted").

    python benchmarks/time_to_loss.py [--rounds 2] [--eval-interval 250] [--out benchmarks/results/time_to_loss.json]

Writes benchmarks/out/time_to_loss.json unless --out names another file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "shakespeare_char_baby.toml"
NANOGPT = {"wall_s": 91.0, "median_ms": 41.4, "final_val_loss": 1.886, "steps": 2000}
OPTIMIZERS = {"adamw": ["--optim.name=adamw"], "muon": ["--optim.name=muon"]}


def nanogpt_layout_ms(steps: int = 60) -> float:
    """Median ms of an eager nanoGPT-layout training step (12 x 64 tokens), timed in a fresh process."""
    code = ("import statistics, time, torch, torch.nn.functional as F\n"
            "from shakespeare_char import NanoGPTLayout\n"
            "torch.manual_seed(0); m = NanoGPTLayout(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)\n"
            "x = torch.randint(0, 65, (12, 64)); y = torch.randint(0, 65, (12, 64)); t = []\n"
            f"for i in range({steps + 10}):\n"
            "    t0 = time.perf_counter(); F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()\n"
            "    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step(); opt.zero_grad()\n"
            "    t.append(time.perf_counter() - t0)\n"
            "print(1000 * statistics.median(t[10:]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def scaletrain_command() -> list[str]:
    """The `scaletrain` command of this environment (what a user runs), else `python -m scaletrain`."""
    script = Path(sys.executable).with_name("scaletrain")
    return [str(script)] if script.exists() else [sys.executable, "-m", "scaletrain"]


def step_ratio(steps: int = 100, warmup: int = 10) -> dict:
    """Median ms of the recipe's training step (compiled, as it runs) with AdamW and with Muon, alternating step
    by step in this process (load slows both alike), and Muon's over AdamW's."""
    from dataclasses import replace

    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    scratch = Path(tempfile.mkdtemp(prefix="step-ratio-"))
    try:
        base = load_config(str(RECIPE), {"checkpoint.enabled": "false", "monitor.enabled": "false",
                                         "logging.tensorboard": "false"})
        trainers = {name: Trainer(replace(base, optim=replace(base.optim, name=name),
                                          train=replace(base.train, run_dir=str(scratch / name))), log=False)
                    for name in OPTIMIZERS}
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for i in range(steps + warmup):
            for name, trainer in trainers.items():
                t0 = time.perf_counter()
                trainer.step()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {name: 1000 * statistics.median(t) for name, t in times.items()}
    return {"median_ms": med, "steps": steps,
            **({"muon_over_adamw": med["muon"] / med["adamw"]} if len(med) == 2 else {})}


def run_recipe(optimizer: str, cache_dir: Path, run_dir: Path, target: float, extra: list[str]) -> dict:
    """One whole training process of the recipe; the time (from launch) and step of the first evaluation at
    or below ``target``, the whole process's wall time, the val curve and the done line."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    cmd = [*scaletrain_command(), "train", "--config", str(RECIPE), f"--train.run_dir={run_dir}",
           "--logging.progress=plain", "--logging.tensorboard=false", *OPTIMIZERS[optimizer], *extra]
    launched = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - launched
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    hit = next((r for r in evals if r["val_loss"] <= target), None)
    done = next((line for line in proc.stdout.splitlines() if line.startswith("done:")), "")
    return {"optimizer": optimizer, "wall_s": wall, "final_val_loss": evals[-1]["val_loss"],
            "time_to_target_s": hit["time"] - launched if hit else None, "step_to_target": hit["step"] if hit else None,
            "val_loss": {str(r["step"]): round(r["val_loss"], 4) for r in evals}, "done_line": done}


def one_round(index: int, target: float, extra: list[str], scratch: Path) -> dict:
    """nanoGPT-layout probe, then each optimizer fresh and warm (order alternating with the round)."""
    order = list(OPTIMIZERS) if index % 2 == 0 else list(reversed(OPTIMIZERS))
    out = {"round": index, "order": order, "nanogpt_layout_ms": nanogpt_layout_ms(), "runs": []}
    for optimizer in order:
        cache = Path(tempfile.mkdtemp(prefix="inductor-", dir=scratch))
        for state in ("fresh", "warm"):
            run_dir = scratch / f"r{index}-{optimizer}-{state}"
            result = run_recipe(optimizer, cache, run_dir, target, extra)
            out["runs"].append({"cache": state, **result})
            print(f"round {index} {optimizer:5s} {state:5s}: to {target} in "
                  f"{_fmt(result['time_to_target_s'])} s (step {result['step_to_target']}), whole run "
                  f"{result['wall_s']:.1f} s, final val {result['final_val_loss']:.4f}", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    return out


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds per (optimizer, cache), and the ratios to nanoGPT's 91 s, raw and load-adjusted."""
    load = statistics.median(r["nanogpt_layout_ms"] for r in rounds) / NANOGPT["median_ms"]
    rows = {}
    for optimizer in OPTIMIZERS:
        for state in ("fresh", "warm"):
            runs = [x for r in rounds for x in r["runs"] if x["optimizer"] == optimizer and x["cache"] == state]
            hits = [x["time_to_target_s"] for x in runs if x["time_to_target_s"] is not None]
            to_target = statistics.median(hits) if len(hits) == len(runs) else None
            wall = statistics.median(x["wall_s"] for x in runs)
            nanogpt_now = NANOGPT["wall_s"] * load
            rows[f"{optimizer}_{state}"] = {
                "time_to_target_s": to_target, "wall_s": wall,
                "steps_to_target": [x["step_to_target"] for x in runs],
                "final_val_loss": statistics.median(x["final_val_loss"] for x in runs),
                "to_target_over_nanogpt": to_target / NANOGPT["wall_s"] if to_target else None,
                "to_target_over_nanogpt_load_adjusted": to_target / nanogpt_now if to_target else None,
                "wall_over_nanogpt": wall / NANOGPT["wall_s"], "wall_over_nanogpt_load_adjusted": wall / nanogpt_now}
    return {"load_factor": load, "rows": rows}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--target", type=float, default=NANOGPT["final_val_loss"])
    parser.add_argument("--eval-interval", type=int, default=250, help="the recipe's is 250")
    parser.add_argument("--steps", type=int, default=0, help="override train.steps (0 = the recipe's 2000)")
    parser.add_argument("--ratio-steps", type=int, default=100, help="interleaved steps of the step-time ratio "
                        "(0 = skip)")
    parser.add_argument("--optimizers", default="adamw,muon", help="which rows to run (comma-separated)")
    parser.add_argument("--flags", default="", help="extra flags for every run, e.g. '--train.compile=false'")
    parser.add_argument("--muon-flags", default="", help="extra flags for the Muon runs, e.g. "
                        "'--optim.muon_lr=0.02 --optim.muon_adjust_lr=original' (Keller Jordan's recipe)")
    parser.add_argument("--out", default=default_out("time_to_loss.json"),
                        help=OUT_HELP.format(name="time_to_loss.json"))
    args = parser.parse_args()
    OPTIMIZERS["muon"] += args.muon_flags.split()
    for name in set(OPTIMIZERS) - set(args.optimizers.split(",")):
        del OPTIMIZERS[name]
    extra = [f"--train.eval_interval={args.eval_interval}", *args.flags.split()] + \
        ([f"--train.steps={args.steps}"] if args.steps else [])
    scratch = Path(tempfile.mkdtemp(prefix="time-to-loss-"))
    load_before = os.getloadavg()[0]
    try:
        rounds = [one_round(i, args.target, extra, scratch) for i in range(args.rounds)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(rounds) if rounds else {"load_factor": float("nan"), "rows": {}}
    summary["side_by_side"] = step_ratio(args.ratio_steps) if args.ratio_steps else None
    result = {"benchmark": "time_to_loss", "recipe": str(RECIPE.relative_to(ROOT)), "target": args.target,
              "eval_interval": args.eval_interval, "flags": args.flags, "optimizers": OPTIMIZERS,
              "nanogpt_reference": NANOGPT,
              "machine": {"load_average_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                          "cpus": os.cpu_count()},
              "summary": summary, "rounds": rounds}
    write_result(args.out, result, indent=2)
    print(f"\nmedians of {args.rounds} rounds; nanoGPT: {NANOGPT['wall_s']:.0f} s whole run = its time to "
          f"{args.target} (BASELINES.md); load factor today {summary['load_factor']:.2f} (nanoGPT-layout step "
          f"vs {NANOGPT['median_ms']} ms)")
    print(f"{'':14s} {'to target s':>11s} {'x nanoGPT':>9s} {'x adj.':>7s} {'whole s':>8s} {'x nanoGPT':>9s} "
          f"{'x adj.':>7s} {'final val':>9s}")
    for name, row in summary["rows"].items():
        print(f"{name:14s} {_fmt(row['time_to_target_s']):>11s} {_ratio(row['to_target_over_nanogpt']):>9s} "
              f"{_ratio(row['to_target_over_nanogpt_load_adjusted']):>7s} {row['wall_s']:8.1f} "
              f"{row['wall_over_nanogpt']:9.2f} {row['wall_over_nanogpt_load_adjusted']:7.2f} "
              f"{row['final_val_loss']:9.4f}")
    if summary["side_by_side"]:
        sbs = summary["side_by_side"]
        print("step time, one process, alternating: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                                   sbs["median_ms"].items())
              + (f"; Muon / AdamW {sbs['muon_over_adamw']:.2f}" if "muon_over_adamw" in sbs else ""))
    print(f"wrote {args.out}")
    return 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
