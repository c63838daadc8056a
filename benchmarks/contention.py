"""Threads that follow the load both ways (issue 49): the default run quiet, and the same run with a minute of
CPU load started 20 s in, side by side.

Each run is ``scaletrain train`` as the README's first command runs it (the default config: the nano model,
1,500 steps on the bundled Tiny Shakespeare), a whole process timed from its launch, with its own run folder
and empty caches (inductor's and scaletrain's: ``train.compile = auto`` and the start's measurements decide as on
a fresh machine, not from the previous run's record). The ``loaded`` run has ``--busy`` busy-loop processes (one
per core the run may use, by default) on its cores from ``--load-start`` s into its training (after its
``model:`` line, so a slow start-up does not eat the load) for ``--load-seconds``; ``quiet`` has none.
``--before REV`` adds the loaded run on REV's ``src/`` (``git archive``; 7347daa is the trainer before issue 49,
whose count never came back). Each run reports its wall, the training loop's seconds, its median step, the
median logged step once the load has been gone RETURN_ALLOWANCE s, the final val loss, and the thread lines it
said with their time from launch. Target (issue 49): the loaded wall at most 1.1x the quiet one plus the load's
own seconds. ``--rounds N`` alternates the order round by round and gives medians.

    python benchmarks/contention.py --before 7347daa --out benchmarks/results/contention.json  # ~25 min, 2 cores
    python benchmarks/contention.py --steps 150 --load-start 10 --load-seconds 20              # a rehearsal

Run the full measurement on a machine nothing else loads: another job's load makes the quiet run a loaded one.
``others`` in ``CoreContention`` is the whole machine's share, so on more cores than the run may use (taskset, a
container) the busy processes on its cores read as a fraction of them. Writes benchmarks/out/contention.json
unless --out names another file, and prints a table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from launch import OUT_HELP, ROOT, default_out, write_result  # benchmarks/launch.py (its folder is on sys.path)

TARGET = 1.1  # issue 49: loaded wall <= 1.1 x quiet wall + the load's seconds
RETURN_ALLOWANCE = 30.0  # seconds after the load ends before its steps count as "after the load" (the return's wait)
THREAD_LINE = re.compile(r"the CPU is shared|the cores are free again|threads were slower than")
BUSY = "while True:\n    pass\n"


def source_of(rev: str, scratch: Path) -> Path:
    """``src/`` of git revision ``rev`` of this checkout, extracted under ``scratch``."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"], capture_output=True,
                         check=True).stdout
    folder = scratch / f"src-{rev}"
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(folder, filter="data")
    return folder / "src"


class BusyLoad:
    """``busy`` busy-loop processes on ``cores``, from ``start`` s after ``begin()`` for ``seconds``."""

    def __init__(self, busy: int, cores: set[int], start: float, seconds: float):
        self.busy, self.cores, self.start, self.seconds = busy, cores, start, seconds
        self.began: float | None = None  # time.time() at begin()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def begin(self) -> None:
        self.began = time.time()
        self._thread.start()

    def _run(self) -> None:
        if self._stop.wait(self.start) or not self.busy:
            return
        pin = f"import os; os.sched_setaffinity(0, {self.cores!r})\n"
        processes = [subprocess.Popen([sys.executable, "-c", pin + BUSY]) for _ in range(self.busy)]
        try:
            self._stop.wait(self.seconds)
        finally:
            for process in processes:
                process.kill()
                process.wait()

    def end(self) -> None:
        self._stop.set()
        if self.began is not None:
            self._thread.join()


def one_run(name: str, src: Path, load: BusyLoad, steps: int, scratch: Path) -> dict:
    """One ``scaletrain train`` process on ``src`` under ``load``: its wall, loop, steps and thread lines."""
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=scratch))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's default count: not pinned
    env.update(PYTHONPATH=str(src), TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"),
               SCALETRAIN_CACHE=str(folder / "scaletrain"))
    cmd = [sys.executable, "-m", "scaletrain", "train", f"--train.run_dir={folder / 'run'}",
           "--logging.progress=plain", *([f"--train.steps={steps}"] if steps else [])]
    load_average = os.getloadavg()[0]
    launched = time.time()
    process = subprocess.Popen(cmd, env=env, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    lines, tail = [], []
    try:
        for line in process.stdout:
            tail = [*tail[-40:], line]
            if load.began is None and line.startswith("model: "):  # set up: the training starts
                load.begin()
            if THREAD_LINE.search(line):
                lines.append({"at_s": round(time.time() - launched, 1), "line": line.strip()})
        returncode = process.wait()
    finally:
        load.end()
    wall = time.time() - launched
    if returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(cmd)} exited {returncode}:\n{''.join(tail)}")
    summary = json.loads((folder / "run" / "run_info.json").read_text())["segments"][-1]["summary"]
    records = [json.loads(r) for r in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    after = (load.began or launched) + load.start + load.seconds + RETURN_ALLOWANCE
    after_ms = [r["step_ms"] for r in records if "step_ms" in r and r["time"] > after]
    return {"wall_s": round(wall, 1), "training_started_s": round((load.began or launched) - launched, 1),
            "loop_s": round(summary["loop_seconds"], 1),
            "median_step_ms": round(summary["median_step_ms"], 1),
            "after_load_step_ms": round(statistics.median(after_ms), 1) if after_ms else None,
            "final_val_loss": round(summary["final_val_loss"], 4), "thread_lines": lines,
            "load_average_at_launch": round(load_average, 2)}


def describe(run: dict) -> str:
    """The thread lines' kinds and times, e.g. ``drop 21 s, back 97 s``."""
    kinds = (("the CPU is shared", "drop"), ("the cores are free", "back"), ("threads were slower", "slower"))
    return ", ".join(next(k for key, k in kinds if key in x["line"]) + f" {x['at_s']:.0f} s"
                     for x in run["thread_lines"]) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="train.steps of every run (0 = the default's 1,500)")
    parser.add_argument("--load-start", type=float, default=20.0,
                        help="seconds into training (after the run's `model:` line) the load starts")
    parser.add_argument("--load-seconds", type=float, default=60.0, help="how long the load lasts")
    parser.add_argument("--busy", type=int, default=0, help="busy processes (0 = one per core the run may use)")
    parser.add_argument("--before", default="", help="also the loaded run on this git revision's src/ (7347daa)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=default_out("contention.json"), help=OUT_HELP.format(name="contention.json"))
    args = parser.parse_args()
    cores = os.sched_getaffinity(0)
    busy = args.busy or len(cores)
    with tempfile.TemporaryDirectory(prefix="contention-") as tmp:
        scratch = Path(tmp)
        sources = {"quiet": ROOT / "src", "loaded": ROOT / "src"}
        if args.before:
            sources["loaded_before"] = source_of(args.before, scratch)
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        for r in range(args.rounds):
            for name in (list(sources) if r % 2 == 0 else list(sources)[::-1]):
                load = BusyLoad(0 if name == "quiet" else busy, cores, args.load_start, args.load_seconds)
                runs[name].append(one_run(name, sources[name], load, args.steps, scratch))
                print(f"round {r + 1} {name}: wall {runs[name][-1]['wall_s']:.1f} s, "
                      f"{describe(runs[name][-1])}", flush=True)
    median = {name: {key: statistics.median(x[key] for x in rs) for key in ("wall_s", "loop_s", "median_step_ms")}
              for name, rs in runs.items()}
    quiet_wall = median["quiet"]["wall_s"]
    bound = TARGET * quiet_wall + args.load_seconds
    result = {
        "what": "the default `scaletrain train` run quiet, and with busy processes on its cores for a while: wall "
                "time from launch (issue 49: threads follow the load both ways)",
        "steps": args.steps or "the default config's", "rounds": args.rounds, "before": args.before or None,
        "load": {"busy_processes": busy, "start_s": args.load_start, "seconds": args.load_seconds},
        "runs": runs, "median": median, "target": f"loaded wall <= {TARGET} x quiet wall + {args.load_seconds:g} s",
        "loaded_bound_s": round(bound, 1),
        "loaded_over_bound": round(median["loaded"]["wall_s"] / bound, 3),
        "within_target": median["loaded"]["wall_s"] <= bound,
        "machine": {"cpu_count": os.cpu_count(), "cores_available": len(cores), "platform": platform.platform(),
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    table = Table(title=f"The default run, quiet and with {busy} busy processes from {args.load_start:g} s for "
                        f"{args.load_seconds:g} s (median of {args.rounds} round{'s' * (args.rounds > 1)})")
    for column in ("run", "wall", "vs quiet", "loop", "median step", "step after the load", "val loss",
                   "thread lines (from launch)"):
        table.add_column(column)
    for name, rs in runs.items():
        after = [x["after_load_step_ms"] for x in rs if x["after_load_step_ms"] is not None]
        table.add_row(name, f"{median[name]['wall_s']:.1f} s", f"{median[name]['wall_s'] / quiet_wall:.2f}x",
                      f"{median[name]['loop_s']:.1f} s", f"{median[name]['median_step_ms']:.0f} ms",
                      f"{statistics.median(after):.0f} ms" if after else "-",
                      f"{statistics.median(x['final_val_loss'] for x in rs):.4f}", describe(rs[-1]))
    Console(width=160).print(table)
    print(f"target: loaded wall {median['loaded']['wall_s']:.1f} s <= {TARGET} x {quiet_wall:.1f} + "
          f"{args.load_seconds:g} = {bound:.1f} s: {'yes' if result['within_target'] else 'NO'}")
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
