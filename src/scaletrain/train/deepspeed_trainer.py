"""The DeepSpeed engine behind the same trainer (``parallel.engine = "deepspeed"``).

``DeepSpeedTrainer`` is the ``Trainer`` with three pieces swapped, so the loop, data, schedule, evaluation,
metrics and logging are the native engine's own:

- build: the model initialised exactly as the native engine does (``build_model`` from ``train.seed``; under
  ZeRO-3 built inside ``deepspeed.zero.Init``, partitioned and offloaded module by module), our
  AdamW param groups (``DeepSpeedCPUAdam`` when the optimizer state is offloaded), then
  ``deepspeed.initialize`` with the merged ds_config (``parallel/deepspeed_engine.py``);
- step: ``engine.backward`` / ``engine.step`` per micro-batch (DeepSpeed reduces, clips at
  ``optim.grad_clip`` and updates at the accumulation boundary);
- checkpoints: DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint`` inside our step folders (marker,
  keep-last, per-rank data position / RNG / counters as for the native engine), read back by ``scaletrain
  eval / generate / export`` through ``checkpoint/deepspeed_format.py``.

The NaN/Inf guard sees every step's loss and gradient norm and still rolls back after
``train.rollback_after`` bad steps, but it cannot veto a single update: DeepSpeed applies it inside
``engine.step``.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.deepspeed_format import TAG, convert_to_universal, is_deepspeed_checkpoint
from scaletrain.checkpoint.manager import CheckpointError
from scaletrain.checkpoint.training import RNGState, saved_config
from scaletrain.config import JobConfig, to_toml
from scaletrain.model import build_model
from scaletrain.parallel import ParallelDims, ParallelModel
from scaletrain.parallel.deepspeed_engine import build_ds_config, build_partitioned_model, initialize
from scaletrain.parallel.distributed import barrier
from scaletrain.train.optimizer import build_optimizer, param_groups
from scaletrain.train.step import MicroBatch, StepResult
from scaletrain.train.trainer import Trainer


def build_optimizer_for(model: torch.nn.Module, cfg: JobConfig, device: torch.device) -> torch.optim.Optimizer:
    """Our AdamW; with the optimizer state offloaded (cpu / nvme), DeepSpeed's CPU Adam in AdamW mode over the
    same param groups (compiled on first use, ~1 min)."""
    offloaded = cfg.deepspeed.offload_optimizer != "none" or "offload_optimizer" in _their_zero(cfg)
    if not offloaded:
        return build_optimizer(model, cfg.optim, device)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    o = cfg.optim
    return DeepSpeedCPUAdam(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            adamw_mode=True)


def _their_zero(cfg: JobConfig) -> dict:
    from scaletrain.parallel.deepspeed_engine import read_user_config

    return read_user_config(cfg.deepspeed.config).get("zero_optimization", {}) if cfg.deepspeed.config else {}


def build_deepspeed_training(cfg: JobConfig, dims: ParallelDims, device: torch.device, precision: str,
                             vocab_limit: int | None = None, load_universal: bool = False,
                             ) -> tuple[ParallelModel, torch.optim.Optimizer, dict]:
    """(a ParallelModel whose one part is the DeepSpeed engine, DeepSpeed's optimizer, the ds_config used).
    ``load_universal``: the engine will load a universal checkpoint (a resume on another world size)."""
    ds_config = build_ds_config(cfg, dims.dp_size, precision)
    if load_universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    if ds_config["zero_optimization"]["stage"] == 3:  # partitioned (and offloaded) as it is built
        model = build_partitioned_model(cfg.model, ds_config, cfg.train.seed)
    else:
        model = build_model(cfg.model, device, seed=cfg.train.seed)  # the native engine's initial weights
    engine, optimizer = initialize(model, build_optimizer_for(model, cfg, device), ds_config)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return ParallelModel(parts=[engine], dims=dims, mesh=None, device=device, dp_rank=rank,
                         vocab_limit=vocab_limit), optimizer, ds_config


def deepspeed_training_step(pm: ParallelModel, optimizer: torch.optim.Optimizer, micro_batches: Iterator[MicroBatch],
                            accum: int, *, grad_clip: float, autocast: Callable = contextlib.nullcontext,
                            scaler: torch.amp.GradScaler | None = None,
                            before_update: Callable[[float, float], bool] | None = None) -> StepResult:
    """One optimizer step through the engine (``training_step``'s signature; ``grad_clip`` and the
    accumulation are DeepSpeed's, from the ds_config built from the same fields)."""
    engine = pm.parts[0]
    loss_sum = None
    for _ in range(accum):
        inputs, targets, mask = next(micro_batches)
        with autocast():
            loss = pm.loss_fn(engine(inputs, attn_mask=mask), targets)
        engine.backward(loss)  # divided by gradient_accumulation_steps inside
        engine.step()  # reduces, clips and updates at the accumulation boundary only
        part = loss.detach() / accum
        loss_sum = part if loss_sum is None else loss_sum + part
    norm = engine.get_global_grad_norm()
    grad_norm = float(norm) if norm is not None else float("nan")
    loss_value = float(pm.replicas.step_loss(loss_sum, pm.dims, pm.device))
    if before_update is not None:
        before_update(loss_value, grad_norm)  # counted for rollback; the update has already been applied
    return StepResult(loss_value, grad_norm, True)


class DeepSpeedCheckpoint:
    """Save / resume / roll back through DeepSpeed's own checkpoint files, inside our step folders."""

    def __init__(self, manager: CheckpointManager, trainer: DeepSpeedTrainer, local: dict):
        self.manager, self.trainer, self.local = manager, trainer, local

    @property
    def engine(self):
        return self.trainer.pm.parts[0]

    def meta(self) -> dict:
        t = self.trainer
        cfg, dims = t.cfg, t.dims
        return {"engine": "deepspeed", "zero_stage": t.ds_config["zero_optimization"]["stage"],
                "tokens_seen": t.state.tokens_seen, "dp_size": dims.dp_size,
                "plan": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": 1, "pp": 1, "cp": 1,
                         "zero_stage": t.ds_config["zero_optimization"]["stage"], "low_comm": "none"},
                "global_batch": {"sequences": cfg.train.batch_size * cfg.train.grad_accum_steps * dims.dp_size,
                                 "seq_len": cfg.data.seq_len},
                "optimizer_state": True,
                "config_sha256": hashlib.sha256(to_toml(saved_config(cfg), comments=False).encode()).hexdigest()}

    def save(self, blocking: bool = True) -> Path:
        def write(folder: Path) -> None:
            self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)

        return self.manager.save_with(self.trainer.state.step, write, self.local, self.meta())

    def _load(self, path: Path, local_names: tuple[str, ...]) -> dict:
        meta = CheckpointManager.read_meta(path)
        if not is_deepspeed_checkpoint(path):
            raise CheckpointError(f"{path}: written by the native engine; resume it with --parallel.engine=native "
                                  f"(or start a new train.run_dir)")
        load_dir = path
        if meta.get("world_size") != self.manager.world_size:
            # ZeRO partitions do not reshard: DeepSpeed's universal checkpoint (converted once, by rank 0, into
            # run_dir/universal/step-N) holds whole tensors that any number of ranks load.
            if not self.engine.load_universal_checkpoint():
                raise CheckpointError(f"{path}: written by {meta.get('world_size')} ranks (now "
                                      f"{self.manager.world_size}) but the engine was built for a checkpoint of "
                                      f"this world size; start the resume again")
            load_dir = self.trainer.run_dir / "universal" / path.name
            if self.manager.rank == 0:
                convert_to_universal(path, load_dir)
            barrier()
        load_path, _ = self.engine.load_checkpoint(str(load_dir), tag=TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"{path}: DeepSpeed could not load its checkpoint")
        local, own = self.manager.load_local(path)
        for name in local_names:
            if name == "rng" and not own:  # another world size: fresh streams, as the native engine does
                RNGState.reseed(self.trainer.cfg.train.seed, int(meta["step"]), self.manager.rank)
            elif name in local:
                self.local[name].load_state_dict(local[name])
        return meta

    def resume(self) -> Path | None:
        self.manager.remove_partial()
        path = self.manager.latest(warn=self.trainer._message)
        if path is None:
            return None
        self._load(path, tuple(self.local))
        self.trainer._message(f"resumed from {path} (step {self.trainer.state.step}, DeepSpeed checkpoint)")
        return path

    def roll_back(self) -> Path | None:
        self.manager.wait()
        path = self.manager.latest(warn=self.trainer._message)
        if path is None:
            return None
        tokens = self.trainer.state.tokens_seen
        self._load(path, ("train_state", "scaler"))
        self.trainer.state.tokens_seen = tokens
        return path


class DeepSpeedTrainer(Trainer):
    """``Trainer`` over ``deepspeed.initialize`` (see the module docstring)."""

    training_step = staticmethod(deepspeed_training_step)

    def __init__(self, cfg: JobConfig, *, log: bool = True):
        super().__init__(cfg, log=log)
        engine = self.pm.parts[0]
        self.model = engine.module  # sampling on rank 0 alone: the plain module (whole unless ZeRO-3)
        stage = self.ds_config["zero_optimization"]["stage"]
        self._message(f"engine: DeepSpeed ZeRO-{stage}"
                      + "".join(f", {k.replace('offload_', '')} offload to {v['device']}"
                                for k, v in self.ds_config["zero_optimization"].items() if k.startswith("offload_")))

    def build_model_and_optimizer(self, cfg: JobConfig, dims: ParallelDims) -> tuple:
        complete = self.checkpoints.list_complete() if cfg.train.resume else []
        other_world = bool(complete) and CheckpointManager.read_meta(complete[-1]).get("world_size") != \
            self.env.world_size
        pm, optimizer, self.ds_config = build_deepspeed_training(cfg, dims, self.device, self.precision,
                                                                 vocab_limit=self.tokenizer.vocab_size,
                                                                 load_universal=other_world)
        return pm, optimizer

    def make_checkpoint(self, local_state: dict) -> DeepSpeedCheckpoint:
        return DeepSpeedCheckpoint(self.checkpoints, self, local_state)

    def save(self, blocking: bool | None = None) -> Path:
        return self.checkpoint.save()  # DeepSpeed writes synchronously


def trainer_class(cfg: JobConfig) -> type[Trainer]:
    """The trainer of ``cfg.parallel.engine``."""
    return DeepSpeedTrainer if cfg.parallel.engine == "deepspeed" else Trainer
