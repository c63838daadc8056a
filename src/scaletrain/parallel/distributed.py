"""Process-group lifecycle for runs launched by ``torchrun`` (or SLURM via torchrun).

``world_size_from_env`` is read *before* any process-group work so degrees can be validated first.
``init_distributed`` creates the default group from the environment torchrun sets (gloo on CPU, nccl on
GPU) and ``destroy_distributed`` shuts it down cleanly: a barrier first, because on gloo a rank that
exits while its peer still talks to it can die with SIGABRT.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def world_size_from_env() -> int:
    """WORLD_SIZE as set by torchrun; 1 when launched as a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global rank, world size, the rank on its node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool  # True when init_distributed created it (so it must also destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str, timeout_s: float = 600.0) -> DistEnv:
    """Create the default process group from torchrun's environment when WORLD_SIZE > 1.

    Reuses an existing group (e.g. a test harness that already initialised one). On CUDA each process
    takes GPU ``LOCAL_RANK``.
    """
    world = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if world == 1 and not dist.is_initialized():
        return DistEnv(0, 1, 0, device, owns_process_group=False)
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        device_id = device if device_type == "cuda" else None
        store = _restart_safe_store(world, timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world,
                                    timeout=timeout, device_id=device_id)
        owns = True
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, owns_process_group=owns)


def _restart_safe_store(world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun with the agent's shared TCP store, a store namespaced by the restart attempt.

    After ``--max-restarts`` restarts the workers, torch reconnects them to the *same* store the agent
    kept (its keys from the failed attempt included), and gloo's mesh set-up then reads stale addresses
    (``connectFullMesh failed`` or a hang). A per-attempt prefix gives every attempt clean
    keys. None when torch's default store set-up is safe (no agent store, or not under torchrun)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"scaletrain/attempt-{attempt}", client)


def restart_attempt() -> int:
    """Which torchrun (re)start this process belongs to: 0 for the first, n after n restarts."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_rank_zero() -> bool:
    """Whether this process speaks for the job: rank 0 of the process group, or before one exists (the CLI's
    first lines) torchrun's RANK; True in a plain process. The one place that decides who prints."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def say(text: str) -> None:
    """A line for people (progress, summaries, warnings), printed once per job: by rank 0 only. Errors are
    not said: every rank prints its own (cli.main), since each may fail for its own reason."""
    if is_rank_zero():
        print(text, flush=True)


def rank_zero_value(value: float, device: torch.device) -> float:
    """Rank 0's ``value`` on every rank (a measurement or decision only rank 0 made); ``value`` itself in a
    plain process. Collective under a process group: every rank calls it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(box, 0)
    return float(box.item())


def any_rank(*flags: bool, device: torch.device) -> tuple[bool, ...]:
    """Each flag, True on every rank when any rank has it (e.g. a notice that reaches the ranks a step apart);
    one all-reduce for all of them. Collective under a process group: every rank calls it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tuple(bool(f) for f in flags)
    box = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in box.tolist())


def barrier() -> None:
    """A barrier over all ranks; a no-op in a single process."""
    if dist.is_initialized():
        dist.barrier()


def destroy_distributed(env: DistEnv) -> None:
    """Barrier, then destroy the process group (only if ``init_distributed`` created it)."""
    if env.owns_process_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank_zero_object(obj):
    """Rank 0's picklable ``obj`` on every rank (a decision only rank 0 made, e.g. a run id or a refusal);
    ``obj`` itself in a plain process. Collective under a process group: every rank calls it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
