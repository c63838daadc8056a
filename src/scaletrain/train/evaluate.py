"""Evaluation, one definition each: the validation loss of a run (training's eval, ``scaletrain eval`` and
``compress --report`` all call ``validation_loss``), bits per byte beside it, and the sliding-window perplexity
of any text (``score_text``: token, word-level and bits per byte, as the Hugging Face perplexity guide defines
it). docs/evaluation.md says what each number is."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ConfigError, JobConfig, ParallelConfig
from scaletrain.data.loader import block_causal_mask
from scaletrain.data.prepare import read_text_file
from scaletrain.data.run_data import describe_validation, training_data, validation_batches
from scaletrain.data.sources import resolve_source
from scaletrain.data.tokenizer import DataError, Tokenizer, encode_known, token_byte_lengths
from scaletrain.finetune.objectives import objective_of
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.parallelize import ParallelModel
from scaletrain.train.loss import forward_loss
from scaletrain.train.precision import autocast, resolve_precision

LN2 = math.log(2)


def bits_per_byte(nll: float, num_bytes: int) -> float:
    """Summed next-token negative log-likelihood (nats) / ln 2 / the UTF-8 bytes of the text scored: the
    tokenizer-independent rate (a char model and a BPE model of the same bytes compare directly). NaN when
    nothing with bytes was scored."""
    return nll / LN2 / num_bytes if num_bytes else math.nan


def byte_table(tokenizer: Tokenizer, device: torch.device | str = "cpu") -> torch.Tensor:
    """``data.tokenizer.token_byte_lengths`` as a tensor on ``device``, to index with target ids."""
    return torch.from_numpy(token_byte_lengths(tokenizer)).to(device)


@dataclass
class ValidationScore:
    """What ``validation_loss`` measured. ``loss`` is the mean of the per-batch mean losses (the val_loss a
    run has always recorded, kept so that resumed runs and old metrics compare); ``nll`` / ``tokens`` /
    ``num_bytes`` are sums over every scored target, so ``bpb`` weighs each byte alike whatever the batch."""

    loss: float
    nll: float  # nats, summed over the scored targets
    tokens: int  # scored targets (instruction prompts, marked -100, are not)
    num_bytes: int  # UTF-8 bytes of the scored targets (special tokens: 0)
    batches: int
    windows: int

    @property
    def bpb(self) -> float:
        return bits_per_byte(self.nll, self.num_bytes)


@torch.no_grad()
def validation_loss(pm: ParallelModel, batches: Iterable[tuple[torch.Tensor, ...]], precision: str,
                    batch_size: int, token_bytes: torch.Tensor | None = None) -> ValidationScore:
    """The mean of the per-batch mean next-token losses over ``batches`` (``data.run_data.validation_batches``),
    under ``precision``'s autocast: the number a run's metrics.jsonl records as val_loss; and, from sums, bits
    per byte (``token_bytes``: ``byte_table`` of the run's tokenizer; None: bpb is NaN). A batch's summed loss
    is its mean times its scored targets (``cross_entropy`` averages over them), so tensor, pipeline and FSDP
    layouts give the sums the one loss they agree on. Every rank scores the same batches (the loss is averaged
    over data-parallel ranks); pipeline ranks pass them through their stages, which cannot cut a short last batch
    into micro-batches (skipped there). The parts are put back in the mode they were in."""
    modes = [module.training for module in pm.modules]
    for module in pm.modules:
        module.eval()
    losses, windows, nll, tokens, num_bytes = [], 0, 0.0, 0, 0
    for batch in batches:
        inputs, targets = (t.to(pm.device, non_blocking=True) for t in batch[:2])
        mask = block_causal_mask(batch[2].to(pm.device)) if len(batch) > 2 else None  # data.document_attention
        if pm.pipeline is not None and len(inputs) != batch_size:
            continue
        loss = forward_loss(pm, inputs, targets, autocast=lambda: autocast(precision, pm.device), attn_mask=mask)
        losses.append(pm.replicas.step_loss(loss, pm.dims, pm.device))
        windows += len(inputs)
        scored = targets != -100  # instruction rows mark prompt and padding targets -100
        count = int(scored.sum())
        if count:
            nll += float(losses[-1]) * count
            tokens += count
            if token_bytes is not None:
                num_bytes += int(token_bytes[targets[scored]].sum())
    for module, mode in zip(pm.modules, modes):
        module.train(mode)
    return ValidationScore(float(torch.stack(losses).mean()), nll, tokens, num_bytes if token_bytes is not None
                           else 0, len(losses), windows)


@dataclass
class RunScore:
    """A loaded run's validation score and the line that says which windows gave it."""

    score: ValidationScore
    windows_text: str  # "over 2 batches x 4 x 32 tokens, evenly spread over the val split (...); precision fp32"
    precision: str

    @property
    def loss(self) -> float:
        return self.score.loss

    @property
    def batches(self) -> int:
        return self.score.batches

    @property
    def windows(self) -> int:
        return self.score.windows

    @property
    def line(self) -> str:
        return (f"val loss {self.loss:.4f}, perplexity {perplexity(self.loss):.2f}, bpb {self.score.bpb:.4f} "
                f"{self.windows_text}")


def score_run(cfg: JobConfig, model: nn.Module, tokenizer: Tokenizer, num_batches: int | None = None,
              say: Callable[[str], None] = print, run_dir: str | Path | None = None,
              trained: JobConfig | None = None) -> RunScore:
    """The validation score of a run read back by ``checkpoint.run.load_run``, computed as training's eval computes
    it (``validation_loss`` over ``validation_batches``, under the run's precision): for the same checkpoint and
    ``num_batches`` (default train.eval_batches) it is the val_loss and val_bpb the run recorded. ``say`` hears
    data notes. ``trained``: the run's saved job when ``cfg`` overrides fields of it (the line says how training's
    windows differ)."""
    device = next(model.parameters()).device
    precision, _ = resolve_precision(cfg.train.precision, device)  # auto: the trainer's rule (cached measurement)
    data = training_data(cfg, say=say)
    pm = ParallelModel(parts=[model], dims=ParallelDims.from_config(ParallelConfig(), 1), mesh=None,
                       device=device, vocab_limit=tokenizer.vocab_size)
    # The objective's own loss (DPO/SimPO/ORPO's, finetune/objectives.py): the val loss training recorded.
    pm.objective_loss = objective_of(cfg.finetune).evaluate(pm, cfg, run_dir or cfg.train.run_dir)
    score = validation_loss(pm, validation_batches(cfg, data, num_batches), precision, cfg.train.batch_size,
                            byte_table(tokenizer, device))
    bs, seq = cfg.train.batch_size, cfg.data.seq_len
    shape = (f"{score.batches:,} batches x {bs} x {seq} tokens" if score.windows == score.batches * bs
             else f"{score.windows:,} windows x {seq} tokens ({score.batches:,} batches)")
    where = describe_validation(cfg, data, num_batches, trained)
    return RunScore(score, f"over {shape}, {where}; precision {precision}", precision)


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The Hugging Face perplexity guide's windows over ``num_tokens`` tokens, as (begin, end, first scored
    position): windows of ``context + 1`` tokens (``context`` inputs, each target sees at most ``context`` tokens
    before it) starting every ``stride`` tokens; each window scores only the targets the previous one did not,
    so every token but the first is scored exactly once, with the most context it can have (``context`` - stride
    at least, once past the first window). The guide's loop with ``max_length = context + 1``."""
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context + 1, num_tokens)
        windows.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return windows


@torch.no_grad()
def sliding_window_nll(model: nn.Module, tokens: torch.Tensor, context: int, stride: int, batch_size: int = 16,
                       vocab_limit: int | None = None) -> tuple[float, int, int]:
    """Summed next-token NLL (nats) of ``tokens`` (1-D) over ``sliding_windows``, ``batch_size`` windows of one
    length a forward. ``vocab_limit``: the tokenizer's vocabulary when the model's is padded; the padding columns
    are left out as in training (``cross_entropy``). Returns (nll, tokens scored, windows)."""
    if tokens.numel() < 2:
        raise DataError(f"the text has {tokens.numel()} token(s): scoring needs at least 2 (a context and a target)")
    device = next(model.parameters()).device
    windows = sliding_windows(tokens.numel(), context, stride)
    nll, count = 0.0, 0
    for group in _same_length_groups(windows, batch_size):
        rows = torch.stack([tokens[begin:end] for begin, end, _ in group]).to(device)  # (b, L+1)
        logits = model(rows[:, :-1])  # (b, L, V)
        if vocab_limit is not None and vocab_limit < logits.size(-1):
            logits = logits[..., :vocab_limit]  # the same loss as training's -inf mask on the padding columns
        losses = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="none")
        losses = losses.view(len(group), -1)  # (b, L): the loss of target position begin + 1 + i
        for row, (begin, end, first) in zip(losses, group):
            nll += float(row[first - begin - 1:].double().sum())
            count += end - first
    return nll, count, len(windows)


def _same_length_groups(windows: list[tuple[int, int, int]], size: int) -> Iterable[list[tuple[int, int, int]]]:
    """``windows`` in order, in runs of at most ``size`` of one length (only the last window is shorter)."""
    group: list[tuple[int, int, int]] = []
    for window in windows:
        if group and (len(group) == size or window[1] - window[0] != group[0][1] - group[0][0]):
            yield group
            group = []
        group.append(window)
    if group:
        yield group


def token_loss(model: nn.Module, tokens: torch.Tensor, seq_len: int, batch_size: int = 16,
               vocab_limit: int | None = None) -> tuple[float, int]:
    """Mean next-token loss over every full window of ``seq_len + 1`` tokens (stride seq_len, no overlap): the
    sliding windows with stride = context, cut to the full ones. Returns (loss, tokens scored)."""
    n_windows = (tokens.numel() - 1) // seq_len
    if n_windows < 1:
        raise ConfigError(f"the text has {tokens.numel()} tokens, fewer than one window of {seq_len + 1}")
    nll, count, _ = sliding_window_nll(model, tokens[:n_windows * seq_len + 1], seq_len, seq_len, batch_size,
                                       vocab_limit)
    return nll / count, count


def wikitext_words(text: str) -> int:
    """Words as the classic WikiText word-level perplexity counts them: the whitespace-separated tokens of each
    line plus one end-of-line (``<eos>``) per line (Merity et al.'s counts: 217,646 for WikiText-2's
    validation split)."""
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()  # the last line's newline ends it; it does not start another
    return sum(len(line.split()) + 1 for line in lines)


@dataclass
class TextScore:
    """The sliding-window score of a text (``score_text``)."""

    nll: float  # nats, summed over the scored tokens (all but the first)
    tokens: int
    num_bytes: int  # UTF-8 bytes of the scored tokens
    words: int  # ``wikitext_words`` of the text scored
    windows: int
    context: int
    stride: int
    skipped: Counter  # characters a char tokenizer does not know, left out (``encode_known``)

    @property
    def loss(self) -> float:
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)

    @property
    def word_perplexity(self) -> float:
        return perplexity(self.nll / self.words) if self.words else math.nan

    @property
    def bpb(self) -> float:
        return bits_per_byte(self.nll, self.num_bytes)


def check_window(context: int, stride: int, max_context: int) -> None:
    """A ConfigError unless 1 <= stride <= context <= max_context (a stride beyond the context would leave
    tokens unscored; a context beyond the rotary tables has no positions)."""
    if not 1 <= context <= max_context:
        raise ConfigError(f"--context {context}: must be between 1 and the model's model.max_seq_len ({max_context})")
    if not 1 <= stride <= context:
        raise ConfigError(f"--stride {stride}: must be between 1 and the context ({context} tokens); a larger "
                          f"stride would leave tokens unscored")


def score_text(model: nn.Module, tokenizer: Tokenizer, text: str, context: int, stride: int, batch_size: int,
               max_tokens: int | None = None, where: str = "the text") -> tuple[TextScore, torch.Tensor]:
    """Token, word-level and bits-per-byte perplexity of ``text`` with ``sliding_window_nll``; ``max_tokens``
    scores only the text's first tokens (words and bytes are then those of the part scored). Returns the score
    and the token ids scored (for an independent check of the same windows). ``where`` (the file) names the text
    when too little of it is in the vocabulary to score."""
    ids, skipped = encode_known(tokenizer, text, where, min_tokens=2)  # a char tokenizer skips what it lacks
    tokens = torch.tensor(ids, dtype=torch.long)
    if max_tokens is not None and max_tokens < tokens.numel():
        tokens = tokens[:max_tokens]
        text = tokenizer.decode(tokens.tolist())  # the part scored: its words
    nll, count, windows = sliding_window_nll(model, tokens, context, stride, batch_size, tokenizer.vocab_size)
    num_bytes = int(token_byte_lengths(tokenizer)[tokens[1:].numpy()].sum())  # every token but the first
    return TextScore(nll, count, num_bytes, wikitext_words(text), windows, context, stride, skipped), tokens


def perplexity(loss: float) -> float:
    """exp(loss), infinite where it would overflow."""
    return math.exp(loss) if loss < 700 else math.inf


def read_eval_text(spec: str) -> tuple[Path, str]:
    """(path, text) of ``eval --text``: a file, or builtin:NAME (``data.sources.BUILTIN``: builtin:wikitext-2 is
    WikiText-2's validation split). Missing, empty, not UTF-8 (UTF-16 said as such): one DataError line."""
    path = resolve_source(spec) if spec.startswith("builtin:") else Path(spec)
    if not path.is_file():
        raise DataError(f"--text {spec}: file not found" + (" (a folder; pass one text file)" if path.is_dir()
                                                             else ""))
    text = read_text_file(path)
    if not text.strip():
        raise DataError(f"--text {path}: the file is empty; there is nothing to score")
    return path, text


def relative_difference(ours: float, theirs: float) -> float:
    """|ours - theirs| / |theirs| (0 when both are 0)."""
    return abs(ours - theirs) / abs(theirs) if theirs else abs(ours)


def text_record(score: TextScore, check: tuple[float, int] | None = None) -> dict:
    """``eval --json``'s numbers for a text (and the transformers check's relative differences, when run)."""
    record = {"loss": score.loss, "perplexity": score.perplexity, "word_perplexity": score.word_perplexity,
              "bpb": score.bpb, "nll_nats": score.nll, "tokens": score.tokens, "bytes": score.num_bytes,
              "words": score.words, "windows": score.windows, "context": score.context, "stride": score.stride,
              "skipped_characters": sum(score.skipped.values())}
    if check is not None:
        nll, tokens = check
        theirs = dataclasses.replace(score, nll=nll, tokens=tokens)
        record["transformers_check"] = {
            "nll_nats": nll, "tokens": tokens, "perplexity": theirs.perplexity,
            "word_perplexity": theirs.word_perplexity, "bpb": theirs.bpb,
            "relative_difference": max(relative_difference(getattr(score, k), getattr(theirs, k))
                                       for k in ("perplexity", "word_perplexity", "bpb"))}
    return record


def text_line(name: str, score: TextScore) -> str:
    """The line ``eval --text`` prints."""
    return (f"{name}: token perplexity {score.perplexity:.3f} (loss {score.loss:.4f} over {score.tokens:,} tokens), "
            f"word perplexity {score.word_perplexity:.3f} ({score.words:,} words), bpb {score.bpb:.4f} "
            f"({score.num_bytes:,} bytes); {score.windows:,} sliding windows of {score.context} tokens of context, "
            f"stride {score.stride}")


def validation_record(run_score: RunScore, cfg: JobConfig) -> dict:
    """``eval --json``'s numbers for the validation split."""
    score = run_score.score
    return {"loss": score.loss, "perplexity": perplexity(score.loss), "bpb": score.bpb, "nll_nats": score.nll,
            "token_mean_loss": score.nll / score.tokens if score.tokens else math.nan, "tokens": score.tokens,
            "bytes": score.num_bytes, "batches": score.batches, "windows": score.windows,
            "window_tokens": cfg.data.seq_len, "scored": run_score.windows_text}
