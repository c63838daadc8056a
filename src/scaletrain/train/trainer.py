"""The trainer: build everything from a JobConfig, then step / evaluate / checkpoint / log.

One ``train_step`` serves every run. The loop in ``train`` only sequences; each piece it calls lives in
its own module (schedule, optimizer, precision, metrics, checkpoint, data).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.adapt import open_base, parameter_counts, resolve_finetune
from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.run_folder import RunLock, checkpoint_disk_check, claim_run_folder
from scaletrain.checkpoint.training import RNGState, TrainingCheckpoint, TrainState, match_global_batch, saved_config
from scaletrain.config import ConfigError, JobConfig, to_toml
from scaletrain.data.instructions import InstructionLoader
from scaletrain.data.loader import TokenLoader, block_causal_mask
from scaletrain.data.run_data import training_data, validation_batches
from scaletrain.files import StorageError, free_bytes, guarded_write, human_bytes
from scaletrain.model import flops_per_token, num_params
from scaletrain.model.generate import generate
from scaletrain.options import UserError
from scaletrain.parallel.compile import compile_unavailable
from scaletrain.parallel.distributed import (
    destroy_distributed,
    init_distributed,
    is_rank_zero,
    rank_zero_object,
    rank_zero_value,
    say,
    world_size_from_env,
)
from scaletrain.peak import devices_in_job, peak_flops
from scaletrain.train.adaptive import (
    BatchRamp,
    LoadBalancer,
    NoiseScale,
    micro_grad_sq_mean,
    timed_micro_batches,
)
from scaletrain.train.evaluate import validation_loss
from scaletrain.train.guard import NonFiniteGuard
from scaletrain.train.metrics import MetricsLogger, mfu, peak_memory_bytes
from scaletrain.train.monitor import WINDOW_KEYS, ResourceMonitor, finish_run_info, timed, write_run_info
from scaletrain.train.precision import autocast, grad_scaler, resolve_device, resolve_precision
from scaletrain.train.preemption import INTERRUPTED, PreemptionHandler, torchrun_launcher
from scaletrain.train.profile import StepProfiler
from scaletrain.train.schedule import lr_at, warmup_warning
from scaletrain.train.step import build_parallel_training, training_step
from scaletrain.train.validate import check_runnable


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (e.g. non-finite steps with nothing to roll back to); printed as one line."""


def resolve_compile(cfg: JobConfig, device: torch.device, announce: bool) -> JobConfig:
    """``cfg`` with train.compile turned off, and one warning line, where torch.compile cannot run (a CPU
    without a C++ compiler): a recipe that compiles still trains, eagerly."""
    reason = compile_unavailable(device) if cfg.train.compile else None
    if reason is None:
        return cfg
    if announce:
        say(f"warning: train.compile=true but {reason}; training eagerly "
            "(install g++ to compile, or set train.compile=false to silence this)")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))


class Trainer:
    """Build order: config -> degrees checked -> process group -> data -> model on meta -> parallelize
    (split, shard, materialize, init) -> optimizer -> loader for this data-parallel rank."""

    def __init__(self, cfg: JobConfig, *, log: bool = True):
        self.started = time.time()  # a preemption trigger file older than this is an earlier run's leftover
        self.launcher = torchrun_launcher()  # taken first: the agent may die during the set-up below
        self.device = resolve_device(cfg.train.device)
        # Rank 0 speaks for the job (parallel/distributed.py: is_rank_zero, also before the process group), and
        # alone measures for precision = auto: the others take its decision (_agree_on_precision).
        self.log_enabled = log and is_rank_zero()
        cfg = resolve_finetune(cfg, announce=self._message)  # a fine-tune: the base's [model] and tokenizer
        self.precision, self.precision_why = resolve_precision(cfg.train.precision, self.device, self._message,
                                                               measure=is_rank_zero())
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        # Checked before any process-group work, so a bad config fails fast on every rank.
        self.dims = dims = check_runnable(cfg, world_size_from_env(), self.device.type, self.precision)
        if not cfg.train.resume and (warning := warmup_warning(cfg.train.steps, cfg.optim.lr, cfg.schedule)):
            self._message(warning)
        self.env = init_distributed(self.device.type, cfg.parallel.collective_timeout_seconds)
        self.device = self.env.device
        self.is_main = self.env.is_main
        if cfg.train.precision == "auto" and self.env.world_size > 1:
            self._agree_on_precision()
        self.run_dir = Path(cfg.train.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint.keep_last,
                                             cfg.checkpoint.keep_every,
                                             collective_timeout_s=cfg.parallel.collective_timeout_seconds)
        # One writer per run folder: rank 0 takes the folder's lock and decides what this run is there (a
        # resume, a refused or an --overwrite fresh start); every rank gets the run id or the refusal.
        self.lock: RunLock | None = None
        verdict = self._claim_run_folder(cfg) if self.is_main else None
        run_id, refusal = rank_zero_object(verdict)
        if refusal:
            raise refusal if self.is_main else ConfigError(f"rank 0 refused the run folder {self.run_dir}")
        self.checkpoints.run_id = run_id
        if cfg.train.resume:  # a resume on another world size keeps the checkpoint's global batch
            complete = self.checkpoints.list_complete()
            if complete:
                accum = cfg.train.grad_accum_steps
                cfg = match_global_batch(cfg, CheckpointManager.read_meta(complete[-1]), dims.dp_size)
                if cfg.train.grad_accum_steps != accum:
                    self._message(f"train.grad_accum_steps {accum} -> {cfg.train.grad_accum_steps}: keeps the "
                                  f"checkpoint's global batch on {dims.dp_size} data-parallel rank(s)")
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        # Instruction JSONL or a text corpus prepared once (data/run_data.py), and the vocabulary it gives the model.
        self.data = training_data(cfg, self.is_main, self._message, dims.tp)
        cfg, self.tokenizer, self.vocab_note = self.data.cfg, self.data.tokenizer, self.data.vocab_note
        self.data_dir, self.instructions = self.data.data_dir, self.data.instructions
        self.cfg = cfg
        dims.check_model(cfg.parallel, cfg.model, cfg.data.seq_len, cfg.train.batch_size)  # now with the vocab
        self._run_config = saved_config(cfg)
        # The run folder is self-contained (tokenizer.json, config.toml). On a resume they are rewritten only
        # once the checkpoint has loaded: settings that do not fit it (another vocabulary or width) must not
        # overwrite the record of what the run was trained with, which eval, generate and the next resume read.
        self._run_files_pending = cfg.train.resume and bool(self.checkpoints.list_complete())
        if not self._run_files_pending:
            self._write_run_files()

        self.cfg = cfg = resolve_compile(cfg, self.device, announce=self.log_enabled)
        # A padded vocabulary (resolve_vocab): the loss masks the rows beyond the tokenizer's out.
        self.pm, self.optimizer = self.build_model_and_optimizer(cfg, dims)
        self.model = self.pm.modules[0] if len(self.pm.modules) == 1 else nn.ModuleList(self.pm.modules)
        self.scaler = grad_scaler(self.precision, self.device)
        if self.instructions is not None:
            self.train_loader = InstructionLoader(self.instructions[0], cfg.data.seq_len, cfg.train.batch_size,
                                                  rank=self.pm.dp_rank, world_size=dims.dp_size,
                                                  seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        else:
            # parallel.balance: every rank walks the one global stream of micro-batches and keeps its own run of
            # them (train/adaptive.py), so the loader is the single-process one on every rank.
            balanced = cfg.parallel.balance == "throughput" and dims.dp_size > 1
            self.train_loader = TokenLoader(str(self.data_dir), "train", cfg.data.seq_len, cfg.train.batch_size,
                                            rank=0 if balanced else self.pm.dp_rank,
                                            world_size=1 if balanced else dims.dp_size, seed=cfg.train.seed,
                                            shuffle=cfg.data.shuffle, return_doc_ids=cfg.data.document_attention)
        self.state = TrainState(schedule=dataclasses.asdict(cfg.schedule))
        self.guard = NonFiniteGuard(self.pm.replicas.rollback_after(cfg.train.rollback_after))
        # Small per-rank state, saved beside the sharded model and optimizer tensors.
        local_state = {"data": self.train_loader, "train_state": self.state, "rng": RNGState(),
                       "scaler": self.scaler, "guard": self.guard}
        if self.pm.replicas.independent:
            local_state["low_comm"] = self.pm.replicas
        self._init_adaptive(cfg, dims, local_state)
        self.checkpoint = self.make_checkpoint(local_state)
        self.preempted = ""
        # Tokens per optimizer step over all data-parallel ranks.
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * cfg.train.grad_accum_steps * dims.dp_size
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self._peak_dtype = "bf16" if self.precision == "bf16" else "fp32"
        self.peak_flops = self._job_peak_flops()
        self._peak_remeasured = False
        self.step_times: list[float] = []
        self.data_times: list[float] = []  # seconds of each step spent waiting for batches (monitor.timed)
        # Seconds the loop spent not training, by cause, and the loop's wall time: the summary's stall share.
        self.stall_seconds = {"eval": 0.0, "sample": 0.0, "checkpoint": 0.0}
        self.loop_seconds = 0.0
        self.monitor: ResourceMonitor | None = None
        self.evals: list[dict] = []
        # Hooks for commands over runs (tune/): ``on_eval(step, val_loss)`` after each evaluation (a tune trial
        # reports to its pruner there; an exception it raises ends the run, the caller then calls ``close``),
        # and ``lr_override(step)``, the peak learning rate of each step instead of the schedule's (lr-find).
        self.on_eval: Callable[[int, float], None] | None = None
        self.lr_override: Callable[[int], float] | None = None
        # Nothing tells a person how much disk the checkpoints take unless we do, before step 1.
        self.disk_note, refusal = rank_zero_object(self._disk_verdict() if self.is_main else None)
        if refusal:
            raise ConfigError(refusal if self.is_main else "rank 0 found too little disk space for a checkpoint")

    def _init_adaptive(self, cfg: JobConfig, dims, local_state: dict) -> None:
        """The batch ramp, the load balancer and the noise-scale estimate (train/adaptive.py); the last two
        are saved with the checkpoint."""
        self.ramp = BatchRamp(cfg.batch, cfg.train.batch_size * cfg.train.grad_accum_steps * dims.dp_size)
        self.balancer = None
        if cfg.parallel.balance == "throughput" and dims.dp_size > 1:
            self.balancer = LoadBalancer(self.pm.dp_rank, dims.dp_size, cfg.parallel.balance_interval, self.device)
            local_state["balance"] = self.balancer
        self.noise = NoiseScale() if cfg.batch.noise_scale_interval else None
        if self.noise is not None:
            local_state["noise_scale"] = self.noise
        self._adaptive_record: dict = {}

    # Engine hooks: the native engine's; train/deepspeed_trainer.py:DeepSpeedTrainer supplies DeepSpeed's.
    training_step = staticmethod(training_step)

    def build_model_and_optimizer(self, cfg: JobConfig, dims) -> tuple:
        """The parallel model and its optimizer (``build_parallel_training``)."""
        return build_parallel_training(cfg, dims, self.device, vocab_limit=self.tokenizer.vocab_size)

    def make_checkpoint(self, local_state: dict) -> TrainingCheckpoint:
        """What saves, resumes and rolls back this run (DCP through ``TrainingCheckpoint``); a fine-tune's holds
        only the trainable tensors plus a reference to its base (source and checksum)."""
        cfg = self.cfg
        base = open_base(cfg.finetune.source).reference() if cfg.finetune.source else None
        return TrainingCheckpoint(self.checkpoints, self.pm, self.optimizer, local_state, self.state, cfg,
                                  self.env.rank, self._message, base=base)

    def close(self) -> None:
        """Barrier, then destroy the process group (a no-op in a single process or when already closed), and
        free the run folder's lock."""
        destroy_distributed(self.env)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _claim_run_folder(self, cfg: JobConfig) -> tuple[str | None, UserError | None]:
        """Rank 0: (run id, None), or (None, the refusal) - a folder in use by another process, a fresh start
        over an earlier run's checkpoints without --overwrite, or a path that cannot be made (StorageError)."""
        try:
            with guarded_write(f"the run folder {self.run_dir}", self.run_dir):  # a path that cannot be made
                self.lock = RunLock.take(self.run_dir)
            return claim_run_folder(self.run_dir, self.checkpoints, cfg.train.resume, cfg.train.overwrite,
                                    say=self._message), None
        except (ConfigError, StorageError) as exc:
            return None, exc

    def _disk_verdict(self) -> tuple[str, str | None]:
        """Rank 0, before training: what the checkpoints will take against the free space of the run folder's
        disk: (note for the start line, None), or ("", refusal) when not even one fits; a warning line when all
        retained ones do not. Estimate: fp32 weights + AdamW's two moments of the trainable ones."""
        try:
            return self._disk_note(), None
        except ConfigError as exc:
            return "", str(exc)

    def _disk_note(self) -> str:
        cfg = self.cfg
        if not cfg.checkpoint.enabled:
            return ""
        local = [p for m in self.pm.modules for p in m.parameters()]
        total = num_params(cfg.model)
        trainable = total * sum(p.numel() for p in local if p.requires_grad) / (sum(p.numel() for p in local) or 1)
        # A fine-tune's checkpoint holds only the trainable tensors (the base is referenced, not copied).
        saved_weights = trainable if getattr(self.checkpoint, "base", None) is not None else total
        size = int(4 * (saved_weights + 2 * trainable))
        existing = len([p for p in self.checkpoints.list_complete() if self.checkpoints.belongs_to_run(p)])
        copies = max(1, cfg.checkpoint.keep_last + 1 - existing)
        free = free_bytes(self.run_dir)
        warning = checkpoint_disk_check(self.run_dir, size, copies, free)
        if warning:
            self._message(warning)
        return f"checkpoints ~{human_bytes(size)} each, {cfg.checkpoint.keep_last} kept ({human_bytes(free)} free)"

    # -- one optimizer step -------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step (``training_step``) at the schedule's learning rate, with the NaN/Inf guard
        deciding whether to update, then the counters and the replicas' synchronisation."""
        cfg = self.cfg
        step = self.state.step
        # The ramp's global batch and LR factor (1 without a ramp), and this rank's micro-batches (train/adaptive.py).
        global_batch = self.ramp.batch_at(step)
        per_rank = global_batch // (cfg.train.batch_size * self.dims.dp_size)
        lr = lr_at(step, cfg.optim.lr, cfg.train.steps, cfg.schedule) * self.ramp.lr_factor(step) \
            if self.lr_override is None else self.lr_override(step)  # lr-find's sweep (tune/lr_find.py)
        mine, skip_before, skip_after, divisor, counts = per_rank, 0, 0, None, None
        if self.balancer is not None:
            counts = self.balancer.counts(per_rank * self.dims.dp_size)
            rank = self.pm.dp_rank
            mine, skip_before, skip_after = counts[rank], sum(counts[:rank]), sum(counts[rank + 1:])
            divisor = float(per_rank)  # M / W: DDP's average over W then makes it the mean over all M
        measure_noise = self.noise is not None and (step + 1) % cfg.batch.noise_scale_interval == 0
        micro_sq: list[float] | None = [] if measure_noise else None
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # lr_scale: muP's per-group factor (train/optimizer.py)
        verdicts = []

        def before_update(loss: float, grad_norm: float) -> bool:
            verdicts.append(self.guard.check(loss, grad_norm, scaler_enabled=self.scaler.is_enabled()))
            # An asynchronous save must have copied the tensors before anything changes them: the optimizer
            # step, or a low-communication synchronisation even on a skipped step.
            self.checkpoints.wait_staged()
            return verdicts[-1] == "ok"

        data_seconds, micro_seconds = [0.0], []
        batches = timed(self._micro_batches(mine, skip_before), data_seconds)
        if self.balancer is not None:
            batches = timed_micro_batches(batches, micro_seconds)
        adaptive = {} if divisor is None and micro_sq is None else {"loss_divisor": divisor, "micro_grad_sq": micro_sq}
        result = self.training_step(self.pm, self.optimizer, batches, mine,
                                    grad_clip=cfg.optim.grad_clip,
                                    autocast=lambda: autocast(self.precision, self.device),
                                    scaler=self.scaler, before_update=before_update, **adaptive)
        for _ in range(skip_after):  # the other ranks' micro-batches of this step
            next(self.train_loader)
        self.data_times.append(data_seconds[0])
        self.state.step += 1
        self.state.tokens_seen += global_batch * cfg.data.seq_len
        self.pm.replicas.after_step(self.state.step)
        record = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": lr}
        self._adapt_after_step(record, global_batch, counts, micro_seconds, micro_sq, result.grad_norm)
        if not result.updated:
            record["skipped_update"] = 1
            self._message(f"warning: step {self.state.step}: loss {result.loss} / gradient norm {result.grad_norm} "
                          f"is not finite; update skipped ({self.guard.consecutive} in a row)")
        if verdicts[-1] == "rollback":
            self._rollback()
        return record

    def _micro_batches(self, count: int, skip: int):
        """``count`` micro-batches on the device, after skipping ``skip`` (other ranks' share, parallel.balance)."""
        for _ in range(skip):
            next(self.train_loader)
        for _ in range(count):
            yield self._batch(next(self.train_loader))

    def _adapt_after_step(self, record: dict, global_batch: int, counts: list[int] | None,
                          micro_seconds: list[float], micro_sq: list[float] | None, grad_norm: float) -> None:
        """The ramp's batch, the balancer's split and re-measurement, the noise-scale update (collective where
        they gather from the ranks); their latest values go into every logged record."""
        cfg = self.cfg
        if cfg.batch.ramp_start:
            record["global_batch"] = global_batch
        if self.balancer is not None:
            self.balancer.record(micro_seconds)
            record["micro_batches_per_rank"] = counts
            if self.balancer.after_step(self.state.step):
                self._adaptive_record["balance_micro_seconds"] = self.balancer.last_seconds
        if micro_sq is not None:
            small_sq = micro_grad_sq_mean(micro_sq, self.device, self.env.world_size)
            b_small = cfg.train.batch_size
            if math.isfinite(small_sq) and math.isfinite(grad_norm) and global_batch > b_small:
                gns = self.noise.update(b_small, small_sq, global_batch, grad_norm ** 2)
                self._adaptive_record.update({"gns_b_simple": gns["gns_b_simple"], "gns_step": self.state.step,
                                              "critical_batch_tokens": gns["gns_b_simple"] * cfg.data.seq_len})
        record.update(self._adaptive_record)

    def _batch(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, targets, attention mask or None) on the device; with data.document_attention the
        loader's document ids become a block-causal mask (B, 1, T, T)."""
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch[:2])
        mask = block_causal_mask(batch[2].to(self.device)) if len(batch) > 2 else None
        return inputs, targets, mask

    # -- evaluation and samples ---------------------------------------------------------------------
    def evaluate(self) -> float:
        """The run's validation loss: ``validation_loss`` over ``validation_batches`` (train.eval_batches batches
        evenly spread over the val split, or the first held-out instruction examples), as ``scaletrain eval``."""
        return validation_loss(self.pm, validation_batches(self.cfg, self.data), self.precision,
                               self.cfg.train.batch_size)[0]

    def sample(self, max_new_tokens: int) -> str:
        """Text from the current model; its own generator keeps the training RNG untouched."""
        gen = torch.Generator().manual_seed(self.cfg.train.seed + self.state.step)
        prompt = self.tokenizer.encode(self.cfg.train.sample_prompt) or [0]
        # Eager even when the model is compiled: the context grows by one token a step, and each new length
        # would cost a recompile (seconds on a CPU) for a forward pass that takes milliseconds.
        with torch.compiler.set_stance("force_eager"):
            # Cropped at the trained context (data.seq_len): the model never saw positions beyond it.
            new = generate(self.model, prompt, max_new_tokens, max_seq_len=self.cfg.data.seq_len,
                           temperature=0.8, top_k=200, generator=gen, stop_id=self.tokenizer.eos_id,
                           vocab_limit=self.tokenizer.vocab_size)
        return self.cfg.train.sample_prompt + self.tokenizer.decode(new)

    # -- checkpoints (what a checkpoint holds: checkpoint/training.py) ------------------------------
    def save(self, blocking: bool | None = None) -> Path:
        """Write a checkpoint of the current step (collective). Asynchronous when checkpoint.async_save is
        set, unless ``blocking``; the folder is complete once ``self.checkpoints.wait()`` returns."""
        with self._stall("checkpoint"):
            return self.checkpoint.save(not self.cfg.checkpoint.async_save if blocking is None else blocking)

    def resume(self) -> bool:
        """Load the newest good checkpoint; False when there is none (any world size or plan)."""
        resumed = self.checkpoint.resume() is not None
        self._write_run_files()
        return resumed

    def _write_run_files(self) -> None:
        """Write the run folder's tokenizer.json and config.toml (rank 0)."""
        self._run_files_pending = False
        if self.is_main:
            self.tokenizer.save(self.run_dir / "tokenizer.json")
            (self.run_dir / "config.toml").write_text(to_toml(self._run_config))

    def _rollback(self) -> None:
        """Back to the last good checkpoint; the batches that produced the non-finite steps are skipped."""
        bad_step = self.state.step
        path = self.checkpoint.roll_back()
        if path is None:
            raise TrainingError(f"{self.guard.rollback_after} non-finite steps in a row at step {bad_step} and no "
                                f"checkpoint to roll back to; lower optim.lr or check the data")
        self._message(f"rolled back to {path.name} after {self.guard.rollback_after} non-finite steps (at step "
                      f"{bad_step}); the data of those steps is skipped")

    def _message(self, text: str) -> None:
        """A line for people, from rank 0 (``say``) of a trainer built with ``log=True``."""
        if self.log_enabled:
            say(text)

    def _agree_on_precision(self) -> None:
        """Every rank takes rank 0's ``train.precision = auto`` decision (only rank 0 measured, before the
        process group existed; ranks must not train in different precisions)."""
        chosen = "bf16" if rank_zero_value(float(self.precision == "bf16"), self.device) else "fp32"
        if chosen != self.precision:
            self.precision, self.precision_why = chosen, f"precision auto -> {chosen}: rank 0's measurement"

    def _job_peak_flops(self, remeasure: bool = False) -> float:
        """The job's peak FLOP/s, MFU's denominator (docs/training.md): one device's measured peak
        (``peak.peak_flops``, a GPU or one CPU core; rank 0's number on every rank) times the devices the
        job runs on (``devices_in_job``). Collective under torchrun: every rank calls it."""
        per_device = peak_flops(self.device, self._peak_dtype, remeasure, log=self._message) \
            if self.env.rank == 0 else 0.0
        devices = devices_in_job(self.device.type, self.env.world_size, torch.get_num_threads())
        return rank_zero_value(per_device, self.device) * devices

    # -- the loop ------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to ``train.steps`` (or ``train.stop_at_step``, or a preemption notice); returns a summary.

        On SIGTERM / SIGUSR1 / the trigger file the current step finishes, a checkpoint is written and the
        summary says ``preempted``; ``scaletrain train`` then exits with status 75 (EX_TEMPFAIL)."""
        cfg, state = self.cfg, self.state
        logger = MetricsLogger(self.run_dir, cfg.logging, cfg.train.steps, state.step, enabled=self.log_enabled)
        log_every, eval_every, ckpt_every = cfg.logging.log_interval, cfg.train.eval_interval, cfg.checkpoint.interval
        stop_at = cfg.train.stop_at_step or cfg.train.steps
        if self._run_files_pending:  # a resume that never called resume(): the files are due all the same
            self._write_run_files()
        notice = PreemptionHandler(cfg.checkpoint.trigger_file, cfg.checkpoint.grace_seconds, self.started,
                                   launcher=self.launcher).install()
        if self.is_main:  # the report's header (train/monitor.py)
            write_run_info(self.run_dir, self.device, self.env.world_size, start_step=state.step)
        self.monitor = ResourceMonitor(cfg.monitor, self.run_dir, self.env.rank, self.device).start()
        profiler = StepProfiler(cfg.profile, self.run_dir, self.env.rank, self.device, self._message).start()
        rollbacks_seen = self.guard.rollbacks
        loop_start = time.perf_counter()
        try:
            if state.step == 0 and eval_every:
                self._eval_and_report(logger)
            while state.step < min(stop_at, cfg.train.steps):
                t0 = time.perf_counter()
                record = self.train_step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                self.step_times.append(time.perf_counter() - t0)
                profiler.step()
                step = state.step
                if step % log_every == 0 or step == cfg.train.steps:
                    logger.log(self._step_record(record))  # collective (per-rank memory): all ranks call it
                else:
                    logger.advance(step)
                    if "skipped_update" in record:  # a NaN-guard event between log steps, for the report
                        logger.log({"step": step, "skipped_update": 1})
                if self.guard.rollbacks != rollbacks_seen:
                    rollbacks_seen = self.guard.rollbacks
                    logger.log({"step": step, "rollback": rollbacks_seen})
                stop, save_failed = self._any_rank(notice.should_stop(), self.checkpoints.background_failed())
                if save_failed:  # an asynchronous save failed in the background: say so now, not at the end
                    self._raise_save_failure()
                if stop:
                    self.preempted = notice.reason or "another rank's notice"
                    break
                if eval_every and step % eval_every == 0 and step != cfg.train.steps:
                    self._eval_and_report(logger)
                if cfg.checkpoint.enabled and ckpt_every and step % ckpt_every == 0 and step < stop_at:
                    self.save()
            if self.preempted:
                self._save_on_notice(notice, logger)
            else:
                if state.step >= cfg.train.steps:
                    # Replicas end on the same (global) weights; not at stop_at_step, where the run goes on later.
                    self.pm.replicas.finish(state.step)
                    self._eval_and_report(logger)  # the final evaluation sees those weights
                elif not self.evals or self.evals[-1]["step"] != state.step:
                    # Stopped at train.stop_at_step: evaluate here, so the summary's val loss is this step's,
                    # not an earlier one's (no RNG is drawn: a resumed run stays bitwise identical).
                    self._eval_and_report(logger)
                if cfg.checkpoint.enabled:
                    self.save()
            with self._stall("checkpoint"):
                self.checkpoints.close()  # an asynchronous save completes before the run ends
            self.loop_seconds = time.perf_counter() - loop_start
        finally:
            profiler.stop()
            self.monitor.stop()
            notice.uninstall()
            logger.close()
        self.close()  # after success only: a barrier in an error path could hang the healthy ranks
        summary = self.summary()
        if self.is_main:
            finish_run_info(self.run_dir, summary)
        return summary

    def _any_rank(self, *flags: bool):
        """True on every rank when any rank has the flag (a notice may reach the ranks a step apart); one
        all-reduce for several flags, which come back as a tuple."""
        if self.env.world_size > 1:
            box = torch.tensor([float(f) for f in flags], device=self.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            flags = tuple(bool(v) for v in box.tolist())
        return flags[0] if len(flags) == 1 else tuple(flags)

    def _raise_save_failure(self) -> None:
        """A background save failed on some rank: that rank raises its own StorageError (``wait``), the others
        say where to look; the previous checkpoint is intact and nothing else is written."""
        self.checkpoints.wait()
        raise StorageError(f"an asynchronous checkpoint save failed on another rank (see its message); the previous "
                           f"checkpoint in {self.checkpoints.folder} is intact")

    def _save_on_notice(self, notice: PreemptionHandler, logger: MetricsLogger) -> None:
        """Preempted: finish any save in flight, then write this step's checkpoint synchronously."""
        t0 = time.perf_counter()
        if self.cfg.checkpoint.enabled:
            self.checkpoints.wait()
            self.save(blocking=True)
        took, left = time.perf_counter() - t0, notice.seconds_left()
        logger.log({"step": self.state.step, "preempted": self.preempted, "checkpoint_seconds": round(took, 3)})
        if not self.cfg.checkpoint.enabled:
            logger.message(f"stopped ({self.preempted}) at step {self.state.step}: nothing saved "
                           "(checkpoint.enabled = false)")
            return
        if self.preempted == INTERRUPTED:  # the command says it (cli.cmd_train), whatever the progress mode
            return
        logger.message(f"preempted ({self.preempted}) at step {self.state.step}: checkpoint written in {took:.1f} s"
                       + (f"; WARNING: past the {self.cfg.checkpoint.grace_seconds:.0f} s grace period"
                          if left < 0 else f", {left:.0f} s of grace left") + "; `--resume` continues")

    def _step_record(self, record: dict) -> dict:
        recent = self.step_times[-self.cfg.logging.log_interval:]
        step_s = statistics.median(recent)
        tokens_per_second = self.tokens_per_step / step_s
        if not self._peak_remeasured and self._any_rank(mfu(self.flops_per_token, tokens_per_second,
                                                            self.peak_flops) > 1):
            # Above the cached "peak" (on any rank): it was measured on a busy machine. Measure again, once.
            self._peak_remeasured = True
            self.peak_flops = self._job_peak_flops(remeasure=True)
        return {"step": self.state.step, **record, "step_ms": 1000 * step_s,
                "tokens_per_second": tokens_per_second,
                "mfu": mfu(self.flops_per_token, tokens_per_second, self.peak_flops),
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20,
                **({"peak_memory_mb_per_rank": self._per_rank_memory_mb()} if self.env.world_size > 1 else {}),
                "data_share": sum(self.data_times[-len(recent):]) / sum(recent), **self._monitor_record()}

    def _monitor_record(self) -> dict:
        """The resource monitor's window (train/monitor.py) as rank 0 logs it: rank 0's values, plus a per-rank
        list of each value where the ranks differ (one small all-gather; collective)."""
        mine = self.monitor.window() if self.monitor is not None else {}
        if self.env.world_size == 1:
            return mine
        vector = torch.tensor([mine.get(k, float("nan")) for k in WINDOW_KEYS], dtype=torch.float64,
                              device=self.device)
        every = [torch.zeros_like(vector) for _ in range(self.env.world_size)]
        dist.all_gather(every, vector)
        out = dict(mine)
        for i, key in enumerate(WINDOW_KEYS):
            values = [float(t[i]) for t in every]
            if not all(math.isnan(v) for v in values) and len({round(v, 1) for v in values}) > 1:
                out[f"{key}_per_rank"] = [None if math.isnan(v) else round(v, 2) for v in values]
        return out

    def _per_rank_memory_mb(self) -> list[float]:
        """Every rank's peak memory (one small all-gather), so rank 0 can log them all."""
        mine = torch.tensor([peak_memory_bytes(self.device) / 2**20], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(every, mine)
        return [round(float(t), 1) for t in every]

    def _eval_and_report(self, logger: MetricsLogger) -> None:
        with self._stall("eval"):
            val_loss = self.evaluate()
        self.evals.append({"step": self.state.step, "val_loss": val_loss})
        logger.log({"step": self.state.step, "val_loss": val_loss, "val_perplexity": math.exp(val_loss)})
        logger.message(f"step {self.state.step}: val loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f}")
        if self.on_eval is not None:
            self.on_eval(self.state.step, val_loss)
        if self.cfg.train.sample_tokens and self.is_main and not self.pm.sharded:
            with self._stall("sample"):
                text = self.sample(self.cfg.train.sample_tokens)
            logger.log({"step": self.state.step, "sample": text})  # for the report
            logger.message("--- sample ---\n" + text.strip() + "\n--------------")

    def summary(self) -> dict:
        times = self.step_times or [float("nan")]
        median_s = statistics.median(times)
        return {"steps": self.state.step, "median_step_ms": 1000 * median_s,
                "tokens_per_second": self.tokens_per_step / median_s,
                "mfu": mfu(self.flops_per_token, self.tokens_per_step / median_s, self.peak_flops),
                "evals": self.evals, "final_val_loss": self.evals[-1]["val_loss"] if self.evals else None,
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20,
                "parameters": num_params(self.cfg.model),
                "trainable_parameters": parameter_counts(self.pm.modules)[0],
                "all_reduce_calls": self.pm.comm.all_reduce_calls, "all_reduce_bytes": self.pm.comm.all_reduce_bytes,
                "preempted": self.preempted, "skipped_updates": self.guard.skipped_total,
                "rollbacks": self.guard.rollbacks, **self._stalls()}

    @contextlib.contextmanager
    def _stall(self, cause: str):
        """Count the block's wall time as a stall of ``cause`` (eval, sample, checkpoint): the summary's share."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stall_seconds[cause] += time.perf_counter() - t0

    def _stalls(self) -> dict:
        """Seconds of the training loop spent evaluating, sampling and checkpointing (rank 0's), and their share
        of the loop's wall time (``stall_share``; NaN before ``train`` has run)."""
        total = sum(self.stall_seconds.values())
        return {"loop_seconds": self.loop_seconds, "stall_seconds": dict(self.stall_seconds),
                "stall_share": total / self.loop_seconds if self.loop_seconds else float("nan")}
