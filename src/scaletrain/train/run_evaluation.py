"""What a run evaluates while it trains: the validation loss and bits per byte every train.eval_interval steps (the
windows ``scaletrain eval`` scores: ``train/evaluate.py:validation_loss``), the preference pairs' held-out rewards,
and rank 0's text sample; each logged, and handed to the trainer's ``on_eval`` hook (tune/'s trials)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from scaletrain.config import JobConfig
from scaletrain.data.run_data import TrainingData, validation_batches
from scaletrain.finetune.objectives import objective_of
from scaletrain.model.generate import generate
from scaletrain.parallel import ParallelModel
from scaletrain.train.evaluate import ValidationScore, byte_table, validation_loss
from scaletrain.train.metrics import MetricsLogger, Throughput


class RunEvaluation:
    """The run's evaluations (``evals``: step, val_loss, val_bpb each) and samples, on the trainer's model."""

    def __init__(self, cfg: JobConfig, data: TrainingData, pm: ParallelModel, sampling_model: nn.Module,
                 precision: str, device: torch.device, is_main: bool):
        self.cfg, self.data, self.tokenizer, self.pm = cfg, data, data.tokenizer, pm
        self.sampling_model, self.precision, self.device, self.is_main = sampling_model, precision, device, is_main
        self.evals: list[dict] = []
        self._token_bytes: torch.Tensor | None = None  # ``byte_table`` of the tokenizer, on the device

    def evaluate(self) -> ValidationScore:
        """The run's validation loss and bits per byte: ``validation_loss`` over ``validation_batches``
        (train.eval_batches batches evenly spread over the val split, or the first held-out instruction examples),
        as ``scaletrain eval``."""
        # Eager even when the model is compiled: no-grad eval mode is another graph, and its cold compile
        # (14.8 s on the baby recipe) cost more than the whole run's evals take eagerly (9 x 0.24 s; compiled
        # 0.21 s each). It is also the forward ``scaletrain eval`` runs, so the two agree to the last bit.
        with torch.compiler.set_stance("force_eager"):
            if self._token_bytes is None:  # the UTF-8 bytes of each token id, for bits per byte (once)
                self._token_bytes = byte_table(self.tokenizer, self.device)
            return validation_loss(self.pm, validation_batches(self.cfg, self.data), self.precision,
                                   self.cfg.train.batch_size, self._token_bytes)

    def sample(self, step: int, max_new_tokens: int) -> tuple[str, str]:
        """(text from the current model, a note when it stopped at the context); its own generator (seeded by
        train.seed + ``step``) keeps the training RNG untouched."""
        gen = torch.Generator().manual_seed(self.cfg.train.seed + step)
        prompt = self.tokenizer.encode(self.cfg.train.sample_prompt) or [0]
        context = self.cfg.data.seq_len
        # Eager even when the model is compiled: the context grows by one token a step, and each new length
        # would cost a recompile (seconds on a CPU) for a forward pass that takes milliseconds.
        with torch.compiler.set_stance("force_eager"):
            # Within the trained context (data.seq_len) and no further (slide=False): every token is one cached
            # step. Sliding past it cost a whole window's forward over the whole vocabulary per token (101 s for
            # 200 tokens past a 64-token context with a 151,936-token vocabulary, issue 36).
            new = generate(self.sampling_model, prompt, max_new_tokens, max_seq_len=context, temperature=0.8,
                           top_k=200, generator=gen, stop_id=self.tokenizer.eos_id,
                           vocab_limit=self.tokenizer.vocab_size, slide=False)
        cut = len(new) < max_new_tokens and len(prompt) + len(new) > context
        note = f" ({len(new)} tokens: stopped at the model's {context}-token context)" if cut else ""
        return self.cfg.train.sample_prompt + self.tokenizer.decode(new), note

    def evaluate_and_sample(self, step: int, logger: MetricsLogger, throughput: Throughput,
                            on_eval: Callable[[int, ValidationScore], None] | None) -> None:
        """Evaluate and log (then ``on_eval``); rank 0 also samples and logs text when train.sample_tokens."""
        with throughput.stall("eval"):
            score = self.evaluate()
        val_loss = score.loss
        self.evals.append({"step": step, "val_loss": val_loss, "val_bpb": score.bpb})
        rewards = objective_of(self.cfg.finetune).metrics(self.pm, "eval")  # e.g. held-out pairs' rewards
        logger.log({"step": step, "val_loss": val_loss, "val_perplexity": math.exp(val_loss),
                    "val_bpb": score.bpb, **rewards})
        pairs = "val_reward_accuracy" in rewards  # a preference objective's held-out pairs
        logger.message(f"step {step}: val loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f}, "
                       f"bpb {score.bpb:.4f}" + (f", reward accuracy {rewards['val_reward_accuracy']:.3f}, margin "
                                                 f"{rewards['val_reward_margin']:.4f}" if pairs else ""))
        if on_eval is not None:
            on_eval(step, score)
        if self.cfg.train.sample_tokens and self.is_main and not self.pm.sharded:
            with throughput.stall("sample"):
                text, note = self.sample(step, self.cfg.train.sample_tokens)
            logger.log({"step": step, "sample": text})  # for the report
            logger.message(f"--- sample{note} ---\n" + text.strip() + "\n--------------")
