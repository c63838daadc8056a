"""Checkpoint stall: how long a ~100M-parameter training loop waits for a synchronous vs an async save.

One process, one ``Trainer`` (dim 768, 14 layers, 12 heads, SwiGLU 2048, char-level Tiny Shakespeare,
1 x 64 tokens a step, fp32 AdamW on the CPU), saving model + AdamW moments (~1.2 GB) into a temporary run
folder. Every round does, in alternating order:

- sync:  ``trainer.save(blocking=True)``; the loop waits for the whole write, hashing and rename;
- async: ``trainer.save(blocking=False)`` returns at once; background threads copy the tensors to CPU
  memory (DCP's staging) and then write them. The loop's stall is that call plus the time its next
  optimizer step waits for the copy to finish (``wait_staged``). The steps that run during the write are
  timed and compared with the median step with nothing in flight (the copy and the write compete for the
  same cores: reported as the interference, "extra step s"), then ``trainer.checkpoint_store.wait()`` before
  the next round.

Each round also times a plain ``clone()`` of the same tensors, the cost of a copy made in the loop.
The machine's cores are shared with other work, so rounds
are interleaved, medians over rounds (and the median of the per-round ratios) are reported with the load
average, and rounds stop after ``--budget-s`` once ``--min-rounds`` are done. A last, untimed round checks
that an async checkpoint is complete (every sha256 matches) and holds the state at the moment of
``save()``, not the state the loop moved on to meanwhile.

    .venv/bin/python benchmarks/checkpoint.py              # 3-8 minutes, depending on the machine's load
    .venv/bin/python benchmarks/checkpoint.py --max-rounds 1 --min-rounds 1 --layers 2

Writes benchmarks/out/checkpoint.json (``--out benchmarks/results/checkpoint.json`` replaces the tracked
result) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)
from scaletrain.checkpoint import CheckpointManager
from scaletrain.config import load_config
from scaletrain.model import num_params
from scaletrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.2  # issue 6: the async stall is under 20% of the synchronous one


def rss_mb() -> float:
    """Resident memory of this process now (not the peak), from /proc."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) / 2**20


def build_trainer(args: argparse.Namespace, run_dir: str) -> Trainer:
    overrides = {"model.dim": args.dim, "model.n_layers": args.layers, "model.n_heads": 12,
                 "model.ffn_hidden_dim": 2048, "model.max_seq_len": 64, "data.seq_len": 64,
                 "train.batch_size": 1, "train.threads": args.threads, "train.device": "cpu",
                 "train.precision": "fp32", "train.eval_interval": 0, "train.sample_tokens": 0,
                 "train.run_dir": run_dir, "checkpoint.keep_last": 1, "logging.progress": "off",
                 "logging.tensorboard": "false"}
    return Trainer(load_config(None, {k: str(v) for k, v in overrides.items()}), log=False)


def tensors_mb(trainer: Trainer) -> float:
    """Bytes of model + optimizer tensors: what one checkpoint holds and what async staging copies."""
    return sum(t.nbytes for part in trainer.checkpoint.tensors().values() for t in part.values()) / 2**20


def timed_steps(trainer: Trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
    return times


def clone_seconds(trainer: Trainer) -> float:
    """Reference for the async stall: a plain copy of the same tensors into fresh memory."""
    t0 = time.perf_counter()
    copies = [t.clone() for part in trainer.checkpoint.tensors().values() for t in part.values()]
    took = time.perf_counter() - t0
    del copies
    return took


def sync_save(trainer: Trainer) -> dict:
    """The loop's stall for a blocking save: the whole call (write, sha256 of every file, rename)."""
    t0 = time.perf_counter()
    path = trainer.save(blocking=True)
    stall = time.perf_counter() - t0
    return {"stall_s": stall, "manager_blocked_s": trainer.checkpoint_store.last_save_seconds["blocked"],
            "size_mb": folder_mb(path)}


def async_save(trainer: Trainer, max_steps: int) -> dict:
    """The loop's stall for a non-blocking save, then the steps that run while the background write does."""
    rss_before = rss_mb()
    t0 = time.perf_counter()
    path = trainer.save(blocking=False)
    stall = time.perf_counter() - t0
    rss_staged = rss_mb()  # the CPU copy exists now
    done_at: list[float] = []
    # The manager's in-flight future; its callback stamps the moment the checkpoint is complete (written,
    # hashed, renamed), which the loop itself only learns at its next wait().
    trainer.checkpoint_store._pending.add_done_callback(lambda _: done_at.append(time.perf_counter()))
    during = []
    while not done_at and len(during) < max_steps:
        during += timed_steps(trainer, 1)
    t_wait = time.perf_counter()
    trainer.checkpoint_store.wait()
    # The copy runs in the background too; the loop waits for it only before its next optimizer step.
    staging_wait = trainer.checkpoint_store.last_save_seconds.get("staging_wait", 0.0)
    return {"stall_s": stall + staging_wait, "save_call_s": stall, "staging_wait_s": staging_wait,
            "manager_blocked_s": trainer.checkpoint_store.last_save_seconds["blocked"],
            "step_s_during_write": during, "wait_s": time.perf_counter() - t_wait,
            "complete_s": done_at[0] - t0, "size_mb": folder_mb(path),
            "rss_staging_mb": rss_staged - rss_before, "rss_delta_after_complete_mb": rss_mb() - rss_before}


def run_round(trainer: Trainer, index: int, args: argparse.Namespace) -> dict:
    """One sync and one async save (order alternating between rounds, so drift in the machine's load hits
    both alike), each after a few steps with nothing in flight, and the clone reference."""
    load = os.getloadavg()[0]
    quiet: list[float] = []
    out: dict = {"round": index}
    for mode in ("sync", "async") if index % 2 == 0 else ("async", "sync"):
        quiet += timed_steps(trainer, args.quiet_steps)
        out[mode] = sync_save(trainer) if mode == "sync" else async_save(trainer, args.max_steps)
    out["clone_s"] = clone_seconds(trainer)
    out["quiet_step_s"] = quiet
    out["load_average_1min"] = (load + os.getloadavg()[0]) / 2
    out["ratio"] = out["async"]["stall_s"] / out["sync"]["stall_s"]
    return out


def check_async_checkpoint(trainer: Trainer) -> dict:
    """Untimed: an async save while the loop moves on holds exactly the state of its step, and verifies."""
    live = trainer.checkpoint.tensors()
    snapshot = {part: {k: t.clone() for k, t in tensors.items()} for part, tensors in live.items()}
    step = trainer.state.step
    path = trainer.save(blocking=False)
    timed_steps(trainer, 2)  # the live weights and moments change while the copy is written
    trainer.checkpoint_store.wait()
    t0 = time.perf_counter()
    meta = CheckpointManager.verify(path)
    verify_s = time.perf_counter() - t0
    loaded = {part: {k: torch.zeros_like(t) for k, t in tensors.items()} for part, tensors in snapshot.items()}
    trainer.checkpoint_store.load(path, loaded)
    equal = all(torch.equal(loaded[part][k], snapshot[part][k]) for part in snapshot for k in snapshot[part])
    moved = any(not torch.equal(live["model"][k], snapshot["model"][k]) for k in snapshot["model"])
    return {"checkpoint": path.name, "meta_step": meta["step"], "step_at_save": step, "files": sorted(meta["files"]),
            "sha256_verified": True, "verify_s": verify_s, "loaded_equals_state_at_save": equal,
            "live_weights_moved_meanwhile": moved}


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds; the async cost also counts the extra time of the steps run during the write."""
    quiet_s = statistics.median(t for r in rounds for t in r["quiet_step_s"])
    during_all = [t for r in rounds for t in r["async"]["step_s_during_write"]]
    for r in rounds:
        during = r["async"]["step_s_during_write"]
        r["async"]["extra_step_s_during_write"] = sum(during) - quiet_s * len(during)
        r["async"]["effective_stall_s"] = r["async"]["stall_s"] + r["async"]["extra_step_s_during_write"]

    def med(mode: str, key: str) -> float:
        return statistics.median(r[mode][key] for r in rounds)

    sync_stall, async_stall = med("sync", "stall_s"), med("async", "stall_s")
    ratio = async_stall / sync_stall
    return {"quiet_step_s": quiet_s, "sync_stall_s": sync_stall, "async_stall_s": async_stall,
            "async_steps_during_write": statistics.median(len(r["async"]["step_s_during_write"]) for r in rounds),
            "async_step_s_during_write": statistics.median(during_all),
            "async_extra_step_s_during_write": med("async", "extra_step_s_during_write"),
            "async_effective_stall_s": med("async", "effective_stall_s"),
            "async_complete_s": med("async", "complete_s"), "clone_s": statistics.median(r["clone_s"] for r in rounds),
            "checkpoint_mb": med("sync", "size_mb"), "rss_staging_mb": med("async", "rss_staging_mb"),
            "ratio_async_over_sync": ratio, "passed": ratio < TARGET_RATIO,
            "median_of_round_ratios": statistics.median(r["ratio"] for r in rounds),
            "ratio_effective_over_sync": med("async", "effective_stall_s") / sync_stall}


def print_table(rounds: list[dict], s: dict, params: int, staged_mb: float, check: dict) -> None:
    print(f"\n{params:,} parameters; checkpoint {s['checkpoint_mb']:,.0f} MiB on disk; median step with nothing "
          f"in flight {s['quiet_step_s']:.2f} s")
    print(f"\n{'round':>5s} {'load':>5s} {'sync stall':>11s} {'async stall':>12s} {'ratio':>6s} {'clone':>6s} "
          f"{'steps during':>13s} {'extra step s':>13s} {'async complete':>15s} {'RSS +MiB':>9s}")
    for r in rounds:
        a = r["async"]
        print(f"{r['round']:5d} {r['load_average_1min']:5.1f} {r['sync']['stall_s']:11.2f} {a['stall_s']:12.2f} "
              f"{r['ratio']:6.3f} {r['clone_s']:6.2f} {len(a['step_s_during_write']):13d} "
              f"{a['extra_step_s_during_write']:13.2f} {a['complete_s']:15.2f} {a['rss_staging_mb']:9.0f}")
    print(f"\n{'median (s)':30s} {'sync':>8s} {'async':>8s}")
    print(f"{'loop stalled by save()':30s} {s['sync_stall_s']:8.2f} {s['async_stall_s']:8.2f}")
    print(f"{'+ extra step time during write':30s} {'':8s} {s['async_extra_step_s_during_write']:8.2f}")
    print(f"{'= effective stall':30s} {s['sync_stall_s']:8.2f} {s['async_effective_stall_s']:8.2f}")
    print(f"{'until checkpoint complete':30s} {s['sync_stall_s']:8.2f} {s['async_complete_s']:8.2f}")
    print(f"\nasync stall / sync stall = {s['ratio_async_over_sync']:.3f} ({'<' if s['passed'] else 'NOT <'} "
          f"{TARGET_RATIO}; median of the per-round ratios {s['median_of_round_ratios']:.3f}); counting the slower "
          f"steps during the write: {s['ratio_effective_over_sync']:.3f}")
    print(f"async stall vs a plain clone() of the same {staged_mb:,.0f} MiB: {s['async_stall_s']:.2f} s vs "
          f"{s['clone_s']:.2f} s; RSS +{s['rss_staging_mb']:,.0f} MiB right after save(blocking=False)")
    print(f"steps during an async write: median {s['async_step_s_during_write']:.2f} s vs {s['quiet_step_s']:.2f} s "
          f"with nothing in flight")
    print(f"async checkpoint {check['checkpoint']}: sha256 of {len(check['files'])} files verified in "
          f"{check['verify_s']:.1f} s; loaded tensors equal the state at save(): "
          f"{check['loaded_equals_state_at_save']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-rounds", type=int, default=3, help="rounds run whatever the time")
    parser.add_argument("--max-rounds", type=int, default=8, help="each round is one sync and one async save")
    parser.add_argument("--budget-s", type=float, default=360, help="no new round after this (past min-rounds)")
    parser.add_argument("--quiet-steps", type=int, default=2, help="steps with nothing in flight before each save")
    parser.add_argument("--max-steps", type=int, default=30, help="most steps to run during one async write")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=default_out("checkpoint.json"), help=OUT_HELP.format(name="checkpoint.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    run_dir = tempfile.mkdtemp(prefix="scaletrain-bench-checkpoint-")
    try:
        trainer = build_trainer(args, run_dir)
        params = num_params(trainer.cfg.model)
        print(f"model: {params:,} parameters, run folder {run_dir}", flush=True)
        timed_steps(trainer, 2)  # warm-up; creates the AdamW moments, so the checkpoint has its full size
        staged_mb = tensors_mb(trainer)
        rounds: list[dict] = []
        t0 = time.perf_counter()
        while len(rounds) < args.max_rounds and (len(rounds) < args.min_rounds
                                                 or time.perf_counter() - t0 < args.budget_s):
            rounds.append(run_round(trainer, len(rounds), args))
            r = rounds[-1]
            print(f"round {r['round']}: sync stall {r['sync']['stall_s']:.2f} s, async stall "
                  f"{r['async']['stall_s']:.2f} s (complete {r['async']['complete_s']:.2f} s), clone "
                  f"{r['clone_s']:.2f} s, load {r['load_average_1min']:.1f}", flush=True)
        check = check_async_checkpoint(trainer)
        trainer.checkpoint_store.close()
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    summary = summarize(rounds)
    result = {
        "benchmark": "checkpoint_stall",
        "machine": {"threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": sys.version.split()[0],
                    "load_average_1min": [round(r["load_average_1min"], 2) for r in rounds]},
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": 12, "ffn_hidden_dim": 2048,
                  "vocab_size": trainer.cfg.model.vocab_size, "seq_len": 64, "batch_size": 1, "parameters": params},
        "staged_tensors_mib": staged_mb, "rounds": rounds, "median": summary,
        "ratio_async_over_sync": summary["ratio_async_over_sync"], "target_ratio": TARGET_RATIO,
        "passed": summary["passed"], "async_check": check, "peak_rss_mib": peak_rss,
    }
    write_result(args.out, result, indent=2)
    print_table(rounds, summary, params, staged_mb, check)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
