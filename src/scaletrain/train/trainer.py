"""The trainer: build everything from a JobConfig, then step / evaluate / checkpoint / log.

One ``train_step`` serves every run. The loop in ``train`` only sequences; each piece it calls lives in
its own module (schedule, optimizer, precision, metrics, checkpoint, data).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from scaletrain.checkpoint import CheckpointManager
from scaletrain.config import ConfigError, JobConfig, ModelConfig, to_toml
from scaletrain.data.loader import TokenLoader, eval_batches
from scaletrain.data.prepare import ensure_prepared
from scaletrain.data.shards import read_manifest
from scaletrain.data.tokenizer import load_tokenizer
from scaletrain.model import Transformer, flops_per_token, num_params
from scaletrain.parallel import (ParallelDims, build_parallel_optimizer, clip_grad_norm_, forward_backward,
                                 global_mean, parallelize)
from scaletrain.parallel import state as parallel_state
from scaletrain.parallel.context import check_context_parallel_supported
from scaletrain.parallel.distributed import barrier, destroy_distributed, init_distributed, world_size_from_env
from scaletrain.plan.calibration import peak_flops
from scaletrain.train.metrics import MetricsLogger, peak_memory_bytes
from scaletrain.train.optimizer import build_optimizer
from scaletrain.train.precision import autocast, grad_scaler, resolve_device, resolve_precision
from scaletrain.train.sampling import generate
from scaletrain.train.schedule import lr_at


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


def prepare_data(cfg: JobConfig) -> Path:
    """The prepared token folder for ``cfg.data`` (preparing raw text into the cache once)."""
    cache = cfg.data.cache_dir or str(Path(cfg.train.run_dir) / "data")
    return ensure_prepared(cfg.data.path, cache, tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.vocab_size,
                           val_fraction=cfg.data.val_fraction, seed=cfg.train.seed)


def resolve_vocab(cfg: JobConfig, manifest: dict) -> JobConfig:
    """Fill model.vocab_size from the data, or check that the model's vocabulary covers it."""
    data_vocab = manifest["vocab_size"]
    if cfg.model.vocab_size == 0:
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=data_vocab))
    if cfg.model.vocab_size < data_vocab:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the data's tokenizer "
                          f"vocabulary ({data_vocab}); set it to 0 to use the data's")
    return cfg


def full_model_module(model_cfg: ModelConfig, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain CPU model around gathered tensors (no copy), for the safetensors checkpoint writer."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    # safetensors refuses views into a larger buffer (as gathered tensors can be): copy only those.
    state = {k: v if v.untyped_storage().nbytes() == v.nbytes else v.clone() for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    return model


class Trainer:
    """Build order: config -> degrees checked -> process group -> data -> model on meta -> parallelize
    (split, shard, materialize, init) -> optimizer -> loader for this data-parallel rank."""

    def __init__(self, cfg: JobConfig, *, log: bool = True):
        self.device = resolve_device(cfg.train.device)
        self.precision = resolve_precision(cfg.train.precision, self.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        # Degrees are validated before any process-group work, so a bad config fails fast on every rank.
        self.dims = dims = ParallelDims.from_config(cfg.parallel, world_size_from_env())
        dims.check_model(cfg.parallel, cfg.model, cfg.data.seq_len, cfg.train.batch_size)
        if dims.cp > 1:
            check_context_parallel_supported(self.device)
        if dims.pp > 1 and cfg.checkpoint.enabled:
            raise ConfigError("checkpoints with parallel.pp > 1 need per-stage (DCP) checkpoints, which are not "
                              "implemented yet; set checkpoint.enabled=false")
        if dims.pp > 1 and self.precision == "fp16":
            raise ConfigError("train.precision=fp16 (gradient scaler) is not supported with parallel.pp > 1; use bf16")
        self.env = init_distributed(self.device.type)
        self.device = self.env.device
        self.is_main = self.env.is_main
        self.run_dir = Path(cfg.train.run_dir)
        if self.is_main:  # rank 0 prepares the data once; the others then find it cached
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.data_dir = prepare_data(cfg)
        barrier()
        if not self.is_main:
            self.data_dir = prepare_data(cfg)
        manifest = read_manifest(self.data_dir)
        self.cfg = cfg = resolve_vocab(cfg, manifest)
        dims.check_model(cfg.parallel, cfg.model, cfg.data.seq_len, cfg.train.batch_size)  # now with the vocab
        self.tokenizer = load_tokenizer(self.data_dir / manifest["tokenizer"]["file"])
        if self.is_main:
            self.tokenizer.save(self.run_dir / "tokenizer.json")  # the run folder is self-contained
            # Saved without this invocation's controls, so `train --resume` runs on to train.steps.
            saved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_at_step=0, resume=False))
            (self.run_dir / "config.toml").write_text(to_toml(saved))

        with torch.device("meta"):
            model = Transformer(cfg.model)
        self.pm = parallelize(model, dims, cfg.parallel, mesh=dims.build_mesh(self.device.type), model_cfg=cfg.model,
                              device=self.device, seed=cfg.train.seed, compile=cfg.train.compile,
                              grad_accum_steps=cfg.train.grad_accum_steps)
        self.model = self.pm.modules[0] if len(self.pm.modules) == 1 else nn.ModuleList(self.pm.modules)
        self.optimizer = build_parallel_optimizer(self.pm, cfg.optim, self.device, dims.zero_stage)
        self.scaler = grad_scaler(self.precision, self.device)
        self.train_loader = TokenLoader(str(self.data_dir), "train", cfg.data.seq_len, cfg.train.batch_size,
                                        rank=self.pm.dp_rank, world_size=dims.dp_size, seed=cfg.train.seed,
                                        shuffle=cfg.data.shuffle)
        self.state = TrainState(schedule=dataclasses.asdict(cfg.schedule))
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint.keep_last)
        self.stateful = {"model": self.model, "optimizer": self.optimizer, "data": self.train_loader,
                         "train_state": self.state, "rng": RNGState(), "scaler": self.scaler}
        if self.pm.low_comm is not None:
            self.stateful["low_comm"] = self.pm.low_comm
        # Tokens per optimizer step over all data-parallel ranks.
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * cfg.train.grad_accum_steps * dims.dp_size
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_flops = peak_flops(self.device, "bf16" if self.precision == "bf16" else "fp32") * dims.world_size
        self.log_enabled = log and self.is_main  # rank-0-only logging
        self.step_times: list[float] = []
        self.evals: list[dict] = []

    def close(self) -> None:
        """Barrier, then destroy the process group (a no-op in a single process or when already closed)."""
        destroy_distributed(self.env)

    # -- one optimizer step -------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Accumulate gradients over ``grad_accum_steps`` micro-batches, clip, and update once.

        Data-parallel gradients are synchronised only on the final micro-batch (DDP ``no_sync`` before);
        with low-communication training they are not synchronised at all (replicas meet every H steps).
        """
        cfg = self.cfg
        lr = lr_at(self.state.step, cfg.optim.lr, cfg.train.steps, cfg.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = cfg.train.grad_accum_steps
        loss_sum = None
        for micro in range(accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in next(self.train_loader))
            loss = forward_backward(self.pm, inputs, targets, accum=accum, sync=micro == accum - 1,
                                    autocast=lambda: autocast(self.precision, self.device), scale=self.scaler.scale)
            if loss is not None:  # None on pipeline ranks that do not hold the last stage
                loss_sum = loss if loss_sum is None else loss_sum + loss
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm_(self.pm.parameters(), max_norm, self.pm.group("pp"), foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += self.tokens_per_step
        if self.pm.low_comm is not None:  # local loss: no per-step communication at all
            self.pm.low_comm.after_step(self.state.step)
            loss_value = float(loss_sum)
        else:
            loss_value = float(global_mean(loss_sum, self.dims, self.device))
        return {"loss": loss_value, "grad_norm": float(grad_norm), "lr": lr}

    # -- evaluation and samples ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data_dir: Path | None = None, split: str = "val") -> float:
        """Mean loss over a fixed, evenly spread set of ``eval_batches`` batches of ``split`` (every rank
        scores the same batches; pipeline ranks pass them through their stages)."""
        for module in self.pm.modules:
            module.eval()
        losses = []
        for inputs, targets in eval_batches(str(data_dir or self.data_dir), split, self.cfg.data.seq_len,
                                            self.cfg.train.batch_size, self.cfg.train.eval_batches):
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            if self.pm.pipeline is not None:
                if len(inputs) != self.cfg.train.batch_size:
                    continue  # a short last batch cannot be cut into the schedule's micro-batches
                with autocast(self.precision, self.device), self.pm.loss_context():
                    loss = self.pm.pipeline.eval(inputs, targets)
            else:
                with autocast(self.precision, self.device), self.pm.loss_context():
                    loss = self.pm.loss_fn(self.pm.parts[0](inputs), targets)
            losses.append(global_mean(loss, self.dims, self.device) if self.pm.low_comm is None else loss.float())
        for module in self.pm.modules:
            module.train()
        return float(torch.stack(losses).mean())

    def sample(self, max_new_tokens: int) -> str:
        """Text from the current model; its own generator keeps the training RNG untouched."""
        gen = torch.Generator().manual_seed(self.cfg.train.seed + self.state.step)
        prompt = self.tokenizer.encode(self.cfg.train.sample_prompt) or [0]
        new = generate(self.model, prompt, max_new_tokens, max_seq_len=self.cfg.model.max_seq_len,
                       temperature=0.8, top_k=200, generator=gen, stop_id=self.tokenizer.eos_id)
        return self.cfg.train.sample_prompt + self.tokenizer.decode(new)

    # -- checkpoints --------------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write a checkpoint. Distributed: every rank helps gather the full state, rank 0 writes it."""
        meta = {"tokens_seen": self.state.tokens_seen, "world_size": self.env.world_size}
        if self.env.world_size == 1:
            return self.checkpoints.save(self.state.step, self.stateful, meta)
        model_state = parallel_state.gather_model_state(self.pm)
        optimizer_state = parallel_state.gather_optimizer_state(self.pm, self.optimizer)
        path = None
        if self.is_main:
            states = {**self.stateful, "model": full_model_module(self.cfg.model, model_state),
                      "optimizer": parallel_state.Held(optimizer_state)}
            path = self.checkpoints.save(self.state.step, states, meta)
        barrier()  # nobody races ahead (or exits) while rank 0 is still writing
        return path

    def resume(self) -> bool:
        """Load the newest good checkpoint (every rank reads it); False when there is none."""
        path = self.checkpoints.latest(warn=self._message)
        if path is None:
            return False
        if self.env.world_size == 1:
            self.checkpoints.load(path, self.stateful)
        else:
            held = parallel_state.Held()
            others = {k: v for k, v in self.stateful.items() if k != "model"}
            self.checkpoints.load(path, {**others, "optimizer": held})
            parallel_state.load_model_state(self.pm, load_file(str(path / "model.safetensors")))
            parallel_state.load_optimizer_state(self.pm, self.optimizer, held.state)
        if self.state.schedule != dataclasses.asdict(self.cfg.schedule):
            self._message("warning: the [schedule] settings differ from the checkpoint's; using the new ones")
        self._message(f"resumed from {path} (step {self.state.step})")
        return True

    def _message(self, text: str) -> None:
        if self.log_enabled:
            print(text, flush=True)

    # -- the loop ------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to ``train.steps`` (or ``train.stop_at_step``); returns a summary of the run."""
        cfg, state = self.cfg, self.state
        logger = MetricsLogger(self.run_dir, cfg.logging, cfg.train.steps, state.step, enabled=self.log_enabled)
        log_every, eval_every, ckpt_every = cfg.logging.log_interval, cfg.train.eval_interval, cfg.checkpoint.interval
        stop_at = cfg.train.stop_at_step or cfg.train.steps
        try:
            if state.step == 0 and eval_every:
                self._eval_and_report(logger)
            while state.step < min(stop_at, cfg.train.steps):
                t0 = time.perf_counter()
                record = self.train_step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                self.step_times.append(time.perf_counter() - t0)
                step = state.step
                if step % log_every == 0 or step == cfg.train.steps:
                    logger.log(self._step_record(record))  # collective (per-rank memory): all ranks call it
                else:
                    logger.advance(step)
                if eval_every and step % eval_every == 0 and step != cfg.train.steps:
                    self._eval_and_report(logger)
                if cfg.checkpoint.enabled and ckpt_every and step % ckpt_every == 0 and step < stop_at:
                    self.save()
            if state.step >= cfg.train.steps:
                self._eval_and_report(logger)
            if self.pm.low_comm is not None:
                self.pm.low_comm.finish(state.step)  # the replicas end on the same (global) weights
            if cfg.checkpoint.enabled:
                self.save()
        finally:
            logger.close()
        self.close()  # after success only: a barrier in an error path could hang the healthy ranks
        return self.summary()

    def _step_record(self, record: dict) -> dict:
        recent = self.step_times[-self.cfg.logging.log_interval:]
        step_s = statistics.median(recent)
        tokens_per_second = self.tokens_per_step / step_s
        return {"step": self.state.step, **record, "step_ms": 1000 * step_s,
                "tokens_per_second": tokens_per_second,
                "mfu": self.flops_per_token * tokens_per_second / self.peak_flops,
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20,
                **({"peak_memory_mb_per_rank": self._per_rank_memory_mb()} if self.env.world_size > 1 else {})}

    def _per_rank_memory_mb(self) -> list[float]:
        """Every rank's peak memory (one small all-gather), so rank 0 can log them all."""
        mine = torch.tensor([peak_memory_bytes(self.device) / 2**20], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(every, mine)
        return [round(float(t), 1) for t in every]

    def _eval_and_report(self, logger: MetricsLogger) -> None:
        val_loss = self.evaluate()
        self.evals.append({"step": self.state.step, "val_loss": val_loss})
        logger.log({"step": self.state.step, "val_loss": val_loss, "val_perplexity": math.exp(val_loss)})
        logger.message(f"step {self.state.step}: val loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f}")
        if self.cfg.train.sample_tokens and self.is_main and not self.pm.sharded:
            logger.message("--- sample ---\n" + self.sample(self.cfg.train.sample_tokens).strip() + "\n--------------")

    def summary(self) -> dict:
        times = self.step_times or [float("nan")]
        median_s = statistics.median(times)
        return {"steps": self.state.step, "median_step_ms": 1000 * median_s,
                "tokens_per_second": self.tokens_per_step / median_s,
                "mfu": self.flops_per_token * self.tokens_per_step / median_s / self.peak_flops,
                "evals": self.evals, "final_val_loss": self.evals[-1]["val_loss"] if self.evals else None,
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20,
                "parameters": num_params(self.cfg.model),
                "all_reduce_calls": self.pm.comm.all_reduce_calls, "all_reduce_bytes": self.pm.comm.all_reduce_bytes}
