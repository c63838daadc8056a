"""The DeepSpeed engine (``parallel.engine = "deepspeed"``): the ``TrainingEngine`` of ``train/engine.py``
over ``deepspeed.initialize``, so the trainer's loop, data, schedule, evaluation, metrics and logging are the
native engine's own. The ds_config, the DeepSpeed job rules and ``initialize`` are in
``train/deepspeed_engine/ds_config.py``; this module is what the trainer calls:

- build: the model initialised exactly as the native engine does (``build_model`` from ``train.seed``; under
  ZeRO-3 built inside ``deepspeed.zero.Init``, partitioned and offloaded module by module), our
  AdamW param groups (``DeepSpeedCPUAdam`` when the optimizer state is offloaded), then
  ``deepspeed.initialize`` with the merged ds_config (``train/deepspeed_engine/ds_config.py``);
- step: ``engine.backward`` / ``engine.step`` per micro-batch (DeepSpeed reduces, clips at
  ``optim.grad_clip`` and updates at the accumulation boundary); the auxiliary loss terms the model leaves
  (train/loss.py) join each micro-batch's loss and are logged as on the native engine;
- checkpoints: DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint`` inside our step folders (marker,
  keep-last, per-rank data position / RNG / counters as for the native engine), read back by ``scaletrain
  eval / generate / export`` through ``checkpoint/deepspeed_format.py``.

The NaN/Inf guard sees every step's loss and gradient norm and still rolls back after
``train.rollback_after`` bad steps, but it cannot veto a single update: DeepSpeed applies it inside
``engine.step``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.deepspeed_format import TAG, is_deepspeed_checkpoint
from scaletrain.checkpoint.manager import CheckpointError
from scaletrain.checkpoint.training import (
    TrainState,
    checkpoint_meta,
    restore_local,
    resume_run,
    roll_back_to_latest,
)
from scaletrain.config import JobConfig
from scaletrain.model import build_model
from scaletrain.parallel import ParallelDims, ParallelModel
from scaletrain.parallel.distributed import barrier
from scaletrain.train.deepspeed_engine.ds_config import (
    build_ds_config,
    build_partitioned_model,
    initialize,
    read_user_config,
)
from scaletrain.train.loss import logits_loss, take_auxiliary, with_auxiliary
from scaletrain.train.optimizer import build_optimizer, param_groups
from scaletrain.train.step import MicroBatch, StepFunction, StepOptions, StepResult, auxiliary_means


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
                            accum: int, options: StepOptions) -> StepResult:
    """One optimizer step through the engine (``training_step``'s signature; ``grad_clip`` and the
    accumulation are DeepSpeed's, from the ds_config built from the same fields). DeepSpeed divides every
    micro-batch's loss by its fixed accumulation and synchronises inside ``engine.backward``, so the
    load balancer's ``loss_divisor`` and the noise scale's ``micro_grad_sq`` cannot be served
    (``check_runnable`` refuses parallel.balance and batch.noise_scale_interval with this engine)."""
    if options.loss_divisor is not None or options.micro_grad_sq is not None:
        raise ValueError("the DeepSpeed engine takes neither loss_divisor nor micro_grad_sq (native engine only)")
    engine = pm.parts[0]
    loss_sum, auxiliary = None, {}
    for _ in range(accum):
        inputs, targets, mask = next(micro_batches)
        with options.autocast():
            loss = logits_loss(pm, engine(inputs, attn_mask=mask), targets)
        terms = take_auxiliary(engine.module)
        engine.backward(with_auxiliary(loss, terms, accum, auxiliary))  # divided by gradient_accumulation_steps inside
        engine.step()  # reduces, clips and updates at the accumulation boundary only
        part = loss.detach() / accum
        loss_sum = part if loss_sum is None else loss_sum + part
    norm = engine.get_global_grad_norm()
    grad_norm = float(norm) if norm is not None else float("nan")
    loss_value = float(pm.replicas.step_loss(loss_sum, pm.dims, pm.device))
    if options.before_update is not None:
        options.before_update(loss_value, grad_norm)  # counted for rollback; the update has already been applied
    return StepResult(loss_value, grad_norm, True, auxiliary_means(auxiliary))


class DeepSpeedCheckpoint:
    """Save / resume / roll back through DeepSpeed's own checkpoint files, inside our step folders."""

    def __init__(self, manager: CheckpointManager, pm: ParallelModel, local: dict, state: TrainState,
                 cfg: JobConfig, ds_config: dict, message: Callable[[str], None]):
        self.manager, self.pm, self.local, self.state = manager, pm, local, state
        self.cfg, self.ds_config, self.message = cfg, ds_config, message

    @property
    def engine(self):
        return self.pm.parts[0]

    def meta(self) -> dict:
        dims, stage = self.pm.dims, self.ds_config["zero_optimization"]["stage"]
        plan = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": 1, "pp": 1, "cp": 1,
                "zero_stage": stage, "low_comm": "none"}
        return checkpoint_meta(self.cfg, self.state, dims.dp_size, plan, True, engine="deepspeed", zero_stage=stage)

    def save(self, blocking: bool = True) -> Path:
        """DeepSpeed writes synchronously, whatever ``blocking`` asks."""
        def write(folder: Path) -> None:
            self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)

        return self.manager.save_with(self.state.step, write, self.local, self.meta())

    def load(self, path: Path, local_names: tuple[str, ...]) -> dict:
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
            load_dir = Path(self.cfg.train.run_dir) / "universal" / path.name
            if self.manager.rank == 0:
                convert_to_universal(path, load_dir)
            barrier()
        load_path, _ = self.engine.load_checkpoint(str(load_dir), tag=TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"{path}: DeepSpeed could not load its checkpoint")
        restore_local(self.manager, path, self.local, local_names, self.cfg.train.seed, int(meta["step"]))
        return meta

    def resume(self) -> Path | None:
        return resume_run(self, lambda meta: ", DeepSpeed checkpoint")

    def roll_back(self) -> Path | None:
        return roll_back_to_latest(self)


class DeepSpeedEngine:
    """The ``TrainingEngine`` over ``deepspeed.initialize`` (see the module docstring)."""

    def __init__(self, precision: str, store: CheckpointManager):
        self.precision, self.store = precision, store
        self.ds_config: dict = {}  # set by build

    def build(self, cfg: JobConfig, dims: ParallelDims, device: torch.device,
              vocab_limit: int | None) -> tuple[ParallelModel, torch.optim.Optimizer]:
        """A resume on another world size builds the engine to load DeepSpeed's universal checkpoint."""
        newest = self.store.newest_meta() if cfg.train.resume else None
        other_world = newest is not None and newest.get("world_size") != self.store.world_size
        pm, optimizer, self.ds_config = build_deepspeed_training(cfg, dims, device, self.precision,
                                                                 vocab_limit=vocab_limit, load_universal=other_world)
        return pm, optimizer

    step: StepFunction = staticmethod(deepspeed_training_step)

    def checkpoint(self, store: CheckpointManager, pm: ParallelModel, optimizer: torch.optim.Optimizer,
                   local: dict, state: TrainState, cfg: JobConfig,
                   message: Callable[[str], None]) -> DeepSpeedCheckpoint:
        """DeepSpeed's own files; ``optimizer`` is inside the engine and saved with it."""
        return DeepSpeedCheckpoint(store, pm, local, state, cfg, self.ds_config, message)

    def sampling_model(self, pm: ParallelModel) -> torch.nn.Module:
        return pm.parts[0].module  # the plain module (whole unless ZeRO-3)

    def describe(self) -> str | None:
        zero = self.ds_config["zero_optimization"]
        return f"engine: DeepSpeed ZeRO-{zero['stage']}" + "".join(
            f", {k.replace('offload_', '')} offload to {v['device']}" for k, v in zero.items()
            if k.startswith("offload_"))


def convert_to_universal(path: Path, out: Path) -> Path:
    """DeepSpeed's universal checkpoint of the step folder ``path`` in ``out/deepspeed`` (``ds_to_universal``, the
    documented converter: every parameter's fp32 weight and Adam moments whole, so any number of ranks can load
    them with ``checkpoint.load_universal``); returns ``out``. Run on one rank."""
    target = Path(out) / TAG
    if (target / "mp_rank_00_model_states.pt").is_file():
        return Path(out)
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(Path(path) / TAG), "--output_folder", str(target), "--num_extract_workers", "1",
                           "--num_merge_workers", "1", "--inject_missing_state"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise CheckpointError(f"{path}: DeepSpeed's ds_to_universal could not convert it for another world size: "
                              f"{(proc.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    return Path(out)
