"""Launching real ranks: torchrun with gloo, and the environment every launched rank gets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from helpers.faults import env
from helpers.waits import CEILING_S

ROOT = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
PARITY_RTOL = 1e-5  # parallel vs single-process losses, relative


def torchrun(nproc: int, *args: str, cwd: Path | None = None,
             timeout: float = CEILING_S) -> subprocess.CompletedProcess:
    """Launch ``nproc`` gloo ranks; the rendezvous TCP store is not shared with the workers
    (sharing it breaks gloo's re-initialisation)."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([*TORCHRUN, f"--nproc-per-node={nproc}", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for_ranks(**extra: str) -> dict[str, str]:
    """``faults.env`` (one thread, no inherited ranks) for a torchrun launch: this checkout's sources first, and the
    rendezvous TCP store not shared with the workers."""
    return env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
