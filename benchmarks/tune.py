"""``scaletrain tune`` on the baby recipe: 2 workers sharing one SQLite study, median pruning, a kill mid-study.

The study searches docs/examples/baby_space.toml (optim.lr log 1e-4..3e-2, schedule.warmup_steps 0..40 by
10, optim.beta2 in {0.95, 0.99}, optim.weight_decay in {0, 0.1}) over configs/shakespeare_char_baby_adamw.toml
shortened to ``--steps`` steps (warmup 10, eval every 50 steps on 10 batches, eager), so that ``--trials``
trials fit in minutes on 2 shared cores. The recipe's own values run first (trial 0, the hand-set baseline).

1. ``scaletrain tune --trials N --parallel 2`` starts; once ``--kill-after`` trials are finished the tune
   process is killed with SIGKILL (its workers die with it);
2. the same command runs again and completes the study.

Reported: the trials finished at the kill and at the end (every one finished before the kill is still there
with the same value), the trials the kill interrupted (failed by heartbeat, run again), the best trial's
val loss vs the hand-set one, and the compute used (FLOPs of the steps actually trained, pruned trials
included) vs running the same trials unpruned and vs an exhaustive grid of the space (lr at 6 half-decades
x 5 warmups x 2 beta2 x 2 weight decays = 120 full runs).

    .venv/bin/python benchmarks/tune.py             # ~15 minutes on 2 shared cores

Writes benchmarks/out/tune.json (``--out benchmarks/results/tune.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import OUT_HELP, default_out, write_result  # noqa: E402  (benchmarks/launch.py)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "shakespeare_char_baby_adamw.toml"
SPACE = ROOT / "docs" / "examples" / "baby_space.toml"
GRID_POINTS = 6 * 5 * 2 * 2


def command(folder: Path, trials: int, steps: int) -> list[str]:
    return [sys.executable, "-m", "scaletrain", "tune", "--config", str(RECIPE), "--space", str(SPACE),
            "--trials", str(trials), "--parallel", "2", "--out", str(folder), f"--train.steps={steps}",
            "--schedule.warmup_steps=10", "--train.eval_interval=50", "--train.eval_batches=10",
            "--train.compile=false", "--logging.tensorboard=false", f"--train.run_dir={folder.parent / 'baby'}"]


def finished(folder: Path) -> list:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not (folder / "study.db").is_file():
        return []
    try:
        study = optuna.load_study(study_name="tune", storage=f"sqlite:///{folder / 'study.db'}")
    except KeyError:  # not created yet
        return []
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return [t for t in study.get_trials(deepcopy=False) if t.state in done]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--kill-after", type=int, default=8, help="finished trials before the kill")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=default_out("tune.json"), help=OUT_HELP.format(name="tune.json"))
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tune"
        first = subprocess.Popen(command(folder, args.trials, args.steps), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        while len(finished(folder)) < args.kill_after and first.poll() is None:
            time.sleep(2)
        at_kill = {t.number: (t.state.name, t.value) for t in finished(folder)}
        first.send_signal(signal.SIGKILL)
        first.wait()
        print(first.stdout.read(), flush=True)
        killed_at = time.time() - t0
        print(f"killed the tune process after {killed_at:.0f} s with {len(at_kill)} trials finished", flush=True)
        time.sleep(3)
        second = subprocess.run(command(folder, args.trials, args.steps), env=env, capture_output=True, text=True)
        print(second.stdout[-6000:], second.stderr[-3000:], flush=True)
        doc = json.loads((folder / "study.json").read_text())
    trials = doc["trials"]
    kept = all(any(t["number"] == n and t["state"].upper() == state and t["value"] == value for t in trials)
               for n, (state, value) in at_kill.items())
    baseline = next(t for t in trials if t["baseline"] and t["state"] == "complete")
    best = doc["best"]
    complete = [t for t in trials if t["state"] == "complete"]
    full_trial_flops = max(t["flops"] for t in complete)  # every point trains the same model for --steps steps
    used = sum(t["flops"] for t in trials)
    counted = [t for t in trials if t["state"] in ("complete", "pruned", "skipped")]
    result = {
        "benchmark": "tune", "recipe": str(RECIPE.relative_to(ROOT)), "space": str(SPACE.relative_to(ROOT)),
        "steps_per_trial": args.steps, "workers": 2, "pruner": "median",
        "trials_finished_at_kill": len(at_kill), "killed_after_seconds": round(killed_at, 1),
        "trials_finished_at_end": len(counted), "trials_failed_by_the_kill": sum(t["state"] == "fail" for t in trials),
        "trials_complete": len(complete), "trials_pruned": sum(t["state"] == "pruned" for t in trials),
        "finished_before_kill_all_kept": kept, "rerun_exit_code": second.returncode,
        "baseline": {"number": baseline["number"], "params": baseline["params"], "val_loss": baseline["value"]},
        "best": best, "best_vs_baseline": best["value"] - baseline["value"],
        "flops_used": used, "flops_full_trial": full_trial_flops,
        "compute_vs_same_trials_unpruned": used / (len(counted) * full_trial_flops),
        "grid_points": GRID_POINTS, "compute_vs_grid": used / (GRID_POINTS * full_trial_flops),
        "seconds": round(time.time() - t0, 1), "machine": platform.processor() or platform.machine(),
        "trials": [{k: t[k] for k in ("number", "state", "value", "params", "steps", "baseline")} for t in trials]}
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}, indent=1))
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
