"""Evaluation: the validation loss of a run (one definition: training's eval, ``scaletrain eval`` and
``compress --report`` all call ``validation_loss``), the loss over token windows of any text, and perplexity."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ConfigError, JobConfig, ParallelConfig
from scaletrain.data.loader import block_causal_mask
from scaletrain.data.run_data import describe_validation, training_data, validation_batches
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.parallel import forward_loss
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.parallelize import ParallelModel
from scaletrain.train.precision import autocast, resolve_precision


@torch.no_grad()
def validation_loss(pm: ParallelModel, batches: Iterable[tuple[torch.Tensor, ...]], precision: str,
                    batch_size: int) -> tuple[float, int, int]:
    """The mean of the per-batch mean next-token losses over ``batches`` (``data.run_data.validation_batches``),
    under ``precision``'s autocast: the number a run's metrics.jsonl records as val_loss. Every rank scores the
    same batches (the loss is averaged over data-parallel ranks); pipeline ranks pass them through their stages,
    which cannot cut a short last batch into micro-batches (skipped there). The parts are put back in the mode
    they were in. Returns (loss, batches scored, windows scored)."""
    modes = [module.training for module in pm.modules]
    for module in pm.modules:
        module.eval()
    losses, windows = [], 0
    for batch in batches:
        inputs, targets = (t.to(pm.device, non_blocking=True) for t in batch[:2])
        mask = block_causal_mask(batch[2].to(pm.device)) if len(batch) > 2 else None  # data.document_attention
        if pm.pipeline is not None and len(inputs) != batch_size:
            continue
        loss = forward_loss(pm, inputs, targets, autocast=lambda: autocast(precision, pm.device), attn_mask=mask)
        losses.append(pm.replicas.step_loss(loss, pm.dims, pm.device))
        windows += len(inputs)
    for module, mode in zip(pm.modules, modes):
        module.train(mode)
    return float(torch.stack(losses).mean()), len(losses), windows


@dataclass
class RunScore:
    """A loaded run's validation loss and the line that says which windows gave it."""

    loss: float
    batches: int
    windows: int
    windows_text: str  # "over 2 batches x 4 x 32 tokens, evenly spread over the val split (...); precision fp32"

    @property
    def line(self) -> str:
        return f"val loss {self.loss:.4f}, perplexity {perplexity(self.loss):.2f} {self.windows_text}"


def score_run(cfg: JobConfig, model: nn.Module, tokenizer: Tokenizer, num_batches: int | None = None,
              say: Callable[[str], None] = print) -> RunScore:
    """The validation loss of a run read back by ``checkpoint.run.load_run``, computed as training's eval computes
    it (``validation_loss`` over ``validation_batches``, under the run's precision): for the same checkpoint and
    ``num_batches`` (default train.eval_batches) it is the val_loss the run recorded. ``say`` hears data notes."""
    device = next(model.parameters()).device
    precision, _ = resolve_precision(cfg.train.precision, device)  # auto: the trainer's rule (cached measurement)
    data = training_data(cfg, say=say)
    pm = ParallelModel(parts=[model], dims=ParallelDims.from_config(ParallelConfig(), 1), mesh=None,
                       device=device, vocab_limit=tokenizer.vocab_size)
    loss, batches, windows = validation_loss(pm, validation_batches(cfg, data, num_batches), precision,
                                             cfg.train.batch_size)
    bs, seq = cfg.train.batch_size, cfg.data.seq_len
    shape = (f"{batches:,} batches x {bs} x {seq} tokens" if windows == batches * bs
             else f"{windows:,} windows x {seq} tokens ({batches:,} batches)")
    where = describe_validation(cfg, data, num_batches)
    return RunScore(loss, batches, windows, f"over {shape}, {where}; precision {precision}")


@torch.no_grad()
def token_loss(model: nn.Module, tokens: torch.Tensor, seq_len: int, batch_size: int = 16,
               vocab_limit: int | None = None) -> tuple[float, int]:
    """Mean next-token loss over every full window of ``seq_len + 1`` tokens (stride seq_len).
    ``vocab_limit``: the tokenizer's vocabulary when the model's is padded; the padding columns are masked
    out as in training (``cross_entropy``). Returns (loss, tokens scored)."""
    n_windows = (tokens.numel() - 1) // seq_len
    if n_windows < 1:
        raise ConfigError(f"the text has {tokens.numel()} tokens, fewer than one window of {seq_len + 1}")
    total, count = 0.0, 0
    for first in range(0, n_windows, batch_size):
        idx = torch.arange(first, min(first + batch_size, n_windows)) * seq_len
        rows = torch.stack([tokens[i:i + seq_len + 1] for i in idx.tolist()])  # (b, T+1)
        logits = model(rows[:, :-1])
        if vocab_limit is not None and vocab_limit < logits.size(-1):
            logits = logits[..., :vocab_limit]  # the same loss as training's -inf mask on the padding columns
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum"))
        count += rows[:, 1:].numel()
    return total / count, count


def perplexity(loss: float) -> float:
    """exp(loss), infinite where it would overflow."""
    return math.exp(loss) if loss < 700 else math.inf
