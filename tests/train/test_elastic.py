"""Autoscaling on PyTorch's elastic engine: ``torchrun --nnodes=1:2 --rdzv-backend=c10d`` agents on localhost.

One agent starts the job alone; a second agent joins (torchrun stops the workers - SIGTERM: the trainer finishes
its step and checkpoints - and restarts them as 2 ranks); then the second agent and its worker are killed (the
survivor's all-reduce fails, torchrun restarts it alone). Each start resumes from the latest checkpoint
(``TORCHELASTIC_RESTART_COUNT`` > 0) at the new world size with the same global batch (gradient accumulation
recomputed, ``checkpoint/training.py:match_global_batch``) and the same schedule (a function of the step).
Checked: every step's loss equals an uninterrupted single-process run's on the same global batches (1e-5
relative: the same samples in the same order, so none repeated or skipped), and every checkpoint's data cursor
is step x global batch. ``elastic_run`` is also what benchmarks/elastic.py measures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.faults import kill, worker_pids
from helpers.launch import HELPERS, env_for_ranks, free_port
from helpers.tiny import tiny_overrides
from helpers.waits import CEILING_S
from scaletrain.checkpoint.manager import CheckpointManager

TESTS = Path(__file__).parents[1]
GLOBAL_BATCH = 8  # sequences per step: 4 x 2 micro-batches on one rank, 4 x 1 on each of two

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def flags(tmp: Path, steps: int) -> list[str]:
    over = tiny_overrides(tmp / "run", **{"train.steps": steps, "train.grad_accum_steps": 2, "checkpoint.interval": 1,
                                          "checkpoint.keep_last": 1000, "logging.log_interval": 1,
                                          "parallel.dp_replicate": -1, "train.threads": 1, "monitor.enabled": "false",
                                          "data.cache_dir": str(tmp / "data")})
    return [f"--{k}={v}" for k, v in over.items()]


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line] if path.exists() else []


def ranks_of(record: dict) -> int:
    return len(record.get("peak_memory_mb_per_rank", [0]))


def wait(condition, agent: subprocess.Popen, what: str, timeout: float = CEILING_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if agent.poll() is not None or time.monotonic() > deadline:
            agent.kill()
            raise AssertionError(f"agent ended (exit {agent.returncode}) or timed out before {what}")
        time.sleep(0.05)


def elastic_run(tmp: Path, steps: int = 16, slow: float = 0.05, join_at: int = 3, run_two: int = 3) -> dict:
    """Start agent A alone, add agent B at step ``join_at`` (A's run is held there until torchrun stops its
    worker for the new rendezvous, so the join happens at that step however long B takes to start), kill B
    ``run_two`` steps after the job ran on two ranks; A runs on alone to ``steps``. Returns the committed loss
    curve (the last record of each step) with the world size of each step, and the events."""
    run = tmp / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=elastic-test",
           "--max-restarts=5", "--monitor-interval=0.5", "--rdzv-conf=last_call_timeout=1,join_timeout=120",
           str(HELPERS / "slow_rank_train.py"), "train", *flags(tmp, steps), "--resume"]
    hold = tmp / "hold"
    # Long enough steps to leave during; held at step join_at until the join.
    env = env_for_ranks(SLOW_RANK="all", SLOW_SECONDS=str(slow), HOLD_FILE=str(hold))
    t0 = time.monotonic()
    logs = [open(tmp / f"agent{i}.log", "w") for i in range(2)]
    a = subprocess.Popen(cmd, env=env, stdout=logs[0], stderr=subprocess.STDOUT)
    b = None
    try:
        wait(lambda: records(run) and records(run)[-1]["step"] >= join_at - 1, a, f"step {join_at - 1}")
        hold.touch()
        joined_at = records(run)[-1]["step"] + 1
        b = subprocess.Popen(cmd, env=env, stdout=logs[1], stderr=subprocess.STDOUT)
        # torchrun stops A's worker (SIGTERM) for the new rendezvous: let it finish its step and checkpoint.
        wait(lambda: "closing signal SIGTERM" in (tmp / "agent0.log").read_text(), a, "the join")
        hold.unlink()
        wait(lambda: any(ranks_of(r) == 2 for r in records(run)), a, "two ranks")
        first_two = next(r["step"] for r in records(run) if ranks_of(r) == 2)
        wait(lambda: records(run)[-1]["step"] >= first_two + run_two - 1, a, "steps on two ranks")
        left_at = records(run)[-1]["step"]
        workers = worker_pids(b)
        kill(b.pid)  # the agent first, so it cannot restart its worker
        for pid in workers.values():
            kill(pid)
        b.wait(CEILING_S)
        assert a.wait(CEILING_S) == 0, (tmp / "agent0.log").read_text()[-4000:]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
    committed: dict[int, dict] = {}
    for r in records(run):
        committed[r["step"]] = r  # a step redone after a failure: the later record is the one kept
    return {"seconds": time.monotonic() - t0, "join_requested_at_step": joined_at,
            "first_step_on_two_ranks": first_two, "leave_at_step": left_at,
            "losses": [committed[s]["loss"] for s in sorted(committed)],
            "ranks": [ranks_of(committed[s]) for s in sorted(committed)], "steps": sorted(committed),
            "log": (tmp / "agent0.log").read_text()}


def reference_run(tmp: Path, steps: int) -> list[float]:
    """The uninterrupted run: one process, the same 8 sequences a step."""
    proc = subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", *flags(tmp, steps)],
                          env=env_for_ranks(), capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["loss"] for r in records(tmp / "run")]


def data_cursors(run: Path) -> dict[int, int]:
    """step -> the data position (global sequences consumed) saved in each checkpoint."""
    manager = CheckpointManager(run / "checkpoints")
    out = {}
    for path in manager.list_complete():
        state, _ = manager.load_local(path)
        assert state["data"]["epoch"] == 0
        out[manager.read_meta(path)["step"]] = state["data"]["cursor"]
    return out


def test_join_and_leave_keep_the_global_batch_and_every_sample(tmp_path):
    steps = 16
    (tmp_path / "elastic").mkdir()
    (tmp_path / "reference").mkdir()
    got = elastic_run(tmp_path / "elastic", steps)
    want = reference_run(tmp_path / "reference", steps)
    assert got["steps"] == list(range(1, steps + 1))
    assert 2 in got["ranks"] and got["ranks"][0] == 1 and got["ranks"][-1] == 1, got["ranks"]
    assert "train.grad_accum_steps 2 -> 1" in got["log"] and "resharded from 2 to 1 ranks" in got["log"]
    worst = max(abs(a - b) / b for a, b in zip(got["losses"], want))
    assert worst < 1e-5, (worst, got["losses"], want)
    cursors = data_cursors(tmp_path / "elastic" / "run")
    assert len(cursors) >= steps - 2 and all(c == step * GLOBAL_BATCH for step, c in cursors.items()), cursors


ELASTIC_LAUNCHER = TESTS.parent / "scripts" / "launch" / "elastic.py"


@pytest.mark.parametrize("nnodes, says", [("2:1", "MIN (2) is greater than MAX (1)"), ("0:2", "MIN must be >= 1"),
                                          ("a:b", "write MIN:MAX")])
def test_elastic_launcher_refuses_bad_nnodes_in_one_line(nnodes, says):
    proc = subprocess.run([sys.executable, str(ELASTIC_LAUNCHER), "--nnodes", nnodes, "--endpoint", "h:1", "--dry-run"],
                          capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and says in proc.stderr, proc.stderr


def test_elastic_launcher_builds_the_torchrun_command():
    proc = subprocess.run([sys.executable, str(ELASTIC_LAUNCHER), "--nnodes", "1:2", "--endpoint", "127.0.0.1:29400",
                           "--id", "j", "--dry-run", "--", "--config", "c.toml"], capture_output=True, text=True,
                          timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr
    for part in ("torch.distributed.run", "--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400",
                 "-m scaletrain.cli train --config c.toml --resume"):
        assert part in proc.stdout
