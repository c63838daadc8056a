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
import torch.nn.functional as F

from scaletrain.checkpoint import CheckpointManager
from scaletrain.config import ConfigError, JobConfig, to_toml
from scaletrain.data.loader import TokenLoader, eval_batches
from scaletrain.data.prepare import ensure_prepared
from scaletrain.data.shards import read_manifest
from scaletrain.data.tokenizer import load_tokenizer
from scaletrain.model import build_model, flops_per_token
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


class Trainer:
    def __init__(self, cfg: JobConfig, *, log: bool = True):
        self.device = resolve_device(cfg.train.device)
        self.precision = resolve_precision(cfg.train.precision, self.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.run_dir = Path(cfg.train.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = prepare_data(cfg)
        manifest = read_manifest(self.data_dir)
        self.cfg = cfg = resolve_vocab(cfg, manifest)
        self.tokenizer = load_tokenizer(self.data_dir / manifest["tokenizer"]["file"])
        self.tokenizer.save(self.run_dir / "tokenizer.json")  # the run folder is self-contained
        # Saved without this invocation's controls, so `train --resume` runs on to train.steps.
        saved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_at_step=0, resume=False))
        (self.run_dir / "config.toml").write_text(to_toml(saved))

        self.model = build_model(cfg.model, self.device, seed=cfg.train.seed)
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scaler = grad_scaler(self.precision, self.device)
        self.train_loader = TokenLoader(str(self.data_dir), "train", cfg.data.seq_len, cfg.train.batch_size,
                                        seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        self.state = TrainState(schedule=dataclasses.asdict(cfg.schedule))
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint.keep_last)
        self.stateful = {"model": self.model, "optimizer": self.optimizer, "data": self.train_loader,
                         "train_state": self.state, "rng": RNGState(), "scaler": self.scaler}
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * cfg.train.grad_accum_steps
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_flops = peak_flops(self.device, "bf16" if self.precision == "bf16" else "fp32")
        self.log_enabled = log
        self.step_times: list[float] = []
        self.evals: list[dict] = []

    # -- one optimizer step -------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Accumulate gradients over ``grad_accum_steps`` micro-batches, clip, and update once."""
        cfg = self.cfg
        lr = lr_at(self.state.step, cfg.optim.lr, cfg.train.steps, cfg.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = cfg.train.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in next(self.train_loader))
            with autocast(self.precision, self.device):
                logits = self.forward(inputs)  # (B, T, V)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / accum
            self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += self.tokens_per_step
        return {"loss": float(loss_sum), "grad_norm": float(grad_norm), "lr": lr}

    # -- evaluation and samples ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data_dir: Path | None = None, split: str = "val") -> float:
        """Mean loss over a fixed, evenly spread set of ``eval_batches`` batches of ``split``."""
        self.model.eval()
        losses = []
        for inputs, targets in eval_batches(str(data_dir or self.data_dir), split, self.cfg.data.seq_len,
                                            self.cfg.train.batch_size, self.cfg.train.eval_batches):
            with autocast(self.precision, self.device):
                logits = self.forward(inputs.to(self.device))
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.to(self.device).flatten()))
        self.model.train()
        return float(torch.stack(losses).mean())

    def sample(self, max_new_tokens: int) -> str:
        """Text from the current model; its own generator keeps the training RNG untouched."""
        gen = torch.Generator().manual_seed(self.cfg.train.seed + self.state.step)
        prompt = self.tokenizer.encode(self.cfg.train.sample_prompt) or [0]
        new = generate(self.model, prompt, max_new_tokens, max_seq_len=self.cfg.model.max_seq_len,
                       temperature=0.8, top_k=200, generator=gen, stop_id=self.tokenizer.eos_id)
        return self.cfg.train.sample_prompt + self.tokenizer.decode(new)

    # -- checkpoints --------------------------------------------------------------------------------
    def save(self) -> Path:
        return self.checkpoints.save(self.state.step, self.stateful,
                                     {"tokens_seen": self.state.tokens_seen, "world_size": 1})

    def resume(self) -> bool:
        """Load the newest good checkpoint; False when there is none."""
        path = self.checkpoints.latest(warn=self._message)
        if path is None:
            return False
        self.checkpoints.load(path, self.stateful)
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
                    logger.log(self._step_record(record))
                else:
                    logger.advance(step)
                if eval_every and step % eval_every == 0 and step != cfg.train.steps:
                    self._eval_and_report(logger)
                if cfg.checkpoint.enabled and ckpt_every and step % ckpt_every == 0 and step < stop_at:
                    self.save()
            if state.step >= cfg.train.steps:
                self._eval_and_report(logger)
            if cfg.checkpoint.enabled:
                self.save()
        finally:
            logger.close()
        return self.summary()

    def _step_record(self, record: dict) -> dict:
        recent = self.step_times[-self.cfg.logging.log_interval:]
        step_s = statistics.median(recent)
        tokens_per_second = self.tokens_per_step / step_s
        return {"step": self.state.step, **record, "step_ms": 1000 * step_s,
                "tokens_per_second": tokens_per_second,
                "mfu": self.flops_per_token * tokens_per_second / self.peak_flops,
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20}

    def _eval_and_report(self, logger: MetricsLogger) -> None:
        val_loss = self.evaluate()
        self.evals.append({"step": self.state.step, "val_loss": val_loss})
        logger.log({"step": self.state.step, "val_loss": val_loss, "val_perplexity": math.exp(val_loss)})
        logger.message(f"step {self.state.step}: val loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f}")
        if self.cfg.train.sample_tokens:
            logger.message("--- sample ---\n" + self.sample(self.cfg.train.sample_tokens).strip() + "\n--------------")

    def summary(self) -> dict:
        times = self.step_times or [float("nan")]
        median_s = statistics.median(times)
        return {"steps": self.state.step, "median_step_ms": 1000 * median_s,
                "tokens_per_second": self.tokens_per_step / median_s,
                "mfu": self.flops_per_token * self.tokens_per_step / median_s / self.peak_flops,
                "evals": self.evals, "final_val_loss": self.evals[-1]["val_loss"] if self.evals else None,
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20,
                "parameters": sum(p.numel() for p in self.model.parameters())}
