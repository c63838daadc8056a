"""What rank 0 decides for every rank while a run is set up, before its first step: whose run folder this is,
whether the job fits this machine's memory and disk, and whether to compile.

Each is asked on rank 0 alone (it holds the run folder's lock, measures, reads the disk) and handed to the other
ranks with ``rank_zero_object``, so every rank raises the same refusal or takes the same decision; the trainer
(``train/trainer.py``) calls them in its build order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.run_folder import checkpoint_bytes, disk_verdict, take_run_folder
from scaletrain.checkpoint.training import match_global_batch
from scaletrain.config import ConfigError, JobConfig
from scaletrain.core.writer_lock import RunLock
from scaletrain.model import num_params
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.compile import compiles_whole_model
from scaletrain.parallel.distributed import rank_zero_object
from scaletrain.train.compile_choice import choose, compiled_before, expected_eager_ms, remember
from scaletrain.train.contention import ThreadWatch

# (resolved job, precision, device, degrees) -> a one-line refusal when the job will not fit in memory, else None
MemoryCheck = Callable[[JobConfig, str, torch.device, ParallelDims], "str | None"]


def open_run_folder(cfg: JobConfig, run_dir: Path, is_main: bool, dp_size: int, message: Callable[[str], None],
                    ) -> tuple[CheckpointManager, RunLock | None, JobConfig]:
    """(the run's checkpoint store, rank 0's lock on the folder, the job). One writer per run folder: rank 0 takes
    the folder's lock and decides what this run is there (a resume, a refused or an --overwrite fresh start);
    every rank gets the run id or the refusal. A resume on another world size keeps the checkpoint's global batch
    (the job returned with train.grad_accum_steps to match)."""
    store = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last, cfg.checkpoint.keep_every,
                              collective_timeout_s=cfg.parallel.collective_timeout_seconds)
    lock, run_id, refusal = take_run_folder(run_dir, store, cfg.train.resume, cfg.train.overwrite, say=message) \
        if is_main else (None, None, None)
    run_id, refusal = rank_zero_object((run_id, refusal))  # the other ranks' (None, None) is replaced
    if refusal:
        raise refusal if is_main else ConfigError(f"rank 0 refused the run folder {run_dir}")
    store.run_id = run_id
    return store, lock, match_global_batch(cfg, store, dp_size, message)


def check_memory(memory_check: MemoryCheck, cfg: JobConfig, precision: str, device: torch.device,
                 dims: ParallelDims, is_main: bool) -> None:
    """Before the model is built: rank 0 asks ``memory_check``; every rank raises its refusal."""
    refusal = rank_zero_object(memory_check(cfg, precision, device, dims) if is_main else None)
    if refusal:
        raise ConfigError(refusal if is_main else "rank 0 found too little memory for this job")


def check_disk(cfg: JobConfig, run_dir: Path, store: CheckpointManager, modules: list[torch.nn.Module],
               is_main: bool, message: Callable[[str], None]) -> str:
    """Nothing tells a person how much disk the checkpoints take unless we do, before step 1: the note for the
    start line (returned), a warning, or a refusal when not even one checkpoint fits."""
    size = checkpoint_bytes(num_params(cfg.model), modules, bool(cfg.finetune.source))
    note, refusal = rank_zero_object(disk_verdict(run_dir, store, cfg.checkpoint, size, message) if is_main
                                     else None)
    if refusal:
        raise ConfigError(refusal if is_main else "rank 0 found too little disk space for a checkpoint")
    return note


@dataclass
class CompileChoice:
    """train.compile = auto decided on rank 0 (train/compile_choice.py), and what the run's end records of it."""

    whole_model: bool  # torch.compile over the whole model (else per block)
    compiled_before: bool  # this shape was compiled on this machine before (a warm cache)

    @classmethod
    def decide(cls, cfg: JobConfig, dims: ParallelDims, device: torch.device, world_size: int, run_dir: Path,
               is_main: bool, thread_watch: ThreadWatch | None,
               message: Callable[[str], None]) -> tuple[JobConfig, CompileChoice]:
        """The job with train.compile as "true"/"false" ("auto" decided on rank 0, every rank builds the same
        model, and said), and the choice."""
        whole_model = compiles_whole_model(dims, cfg.parallel)
        choice = cls(whole_model, compiled_before(cfg, device, whole_model) if is_main else False)
        if thread_watch is not None:  # what a step should take here: the slow-step check's yardstick
            thread_watch.expected_seconds = expected_eager_ms(cfg, device, world_size, whole_model) / 1000
        compile_, why = rank_zero_object(choose(cfg, device, world_size, whole_model, run_dir) if is_main else None)
        if why:
            message(why)
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=compile_)), choice

    def remember(self, cfg: JobConfig, device: torch.device, compiled: bool, step_times: list[float]) -> None:
        """What the next train.compile = auto run of this shape weighs (one process, rank 0)."""
        remember(cfg, device, self.whole_model, compiled, step_times, self.compiled_before)
