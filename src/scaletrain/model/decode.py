"""A compiled decode: the static KV cache (``model/cache.py``'s ``StaticKVCache``) and a ``torch.compile``d
one-token step, as gpt-fast does it.

Today's decode (``KVCache``) runs each step eagerly, and each step's shapes grow by one slot, so a compiled step
would recompile at every position. Here every shape of a generation is fixed (``capacity`` slots a row, the
next slot a tensor), so the step is one graph for all positions: compiled once per (batch size, capacity, dtype)
with ``fullgraph=True`` (no graph breaks) and ``dynamic=False``; on CUDA with ``mode="reduce-overhead"`` (the
step captured in a CUDA graph and replayed: one launch instead of hundreds a token). The prefill (the prompt's
forward, its length varying) stays eager. On the CPU the step's matrix products are not ``aten::mm`` (which
reads the weights at half the memory's speed at a few rows): a batch of a model of plain float weights is
compiled with its weights frozen into the step, so inductor's C++ GEMM template runs them (register-blocked
micro-kernels over prepacked weights, ``FROZEN_CPU``); one row, and a quantized model (torchao's int8
weight-only tensors), run their Linears as fused weight-streaming loops (``StreamedLinear``; freezing would fold
int8 weights back to float) -- except int8 on a CPU without AVX-512, where inductor's int8 loops are slow: there
the one-row step streams a float16 copy of the integers (``HalfHeldLinear``) and a batch's step is frozen, its
int8 weights folded to float32 (``dequantized_in_step``). Greedy tokens equal today's
(``tests/model/test_decode_compiled.py``).

``stream(..., decoder=StaticDecoder(model))`` uses it (``scaletrain generate --compile``); a model it cannot run
(prompt tuning's embedding puts positions in front of the tokens) keeps the eager decode (``supports``).
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from scaletrain.model.cache import StaticKVCache

CAPACITY_MULTIPLE = 64  # slots: capacities rounded up to this, so prompts of nearby lengths share a compiled step
# dynamo keeps one compiled graph a (model, batch size, capacity) on the one code object of ``_forward``, and stops
# compiling it past ``recompile_limit`` (8) entries: a process that decodes with several models (a benchmark's fp32
# and int8, the tests) reaches that without any per-position recompile. The step's own limit is raised to this.
STEP_RECOMPILE_LIMIT = 64


# The CPU step of a float model: its weights frozen into the compiled graph as constants (prepacked once), every
# matrix product through inductor's C++ GEMM template (only that backend: one choice, nothing benchmarked while
# compiling). benchmarks/decode.py's 62.9M model on a 2-vCPU AVX2 EPYC: 456 tokens/s at batch 8 against 250 with
# StreamedLinear's loops (benchmarks/results/decode_avx2.json). Set as inductor's config while the step runs (it
# compiles on a call): torch.compile's options= did not freeze. The cost: the packed copy of the weights (the eager
# prefill keeps the model's own), and the step holds the weights as they were when it compiled
# (``_weights_version``).
FROZEN_CPU = dict(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP")
# Every CPU step (frozen or streamed) with inductor's C++ wrapper: the compiled graph's host code (buffer
# allocation, the kernels' calls) as C++ instead of Python. A step at one row of benchmarks/decode.py's model
# takes ~8 ms, of which the Python wrapper was ~0.5 ms (a profile): 8.09 vs 8.32 ms a step, medians of 60
# interleaved rounds of 16 steps in one process.
CPU_STEP = dict(cpp_wrapper=True)
# ... at batch 2 and more only: at one row StreamedLinear's split sums decode as fast (104.0 vs 104.7 tokens/s, the
# benchmark's first invocation on that machine) and compile faster (cold, the same model at batch 1 with two
# capacities: 17 s streamed, 36 s frozen).
FROZEN_MIN_ROWS = 2

STREAMED_ROWS = 8  # a Linear on at most this many rows is computed by ``StreamedLinear`` inside the compiled step
# One row's reduction over K split in this many parts (two accumulators a weight row): 56 vs 9 GB/s of fp32 weights
# at one row; at 8 rows one part is faster (543 vs 466 tokens/s on benchmarks/decode.py's model, 4 parts: 378).
K_SPLIT = 2


class StreamedLinear(TorchFunctionMode):
    """Inside the compiled step on the CPU: each ``F.linear`` on a few rows (a decode step's B tokens) written as a
    product and a sum that inductor fuses into one loop streaming the weight once, instead of ``aten::mm``.

    Why: a decode step is the weights read from memory once a token. At B <= 8 rows torch's ``mm`` on this CPU
    (an AMD EPYC, 2 threads) reads fp32 weights at ~17-20 GB/s, where the memory gives ~40 (llama.cpp's rate);
    and torchao's int8 weight-only linear converts the whole int8 weight to float32 every call. The fused loop
    reads each weight row once, converts int8 to float in registers, and multiplies it into every row's input
    (benchmarks/decode.py; docs/inference.md). At one row the reduction over K is split in ``K_SPLIT`` parts.

    Weights it takes: plain float tensors, and torchao's per-row ``Int8Tensor`` (weight-only: ``qdata`` int8
    (N, K), ``scale`` (N, 1); computed as torchao does, ``x @ qdata.T * scale``). Anything else (other
    subclasses, more rows, an odd K, a GPU) goes to ``F.linear`` unchanged. The sums run in another order
    than ``mm``'s (float rounding in the last bits, ~1e-6 relative)."""

    def __enter__(self):
        import torch._inductor.inductor_prims  # noqa: F401 (registers prims.inductor_force_stride_order)

        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            out = streamed_linear(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` as one weight-streaming reduction (``StreamedLinear``), or None where it
    does not apply. x (..., K), weight (N, K) -> (..., N)."""
    if type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype == x.dtype:
        return streamed(x, weight, None, bias)
    if _int8_weight_only(weight, weight.shape[-1]):
        return streamed(x, weight.qdata, weight.scale, bias)  # (N, K) int8, (N, 1)
    return None


def streamed(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None,
             bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ values.T (* scale) (+ bias)`` streaming ``values`` (N, K) once, each converted to x's dtype in
    registers (float, or integers held as int8 or float16), ``scale`` (N, 1) after the sum as torchao orders it;
    None where it does not apply (a GPU, more than ``STREAMED_ROWS`` rows, an odd K at one row)."""
    n, k = values.shape[0], values.shape[-1]
    rows = x.numel() // max(k, 1)
    split = K_SPLIT if rows == 1 else 1
    if x.device.type != "cpu" or rows > STREAMED_ROWS or k % split or not x.dtype.is_floating_point:
        return None
    # The input as its own buffer: inlined into the loop (the norm before a projection, SwiGLU's product) it would
    # be recomputed for every weight row, and inductor then tiles the loop differently (seen: 10-100x slower).
    inputs = torch.ops.prims.inductor_force_stride_order(x.reshape(rows, k), (k, 1))  # (rows, K)
    parts = values.view(n, 1, split, k // split).to(x.dtype) * inputs.view(1, rows, split, k // split)
    out = parts.sum(-1).sum(-1)  # (N, rows): weight row n stays in cache while every input row uses it
    if scale is not None:
        out = out * scale.view(n, 1).to(out.dtype)
    out = out.t().reshape(*x.shape[:-1], n)
    return out if bias is None else out + bias


def _int8_weight_only(weight: torch.Tensor, k: int) -> bool:
    """torchao's ``Int8Tensor`` quantized per row, weight-only (no activation quantization, no pre-scale)."""
    qdata = getattr(weight, "qdata", None)
    return (type(weight).__name__ == "Int8Tensor" and qdata is not None and qdata.dtype == torch.int8
            and list(getattr(weight, "block_size", ())) == [1, k] and getattr(weight, "act_quant_kwargs", 0) is None
            and getattr(weight, "act_pre_scale", 0) is None)


def plain_weights(model: nn.Module) -> bool:
    """Whether every parameter is a plain float tensor (no quantized subclass): the frozen CPU step's models."""
    return all(type(p) in (torch.Tensor, nn.Parameter) and p.dtype.is_floating_point for p in model.parameters())


class HalfHeldLinear(nn.Module):
    """A Linear of torchao's per-row int8 weight-only tensor, its integers held as float16 (each of -128..127
    exact, as the int8 value) for the one-row step on a CPU without AVX-512 (``half_held``): streamed
    (``streamed``) as the int8 values would be, the same products in the same order, but through float16 loads
    and AVX2's float16 conversion (one instruction), where inductor's int8 loads are 4-9x slower than its float
    ones. Half the bytes of the float32 copy the frozen step folds, so half the memory read a token: on
    benchmarks/decode.py's model, 166.5 tokens/s against 123.6 with the float32 fold and 152.0 holding them as
    bfloat16 (medians of five interleaved rounds in one process, a 2-vCPU AVX2 EPYC; docs/inference.md)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight
        self.register_buffer("values", weight.qdata.to(torch.float16), persistent=False)  # (N, K)
        self.register_buffer("scale", weight.scale.reshape(-1, 1), persistent=False)  # (N, 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = streamed(x, self.values, self.scale, self.bias)
        if out is None:  # more rows: the same product as one matrix (not the one-row step's case)
            out = F.linear(x, self.values.to(x.dtype)) * self.scale.view(-1).to(x.dtype)
            out = out if self.bias is None else out + self.bias
        return out


def half_held(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules sharing every parameter and buffer, its int8 weight-only Linears replaced by
    ``HalfHeldLinear`` (the only new tensors: their float16 values and scales)."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, shared)
    for module in list(clone.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and _int8_weight_only(child.weight, child.in_features):
                setattr(module, name, HalfHeldLinear(child))
    return clone


class _Step(nn.Module):
    """The one-token step as a module: freezing finds the weights to fold through the compiled module's own."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """tokens (B, 1) -> the next logits (B, V), the cache written at its slot."""
        return self.model(tokens, cache=cache, last_only=True)[:, -1]


def quantized_weights(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that are not plain tensors (torchao's quantized subclasses)."""
    return [p for p in model.parameters() if type(p) not in (torch.Tensor, nn.Parameter)]


def int8_weight_only(model: nn.Module) -> bool:
    """Whether the model is quantized, every quantized weight torchao's per-row int8 weight-only tensor."""
    quantized = quantized_weights(model)
    return bool(quantized) and all(_int8_weight_only(p, p.shape[-1]) for p in quantized)


def dequantized_bytes(model: nn.Module, itemsize: int = 4) -> int:
    """The bytes of ``model``'s quantized weights held as floats of ``itemsize`` bytes: what a step that folds them
    to float32 holds (4), or the one-row step's float16 copy (2, ``half_held``)."""
    return itemsize * sum(p.numel() for p in quantized_weights(model))


def avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def dequantized_in_step(model: nn.Module) -> bool:
    """Whether the CPU step holds ``model``'s int8 weights as floats: int8 weight-only on a CPU without AVX-512,
    where inductor's int8 kernels run slower than the eager decode (``slower_than_eager``). At one row the step
    streams a float16 copy of the integers (``half_held``: exact); at ``FROZEN_MIN_ROWS`` rows and more it is
    compiled frozen, as a float model's, and freezing folds ``qdata.to(float32)`` into a constant and keeps
    ``* scale`` in the graph, torchao's own order. Either way the tokens are the eager int8 decode's; the cost is
    the copy while the decoder lives (2x the int8 bytes at one row, 4x packed at more), each made at its first
    step."""
    return next(model.parameters()).device.type == "cpu" and int8_weight_only(model) and not avx512()


def slower_than_eager(model: nn.Module) -> str:
    """Why the compiled step would decode ``model`` slower than the eager decode on this machine ('' when it
    would not): quantized weights on a CPU without AVX-512, other than int8 weight-only (which the step holds
    dequantized there: ``dequantized_in_step``). There inductor's kernel for an int8 weight runs 4-9x
    slower than the fp32 one at the same shape (8-lane partial loads of a 32-lane int8 vector before the
    conversion; other formulations measured no better), and the streamed step ran 26 tokens/s against the eager
    decode's 31-56 at batch 1, 31 against 131-179 at batch 8 (benchmarks/decode.py, a 2-vCPU AVX2 EPYC; on an
    AVX-512 EPYC it ran 345 and 568, 8x and 2.7x the eager)."""
    if next(model.parameters()).device.type != "cpu" or plain_weights(model) or dequantized_in_step(model):
        return ""
    if avx512():
        return ""
    return ("its quantized weights on a CPU without AVX-512, where inductor's int8 kernels run far below its fp32 "
            "ones (the compiled step measured 2-6x slower than the eager decode)")


def supports(model: nn.Module) -> str:
    """Why ``model`` cannot decode with the static cache ('' when it can)."""
    if any(getattr(m, "takes_cache", False) for m in (getattr(model, "tok_embeddings", None),
                                                       getattr(model, "output", None))):
        return "prompt tuning's virtual tokens change the sequence length at the first forward"
    if getattr(model, "tok_embeddings", None) is None or getattr(model, "output", None) is None:
        return "a pipeline stage is not a whole model"
    return ""


def static_capacity(prompt_width: int, max_new_tokens: int, max_seq_len: int) -> int:
    """The slots a generation needs (the prompt and every new token but the last), rounded up to
    ``CAPACITY_MULTIPLE``, at most the context ``max_seq_len`` (past it ``stream`` slides, eagerly)."""
    needed = prompt_width + max(max_new_tokens, 1)
    return min(max_seq_len, -(-needed // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE)


class StaticDecoder:
    """Holds the compiled step and the static caches of one model (a cache a shape, reused: a CUDA graph replays
    on the same buffers). ``compile=False``: the same static cache, eager (for comparisons)."""

    def __init__(self, model: nn.Module, compile: bool = True, mode: str | None = None, capacity: int = 0,
                 freeze: bool | None = None):
        reason = supports(model)
        if reason:
            raise ValueError(f"the compiled decode cannot run this model: {reason}")
        self.model = model
        self.device = next(model.parameters()).device
        self.cuda_graphs = compile and self.device.type == "cuda" and mode in (None, "reduce-overhead")
        self.mode = mode or ("reduce-overhead" if self.device.type == "cuda" else None)
        # On the CPU a float model's step at FROZEN_MIN_ROWS rows or more is compiled with its weights frozen in
        # (FROZEN_CPU), and so is an int8 weight-only model's where inductor's int8 kernels are slow
        # (dequantized_in_step); at one row, other quantized models, or with ``freeze=False`` (no packed copy of
        # the weights), through StreamedLinear -- the int8 model then over its float16 copy (``held``)
        cpu_step = compile and self.device.type == "cpu" and mode is None
        may_freeze = cpu_step and freeze is not False
        self.held = cpu_step and dequantized_in_step(model)
        self.frozen = may_freeze and (plain_weights(model) or self.held)
        self._compile = compile
        self._module = _Step(model)
        self._build_step()
        self._caches: dict[tuple[int, int], StaticKVCache] = {}
        # ``capacity`` > 0: every generation gets these slots (chat: the whole context), so the growing prompts of
        # a conversation share one compiled step instead of compiling one a 64-slot rounding (seconds each)
        self.fixed_capacity = capacity

    def capacity(self, prompt_width: int, max_new_tokens: int, max_seq_len: int) -> int:
        """The slots of a generation's cache: the fixed capacity where it holds this one, else
        ``static_capacity``'s rounding."""
        needed = static_capacity(prompt_width, max_new_tokens, max_seq_len)
        return self.fixed_capacity if self.fixed_capacity >= needed else needed

    def _build_step(self) -> None:
        self._frozen_step = torch.compile(self._module, fullgraph=True, dynamic=False) if self.frozen else None
        self._step = (torch.compile(self._forward, fullgraph=True, dynamic=False, mode=self.mode) if self._compile
                      else self._forward)
        self._held: _Step | None = None  # the half_held copy, made at the first step that streams it
        self._version = self._weights_version()

    def _weights_version(self) -> int:
        """The sum of the parameters' in-place write counters: it moves when an optimizer step or a load writes
        them, after which a frozen step (which holds the weights it compiled with) is compiled again and the
        float16 copy made again."""
        return sum(p._version for p in self.model.parameters()) if self.frozen or self.held else 0

    def _forward(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        with StreamedLinear():
            return (self._held if self.held else self._module)(tokens, cache)

    def cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        """An empty cache of this shape (the one made before for it, reset: same buffers, no recompile)."""
        if self._weights_version() != self._version:  # the weights changed since the frozen step compiled:
            # its guards check the parameters' identity, not their values, so only a reset of dynamo's caches
            # (every compiled function of the process recompiles on its next call) drops the stale graph
            torch.compiler.reset()
            self._build_step()
        key = (batch_size, capacity)
        if key not in self._caches:  # kept: a CUDA graph replays on these very buffers (a new one re-records)
            self._caches[key] = StaticKVCache(batch_size, capacity, self.device)
        cache = self._caches[key]
        cache.slot.zero_()
        cache.tokens = 0
        return cache

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, padding: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """tokens, padding (B, T) (left padding, ``generate.left_pad``) -> the last position's logits (B, V), eager."""
        logits = self.model(tokens, cache=cache, padding=padding, last_only=True)[:, -1]
        cache.tokens += tokens.shape[1]
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """tokens (B, 1), each row's last token -> the next logits (B, V): the compiled step."""
        if cache.tokens >= cache.capacity:
            raise ValueError(f"static KV cache full: {cache.tokens} of {cache.capacity} slots")
        logits = self.run_step(tokens, cache)
        cache.tokens += 1
        return logits

    @torch.no_grad()
    def run_step(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """The compiled one-token step over any cache whose shapes stay fixed from step to step (a
        ``StaticKVCache``; ``infer/batch.py``'s ``SlotCache`` at its whole slot count): tokens (B, 1) -> the next
        logits (B, V); the cache's own bookkeeping (``step``'s count of tokens) is the caller's."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are read: reuse its memory
        frozen = self._frozen_step is not None and tokens.shape[0] >= FROZEN_MIN_ROWS
        if self.held and not frozen and self._held is None:
            self._held = _Step(half_held(self.model))
        config = {**(CPU_STEP if self.device.type == "cpu" and self._compile else {}), **(FROZEN_CPU if frozen else {})}
        with torch._dynamo.config.patch(recompile_limit=STEP_RECOMPILE_LIMIT), inductor_config.patch(**config):
            logits = (self._frozen_step if frozen else self._step)(tokens, cache)
        return logits.clone() if self.cuda_graphs else logits  # the graph's output buffer is rewritten next replay
