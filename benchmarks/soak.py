"""Fault-injection soak: kill a training run at random moments, restart it each time, and check that it ends
with exactly the weights of an uninterrupted run.

Two layouts: one process, and 2 gloo ranks under torchrun with FSDP2 (``parallel.dp_shard=2``). Each is
first run once uninterrupted (the reference). Then the same job is started with ``--resume`` over and over;
each start is ended at a random moment - uniformly within the time a start takes, so the blows land in
start-up, data loading (the loader's prefetch thread), steps, and the asynchronous checkpoint saves
(``checkpoint.async_save = true``, a save every few steps) - by ``kill -9`` of the whole process group, or
(one time in four) by a SIGTERM, after which the run saves and exits 75 by itself. Restarts go on until a
start exits 0; then the last checkpoint's weights and the per-step losses must equal the reference's
bitwise, and, while blows remain to be dealt, a new run begins in a new folder (a round).

Reported per layout: kills and SIGTERMs, restarts, failures (a start that exited neither 0, 75 nor by our
kill, or a final mismatch; each with its output), wall time of the soak vs the reference, and the wall time
lost per kill ((soak - reference) / blows).

    .venv/bin/python benchmarks/soak.py                          # 50 blows in all, ~10 minutes on 2 cores
    .venv/bin/python benchmarks/soak.py --kills-single 4 --kills-fsdp 2 --steps 40   # a quick look

Writes benchmarks/out/soak.json (``--out benchmarks/results/soak.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)
from scaletrain.checkpoint.run import load_run

ROOT = Path(__file__).resolve().parents[1]
PREEMPTED = 75

JOB = """
[model]
dim = 64
n_layers = 4
n_heads = 4
ffn_hidden_dim = 128
max_seq_len = 64
[data]
seq_len = 64
cache_dir = "{cache}"
[train]
precision = "fp32"  # a bitwise comparison: not auto (bf16 on a CPU with fast bf16 matmuls)
steps = {steps}
batch_size = 8
eval_interval = 0
eval_batches = 2
sample_tokens = 0
seed = 11
[schedule]
warmup_steps = 5
[logging]
log_interval = 1
progress = "off"
tensorboard = false
[checkpoint]
interval = {interval}
keep_last = 2
async_save = true
"""

LAYOUTS = {"single": (1, []), "fsdp2": (2, ["--parallel.dp_shard=2"])}


def command(layout: str, config: Path, run: Path, resume: bool) -> list[str]:
    nproc, extra = LAYOUTS[layout]
    train = ["train", "--config", str(config), f"--train.run_dir={run}", *extra, *(["--resume"] if resume else [])]
    if nproc == 1:
        return [sys.executable, "-m", "scaletrain.cli", *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "scaletrain.cli", *train]


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    # Its own process group: a kill -9 takes torchrun's agent and workers at once, as a lost node does.
    return subprocess.Popen(cmd, env=environment(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    _, model, _, path = load_run(run)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def losses(run: Path) -> dict[int, float]:
    """Per-step training loss, the last record of each step (a resumed run re-logs the steps after its
    checkpoint)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by a kill -9
            continue
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def compare(reference: Path, run: Path) -> str:
    """'' when ``run`` ended with the reference's per-step losses and final weights, bitwise; else what differs."""
    la, lb = losses(reference), losses(run)
    wa, wb = final_weights(reference), final_weights(run)
    bad_steps = [s for s in la if la[s] != lb.get(s)] + [s for s in lb if s not in la]
    bad_tensors = [k for k in wa if k not in wb or not torch.equal(wa[k], wb[k])]
    return f"steps {bad_steps[:5]} tensors {bad_tensors[:5]}" if bad_steps or bad_tensors else ""


def soak_layout(layout: str, blows: int, folder: Path, steps: int, interval: int, rng: random.Random) -> dict:
    config = folder / "job.toml"
    config.write_text(JOB.format(cache=folder / "data", steps=steps, interval=interval))
    reference = folder / "reference"
    t0 = time.perf_counter()
    proc = start(command(layout, config, reference, resume=False), folder / "reference.log")
    if proc.wait() != 0:
        raise SystemExit(f"{layout}: the reference run failed:\n{(folder / 'reference.log').read_text()[-3000:]}")
    reference_s = time.perf_counter() - t0
    print(f"{layout}: reference run {reference_s:.1f} s", flush=True)

    kills = sigterms = starts = rounds = 0
    failures: list[str] = []
    equal_rounds = 0
    t0 = time.perf_counter()
    # Rounds until the blows are dealt: a round is one run from scratch to its end, restarted after every
    # blow; a run that finishes before the blows are all dealt is compared, and the next round begins.
    while kills + sigterms < blows and len(failures) <= 5:
        run = folder / f"soak-{rounds:02d}"
        rounds += 1
        done = False
        while not done and len(failures) <= 5:
            log = folder / f"{run.name}-start-{starts:03d}.log"
            proc = start(command(layout, config, run, resume=True), log)
            starts += 1
            if kills + sigterms < blows:
                # Uniform over a start's life (start-up included): blows land everywhere, saves among them.
                delay = rng.uniform(0.2, max(1.0, reference_s))
                try:
                    code = proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    if rng.random() < 0.25:
                        os.killpg(proc.pid, signal.SIGTERM)
                        sigterms += 1
                        code = proc.wait(timeout=300)
                        if code not in (PREEMPTED, 0, -signal.SIGTERM, 128 + signal.SIGTERM, 1):
                            failures.append(f"{log.name}: SIGTERM -> exit {code}: {log.read_text()[-1500:]}")
                    else:
                        os.killpg(proc.pid, signal.SIGKILL)
                        kills += 1
                        code = proc.wait(timeout=60)
                    continue
            else:
                code = proc.wait(timeout=900)
            if code == 0:
                done = True
            elif code != PREEMPTED:
                failures.append(f"{log.name}: exit {code}: {log.read_text()[-1500:]}")
        if done:
            mismatch = compare(reference, run)
            if mismatch:
                failures.append(f"{run.name}: final state differs from the reference: {mismatch}")
            else:
                equal_rounds += 1
    soak_s = time.perf_counter() - t0
    equal = equal_rounds == rounds and not failures
    done = equal_rounds == rounds
    total = kills + sigterms
    result = {"layout": layout, "ranks": LAYOUTS[layout][0], "steps": steps, "checkpoint_interval": interval,
              "kill9": kills, "sigterm": sigterms, "starts": starts, "rounds": rounds, "finished": done,
              "bitwise_equal": equal, "reference_s": round(reference_s, 2), "soak_s": round(soak_s, 2),
              # each round would have taken one uninterrupted run's time: the rest is what the blows cost
              "lost_s_per_blow": round((soak_s - rounds * reference_s) / total, 2) if total else 0.0,
              "failures": failures}
    print(f"{layout}: {kills} kill -9 + {sigterms} SIGTERM over {starts} starts in {rounds} runs, finished={done}, "
          f"bitwise equal={equal}, {soak_s:.0f} s vs {rounds} x {reference_s:.0f} s uninterrupted "
          f"({result['lost_s_per_blow']:.1f} s lost per blow), failures: {len(failures)}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills-single", type=int, default=30, help="blows for the one-process layout")
    parser.add_argument("--kills-fsdp", type=int, default=20, help="blows for the 2-rank FSDP2 layout")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=6, help="checkpoint every N steps (asynchronous)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=default_out("soak.json"), help=OUT_HELP.format(name="soak.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        for layout, blows in (("single", args.kills_single), ("fsdp2", args.kills_fsdp)):
            folder = Path(tmp) / layout
            folder.mkdir()
            results.append(soak_layout(layout, blows, folder, args.steps, args.interval, rng))
    print()
    print(f"{'layout':8} {'kill -9':>8} {'SIGTERM':>8} {'starts':>7} {'runs':>5} {'equal':>6} {'lost s/blow':>12} "
          f"{'failures':>9}")
    for r in results:
        print(f"{r['layout']:8} {r['kill9']:>8} {r['sigterm']:>8} {r['starts']:>7} {r['rounds']:>5} "
              f"{str(r['bitwise_equal']):>6} "
              f"{r['lost_s_per_blow']:>12.1f} {len(r['failures']):>9}")
    blows = sum(r["kill9"] + r["sigterm"] for r in results)
    ok = all(r["finished"] and r["bitwise_equal"] and not r["failures"] for r in results)
    summary = {"blows": blows, "kill9": sum(r["kill9"] for r in results),
               "sigterm": sum(r["sigterm"] for r in results), "all_survived": ok, "layouts": results,
               "torch": torch.__version__, "machine": platform.machine(), "cores": os.cpu_count(),
               "load_average": os.getloadavg()[0], "seed": args.seed}
    out = Path(args.out)
    write_result(out, summary, indent=2)
    print(f"\n{blows} blows, all survived bitwise: {ok} -> {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
