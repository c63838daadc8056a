"""Autoregressive generation with a KV cache: batched, streamed, greedy or sampled.

``stream`` is the one loop; ``generate`` (one prompt) and ``generate_batch`` (several) collect what it yields.
With the cache (the default) the prompts are prefilled once and each step runs the model on one new token a
row; ``use_cache=False`` re-runs each row's whole context at every step (the reference the tests compare to).

Prompts of different lengths share a batch by **left padding** (``model/cache.py``): padding slots are never
attended to and do not count as positions, so each row is computed as if it were alone (greedy tokens equal
to generating each prompt alone; the floating-point sums differ in the last bits).

The context is the one the model was trained on (``max_seq_len``: pass ``data.seq_len``). A prompt longer
than it is refused. With ``slide=False`` a row ends once prompt + generated tokens fill the context: every
token is then one cached step (training's samples, ``scaletrain generate`` by default). With ``slide=True``
every further step re-runs the last ``max_seq_len`` tokens of each row (a sliding window, as without the
cache: no speed-up past the context, a whole window's forward per token).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.core.options import ConfigError
from scaletrain.model.cache import KVCache, StaticKVCache
from scaletrain.model.decode import StaticDecoder


@dataclass
class Sampling:
    """How the next token is chosen from the logits."""

    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # sample among the k most likely tokens; 0 = all
    top_p: float = 1.0  # nucleus: the smallest set of tokens holding this probability mass; 1 = off
    repetition_penalty: float = 1.0  # CTRL's: logits of tokens already in the row / p if > 0, else * p; 1 = off

    def check(self) -> None:
        """Each value in its range, one ConfigError naming the first that is not (NaN and infinity included: they
        would reach ``torch.multinomial`` as a probability tensor it refuses, or sample uniform noise)."""
        rules = [("--temperature", self.temperature, self.temperature >= 0, ">= 0 (0 = greedy)"),
                 ("--top-k", self.top_k, self.top_k >= 0, ">= 0 (0 = all tokens)"),
                 ("--top-p", self.top_p, 0 < self.top_p <= 1, "in (0, 1] (1 = off)"),
                 ("--repetition-penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0 (1 = off)")]
        for flag, value, ok, rule in rules:
            if not (math.isfinite(value) and ok):
                raise ConfigError(f"{flag} must be a finite number {rule} (got {value})")


def penalize_repetition(logits: torch.Tensor, rows: list[list[int]], penalty: float) -> torch.Tensor:
    """logits (B, V): each row's logits of the tokens it already holds made less likely (CTRL, Keskar et al.
    2019; Hugging Face's ``repetition_penalty``)."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids = torch.tensor([t for t in row if t < logits.shape[-1]], dtype=torch.long, device=logits.device)
        seen[i, ids] = True
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) float -> next tokens (B, 1): greedy at temperature 0, else sampled after top-k / top-p."""
    if sampling.temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.size(-1))).values[:, -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop tokens once the mass before them already reaches top_p (always keep the first).
        drop = cumulative - sorted_logits.softmax(-1) >= sampling.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator).to(logits.device)


def left_pad(rows: list[list[int]], device: torch.device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, L), padding (B, L) bool): the rows right-aligned, ``pad_id`` in front of the shorter ones."""
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    padding = torch.ones(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            tokens[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            padding[i, width - len(row):] = False
    return tokens.to(device), padding.to(device)


def _next_logits(model: nn.Module, rows: list[list[int]], cache: KVCache | StaticKVCache | None, max_seq_len: int,
                 use_cache: bool, device: torch.device, decoder: StaticDecoder | None = None,
                 max_new_tokens: int = 0) -> tuple[torch.Tensor, KVCache | StaticKVCache | None]:
    """(the last position's logits (B, V) of every row, the cache to go on with) for one generation step;
    ``decoder``: the first context through its static cache (eager prefill, then its compiled step)."""
    if not use_cache:  # the whole context of each row, one row at a time
        return torch.cat([model(torch.tensor([r[-max_seq_len:]], device=device))[:, -1] for r in rows]), cache
    if cache is not None and cache.tokens >= max_seq_len and min(map(len, rows)) >= max_seq_len:
        # Every row fills the context: from now on each step is a whole-window forward (the window slides by one
        # token), so the plain causal forward, without filling a cache that would be dropped at once.
        window = torch.tensor([r[-max_seq_len:] for r in rows], dtype=torch.long, device=device)
        return model(window, last_only=True)[:, -1], cache
    if cache is None and decoder is not None:  # the static cache's prefill (eager)
        tokens, padding = left_pad(rows, device)
        cache = decoder.cache(len(rows), decoder.capacity(tokens.shape[1], max_new_tokens, max_seq_len))
        return decoder.prefill(tokens, padding, cache), cache
    if cache is None or cache.tokens >= max_seq_len:  # prefill (again, once the context is full)
        tokens, padding = left_pad([r[-max_seq_len:] for r in rows], device)
        cache = KVCache(len(rows), max_seq_len)
        return model(tokens, cache=cache, padding=padding, last_only=True)[:, -1], cache
    last = torch.tensor([[r[-1]] for r in rows], dtype=torch.long, device=device)  # (B, 1)
    if isinstance(cache, StaticKVCache):
        return decoder.step(last, cache), cache
    return model(last, cache=cache, last_only=True)[:, -1], cache


@torch.no_grad()
def stream(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, *, max_seq_len: int,
           sampling: Sampling | None = None, generator: torch.Generator | None = None,
           stop_id: int | Collection[int] | None = None,
           vocab_limit: int | None = None, stop: Callable[[int, list[int]], bool] | None = None,
           use_cache: bool = True, slide: bool = True, decoder: StaticDecoder | None = None
           ) -> Iterator[list[tuple[int, int]]]:
    """Yield, at each step, [(row, token)] for the rows still going. A row ends after ``max_new_tokens``, at
    ``stop_id`` (one id or several, e.g. a chat template's end of turn and the EOS; not yielded), when
    ``stop(row, its new tokens)`` says so (the token that made it is yielded), or, with ``slide=False``, once
    it fills the context. ``vocab_limit``: only ids below it are produced (the tokenizer's vocabulary when the
    model's is padded). ``max_seq_len``: the trained context (see the module docstring). ``decoder``: the first
    context's decode through its static cache and compiled step (``model/decode.py``; same tokens), the
    rest (sliding past the context) as without."""
    sampling = sampling or Sampling(temperature=0.0)
    sampling.check()
    stop_ids = set() if stop_id is None else {stop_id} if isinstance(stop_id, int) else set(stop_id)
    too_long = [i for i, p in enumerate(prompts) if len(p) > max_seq_len]
    if too_long:
        raise ConfigError(f"prompt {too_long[0] + 1} is {len(prompts[too_long[0]])} tokens, longer than the "
                          f"model's context of {max_seq_len} tokens (data.seq_len); shorten it")
    if any(not p for p in prompts):
        raise ConfigError("a prompt is empty (no tokens)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    going = list(range(len(rows)))
    cache: KVCache | None = None
    try:
        for _ in range(max_new_tokens):
            if not going:
                break
            logits, cache = _next_logits(model, rows, cache, max_seq_len, use_cache, device, decoder, max_new_tokens)
            logits = logits[:, :vocab_limit].float()  # (B, V): padding rows of the vocabulary never compete
            if sampling.repetition_penalty != 1.0:
                logits = penalize_repetition(logits, rows, sampling.repetition_penalty)
            chosen = choose(logits, sampling, generator).view(-1).tolist()
            out = []
            for i, token in enumerate(chosen):
                rows[i].append(token)  # every row advances (a finished one too, unread) to keep the batch aligned
                if i not in going:
                    continue
                if token in stop_ids:
                    going.remove(i)
                    continue
                new[i].append(token)
                out.append((i, token))
                if (stop is not None and stop(i, new[i])) or (not slide and len(rows[i]) > max_seq_len):
                    going.remove(i)
            yield out
    finally:
        model.train(was_training)


def generate_batch(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    """The new tokens of every prompt (see ``stream`` for the arguments)."""
    new: list[list[int]] = [[] for _ in prompts]
    for step in stream(model, prompts, max_new_tokens, **kw):
        for row, token in step:
            new[row].append(token)
    return new


def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, *, max_seq_len: int,
             temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, stop_id: int | Collection[int] | None = None,
             vocab_limit: int | None = None, use_cache: bool = True, slide: bool = True,
             decoder: StaticDecoder | None = None) -> list[int]:
    """Sample up to ``max_new_tokens`` after ``prompt``; temperature 0 is greedy. Returns only the new tokens."""
    return generate_batch(model, [prompt], max_new_tokens, max_seq_len=max_seq_len,
                          sampling=Sampling(temperature, top_k, top_p), generator=generator, stop_id=stop_id,
                          vocab_limit=vocab_limit, use_cache=use_cache, slide=slide, decoder=decoder)[0]


def stop_at_strings(decode: Callable[[list[int]], str], stops: list[str]) -> Callable[[int, list[int]], bool]:
    """A ``stop`` for ``stream``: a row ends once its decoded text holds one of ``stops``."""
    if any(not s for s in stops):
        raise ConfigError("--stop: a stop string must not be empty")
    return lambda _row, tokens: any(s in decode(tokens) for s in stops)


def cut_at_stop(text: str, stops: list[str]) -> str:
    """``text`` up to (not including) the first stop string in it."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[:min(cuts)] if cuts else text


@torch.no_grad()
def decode_speed(model: nn.Module, vocab_size: int, prompt_tokens: int, new_tokens: int, batch_size: int = 1,
                 use_cache: bool = True, seed: int = 0, max_seq_len: int | None = None,
                 decoder: StaticDecoder | None = None) -> dict[str, float]:
    """Prefill and decode tokens/s of greedy generation: ``batch_size`` random prompts of ``prompt_tokens``,
    ``new_tokens`` generated each (no stop token). Prefill = the first step (the prompt's forward and the first
    token); decode = the rest, per generated token of all rows. ``max_seq_len``: the context (default: prompt +
    new tokens; a shorter one slides, as ``stream`` does). ``decoder``: the compiled decode (``model/decode.py``;
    compile it first with a run of the same shape: this times the steps, not the compiling)."""
    rng = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab_size, (batch_size, prompt_tokens), generator=rng).tolist()
    steps = stream(model, prompts, new_tokens, max_seq_len=max_seq_len or prompt_tokens + new_tokens,
                   vocab_limit=vocab_size, use_cache=use_cache, decoder=decoder)
    start = time.perf_counter()
    next(steps)
    prefilled = time.perf_counter()
    generated = sum(len(step) for step in steps)
    end = time.perf_counter()
    return {"prefill_tokens_per_second": batch_size * prompt_tokens / (prefilled - start),
            "decode_tokens_per_second": generated / (end - prefilled) if generated else 0.0,
            "prefill_seconds": prefilled - start, "decode_seconds": end - prefilled}


def decode_report(model: nn.Module, vocab_size: int, prompt_tokens: int, new_tokens: int, max_seq_len: int,
                  batch_sizes: tuple[int, ...] = (1, 8)) -> dict[str, float]:
    """``decode_speed`` with the KV cache at each batch size, as flat fields for a report row
    (``prefill_tokens_per_s_batch1``, ``decode_tokens_per_s_batch1``, ... ``_batch8``); one warm-up step first."""
    decode_speed(model, vocab_size, prompt_tokens, 2, max_seq_len=max_seq_len)
    row = {}
    for batch in batch_sizes:
        rates = decode_speed(model, vocab_size, prompt_tokens, new_tokens, batch_size=batch, max_seq_len=max_seq_len)
        row[f"prefill_tokens_per_s_batch{batch}"] = rates["prefill_tokens_per_second"]
        row[f"decode_tokens_per_s_batch{batch}"] = rates["decode_tokens_per_second"]
    return row
