"""Time to a target validation loss, ours against nanoGPT in the same minutes: AdamW and Muon, fresh and warm.

Recipes (--recipe char|bpe|both):
- char: the nanoGPT baby GPT on Tiny Shakespeare: the recipe (configs/shakespeare_char_baby.toml, Muon, its own
  step count) as the `muon` row, nanoGPT's optimizer step for step (configs/shakespeare_char_baby_adamw.toml) as
  the `adamw` row, nanoGPT's 2000 steps. Target: the final val loss of the nanoGPT run in the same round (also
  reported against BASELINES.md's recorded 1.886).
- bpe: configs/gutenberg_bpe_small.toml, a 4096-token BPE on the Gutenberg Shakespeare books. nanoGPT runs as
  many steps as our recipe; target: its final model's val loss on the windows our evaluation scores (the same
  val tokens; nanoGPT's own estimate_loss draws random batches).

Each round runs, as whole processes timed from their launch: benchmarks/nanogpt_reference.py (nanoGPT's
train.py restated, eager, on the same prepared tokens at the same size) and `scaletrain train` with each
optimizer, first with an empty TORCHINDUCTOR_CACHE_DIR (a fresh machine), then with the same folder again
(warm). The order alternates round by round (nanoGPT first, then last, ...; fresh before warm, then warm - on
the cache of the previous round's fresh run - before fresh). With --equal-wall each round also runs Muon with
its steps, and so its schedule, cut to end at AdamW's wall time (steps / the measured step ratio). Both sides
start from tokens prepared before the round, as nanoGPT's train.py starts from its prepare.py's train.bin /
val.bin. Ratios ours / nanoGPT are taken within a round (these shared machines drift by 20-30% within
minutes), and the table gives medians over rounds. nanoGPT's time to its own final loss is its whole run.

    python benchmarks/time_to_loss.py [--recipe both] [--rounds 2] [--steps N] [--optimizers adamw,muon]
                                      [--equal-wall]

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
from dataclasses import replace
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)
from scaletrain.config import load_config
from scaletrain.data.run_data import prepare_data
from scaletrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = Path(__file__).with_name("nanogpt_reference.py")
# BASELINES.md: nanoGPT's baby GPT measured on these machines (91 s for 2000 steps, final val loss 1.886).
NANOGPT_RECORDED = {"wall_s": 91.0, "median_ms": 41.4, "final_val_loss": 1.886, "steps": 2000}
RECIPES = {
    # The char recipe is Muon's with its own steps; AdamW's row is nanoGPT's run step for step (its own config).
    "char": {"config": "configs/shakespeare_char_baby_adamw.toml", "target": "final_val_loss",
             "recorded": NANOGPT_RECORDED, "own_configs": {"muon": "configs/shakespeare_char_baby.toml"},
             "target_text": "nanoGPT's final val loss (its estimate_loss) in the same round"},
    "bpe": {"config": "configs/gutenberg_bpe_small.toml", "target": "val_loss_windows", "recorded": None,
            "target_text": "nanoGPT's final model scored on our val windows, in the same round"},
}
OPTIMIZERS = {"adamw": ["--optim.name=adamw"], "muon": ["--optim.name=muon"]}


def scaletrain_command() -> list[str]:
    """The `scaletrain` command of this environment (what a user runs), else `python -m scaletrain`."""
    script = Path(sys.executable).with_name("scaletrain")
    return [str(script)] if script.exists() else [sys.executable, "-m", "scaletrain"]


def step_ratio(config: str, data_dir: Path, steps: int = 100, warmup: int = 10) -> dict:
    """Median ms of the recipe's training step (compiled, as it runs) with AdamW and with Muon, alternating step
    by step in this process (load slows both alike), and Muon's over AdamW's."""
    scratch = Path(tempfile.mkdtemp(prefix="step-ratio-"))
    try:
        base = load_config(str(ROOT / config), {"checkpoint.enabled": "false", "monitor.enabled": "false",
                                                "logging.tensorboard": "false", "data.cache_dir": str(data_dir)})
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


def run_ours(config: str, optimizer: str, cache_dir: Path, run_dir: Path, data_dir: Path, extra: list[str]) -> dict:
    """One whole `scaletrain train` process: its wall time from launch, and each evaluation as
    (step, val loss, seconds from launch)."""
    # A fresh machine has neither inductor's cache nor scaletrain's (the measured peak, train.compile=auto's
    # record): both live in ``cache_dir``, new for a "fresh" run and reused by the "warm" one after it.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
           "SCALETRAIN_CACHE": str(cache_dir / "scaletrain")}
    cmd = [*scaletrain_command(), "train", "--config", str(ROOT / config), f"--train.run_dir={run_dir}",
           f"--data.cache_dir={data_dir}", "--logging.progress=plain", "--logging.tensorboard=false",
           *OPTIMIZERS[optimizer], *extra]
    launched = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - launched
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [[r["step"], r["val_loss"], r["time"] - launched] for r in records if "val_loss" in r]
    done = next((line for line in proc.stdout.splitlines() if line.startswith("done:")), "")
    return {"optimizer": optimizer, "wall_s": wall, "final_val_loss": evals[-1][1], "evals": evals,
            "val_loss": {str(step): round(loss, 4) for step, loss, _ in evals}, "done_line": done}


def run_nanogpt(recipe: str, data_dir: Path, steps: int, eval_interval: int, windows_batches: int) -> dict:
    """One whole nanoGPT reference process; its wall time is launch to the end of training (the scoring of
    the val windows after it is not part of nanoGPT's run)."""
    cmd = [sys.executable, str(REFERENCE), "--config", recipe, "--data", str(data_dir), f"--max-iters={steps}",
           f"--eval-interval={eval_interval}", f"--windows-batches={windows_batches}"]
    launched = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    evals = [[r["step"], r["val_loss"], r["time"] - launched] for r in records if "val_loss" in r]
    end = next(r for r in records if r.get("end"))
    windows = next((r["val_loss_windows"] for r in records if "val_loss_windows" in r), None)
    return {"optimizer": "nanogpt", "wall_s": end["time"] - launched, "final_val_loss": evals[-1][1],
            "val_loss_windows": windows, "median_step_ms": end["median_step_ms"], "evals": evals,
            "val_loss": {str(step): loss for step, loss, _ in evals}}


def first_at(evals: list[list[float]], target: float) -> tuple[float | None, int | None]:
    """(seconds from launch, step) of the first evaluation at or below ``target``."""
    hit = next((e for e in evals if e[1] <= target), None)
    return (hit[2], hit[0]) if hit else (None, None)


def score(run: dict, nanogpt: dict, target: float, recorded: dict | None) -> None:
    """Add the run's time and step to ``target`` and its ratios to the same round's nanoGPT run."""
    run["time_to_target_s"], run["step_to_target"] = first_at(run["evals"], target)
    run["to_target_over_nanogpt"] = run["time_to_target_s"] / nanogpt["wall_s"] if run["time_to_target_s"] else None
    run["wall_over_nanogpt"] = run["wall_s"] / nanogpt["wall_s"]
    if recorded:
        run["time_to_recorded_s"], run["step_to_recorded"] = first_at(run["evals"], recorded["final_val_loss"])


def one_round(index: int, recipe: str, settings: dict, scratch: Path) -> dict:
    """nanoGPT and each optimizer fresh then warm, the order alternating with the round; then every run of ours
    scored against this round's nanoGPT."""
    contenders = ["nanogpt", *OPTIMIZERS]
    order = contenders if index % 2 == 0 else contenders[::-1]
    out = {"round": index, "order": order, "runs": []}
    for name in order:
        if name == "nanogpt":
            out["nanogpt"] = run_nanogpt(recipe, settings["data_dir"], settings["steps"], settings["eval_interval"],
                                         settings["eval_batches"])
            print(f"{recipe} round {index} nanoGPT     : whole run {out['nanogpt']['wall_s']:.1f} s, final val "
                  f"{out['nanogpt']['final_val_loss']:.4f} (windows {_fmt(out['nanogpt']['val_loss_windows'], 4)})",
                  flush=True)
            continue
        # Fresh then warm in even rounds; warm (on the cache the previous round's fresh run filled) then fresh in
        # odd ones, so that neither state always runs first (the fresh runs of the first record, always first,
        # were slower throughout their steps than the warm ones after them).
        warm_caches = settings["warm_caches"]
        states = ("fresh", "warm") if index % 2 == 0 or name not in warm_caches else ("warm", "fresh")
        for state in states:
            if state == "fresh":
                if name in warm_caches:
                    shutil.rmtree(warm_caches[name], ignore_errors=True)
                warm_caches[name] = Path(tempfile.mkdtemp(prefix="inductor-", dir=scratch))
            run_dir = scratch / f"{recipe}-r{index}-{name}-{state}"
            result = run_ours(settings["configs"].get(name, settings["config"]), name, warm_caches[name], run_dir,
                              settings["data_dir"], settings["extra"])
            out["runs"].append({"cache": state, **result})
            print(f"{recipe} round {index} {name:5s} {state:5s}: whole run {result['wall_s']:.1f} s, final val "
                  f"{result['final_val_loss']:.4f}", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
    if settings.get("equal_wall_steps") and "muon" in OPTIMIZERS:
        # Muon with its schedule fitted to AdamW's wall time: steps x (AdamW step / Muon step), side by side.
        steps = settings["equal_wall_steps"]
        run_dir = scratch / f"{recipe}-r{index}-muon-equal-wall"
        extra = [*settings["extra"], f"--train.steps={steps}"]
        result = run_ours(settings["config"], "muon", warm_caches["muon"], run_dir, settings["data_dir"], extra)
        out["runs"].append({"cache": "warm", "equal_wall_steps": steps, **result, "optimizer": "muon_equal_wall"})
        print(f"{recipe} round {index} Muon, {steps} steps (AdamW's wall): whole run {result['wall_s']:.1f} s, "
              f"final val {result['final_val_loss']:.4f}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    out["target"] = out["nanogpt"][RECIPES[recipe]["target"]]
    for run in out["runs"]:
        score(run, out["nanogpt"], out["target"], RECIPES[recipe]["recorded"])
    return out


def _median(values: list) -> float | None:
    """The median, or None when a run never reached its target (a median over the hits would flatter it)."""
    return None if not values or any(v is None for v in values) else statistics.median(values)


def summarize(rounds: list[dict], recorded: dict | None) -> dict:
    """Medians over rounds: nanoGPT's run, and per (optimizer, cache) ours with its same-round ratios."""
    nanogpt = [r["nanogpt"] for r in rounds]
    rows = {"nanogpt": {"wall_s": _median([n["wall_s"] for n in nanogpt]),
                        "final_val_loss": _median([n["final_val_loss"] for n in nanogpt]),
                        "val_loss_windows": _median([n["val_loss_windows"] for n in nanogpt]),
                        "median_step_ms": _median([n["median_step_ms"] for n in nanogpt]),
                        "target": _median([r["target"] for r in rounds])}}
    equal_wall = any(x["optimizer"] == "muon_equal_wall" for r in rounds for x in r["runs"])
    for optimizer in [*OPTIMIZERS, *(["muon_equal_wall"] if equal_wall else [])]:
        for state in ("fresh", "warm") if optimizer in OPTIMIZERS else ("warm",):
            runs = [x for r in rounds for x in r["runs"] if x["optimizer"] == optimizer and x["cache"] == state]
            row = {"time_to_target_s": _median([x["time_to_target_s"] for x in runs]),
                   "steps_to_target": [x["step_to_target"] for x in runs],
                   "to_target_over_nanogpt": _median([x["to_target_over_nanogpt"] for x in runs]),
                   "wall_s": _median([x["wall_s"] for x in runs]),
                   "wall_over_nanogpt": _median([x["wall_over_nanogpt"] for x in runs]),
                   "final_val_loss": _median([x["final_val_loss"] for x in runs])}
            if recorded:
                row["time_to_recorded_s"] = _median([x["time_to_recorded_s"] for x in runs])
                row["steps_to_recorded"] = [x["step_to_recorded"] for x in runs]
                row["to_recorded_over_nanogpt_recorded"] = (row["time_to_recorded_s"] / recorded["wall_s"]
                                                            if row["time_to_recorded_s"] else None)
            rows[f"{optimizer}_{state}" if optimizer in OPTIMIZERS else optimizer] = row
    return {"rows": rows}


def run_recipe(recipe: str, args: argparse.Namespace, scratch: Path) -> dict:
    """Prepare the recipe's tokens once, run the rounds, and summarize them."""
    config = RECIPES[recipe]["config"]
    data_dir = scratch / f"data-{recipe}"
    cfg = load_config(str(ROOT / config), {"data.cache_dir": str(data_dir)})
    prepare_data(cfg)
    steps = args.steps or cfg.train.steps
    eval_interval = args.eval_interval or cfg.train.eval_interval
    # A recipe of its own (the char Muon recipe) keeps its steps unless --steps names them for every run.
    own = RECIPES[recipe].get("own_configs", {})
    settings = {"config": config, "configs": own, "data_dir": data_dir, "steps": steps, "eval_interval": eval_interval,
                "eval_batches": cfg.train.eval_batches,
                "extra": [*([f"--train.steps={steps}"] if args.steps or not own else []),
                          f"--train.eval_interval={eval_interval}", *args.flags.split()],
                "warm_caches": {}}
    # The step-time ratio first: it sets the equal-wall Muon run's steps.
    side_by_side = step_ratio(config, data_dir, args.ratio_steps) if args.ratio_steps else None
    if args.equal_wall and side_by_side and "muon_over_adamw" in side_by_side:
        settings["equal_wall_steps"] = round(steps / side_by_side["muon_over_adamw"])
    rounds = [one_round(i, recipe, settings, scratch) for i in range(args.first_round, args.first_round + args.rounds)]
    summary = summarize(rounds, RECIPES[recipe]["recorded"])
    summary["side_by_side"] = side_by_side
    return {"recipe": config, "steps": steps, "eval_interval": eval_interval,
            "target": RECIPES[recipe]["target_text"],
            "nanogpt_recorded": RECIPES[recipe]["recorded"], "summary": summary, "rounds": rounds}


def print_table(recipe: str, result: dict, rounds: int) -> None:
    rows, recorded = result["summary"]["rows"], result["nanogpt_recorded"]
    nanogpt = rows["nanogpt"]
    print(f"\n{recipe} ({result['recipe']}, {result['steps']} steps), medians of {rounds} rounds; target: "
          f"{result['target']} (median {_fmt(nanogpt['target'], 4)}); nanoGPT's whole run "
          f"{_fmt(nanogpt['wall_s'])} s, {_fmt(nanogpt['median_step_ms'])} ms/step")
    extra = f" {'to ' + str(recorded['final_val_loss']) + ' s':>11s} {'x 91 s':>7s}" if recorded else ""
    print(f"{'':12s} {'to target s':>11s} {'x nanoGPT':>9s} {'steps':>10s} {'whole s':>8s} {'x nanoGPT':>9s} "
          f"{'final val':>9s}{extra}")
    for name, row in rows.items():
        if name == "nanogpt":
            continue
        steps = ",".join("-" if s is None else str(s) for s in row["steps_to_target"])
        name = name.replace("muon_equal_wall", "muon eq.wall")
        line = (f"{name:12s} {_fmt(row['time_to_target_s']):>11s} {_fmt(row['to_target_over_nanogpt'], 2):>9s} "
                f"{steps:>10s} {row['wall_s']:8.1f} {row['wall_over_nanogpt']:9.2f} {row['final_val_loss']:9.4f}")
        if recorded:
            line += (f" {_fmt(row['time_to_recorded_s']):>11s} "
                     f"{_fmt(row['to_recorded_over_nanogpt_recorded'], 2):>7s}")
        print(line)
    sbs = result["summary"]["side_by_side"]
    if sbs:
        print("step time, one process, alternating: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                                   sbs["median_ms"].items())
              + (f"; Muon / AdamW {sbs['muon_over_adamw']:.2f}" if "muon_over_adamw" in sbs else ""))


def _fmt(value: float | None, decimals: int = 1) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=("char", "bpe", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--first-round", type=int, default=0, help="index of the first round (its parity sets the "
                        "order: 1 runs nanoGPT last), to add rounds to an earlier result")
    parser.add_argument("--steps", type=int, default=0, help="steps of every run, ours and nanoGPT's (0 = the "
                        "recipe's train.steps: char 2000, bpe 1000)")
    parser.add_argument("--eval-interval", type=int, default=0, help="0 = the recipe's (250 for both)")
    parser.add_argument("--ratio-steps", type=int, default=100, help="interleaved steps of the step-time ratio "
                        "(0 = skip)")
    parser.add_argument("--equal-wall", action="store_true", help="also a Muon run (warm) whose steps, and so its "
                        "schedule, end at AdamW's wall time: the recipe's steps / the measured Muon/AdamW step ratio")
    parser.add_argument("--optimizers", default="adamw,muon", help="which rows of ours to run (comma-separated)")
    parser.add_argument("--flags", default="", help="extra flags for every run of ours, e.g. '--train.compile=false'")
    parser.add_argument("--muon-flags", default="", help="extra flags for the Muon runs, e.g. "
                        "'--optim.muon_lr=0.02 --optim.muon_adjust_lr=original' (Keller Jordan's recipe)")
    parser.add_argument("--out", default=default_out("time_to_loss.json"),
                        help=OUT_HELP.format(name="time_to_loss.json"))
    args = parser.parse_args()
    OPTIMIZERS["muon"] += args.muon_flags.split()
    for name in set(OPTIMIZERS) - set(args.optimizers.split(",")):
        del OPTIMIZERS[name]
    recipes = list(RECIPES) if args.recipe == "both" else [args.recipe]
    scratch = Path(tempfile.mkdtemp(prefix="time-to-loss-"))
    load_before = os.getloadavg()[0]
    try:
        results = {recipe: run_recipe(recipe, args, scratch) for recipe in recipes}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_result(args.out, {
        "benchmark": "time_to_loss", "flags": args.flags, "optimizers": OPTIMIZERS,
        "machine": {"load_average_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                    "cpus": os.cpu_count()},
        "recipes": results}, indent=2)
    for recipe, result in results.items():
        print_table(recipe, result, args.rounds)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
