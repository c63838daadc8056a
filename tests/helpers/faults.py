"""Helpers for the fault-injection tests: launch real training processes, wait for a step, kill them,
and compare what a run ends with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from helpers.waits import CEILING_S

HELPERS = Path(__file__).parent  # the scripts launched below live here
FAULT_TRAIN = [sys.executable, str(HELPERS / "fault_train.py")]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# Slow enough (~20-30 ms a step on 2 cores) that a kill lands mid-run, small enough to train in seconds.
TINY_TOML = """
[model]
vocab_size = {vocab}
dim = 64
n_layers = 4
n_heads = 4
ffn_hidden_dim = 128
max_seq_len = 64
[data]
seq_len = 64
cache_dir = "{cache}"
[train]
precision = "fp32"  # bitwise comparisons: not "auto", which picks bf16 on a CPU with fast bf16
steps = {steps}
batch_size = 8
eval_interval = 0
eval_batches = 2
sample_tokens = 0
seed = 7
[schedule]
warmup_steps = 5
[logging]
log_interval = 1
progress = "off"
tensorboard = false
[checkpoint]
interval = {interval}
keep_last = 2
"""


def write_config(folder: Path, steps: int, interval: int, vocab: int = 0) -> Path:
    """``vocab``: 0 = the tokenizer's (65 characters); tensor parallelism needs a multiple of its degree."""
    config = folder / "tiny.toml"
    config.write_text(TINY_TOML.format(cache=folder / "data", steps=steps, interval=interval, vocab=vocab))
    return config


def env(**extra: str) -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(key, None)
    return out


def _sigint_as_in_a_terminal() -> None:
    """Run in the child before exec: SIGINT back to its default, so Python installs KeyboardInterrupt as it does
    in a terminal. A suite started in the background (``cmd &`` in a script, nohup) has SIGINT ignored, which
    children inherit: Python then never raises KeyboardInterrupt and a Ctrl-C test waits for nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(args: list[str], nproc: int = 1, torchrun_args: tuple[str, ...] = (), **extra_env: str) -> subprocess.Popen:
    """``scaletrain`` in a new process (under torchrun when nproc > 1); output goes to a temp file."""
    if nproc == 1:
        cmd = [*FAULT_TRAIN, *args]
    else:
        cmd = [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *torchrun_args, str(HELPERS / "fault_train.py"),
               *args]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=env(**extra_env), stdout=log, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_sigint_as_in_a_terminal)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def output(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read()


def finish(proc: subprocess.Popen, timeout: float = CEILING_S) -> int:
    """Wait for ``proc`` to end; ``timeout`` only catches a hang (helpers/waits.py)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"training process still running after {timeout:.0f} s:\n{output(proc)[-4000:]}") from None


def run_ok(args: list[str], nproc: int = 1, expect: int = 0, **kw) -> str:
    proc = launch(args, nproc, **kw)
    code = finish(proc)
    text = output(proc)
    assert code == expect, f"exit {code} (expected {expect}):\n{text[-5000:]}"
    return text


def last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def wait_for(condition, proc: subprocess.Popen, timeout: float = CEILING_S, what: str = "") -> None:
    """Poll ``condition()`` every few ms until it holds; fail, with the process's output, if the process ends
    first. ``timeout`` only catches a hang: a slow machine just takes longer (helpers/waits.py)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"process ended (exit {proc.returncode}) before {what}:\n{output(proc)[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"no {what} after {timeout:.0f} s, the process still running:\n"
                                 f"{output(proc)[-3000:]}")
        time.sleep(0.003)


def kill9_after_step(args: list[str], run: Path, step: int, total: int) -> None:
    """``scaletrain ARGS`` into ``run``, killed with SIGKILL (no handler, no cleanup) once its metrics reach
    ``step``; fails if the run finished (``total`` steps) before the kill landed."""
    proc = launch([*args, f"--train.run_dir={run}"])
    wait_for(lambda: last_step(run) >= step, proc, what=f"step {step}")
    proc.kill()
    proc.wait()
    assert last_step(run) < total, "the run finished before the kill landed"


def worker_pids(torchrun: subprocess.Popen) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes."""
    out = {}
    for task in Path(f"/proc/{torchrun.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    out[int(item[5:])] = int(pid)
    return out


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def losses(run: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a crash and again after the resume) keeps the last."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from scaletrain.infer.load import load_run  # any run, fine-tunes included

    _, model, _, _ = load_run(run)
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_run(a: Path, b: Path, rtol: float = 0.0) -> None:
    """Identical per-step losses and final parameters (bitwise when rtol == 0)."""
    la, lb = losses(a), losses(b)
    assert sorted(la) == sorted(lb), (sorted(la), sorted(lb))
    for step in la:
        assert abs(la[step] - lb[step]) <= rtol * abs(la[step]), f"step {step}: {la[step]} vs {lb[step]}"
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        if rtol == 0:
            assert torch.equal(wa[k], wb[k]), f"final {k} differs"
        else:  # relative to the tensor's size: Adam's m / sqrt(v) amplifies rounding in near-zero entries
            rel = float((wa[k] - wb[k]).norm() / wa[k].norm())
            assert rel <= rtol, f"final {k} differs: relative difference {rel:.2e}"


def train_args(config: Path, run: Path, *extra: str) -> list[str]:
    """``scaletrain train`` of ``config`` into run folder ``run``, plus ``extra`` flags."""
    return ["train", "--config", str(config), f"--train.run_dir={run}", *extra]


def reference_run(folder: Path, steps: int, interval: int) -> tuple[Path, Path]:
    """An uninterrupted run of the tiny job (synchronous checkpoints every ``interval`` steps) in ``folder``:
    (its config, its run folder), the reference a resumed run must end equal to."""
    config = write_config(folder, steps, interval)
    run_ok(train_args(config, folder / "run"))
    return config, folder / "run"
