"""Start the processes a benchmark measures: one plain Python process, or ``ranks`` gloo ranks under torchrun;
and where and how a benchmark writes its JSON (``default_out``, ``write_result``: with the CPU it ran on).

Every benchmark that runs real ranks launches them the same way: ``OMP_NUM_THREADS`` set per process, the
rendezvous TCP store not shared with the workers (sharing it breaks gloo
re-initialisation), and a failure reported with the tail of the workers' stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"  # tracked: the figures the docs quote (tests/repo/test_docs.py checks them)
OUT = ROOT / "benchmarks" / "out"  # ignored by git: where a run writes unless --out names another file
OUT_HELP = ("JSON to write (default: benchmarks/out/{name}, ignored by git; pass --out benchmarks/results/{name} "
            "to replace the tracked result the docs quote)")


def default_out(name: str) -> str:
    """``benchmarks/out/NAME``: re-running a documented benchmark leaves the tracked
    ``benchmarks/results/NAME`` alone unless ``--out benchmarks/results/NAME`` is given explicitly."""
    return str(OUT / name)


def write_result(path: str | Path, result: object, indent: int = 1) -> Path:
    """Write a benchmark's result as JSON to ``path`` (its folder made first) and return the path. A dict result
    gets ``cpu``: the machine it was measured on (``machine_record``), since a time belongs to one CPU."""
    if isinstance(result, dict) and "cpu" not in result:
        result = {**result, "cpu": machine_record()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    return path


def machine_record() -> dict:
    """The CPU a benchmark ran on: model, cores, and the flags that decide its speed (AVX2, AVX-512, AVX512_BF16,
    AMX: ``scaletrain.hardware.peak.cpu_features``), with the torch version."""
    import torch

    from scaletrain.hardware.peak import cpu_features

    return {**cpu_features(), "torch": torch.__version__}


def run_ranks(args: list[str], ranks: int, what: str, *, threads: int = 1,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` (ranks == 1) or ``torchrun --standalone --nproc-per-node=RANKS ARGS``; raises
    ``RuntimeError("<what> failed: ...")`` with the stderr tail when it exits non-zero."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("WORLD_SIZE", None)  # started from inside a rank, torchrun would otherwise see its parent's
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    proc = subprocess.run([sys.executable, *launcher, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return proc


def append_rank_result(out: str | Path, result: dict) -> None:
    """Each torchrun rank appends its ``result`` (less its per-step list) to ``out`` as one JSON line, one rank at
    a time (a barrier between writers), then leaves the process group."""
    import torch.distributed as dist

    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            with open(out, "a") as fh:
                fh.write(json.dumps({k: v for k, v in result.items() if k != "step_s_all"}) + "\n")
        dist.barrier()
    dist.destroy_process_group()
