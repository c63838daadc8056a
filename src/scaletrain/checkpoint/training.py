"""A training run's checkpoint: which tensors and small states it holds, and save / resume / roll back.

The trainer owns the objects (model parts, optimizer, loader, counters, guard); ``TrainingCheckpoint``
knows how they make a checkpoint: the model and optimizer tensors by full-model name (written sharded
through DCP by ``CheckpointManager``), the small per-rank stateful objects beside them, and a metadata
record (layout, global batch, config hash) that a resume on another world size or plan reads first.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from scaletrain.checkpoint.deepspeed_format import is_deepspeed_checkpoint
from scaletrain.checkpoint.manager import CheckpointError, CheckpointManager, Stateful
from scaletrain.checkpoint.state import (
    init_optimizer_state,
    local_optimizer,
    model_tensors,
    optimizer_tensors,
    trainable_names,
)
from scaletrain.config import ConfigError, JobConfig, to_toml
from scaletrain.parallel import ParallelModel


@dataclasses.dataclass
class TrainState:
    """Counters saved with every checkpoint. The LR schedule is a pure function of ``step``, so the step
    (plus the schedule settings, kept to detect a changed schedule on resume) is the scheduler's state."""

    step: int = 0
    tokens_seen: int = 0
    schedule: dict = dataclasses.field(default_factory=dict)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.schedule = dict(state.get("schedule", {}))


class RNGState:
    """Global torch RNG streams (CPU and CUDA), so anything random after a resume repeats exactly."""

    def state_dict(self) -> dict:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {"torch": torch.get_rng_state(), "cuda": cuda}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    @staticmethod
    def reseed(seed: int, step: int, rank: int) -> None:
        """After a change of world size a rank has no saved stream of its own: a fresh one, a pure
        function of (seed, step, rank), so the resumed run is still reproducible."""
        torch.manual_seed((seed * 1_000_003 + step * 1_009 + rank) % 2**63)


def saved_config(cfg: JobConfig) -> JobConfig:
    """The config as a run folder keeps it: without this invocation's controls (``stop_at_step``,
    ``resume``, ``overwrite``), so a later ``train --resume`` runs on to ``train.steps``."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_at_step=0, resume=False,
                                                              overwrite=False))


def global_batch(cfg: JobConfig, dp_size: int) -> int:
    """Sequences per optimizer step over every rank (the one definition: both engines, the trainer's token count,
    a checkpoint's record and a resume's match): train.batch_size x train.grad_accum_steps x data-parallel ranks."""
    return cfg.train.batch_size * cfg.train.grad_accum_steps * dp_size


def checkpoint_meta(cfg: JobConfig, state: TrainState, dp_size: int, plan: dict, optimizer_state: bool,
                    **extra) -> dict:
    """What a resume needs to know before loading, whatever the engine: counters, layout (``plan``), the global
    batch, whether optimizer states exist, the config (TOML) and its hash; ``extra`` what the engine adds (its
    name, a base). The config travels with the checkpoint so a run folder that lost its config.toml still
    resumes as it was trained (``run_folder.checkpoint_config``), never under the defaults."""
    config = to_toml(saved_config(cfg), comments=False)
    return {**extra, "tokens_seen": state.tokens_seen, "dp_size": dp_size, "plan": plan,
            "global_batch": {"sequences": global_batch(cfg, dp_size), "seq_len": cfg.data.seq_len},
            "optimizer_state": optimizer_state, "config": config,
            "config_sha256": hashlib.sha256(config.encode()).hexdigest()}


def restore_local(manager: CheckpointManager, path: Path, local: dict[str, Stateful], names: tuple[str, ...],
                  seed: int, step: int) -> None:
    """The small per-rank states ``names`` of ``local`` from ``path``; on another world size a rank has no RNG
    stream of its own: a fresh one (``RNGState.reseed``), as every engine does."""
    saved, own = manager.load_local(path)
    for name in names:
        if name == "rng" and not own:
            RNGState.reseed(seed, step, manager.rank)
        elif name in saved:
            local[name].load_state_dict(saved[name])


def resume_run(checkpoint, describe: Callable[[dict], str] = lambda meta: "") -> Path | None:
    """A run checkpoint's ``resume`` (every engine's: ``checkpoint.manager``, ``.local``, ``.state``, ``.message``
    and ``.load(path, local_names) -> meta``): the newest good checkpoint loaded and announced with ``describe(meta)``
    after the step; None when there is none."""
    path = checkpoint_to_resume(checkpoint.manager, checkpoint.message)
    if path is None:
        return None
    meta = checkpoint.load(path, tuple(checkpoint.local))
    checkpoint.message(f"resumed from {path} (step {checkpoint.state.step}{describe(meta)})"
                       f"{fallback_note(checkpoint.manager)}")
    return path


def check_base(path: Path, reference: dict | None, remedy: str) -> None:
    """The base rule, once: a fine-tune's checkpoint at ``path`` records its base's checksum (meta.json ``base``);
    one trained on another base, or on a base changed since, is refused in one line ending with ``remedy``."""
    saved = CheckpointManager.read_meta(path).get("base")
    if reference is not None and saved is not None and saved.get("sha256") != reference["sha256"]:
        raise CheckpointError(f"{path}: trained on a base with checksum {saved['sha256'][:12]}, but finetune.source "
                              f"{reference['source']} now has {reference['sha256'][:12]}; {remedy}")


def match_global_batch(cfg: JobConfig, store: CheckpointManager, dp_size: int,
                       say: Callable[[str], None]) -> JobConfig:
    """Resuming (train.resume) on another number of data-parallel ranks: keep the global batch (sequences per
    optimizer step) of the newest complete checkpoint in ``store`` by changing gradient accumulation, so the
    run goes on with the same optimisation; ``say`` tells of the change."""
    saved = (store.newest_meta() or {}).get("global_batch") if cfg.train.resume else None
    if not saved:
        return cfg
    target = saved["sequences"]
    per_micro = cfg.train.batch_size * dp_size
    if global_batch(cfg, dp_size) == target:
        return cfg
    if target % per_micro:
        raise ConfigError(f"cannot keep the checkpoint's global batch of {target} sequences with train.batch_size="
                          f"{cfg.train.batch_size} on {dp_size} data-parallel rank(s); choose a batch_size that "
                          f"divides {target // dp_size if target % dp_size == 0 else target}")
    say(f"train.grad_accum_steps {cfg.train.grad_accum_steps} -> {target // per_micro}: keeps the checkpoint's "
        f"global batch on {dp_size} data-parallel rank(s)")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=target // per_micro))


class TrainingCheckpoint:
    """Save and load one training run's state through a ``CheckpointManager``.

    ``local`` are this rank's small stateful objects by name (data position, counters, RNG, scaler, guard,
    replica sync); ``state`` is the ``TrainState`` among them (read for the step and counters)."""

    def __init__(self, manager: CheckpointManager, pm: ParallelModel, optimizer: torch.optim.Optimizer,
                 local: dict[str, Stateful], state: TrainState, cfg: JobConfig, rank: int,
                 message: Callable[[str], None] = print, base: dict | None = None):
        self.manager, self.pm, self.optimizer, self.local = manager, pm, optimizer, local
        self.state, self.cfg, self.rank, self.message = state, cfg, rank, message
        # A fine-tune (finetune/): the checkpoint holds only the trainable tensors, plus this reference to the
        # base weights (source and checksum), which a resume checks before loading.
        self.base = base

    def tensors(self) -> dict:
        """This rank's model and optimizer tensors by full-model name (DCP writes and reads the shards)."""
        prefix = self.pm.replicas.checkpoint_prefix(self.pm.dp_rank)  # replicas may differ between syncs
        model = model_tensors(self.pm.modules, prefix)
        if self.base is not None:  # frozen base weights come from the base, not the checkpoint
            model = {k: v for k, v in model.items() if k in trainable_names(self.pm.modules, prefix)}
        return {"model": model,
                "optimizer": optimizer_tensors(self.pm.modules, self.optimizer, prefix)}

    def meta(self) -> dict:
        """What a resume needs to know before loading (``checkpoint_meta``), with this engine's layout."""
        cfg, dims = self.cfg, self.pm.dims
        plan = {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp")} | {
            "zero_stage": dims.zero_stage, "low_comm": cfg.parallel.low_comm}
        return checkpoint_meta(cfg, self.state, dims.dp_size, plan, bool(local_optimizer(self.optimizer).state),
                               **({"base": self.base} if self.base is not None else {}))

    def save(self, blocking: bool) -> Path:
        """Write a checkpoint of the current step (collective); complete once ``manager.wait()`` returns."""
        return self.manager.save(self.state.step, self.tensors(), self.local, self.meta(), blocking=blocking)

    def load(self, path: Path, local_names: tuple[str, ...]) -> dict:
        """Model + optimizer from ``path`` (resharded to this run's layout) and the named small states."""
        meta = CheckpointManager.read_meta(path)
        check_base(path, self.base, "restore that base or fine-tune again into a new train.run_dir")
        if is_deepspeed_checkpoint(path):
            raise CheckpointError(f"{path}: written by the deepspeed engine; resume it with "
                                  f"--parallel.engine=deepspeed (or start a new train.run_dir)")
        try:
            self.pm.replicas.check_resume(path, meta.get("dp_size"), self.pm.dims.dp_size)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        tensors = self.tensors()
        if meta.get("optimizer_state", True):
            init_optimizer_state(self.optimizer)  # DCP loads into existing tensors
            tensors = self.tensors()
        else:
            tensors.pop("optimizer")
        self.manager.load(path, tensors)
        restore_local(self.manager, path, self.local, local_names, self.cfg.train.seed, int(meta["step"]))
        return meta

    def resume(self) -> Path | None:
        """Load the newest good checkpoint (None when there is none). Works across world sizes and plans:
        DCP reshards model and optimizer, the data stream continues at the next unseen sample."""
        return resume_run(self, self._describe_resume)

    def _describe_resume(self, meta: dict) -> str:
        if self.state.schedule != dataclasses.asdict(self.cfg.schedule):
            self.message("warning: the [schedule] settings differ from the checkpoint's; using the new ones")
        return "" if meta.get("world_size") == self.manager.world_size else \
            f", resharded from {meta.get('world_size')} to {self.manager.world_size} ranks"

    def roll_back(self) -> Path | None:
        """Back to the last good checkpoint's weights, optimizer and counters (None when there is none);
        the data position is kept, so the batches since are skipped, not replayed."""
        return roll_back_to_latest(self)


def checkpoint_to_resume(manager: CheckpointManager, message) -> Path | None:
    """The checkpoint a ``--resume`` continues from: the newest that verifies (damaged newer ones are named
    through ``message`` and skipped); None when the folder holds none at all. When every checkpoint there is
    damaged, a CheckpointError naming them: starting from step 0 instead would silently throw the run away."""
    manager.remove_partial()
    path = manager.latest(warn=message)
    if path is None and manager.damaged:
        problems = "; ".join(problem for _, problem in manager.damaged)
        raise CheckpointError(f"no valid checkpoint to resume from in {manager.folder}: {problems}; restore it, "
                              f"or start over with --overwrite (which deletes these checkpoints)")
    return path


def fallback_note(manager: CheckpointManager) -> str:
    """', the newest valid one (step-00000015 is damaged)' for the resumed line after a fallback, else ''."""
    if not manager.damaged:
        return ""
    names = ", ".join(name for name, _ in manager.damaged)
    verb = "is" if len(manager.damaged) == 1 else "are"
    why = "another run's" if all("belongs to another run" in problem for _, problem in manager.damaged) \
        else "damaged"
    return f", the newest valid checkpoint ({names} {verb} {why}, see above)"


def roll_back_to_latest(checkpoint) -> Path | None:
    """A run checkpoint's ``roll_back`` (every engine's: ``checkpoint.manager``, ``.state``, ``.message`` and
    ``.load(path, local_names)``): the latest complete checkpoint's weights, optimizer, counters and scaler,
    with the data position kept (the batches since are skipped, not replayed); None when there is none."""
    checkpoint.manager.wait()
    path = checkpoint.manager.latest(warn=checkpoint.message)
    if path is None:
        return None
    tokens = checkpoint.state.tokens_seen
    checkpoint.load(path, ("train_state", "scaler"))
    checkpoint.state.tokens_seen = tokens  # tokens really consumed, skipped ones included
    return path
