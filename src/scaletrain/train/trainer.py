"""The trainer: build everything from a JobConfig, then step / evaluate / sample / checkpoint / log.

One ``step`` serves every run, through the engine the trainer holds (``train/engine.py``: native or DeepSpeed).
The loop in ``train`` only sequences; each piece it calls lives in its own module (engine, schedule, adaptive
batch, precision, metrics, monitor, preemption, checkpoint, data).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from scaletrain.checkpoint.training import RNGState, TrainState, global_batch, saved_config
from scaletrain.config import JobConfig, to_toml
from scaletrain.core.files import write_file
from scaletrain.core.options import UserError
from scaletrain.data.loader import block_causal_mask
from scaletrain.data.run_data import training_data
from scaletrain.finetune import parameter_counts, resolve_finetune
from scaletrain.finetune.flops import trained_flops_per_token
from scaletrain.finetune.method_table import packs_instructions
from scaletrain.finetune.objectives import objective_of
from scaletrain.model import num_params
from scaletrain.model.moe import expert_load
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.compile import compile_enabled, resolve_compile
from scaletrain.parallel.distributed import (
    destroy_distributed,
    init_distributed,
    is_rank_zero,
    say,
    world_size_from_env,
)
from scaletrain.train.adaptive import Adaptive
from scaletrain.train.contention import ThreadWatch
from scaletrain.train.deferred import DeferredReads, defer_reads, settle
from scaletrain.train.engine import engine_for
from scaletrain.train.evaluate import ValidationScore
from scaletrain.train.guard import NonFiniteGuard
from scaletrain.train.metrics import MetricsLogger, Throughput, peak_memory_bytes
from scaletrain.train.monitor import ResourceMonitor, finish_run_info, gathered_window, write_run_info
from scaletrain.train.precision import agree_on_precision, autocast, grad_scaler, resolve_device, resolve_precision
from scaletrain.train.preemption import PreemptionHandler, save_on_notice, stop_reason, torchrun_launcher
from scaletrain.train.profile import StepProfiler
from scaletrain.train.run_evaluation import RunEvaluation
from scaletrain.train.run_setup import CompileChoice, MemoryCheck, check_disk, check_memory, open_run_folder
from scaletrain.train.schedule import lr_at, warmup_warning
from scaletrain.train.step import DeferredGuard, StepOptions
from scaletrain.train.validate import check_runnable


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (e.g. non-finite steps with nothing to roll back to); printed as one line."""


class Trainer:
    """Build order: config -> degrees checked -> process group -> run folder -> data -> the engine's model on
    meta -> parallelize (split, shard, materialize, init) -> optimizer -> loader for this data-parallel rank."""

    def __init__(self, cfg: JobConfig, *, log: bool = True, memory_check: MemoryCheck | None = None):
        """``memory_check(cfg, precision, device, dims)``: rank 0's refusal (one line) of a job that will not fit
        this machine's memory, or None; asked once the vocabulary is known, before the model is built (the
        planner's estimate sits above this layer: ``scaletrain train`` passes ``plan.fit.memory_refusal``)."""
        self.started = time.time()  # a preemption trigger file older than this is an earlier run's leftover
        self.launcher = torchrun_launcher()  # taken first: the agent may die during the set-up below
        self.device = resolve_device(cfg.train.device)
        # Rank 0 speaks for the job (parallel/distributed.py: is_rank_zero, also before the process group), and
        # alone measures for precision = auto: the others take its decision (agree_on_precision).
        self.log_enabled = log and is_rank_zero()
        cfg = resolve_finetune(cfg, announce=self._message)  # a fine-tune: the base's [model] and tokenizer
        self.precision, self.precision_why = resolve_precision(cfg.train.precision, self.device, self._message,
                                                               measure=is_rank_zero())
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        # Cores another job holds: said, and fewer threads when they would oversubscribe (train/contention.py).
        self.thread_watch = ThreadWatch(cfg.train.threads, self._message) if self.device.type == "cpu" else None
        if self.thread_watch is not None:
            self.thread_watch.at_start()
        # Checked before any process-group work, so a bad config fails fast on every rank.
        self.dims = dims = check_runnable(cfg, world_size_from_env(), self.device.type, self.precision)
        if not cfg.train.resume and (warning := warmup_warning(cfg.train.steps, cfg.optim.lr, cfg.schedule)):
            self._message(warning)
        self.env = init_distributed(self.device.type, cfg.parallel.collective_timeout_seconds)
        self.device = self.env.device
        self.is_main = self.env.is_main
        if cfg.train.precision == "auto" and self.env.world_size > 1:
            self.precision, self.precision_why = agree_on_precision(self.precision, self.precision_why, self.device)
        self.run_dir = Path(cfg.train.run_dir)
        self.checkpoint_store, self.lock, cfg = open_run_folder(cfg, self.run_dir, self.is_main, dims.dp_size,
                                                                self._message)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        # Instruction JSONL or a text corpus prepared once (data/run_data.py), and the vocabulary it gives the model.
        self.data = training_data(cfg, self.is_main, self._message, dims.tp)
        cfg, self.tokenizer, self.vocab_note = self.data.cfg, self.data.tokenizer, self.data.vocab_note
        self.data_dir, self.instructions = self.data.data_dir, self.data.instructions
        self.cfg = cfg
        dims.check_model(cfg.parallel, cfg.model, cfg.data.seq_len, cfg.train.batch_size)  # now with the vocab
        if memory_check is not None:
            check_memory(memory_check, cfg, self.precision, self.device, dims, self.is_main)
        cfg, self.compile_choice = CompileChoice.decide(cfg, dims, self.device, self.env.world_size, self.run_dir,
                                                        self.is_main, self.thread_watch, self._message)
        self._run_config = saved_config(cfg)
        # The run folder is self-contained (tokenizer.json, config.toml). On a resume they are rewritten only
        # once the checkpoint has loaded: settings that do not fit it (another vocabulary or width) must not
        # overwrite the record of what the run was trained with, which eval, generate and the next resume read.
        self._run_files_pending = cfg.train.resume and bool(self.checkpoint_store.list_complete())
        if not self._run_files_pending:
            self._write_run_files()
        self.cfg = cfg = resolve_compile(cfg, self.device, announce=self.log_enabled)
        self._build(cfg, dims)
        # Hooks for tune/: ``on_eval(step, score)`` after each evaluation (a trial reports its objective to its
        # pruner; an exception ends the run, the caller then calls ``close``); ``lr_override(step)``: lr-find's
        # peak LR.
        self.on_eval: Callable[[int, ValidationScore], None] | None = None
        self.lr_override: Callable[[int], float] | None = None
        self.disk_note = check_disk(cfg, self.run_dir, self.checkpoint_store, self.pm.modules, self.is_main,
                                    self._message)

    def _build(self, cfg: JobConfig, dims: ParallelDims) -> None:
        """The engine's model and optimizer (a padded vocabulary: the loss masks the rows beyond the tokenizer's
        out), this rank's loader, what a checkpoint holds, and the counters of the loop."""
        self.engine = engine_for(cfg, self.precision, self.checkpoint_store)
        self.pm, self.optimizer = self.engine.build(cfg, dims, self.device, self.tokenizer.vocab_size)
        if line := self.engine.describe():
            self._message(line)
        self.model = self.engine.sampling_model(self.pm)
        self.scaler = grad_scaler(self.precision, self.device)
        self.train_loader = self.data.train_loader(self.pm.dp_rank, dims.dp_size,
                                                   cfg.parallel.balance == "throughput" and dims.dp_size > 1,
                                                   packed=packs_instructions(cfg))
        self.state = TrainState(schedule=dataclasses.asdict(cfg.schedule))
        self.guard = NonFiniteGuard(self.pm.replicas.rollback_after(cfg.train.rollback_after))
        # The loop's steps read nothing back until a log step where the optimizer can skip on the device.
        self.deferred, self._defer = DeferredReads(), defer_reads(self.optimizer, self.scaler,
                                                                  cfg.parallel.engine != "deepspeed")
        # Small per-rank state, saved beside the sharded model and optimizer tensors.
        local_state = {"data": self.train_loader, "train_state": self.state, "rng": RNGState(),
                       "scaler": self.scaler, "guard": self.guard}
        if self.pm.replicas.independent:
            local_state["low_comm"] = self.pm.replicas
        self.adaptive = Adaptive(cfg, dims, self.pm.dp_rank, self.device, self.env.world_size, local_state)
        self.checkpoint = self.engine.checkpoint(self.checkpoint_store, self.pm, self.optimizer, local_state,
                                                 self.state, cfg, self._message)
        # Tokens per optimizer step over all data-parallel ranks (a preference pair is two rows: the objective's
        # rows_per_example).
        self.objective = objective_of(cfg.finetune)  # its loss is installed on the model (train/converters.py)
        self.tokens_per_step = global_batch(cfg, dims.dp_size) * cfg.data.seq_len * self.objective.rows_per_example
        # MFU's numerator: a fine-tune's frozen weights without their weight gradient (finetune/flops.py)
        self.flops_per_token = trained_flops_per_token(cfg.model, cfg.data.seq_len,
                                                       cfg.finetune if cfg.finetune.source else None)
        self.throughput = Throughput(self.tokens_per_step, self.flops_per_token, self.device, self.precision,
                                     self.env.world_size, self.env.rank, self._message)
        self.monitor: ResourceMonitor | None = None
        self.evaluation = RunEvaluation(cfg, self.data, self.pm, self.model, self.precision, self.device, self.is_main)
        self.evals = self.evaluation.evals  # step, val_loss, val_bpb of each evaluation
        self.preempted = ""

    def close(self) -> None:
        """Barrier, then destroy the process group (a no-op in a single process or when already closed), and
        free the run folder's lock."""
        destroy_distributed(self.env)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _message(self, text: str) -> None:
        """A line for people, from rank 0 (``say``) of a trainer built with ``log=True``."""
        if self.log_enabled:
            say(text)

    # -- one optimizer step -------------------------------------------------------------------------
    def step(self, deferred: bool = False) -> dict:
        """One optimizer step (the engine's) at the schedule's learning rate, with the NaN/Inf guard deciding
        whether to update, then the counters and the replicas' synchronisation; returns the step's record.
        ``deferred`` (the loop's, train/deferred.py): the record's loss and norm stay on the device and the guard
        counts the step at the next read (``_read_deferred``)."""
        cfg, step = self.cfg, self.state.step
        plan = self.adaptive.plan(step)  # the ramp's global batch and this rank's micro-batches (train/adaptive.py)
        lr = lr_at(step, cfg.optim.lr, cfg.train.steps, cfg.schedule) * self.adaptive.lr_factor(step) \
            if self.lr_override is None else self.lr_override(step)  # lr-find's sweep (tune/lr_find.py)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # lr_scale: muP's per-group factor (train/optimizer.py)
        verdicts = []

        def before_update(loss: float, grad_norm: float) -> bool:
            verdicts.append(self.guard.check(loss, grad_norm, scaler_enabled=self.scaler.is_enabled()))
            # An asynchronous save must have copied the tensors before anything changes them: the optimizer
            # step, or a low-communication synchronisation even on a skipped step.
            self.checkpoint_store.wait_staged()
            return verdicts[-1] == "ok"

        data_seconds = [0.0]
        deferred = deferred and plan.micro_grad_sq is None  # a noise-scale step reads its norm at once
        options = StepOptions(grad_clip=cfg.optim.grad_clip, autocast=lambda: autocast(self.precision, self.device),
                              scaler=self.scaler, before_update=DeferredGuard(self.checkpoint_store.wait_staged)
                              if deferred else before_update, loss_divisor=plan.loss_divisor,
                              micro_grad_sq=plan.micro_grad_sq)
        result = self.engine.step(self.pm, self.optimizer,
                                  self.adaptive.batches(plan, self.train_loader, self._batch, data_seconds),
                                  plan.mine, options)
        self.adaptive.skip_rest(plan, self.train_loader)  # the other ranks' micro-batches of this step
        self.throughput.data_times.append(data_seconds[0])
        self.state.step += 1
        self.state.tokens_seen += plan.global_batch * cfg.data.seq_len
        self.pm.replicas.after_step(self.state.step)
        record = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": lr, **result.auxiliary,
                  **self.objective.metrics(self.pm, "train")}  # e.g. DPO/SimPO/ORPO's rewards
        self.adaptive.after_step(plan, self.state.step, result.grad_norm, record)
        if deferred:
            self.deferred.add(self.state.step, result)
        elif not result.updated:
            record["skipped_update"] = 1
            self._message(f"warning: step {self.state.step}: loss {result.loss} / gradient norm {result.grad_norm} "
                          f"is not finite; update skipped ({self.guard.consecutive} in a row)")
        if verdicts and verdicts[-1] == "rollback":
            self._rollback()
        return record

    def _batch(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, targets, attention mask or None) on the device; with data.document_attention the
        loader's document ids become a block-causal mask (B, 1, T, T)."""
        # Pinned on CUDA: a copy from pageable memory makes the host wait for the stream (a sync per batch).
        inputs, targets = ((t.pin_memory() if self.device.type == "cuda" else t).to(self.device, non_blocking=True)
                           for t in batch[:2])
        mask = block_causal_mask(batch[2].to(self.device)) if len(batch) > 2 else None
        return inputs, targets, mask

    # -- evaluation and samples ---------------------------------------------------------------------
    def evaluate(self) -> ValidationScore:
        """The run's validation loss and bits per byte, as ``scaletrain eval`` (train/run_evaluation.py)."""
        return self.evaluation.evaluate()

    def sample(self, max_new_tokens: int) -> tuple[str, str]:
        """(text from the current model, a note when it stopped at the context); the training RNG untouched."""
        return self.evaluation.sample(self.state.step, max_new_tokens)

    # -- checkpoints (what a checkpoint holds: the engine's, e.g. checkpoint/training.py) -----------
    def save(self, blocking: bool | None = None) -> Path:
        """Write a checkpoint of the current step (collective). Asynchronous when checkpoint.async_save is
        set, unless ``blocking``; the folder is complete once ``self.checkpoint_store.wait()`` returns."""
        with self.throughput.stall("checkpoint"):
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
            write_file(self.run_dir / "config.toml", to_toml(self._run_config))

    def _rollback(self) -> None:
        """Back to the last good checkpoint; the batches that produced the non-finite steps are skipped."""
        bad_step = self.state.step
        path = self.checkpoint.roll_back()
        if path is None:
            raise TrainingError(f"{self.guard.rollback_after} non-finite steps in a row at step {bad_step} and no "
                                f"checkpoint to roll back to; lower optim.lr or check the data")
        self._message(f"rolled back to {path.name} after {self.guard.rollback_after} non-finite steps (at step "
                      f"{bad_step}); the data of those steps is skipped")

    # -- the loop ------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to ``train.steps`` (or ``train.stop_at_step``, or a preemption notice); returns a summary.

        On SIGTERM / SIGUSR1 / the trigger file the current step finishes, a checkpoint is written and the
        summary says ``preempted``; ``scaletrain train`` then exits with status 75 (EX_TEMPFAIL)."""
        cfg, state = self.cfg, self.state
        logger = MetricsLogger(self.run_dir, cfg.logging, cfg.train.steps, state.step, enabled=self.log_enabled)
        eval_every, ckpt_every = cfg.train.eval_interval, cfg.checkpoint.interval
        stop_at = cfg.train.stop_at_step or cfg.train.steps
        if self._run_files_pending:  # a resume that never called resume(): the files are due all the same
            self._write_run_files()
        notice = PreemptionHandler(cfg.checkpoint.trigger_file, cfg.checkpoint.grace_seconds, self.started,
                                   launcher=self.launcher).install()
        if self.is_main:  # the report's header (train/monitor.py)
            write_run_info(self.run_dir, self.device, self.env.world_size, start_step=state.step)
        self.monitor = ResourceMonitor(cfg.monitor, self.run_dir, self.env.rank, self.device).start()
        profiler = StepProfiler(cfg.profile, self.run_dir, self.env.rank, self.device, self._message).start()
        self._rollbacks_logged = self.guard.rollbacks
        loop_start = time.perf_counter()
        try:
            if state.step == 0 and eval_every:
                self._eval_and_sample(logger)
            while state.step < min(stop_at, cfg.train.steps):
                record = self._timed_step(profiler)
                self._log_step(record, logger)
                self.preempted = stop_reason(notice, self.checkpoint_store, self.device)
                if self.preempted:
                    break
                if eval_every and state.step % eval_every == 0 and state.step != cfg.train.steps:
                    self._eval_and_sample(logger)
                if cfg.checkpoint.enabled and ckpt_every and state.step % ckpt_every == 0 and state.step < stop_at:
                    self.save()
            self._finish(notice, logger)
            self.throughput.loop_seconds = time.perf_counter() - loop_start
        finally:
            profiler.stop()
            self.monitor.stop()
            notice.uninstall()
            logger.close()
        self.close()  # after success only: a barrier in an error path could hang the healthy ranks
        summary = self.summary()
        if self.is_main:
            finish_run_info(self.run_dir, summary)
            if self.env.world_size == 1:  # what the next train.compile = auto run of this shape weighs
                self.compile_choice.remember(self.cfg, self.device, compile_enabled(self.cfg),
                                             self.throughput.step_times)
        return summary

    def _timed_step(self, profiler: StepProfiler) -> dict:
        """``step``, its wall time recorded (after the GPU has finished it)."""
        if self.thread_watch is not None:
            self.thread_watch.before_step()
        self.throughput.clock.start()  # on CUDA timing events, read at the log steps (no sync per step)
        record = self.step(deferred=self._defer)
        self.throughput.clock.stop()
        if self.thread_watch is not None:
            self.thread_watch.after_step(self.throughput.clock.last(), self.state.step)
        profiler.step()
        return record

    def _log_step(self, record: dict, logger: MetricsLogger) -> None:
        """The step's full record every logging.log_interval steps (and the last), else only its events."""
        step, cfg = self.state.step, self.cfg
        log_due = step % cfg.logging.log_interval == 0 or step == cfg.train.steps
        if self.deferred.pending and (log_due or step >= (cfg.train.stop_at_step or cfg.train.steps) or any(
                every and step % every == 0 for every in (cfg.train.eval_interval, cfg.checkpoint.interval))):
            self._read_deferred(logger, record)  # the steps' reads, before the log, an evaluation or a save
        if log_due:
            logger.log(self._step_record(record))  # collective (per-rank memory): all ranks call it
        else:
            logger.advance(step)
            if "skipped_update" in record:  # a NaN-guard event between log steps, for the report
                logger.log({"step": step, "skipped_update": 1})
        if self.guard.rollbacks != self._rollbacks_logged:
            self._rollbacks_logged = self.guard.rollbacks
            logger.log({"step": step, "rollback": self._rollbacks_logged})

    def _read_deferred(self, logger: MetricsLogger, record: dict) -> None:
        """The deferred steps' losses, norms and NaN-guard verdicts, in one read (train/deferred.py)."""
        if settle(self.deferred.read(self.guard), record, self.state.step, logger.log, self._message, self.guard):
            self._rollback()

    def _finish(self, notice: PreemptionHandler, logger: MetricsLogger) -> None:
        """After the loop: a preempted run saves this step at once; a finished one evaluates (and samples) the
        last step's weights and saves; any save still in flight completes."""
        self._read_deferred(logger, {})  # a preemption notice can end the loop between reads
        state = self.state
        if self.preempted:
            save_on_notice(notice, self.preempted, state.step, self.cfg.checkpoint, self._save_now, logger)
        else:
            if state.step >= self.cfg.train.steps:
                # Replicas end on the same (global) weights; not at stop_at_step, where the run goes on later.
                self.pm.replicas.finish(state.step)
                self._eval_and_sample(logger)  # the final evaluation sees those weights
            elif not self.evals or self.evals[-1]["step"] != state.step:
                # Stopped at train.stop_at_step: evaluate here, so the summary's val loss is this step's,
                # not an earlier one's (no RNG is drawn: a resumed run stays bitwise identical).
                self._eval_and_sample(logger)
            if self.cfg.checkpoint.enabled:
                self.save()
        with self.throughput.stall("checkpoint"):
            self.checkpoint_store.close()  # an asynchronous save completes before the run ends

    def _save_now(self) -> None:
        """Finish any save in flight, then write this step's checkpoint synchronously (a preemption notice)."""
        self.checkpoint_store.wait()
        self.save(blocking=True)

    def _step_record(self, record: dict) -> dict:
        """The logged record of a step: its values, speed, memory, the resource monitor's window (collective)."""
        self.pm.sum_expert_counts("tokens_since_log", "dropped_since_log")  # the load of every data-parallel rank
        return {"step": self.state.step, **record, **self.throughput.record(self.cfg.logging.log_interval),
                # a mixture of experts' load since the last log step (model/moe.py), of every pipeline stage
                **self.pm.gather_over_stages(expert_load(self.pm.modules)),
                **gathered_window(self.monitor, self.device, self.env.world_size)}

    def _eval_and_sample(self, logger: MetricsLogger) -> None:
        """Evaluate and log (then ``on_eval``); rank 0 also samples and logs text when train.sample_tokens."""
        self.evaluation.evaluate_and_sample(self.state.step, logger, self.throughput, self.on_eval)

    def summary(self) -> dict:
        """Steps, speed, evaluations, memory, parameters, communication, NaN-guard events, stalls."""
        return {"steps": self.state.step, **self.throughput.median(),
                "evals": self.evals, "final_val_loss": self.evals[-1]["val_loss"] if self.evals else None,
                "final_val_bpb": self.evals[-1]["val_bpb"] if self.evals else None,
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20,
                "parameters": num_params(self.cfg.model),
                "trainable_parameters": parameter_counts(self.pm.modules)[0],
                "all_reduce_calls": self.pm.comm.all_reduce_calls, "all_reduce_bytes": self.pm.comm.all_reduce_bytes,
                "preempted": self.preempted, "skipped_updates": self.guard.skipped_total,
                "rollbacks": self.guard.rollbacks, **self.throughput.stalls()}
