"""Fault-injection soak: kill a training run at random moments, restart it each time, and check that it ends
with exactly the weights of an uninterrupted run.

Two layouts: one process, and 2 gloo ranks under torchrun with FSDP2 (``parallel.dp_shard=2``). Each is
first run once uninterrupted (the reference). Then the same job is started with ``--resume`` over and over;
each start is ended at a random moment - uniformly within the time a start takes, so the blows land in
start-up, data loading (the loader's prefetch thread), steps, and the asynchronous checkpoint saves
(``checkpoint.async_save = true``, a save every few steps). The blows (``BLOWS``):

- ``node``: ``kill -9`` of every process of the run - torchrun's agent and each worker, found from the process
  tree (torchrun starts each worker in a session of its own, so a process-group kill would end the agent
  alone and leave the workers training as orphans); what a lost node (or a lost machine) loses;
- ``worker`` (2 ranks only): ``kill -9`` of one worker alone; the other rank must not hang (its collectives
  fail, torchrun's agent stops it) and the agent exits non-zero, a failure the restart recovers from;
- ``sigterm`` (one time in four): SIGTERM to the agent (the process, with one rank), which forwards it;
  the run saves and exits 75 by itself.

After each blow the soak waits for the run to end and then checks that no process of it is left (the tree
taken at the blow, and any process naming the run folder): one that is left is a failure. Restarts go on
until a start exits 0; then the last checkpoint's weights and the per-step losses must equal the
reference's bitwise, and, while blows remain to be dealt, a new run begins in a new folder (a round). Each
start records the step it resumed from (its ``resumed from ... (step N`` line), which must be the newest
complete checkpoint in the folder when it started; with 2 ranks, some starts must have resumed from a
checkpoint in the middle of the run, or the blows did not land.

Reported per layout: blows of each kind, restarts, the steps the starts resumed from, failures (a start
that exited neither 0, 75 nor by our kill, a process left after a blow, a run that did not end within
``END_S`` of a blow, a final mismatch; each with its output), the seconds from a blow until no process of
the run was left, wall time of the soak vs the reference, and the wall time lost per blow
((soak - rounds x reference) / blows).

    .venv/bin/python benchmarks/soak.py                          # 50 blows in all, 35 minutes on 2 busy cores
    .venv/bin/python benchmarks/soak.py --kills-single 4 --kills-fsdp 6 --steps 40   # a quick look

Writes benchmarks/out/soak.json (``--out benchmarks/results/soak.json`` replaces the tracked result).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)
from scaletrain.infer.load import load_run

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
    # A session of its own, as a job under a scheduler has: Ctrl-C in the soak's terminal does not reach it.
    return subprocess.Popen(cmd, env=environment(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)


# -- the blows and what must be left after them ------------------------------------------------------------------
END_S = 180  # a run still alive this long after a blow hangs (torchrun's agent kills workers 30 s after SIGTERM)


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and every process below it (torchrun's agent and its workers, and whatever they started)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


def workers(pid: int) -> list[psutil.Process]:
    """torchrun's worker processes (the agent's children that run the trainer)."""
    out = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children():
            with contextlib.suppress(psutil.Error):
                if "scaletrain.cli" in child.cmdline():
                    out.append(child)
    return out


def kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def kill_node(pid: int) -> list[psutil.Process]:
    """``kill -9`` of the process at ``pid`` and every process below it, as a lost node loses them. The top
    one is stopped first (SIGSTOP), so that it cannot start another worker between the look at the tree and
    the kills. Returns the processes killed."""
    with contextlib.suppress(psutil.NoSuchProcess):
        top = psutil.Process(pid)
        top.suspend()
        deadline = time.monotonic() + 2
        while top.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE) and time.monotonic() < deadline:
            time.sleep(0.001)
    tree = process_tree(pid)
    kill_all(tree)
    return tree


def alive(process: psutil.Process) -> bool:
    """Running (a zombie is dead; ``is_running`` also tells a reused PID from the process we saw)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def left_over(tree: list[psutil.Process], run: Path) -> list[psutil.Process]:
    """Processes of the run that are still alive: any of ``tree``, or any process naming the run folder."""
    left = [p for p in tree if alive(p)]
    seen = {p.pid for p in left}
    flag = f"--train.run_dir={run}"
    for process in psutil.process_iter(["cmdline"]):
        if process.pid not in seen and flag in (process.info["cmdline"] or []) and alive(process):
            left.append(process)
    return left


def describe(processes: list[psutil.Process]) -> str:
    out = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            out.append(f"PID {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:160]}")
    return "; ".join(out)


def deal_blow(kind: str, proc: subprocess.Popen, rng: random.Random) -> tuple[str, list[psutil.Process]]:
    """Deal one blow to the running start ``proc``; (the kind dealt, the processes of the run at that moment).
    A ``worker`` blow before torchrun has started its workers becomes a ``node`` blow."""
    if kind == "worker":
        ranks = workers(proc.pid)
        if not ranks:
            kind = "node"
        else:
            tree = process_tree(proc.pid)
            with contextlib.suppress(psutil.NoSuchProcess):
                rng.choice(ranks).kill()
            return kind, tree
    if kind == "node":
        return kind, kill_node(proc.pid)
    tree = process_tree(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)  # torchrun's agent forwards it to its workers
    return kind, tree


def expected_exit(kind: str, code: int) -> bool:
    """Whether a start's exit status is one its blow explains (0: the run had finished as the blow landed)."""
    if kind == "node":
        return code in (0, -signal.SIGKILL)
    if kind == "worker":  # torchrun's agent reports the failed worker with 1; 0 if it had already finished
        return code in (0, 1)
    return code in (PREEMPTED, 0, -signal.SIGTERM, 128 + signal.SIGTERM, 1)


def latest_checkpoint(run: Path) -> int:
    """The step of the newest complete checkpoint in the run folder (its ``meta.json`` is written last); 0 if
    none: where a restart must resume."""
    steps = [int(p.parent.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*/meta.json")]
    return max(steps, default=0)


def resumed_from(log: Path) -> int | None:
    """The step a start resumed from (0: a fresh start), or None when it was stopped before it said."""
    text = log.read_text(errors="replace")
    found = re.search(r"resumed from \S+ \(step (\d+)", text)
    if found:
        return int(found.group(1))
    return 0 if "starting from scratch" in text else None


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


BLOWS = {"single": ("node", "sigterm"), "fsdp2": ("node", "worker", "sigterm")}


def draw_blow(layout: str, rng: random.Random) -> str:
    """One time in four a SIGTERM; else a lost node, or (2 ranks) as often one lost worker."""
    if rng.random() < 0.25:
        return "sigterm"
    kinds = [k for k in BLOWS[layout] if k != "sigterm"]
    return rng.choice(kinds)


def after_blow(kind: str, proc: subprocess.Popen, tree: list[psutil.Process], run: Path, log: Path,
               failures: list[str]) -> tuple[int | None, float]:
    """Wait for the run to end after a blow; (the start's exit status or None if it hung, seconds from the blow
    until no process of the run was left). A process left over, a hang or an unexplained exit status is a
    failure; what is left is then killed, so that the next start finds the folder free."""
    t0 = time.perf_counter()
    try:
        code = proc.wait(timeout=END_S)
    except subprocess.TimeoutExpired:
        code = None
        failures.append(f"{log.name}: {kind} blow: still running {END_S} s later: {describe(left_over(tree, run))}")
    left = left_over(tree, run)
    deadline = time.monotonic() + 10  # the kernel's last clean-up of a killed process (reparented, reaped)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = left_over(tree, run)
    ended_s = time.perf_counter() - t0
    if left:
        failures.append(f"{log.name}: {kind} blow: {len(left)} process(es) of the run left: {describe(left)}")
        kill_all(left)
        proc.wait(timeout=60)
    if code is not None and not expected_exit(kind, code):
        failures.append(f"{log.name}: {kind} blow -> exit {code}: {log.read_text(errors='replace')[-1500:]}")
    return code, ended_s


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

    dealt = dict.fromkeys(BLOWS[layout], 0)
    ended_s: dict[str, list[float]] = {kind: [] for kind in BLOWS[layout]}
    starts: list[dict] = []  # per start: the step it resumed from, how it ended
    failures: list[str] = []
    rounds = equal_rounds = 0
    t0 = time.perf_counter()
    # Rounds until the blows are dealt: a round is one run from scratch to its end, restarted after every
    # blow; a run that finishes before the blows are all dealt is compared, and the next round begins.
    while sum(dealt.values()) < blows and len(failures) <= 5:
        run = folder / f"soak-{rounds:02d}"
        rounds += 1
        done = False
        while not done and len(failures) <= 5:
            log = folder / f"{run.name}-start-{len(starts):03d}.log"
            latest = latest_checkpoint(run)
            proc = start(command(layout, config, run, resume=True), log)
            record = {"run": run.name, "latest_checkpoint": latest, "blow": None}
            starts.append(record)
            if sum(dealt.values()) < blows:
                # Uniform over a start's life (start-up included): blows land everywhere, saves among them.
                delay = rng.uniform(0.2, max(1.0, reference_s))
                try:
                    code = proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    kind, tree = deal_blow(draw_blow(layout, rng), proc, rng)
                    dealt[kind] += 1
                    code, seconds = after_blow(kind, proc, tree, run, log, failures)
                    ended_s[kind].append(seconds)
                    record.update(blow=kind, ended_s=round(seconds, 2))
            else:
                code = proc.wait(timeout=900)
            record.update(resumed_from=resumed_from(log), exit=code)
            if record["resumed_from"] not in (None, latest):  # a valid newer checkpoint was passed over
                failures.append(f"{log.name}: resumed from step {record['resumed_from']}, not from the newest "
                                f"checkpoint (step {latest})")
            if code == 0:
                done = True
            elif record["blow"] is None:
                failures.append(f"{log.name}: exit {code}: {log.read_text(errors='replace')[-1500:]}")
        if done:
            mismatch = compare(reference, run)
            if mismatch:
                failures.append(f"{run.name}: final state differs from the reference: {mismatch}")
            else:
                equal_rounds += 1
    soak_s = time.perf_counter() - t0
    # A restart resumed "mid-run" from a checkpoint after step 0 and before the end.
    mid_run = sum(1 for r in starts if r["resumed_from"] is not None and 0 < r["resumed_from"] < steps)
    if LAYOUTS[layout][0] > 1 and blows and not mid_run:
        failures.append("no start resumed from a mid-run checkpoint: the blows did not stop the run")
    equal = equal_rounds == rounds and not failures
    done = equal_rounds == rounds
    total = sum(dealt.values())
    result = {"layout": layout, "ranks": LAYOUTS[layout][0], "steps": steps, "checkpoint_interval": interval,
              "blows": dealt, "starts": len(starts), "restarts": len(starts) - rounds,
              "resumed_mid_run": mid_run, "rounds": rounds, "finished": done, "bitwise_equal": equal,
              "reference_s": round(reference_s, 2), "soak_s": round(soak_s, 2),
              # each round would have taken one uninterrupted run's time: the rest is what the blows cost
              "lost_s_per_blow": round((soak_s - rounds * reference_s) / total, 2) if total else 0.0,
              "blow_to_end_s": {kind: {"median": round(statistics.median(v), 2), "max": round(max(v), 2)}
                                for kind, v in ended_s.items() if v},
              "processes_left": sum("process(es) of the run left" in f or "still running" in f for f in failures),
              "failures": failures, "per_start": starts}
    print(f"{layout}: {dealt} over {len(starts)} starts in {rounds} runs, {mid_run} resumed mid-run, finished={done}, "
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
    print(f"{'layout':8} {'node':>5} {'worker':>7} {'SIGTERM':>8} {'starts':>7} {'mid-run':>8} {'runs':>5} "
          f"{'equal':>6} {'lost s/blow':>12} {'failures':>9}")
    for r in results:
        b = r["blows"]
        print(f"{r['layout']:8} {b.get('node', 0):>5} {b.get('worker', 0):>7} {b.get('sigterm', 0):>8} "
              f"{r['starts']:>7} {r['resumed_mid_run']:>8} {r['rounds']:>5} {str(r['bitwise_equal']):>6} "
              f"{r['lost_s_per_blow']:>12.1f} {len(r['failures']):>9}")
    ok = all(r["finished"] and r["bitwise_equal"] and not r["failures"] for r in results)
    by_kind = {kind: sum(r["blows"].get(kind, 0) for r in results) for kind in ("node", "worker", "sigterm")}
    summary = {"blows": sum(by_kind.values()), **by_kind, "all_survived": ok, "layouts": results,
               "torch": torch.__version__, "machine": platform.machine(), "cores": os.cpu_count(),
               "load_average": os.getloadavg()[0], "seed": args.seed}
    out = Path(args.out)
    write_result(out, summary, indent=2)
    for r in results:
        for failure in r["failures"]:
            print(f"FAILURE ({r['layout']}): {failure}")
    print(f"\n{summary['blows']} blows, all survived bitwise: {ok} -> {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
