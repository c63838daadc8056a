"""This machine's full calibration (``scaletrain doctor``): the rates the CPU time model multiplies by.

The cache file, the device fingerprint and the peak matmul rate live one layer down in
``scaletrain.hardware.peak`` (the trainer's MFU needs them too); this module adds the planner's curves.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from scaletrain.config import ConfigError
from scaletrain.hardware.peak import (
    CLOCKS,
    CoreContention,
    calibration_path,
    comm_fingerprint,
    device_fingerprint,
    load_calibration,
    matmul_size,
    measure_matmul_flops,
    peak_flops,
    save_calibration,
)
from scaletrain.model.config import ModelConfig
from scaletrain.model.decoder import TransformerBlock, rope_tables
from scaletrain.plan import timing
from scaletrain.plan.aten_ops import count_aten_ops
from scaletrain.plan.memory import block_activation_elements

# --------------------------------------------------------------------------------------------------
# Full calibration (``scaletrain doctor``): the rates the CPU time model multiplies by.
#
# Each rate comes from its own microbenchmark, never from the configurations the planner is later
# checked against (benchmarks/planner_accuracy.py): GEMM throughput at transformer shapes, attention
# (SDPA) throughput, cross-entropy cost per logit, AdamW cost per parameter, per-op dispatch overhead,
# and the elementwise cost per saved activation element of one reference block.
# --------------------------------------------------------------------------------------------------

# GEMM widths (sqrt(n*k)) and rows (tokens of a micro-batch), and the attention and cross-entropy shapes the
# curves are sampled at; the time model interpolates, and holds a curve's end value beyond it. The ranges
# cover the shapes plans are made for (issue 10: held-out rows with a 50k vocabulary, whose output head is
# 3.6k wide, micro-batch 1 at 128 tokens, sequence 2048 and head dim 16 fell off the ends of the old ones).
GEMM_WIDTHS = (64, 128, 256, 512, 1024, 2048, 4096)
GEMM_ROWS = (128, 1024)
ATTN_HEAD_DIMS = (16, 32, 64, 128)
ATTN_SEQ_LENS = (64, 256, 1024, 2048)
CE_VOCABS = (256, 2048, 16384, 65536)
CE_MAX_LOGITS = 1 << 24  # rows x vocab of one cross-entropy sample: fewer rows for the largest vocabularies
OPT_SIZES = (1 << 18, 1 << 21, 1 << 24)  # parameters


# The clock of the microbenchmarks: wall time, or (``calibrate(clock="cpu")``, single-threaded only) this
# process's CPU time, which other processes time-sharing the cores do not inflate.
_clock = CLOCKS["wall"]


def _best_time(fn, reps: int, warmup: int = 1) -> float:
    """Best time of ``fn`` over ``reps`` runs.

    The best, not the median: a calibration describes what the machine can do, and other work sharing the
    cores only ever adds time.
    """
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = _clock()
        fn()
        best = min(best, _clock() - t0)
    return best


def _backward_rate(flops: float, t_fwd: float, t_both: float) -> float:
    """FLOP/s of a backward timed as (forward + backward) - forward. A backward does twice the forward's
    work, so forward + backward under 1.5x forward means the forward sample was slowed by other work:
    report 0 so that another round's value wins (rounds keep the best)."""
    return flops / (t_both - t_fwd) if t_both > 1.5 * t_fwd else 0.0


def amp_context(precision: str):
    """The trainer's mixed precision (``train/precision.autocast`` on a CPU): fp32 weights, bf16 matmuls under
    ``torch.autocast``; a plain context for fp32. Entered once per timed call, as the trainer enters it once
    per forward: the casts of the fp32 weights (and their gradients back) are paid on every call."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _linear_rates(m: int, k: int, n: int, precision: str) -> tuple[float, float]:
    """(forward FLOP/s, backward FLOP/s) of a bias-free ``nn.Linear(k, n)`` on m rows: the forward GEMM and the
    backward's two (input grad and weight grad, whose shapes run differently). ``precision="bf16"``: as the
    trainer runs it under autocast (fp32 weight cast to bf16 on each call, bf16 input, the weight's gradient
    cast back to fp32)."""
    act = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k, dtype=act, requires_grad=True)
    grad = torch.randn(m, n, dtype=act)
    flops = 2.0 * m * n * k
    reps = max(3, min(40, int(2e9 / flops)))

    def fwd():
        with amp_context(precision):
            layer(x)

    def fwd_bwd():
        with amp_context(precision):
            y = layer(x)
        y.backward(grad)
        layer.weight.grad = None

    t_fwd = _best_time(fwd, reps)
    return flops / t_fwd, _backward_rate(2 * flops, t_fwd, _best_time(fwd_bwd, reps))


def measure_gemm_curve(m: int = 1024, precision: str = "fp32") -> list[list[float]]:
    """[[width, forward FLOP/s, backward FLOP/s], ...] of a bias-free ``nn.Linear(w, w)`` on m rows
    (``_linear_rates``), in ``precision``."""
    out = []
    for w in GEMM_WIDTHS:
        if m * w * w > (1 << 34):  # ~34 GFLOP a forward: enough of the widest at 1024 rows
            continue
        out.append([float(w), *_linear_rates(m, w, w, precision)])
    return out


# The output head is a GEMM of another shape than the blocks': a narrow input (the model width) to a wide output
# (the vocabulary). Its rate by input width is measured on its own: a square GEMM of the same FLOPs ran faster
# (a 128-wide model with a 32k vocabulary was under-predicted by 17% with the square curve).
HEAD_DIMS = (64, 128, 256, 512, 1024, 2048)
HEAD_VOCAB = 8192
HEAD_ROWS = 512


def measure_head_curve(precision: str = "fp32") -> list[list[float]]:
    """[[model width, forward FLOP/s, backward FLOP/s], ...] of the output head ``nn.Linear(width, HEAD_VOCAB)``
    on ``HEAD_ROWS`` rows, in ``precision``."""
    return [[float(d), *_linear_rates(HEAD_ROWS, d, HEAD_VOCAB, precision)] for d in HEAD_DIMS]


def measure_head_chunk_curve(precision: str = "fp32") -> list[list[float]]:
    """[[rows, forward FLOP/s, input-gradient FLOP/s], ...] of the chunked loss's head products on ``rows``
    positions (``timing.HEAD_CHUNK_ROWS``): hidden (rows, d) @ W^T and the logits' gradient (rows, V) @ W, W (V, d)
    of ``timing.HEAD_CHUNK_VOCAB`` x ``HEAD_CHUNK_DIM`` already in the compute dtype (model/loss.py casts it once a
    micro-batch; that cast is ``measure_weight_cast``'s), in ``precision``."""
    act = torch.bfloat16 if precision == "bf16" else torch.float32
    vocab, dim = timing.HEAD_CHUNK_VOCAB, timing.HEAD_CHUNK_DIM
    weight = torch.randn(vocab, dim, dtype=act)
    out = []
    for rows in timing.HEAD_CHUNK_ROWS:
        hidden = torch.randn(rows, dim, dtype=act)
        grad = torch.randn(rows, vocab, dtype=act)
        flops = 2.0 * rows * dim * vocab
        out.append([float(rows), flops / _best_time(lambda: hidden @ weight.t(), 3),
                    flops / _best_time(lambda: grad @ weight, 3)])
    return out


# The weight doctor casts fp32 -> bf16 (elements: the size of a family base's embedding), and the side of the NF4
# weights it dequantizes (that of a family base's projections).
WEIGHT_CAST_ELEMENTS = 1 << 26
NF4_DEQUANT_SIDE = 2048


def measure_weight_cast(n: int | None = None) -> float:
    """Seconds per element of casting an fp32 weight to a fresh bf16 tensor (what autocast and the chunked loss do
    to a frozen fp32 weight each forward): ``WEIGHT_CAST_ELEMENTS`` elements."""
    weight = torch.randn(n or WEIGHT_CAST_ELEMENTS)
    return _best_time(lambda: weight.to(torch.bfloat16), 3) / weight.numel()


def measure_nf4_dequant_rate(n: int | None = None, weights: int = 4) -> dict:
    """``nf4_dequant_s_per_element``: torchao's eager NF4 dequantization (QLoRA's frozen projections, dequantized in
    the forward and again for the input gradient) of ``weights`` distinct n x n weights (``NF4_DEQUANT_SIDE``) in
    turn, so that none is still in cache when its turn comes, as in a step (one 512 x 512 weight
    dequantized again and again measured 14 ns an element where a step of 2048 x 2048 and 4864 x 896 ones spent
    14-19); empty without torchao."""
    try:
        from scaletrain.finetune.lora import to_nf4
    except ImportError:
        return {}
    n = n or NF4_DEQUANT_SIDE
    try:
        stack = [to_nf4(torch.randn(n, n), 64, 256) for _ in range(weights)]
    except ImportError:  # torchao missing: no QLoRA to plan
        return {}

    def dequantize():
        for weight in stack:
            weight.to(torch.float32)

    return {"nf4_dequant_s_per_element": _best_time(dequantize, 5) / (weights * n * n)}


def measure_attention_curve(batch_heads: int = 16, precision: str = "fp32") -> dict[str, list[list[float]]]:
    """{head_dim: [[seq_len, fwd FLOP/s, bwd FLOP/s], ...]} of causal SDPA, counting 4*T^2*hd per head
    forward (QK^T and AV, no causal halving: the same convention as ``flops_per_token``). ``precision="bf16"``:
    q, k, v in bf16, as the projections under autocast return them."""
    import torch.nn.functional as F

    act = torch.bfloat16 if precision == "bf16" else torch.float32
    out: dict[str, list[list[float]]] = {}
    for hd in ATTN_HEAD_DIMS:
        rows = []
        for seq in ATTN_SEQ_LENS:
            bh = max(1, batch_heads * 1024 // seq) if seq > 1024 else batch_heads  # long sequences: fewer heads
            q, k, v = (torch.randn(1, bh, seq, hd, dtype=act, requires_grad=True) for _ in range(3))
            fwd_flops = 4.0 * bh * seq * seq * hd
            reps = max(3, min(20, int(1e9 / fwd_flops)))
            t_fwd = _best_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)
            grad = torch.randn(1, bh, seq, hd, dtype=act)

            def fwd_bwd():
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

            t_both = _best_time(fwd_bwd, reps)
            rows.append([float(seq), fwd_flops / t_fwd, _backward_rate(2 * fwd_flops, t_fwd, t_both)])
        out[str(hd)] = rows
    return out


def measure_cross_entropy_curve(rows: int = 1024, precision: str = "fp32") -> list[list[float]]:
    """[[vocab, seconds per logit element], ...] for cross-entropy forward + backward (log-softmax is
    transcendental-bound on CPU, not bandwidth-bound). ``precision="bf16"``: bf16 logits (the head's output
    under autocast), which autocast computes the loss of in fp32."""
    import torch.nn.functional as F

    act = torch.bfloat16 if precision == "bf16" else torch.float32
    out = []
    for vocab in CE_VOCABS:
        n = max(1, min(rows, CE_MAX_LOGITS // vocab))
        logits = torch.randn(n, vocab, dtype=act, requires_grad=True)
        target = torch.randint(0, vocab, (n,))

        def fwd_bwd():
            with amp_context(precision):
                loss = F.cross_entropy(logits, target)
            loss.backward()

        t = _best_time(fwd_bwd, 5)
        out.append([float(vocab), t / (n * vocab)])
    return out


def measure_optimizer_curve() -> list[list[float]]:
    """[[params, seconds per parameter], ...] of AdamW(fused) step + clip_grad_norm_ + zero_grad, the
    trainer's defaults, over transformer-like tensors (cost per parameter grows once states leave cache)."""
    out = []
    for n in OPT_SIZES:
        shapes = [(n // 8 // 256, 256)] * 8
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

        def step():
            for p in params:
                p.grad = torch.randn_like(p) if p.grad is None else p.grad
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()

        step()
        for p in params:
            p.grad = torch.randn_like(p)
        t = _best_time(step, 5)  # grads are reused: the step itself, not randn, is timed
        out.append([float(n), t / n])
    return out


def measure_op_overhead() -> float:
    """Seconds of dispatch per (tiny) aten op: the floor every op pays on CPU."""
    x = torch.randn(8)
    return _best_time(lambda: [torch.add(x, x) for _ in range(100)], 21) / 100


def measure_decode_op_seconds(new_tokens: int = 64) -> float:
    """Seconds per aten op of an eager cached decode step (``timing.decode_ops``): a tiny two-block model's sample
    per token, over the ops it dispatches. A decode step's ops cost far more than ``measure_op_overhead``'s bare
    add (each passes through the modules' Python and the cache's bookkeeping): 16-17 us an op of process CPU
    time on a 2-vCPU EPYC shared with other jobs, for 2 and 4 blocks alike."""
    from scaletrain.model.decoder import Transformer
    from scaletrain.model.generate import generate

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, vocab_size=256, max_seq_len=new_tokens + 1)
    model = Transformer(cfg).eval()

    def sample(tokens: int):
        return lambda: generate(model, [0], tokens, max_seq_len=cfg.max_seq_len, temperature=0.8, top_k=200,
                                generator=torch.Generator().manual_seed(0), vocab_limit=cfg.vocab_size, slide=False)

    with torch.no_grad():
        seconds = _best_time(sample(new_tokens), 5) - _best_time(sample(1), 5)
    return max(seconds, 0.0) / (new_tokens - 1) / timing.decode_ops(cfg)


def measure_checkpoint_write(folder: Path | None = None) -> dict:
    """The fixed cost (s) and write rate (bytes/s) of a checkpoint on the disk of ``folder`` (default: the cache
    folder): ``CheckpointManager.save`` of 1 MiB and 64 MiB of fp32 tensors, best of 3 each."""
    import tempfile

    from scaletrain.checkpoint.manager import CheckpointManager

    root = folder or calibration_path().parent
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="checkpoint-write-") as tmp:
        store = CheckpointManager(tmp, keep_last=1)
        times = {}
        for mib in (1, 64):
            tensors = {"weight": torch.randn(mib * 2**18)}
            best = float("inf")
            for step in range(3):
                t0 = time.perf_counter()
                store.save(mib * 10 + step, tensors, {}, {})
                best = min(best, time.perf_counter() - t0)
            times[mib] = best
    rate = 63 * 2**20 / max(times[64] - times[1], 1e-9)
    return {"checkpoint_bytes_per_s": rate, "checkpoint_latency_s": max(0.0, times[1] - 2**20 / rate)}


def measure_memory_bandwidth(n_bytes: int = 1 << 28) -> float:
    """Bytes/s of a large in-place copy (read + write), the STREAM 'copy' kernel."""
    a = torch.empty(n_bytes // 4)
    b = torch.randn(n_bytes // 4)
    t = _best_time(lambda: a.copy_(b), 5)
    return 2.0 * n_bytes / t


ELEMENTWISE_BATCHES = (1, 4, 16)

# The reference shape every block-level calibration measures: the elementwise cost here, and under torchrun
# the co-running slowdown and tensor parallelism's overhead (doctor.py). Not one of the accuracy
# benchmark's rows.
REFERENCE_SHAPE = dict(dim=384, n_heads=6, ffn_hidden_dim=1024, vocab_size=512, max_seq_len=192)


def reference_block_step(batch: int, precision: str = "fp32"):
    """``(cfg, fwd_bwd)``: one reference TransformerBlock and a closure running its forward + backward on
    ``batch`` sequences of ``max_seq_len`` tokens (gradients cleared after each call), under the trainer's
    autocast for ``precision="bf16"``."""
    cfg = ModelConfig(n_layers=1, **REFERENCE_SHAPE)
    seq = cfg.max_seq_len
    block = TransformerBlock(cfg)
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, seq, cfg.rope_theta)
    x = torch.randn(batch, seq, cfg.dim, requires_grad=True)
    grad = torch.randn(batch, seq, cfg.dim)

    def fwd_bwd() -> None:
        with amp_context(precision):
            y = block(x, cos, sin)
        y.backward(grad)
        block.zero_grad(set_to_none=True)

    return cfg, fwd_bwd


def measure_block_elementwise(entry: dict, precision: str = "fp32") -> tuple[list[list[float]], float]:
    """([[saved elements, seconds per element], ...], aten ops per block fwd+bwd) of a reference block's
    work that the GEMM and attention curves do not cover.

    The reference block (``REFERENCE_SHAPE``: dim 384, 6 heads, SwiGLU 1024, T=192, B = 1, 4, 16) is not one
    of the accuracy benchmark's rows. Its measured fwd+bwd time minus the GEMM and attention time the curves
    predict, minus per-op dispatch, divided by its saved activation elements, is the cost other shapes are
    charged at their own activation size (larger working sets fall out of cache and cost more per element).
    ``precision="bf16"``: the block under autocast against ``entry``'s bf16 curves (its casts are elementwise
    work too).
    """
    curve, n_ops = [], 0
    rates = timing.precision_rates(entry, precision)
    for batch in ELEMENTWISE_BATCHES:
        cfg, fwd_bwd = reference_block_step(batch, precision)
        seq = cfg.max_seq_len
        n_ops = count_aten_ops(fwd_bwd)
        t = _best_time(fwd_bwd, max(3, 12 // batch), warmup=1)
        predicted = timing.block_gemm_attention_seconds(cfg, batch, seq, rates, recompute=False)
        units = block_activation_elements(cfg, batch, seq)
        rest = t - predicted - n_ops * entry["op_overhead_s"]
        # Never let a noisy measurement make the elementwise cost vanish: keep at least 5% of the block.
        curve.append([float(units), max(rest, 0.05 * t) / units])
    return curve, float(n_ops)


def entry_rows(measured: dict) -> list[list[float]]:
    """The [x, forward rate, backward rate] rows of the GEMM and attention curves (for fix-ups)."""
    rows = list(measured.get("gemm_curve", [])) + list(measured.get("head_curve", []))
    for curve in measured.get("gemm_curve_by_rows", {}).values():
        rows += curve
    for curve in measured.get("attention_curve", {}).values():
        rows += curve
    return rows


def _best_of(a, b, higher_is_better: bool):
    """Merge two measurements of the same thing, point by point, keeping the better one."""
    if isinstance(a, dict):
        return {k: _best_of(a[k], b[k], higher_is_better) for k in a}
    if isinstance(a, list):
        return [_best_of(x, y, higher_is_better) if isinstance(x, list) else x for x, y in zip(a, b)] \
            if a and isinstance(a[0], list) else [a[0]] + [max(x, y) if higher_is_better else min(x, y)
                                                          for x, y in zip(a[1:], b[1:])]
    return max(a, b) if higher_is_better else min(a, b)


def calibrate(device: torch.device | str = "cpu", dtypes: tuple[str, ...] = ("fp32", "bf16"),
              log=print, rounds: int = 1, clock: str = "wall", by: str = "`scaletrain doctor`") -> dict:
    """Measure every rate the planner uses for ``device`` and cache it under its fingerprint (~10 s a round).

    ``rounds`` > 1 repeats the CPU microbenchmarks and keeps the best of each point: on cores shared with
    other work, interference only ever makes a round slower. ``clock="cpu"`` times with process CPU time
    (only meaningful with one torch thread): robust on a machine shared with other jobs. A round during which this
    process waited for a core is dropped and repeated; a calibration that still cannot be trusted (busy throughout,
    or contradicting itself: ``calibration_problems``) raises ``CalibrationError`` and is not cached. ``by``:
    what measured it, for the plan's "measured on this machine by ..." line.
    """
    global _clock
    if clock == "cpu" and torch.get_num_threads() != 1:
        raise ValueError("calibrate(clock='cpu') needs torch.set_num_threads(1): CPU time sums all threads")
    previous, _clock = _clock, CLOCKS[clock]
    try:
        return _calibrate(torch.device(device), dtypes, log, rounds, clock, by)
    finally:
        _clock = previous


class CalibrationError(ConfigError):
    """A calibration that cannot be trusted (taken on a busy machine, or contradicting itself): not cached."""


# A round whose threads waited more than this share of the time for a core (another process held it) is
# discarded on the wall clock: other work only ever adds time, and a calibration describes the machine.
QUIET_WAIT = 0.10
EXTRA_ROUNDS = 4  # busy rounds are retried this many times beyond ``rounds`` before giving up


def _quiet_rounds(measure, merge_rules: dict[str, bool], rounds: int, clock: str, log, what: str,
                  seen: dict) -> dict:
    """Run ``measure()`` (a dict of measurements) until ``rounds`` quiet rounds, merging each quiet round's
    values (``merge_rules``: key -> higher is better) point by point; a round whose threads waited more than
    ``QUIET_WAIT`` for a core is dropped and retried (up to ``EXTRA_ROUNDS`` more). On the CPU clock with one
    thread a busy round still counts (CPU time does not run while the thread waits). ``seen`` collects the
    worst wait and others' load of the kept rounds. Raises ``CalibrationError`` when no round was quiet."""
    merged: dict = {}
    kept = tried = 0
    robust = clock == "cpu" and torch.get_num_threads() == 1
    while kept < rounds and tried < rounds + EXTRA_ROUNDS:
        tried += 1
        with CoreContention() as probe:
            this = measure()
        waited = probe.waited or 0.0
        if waited > QUIET_WAIT and not robust:
            log(f"{what}: round {tried} dropped, the machine was busy (this process waited {waited:.0%} of the "
                f"time for a core; other processes used {probe.others or 0:.0%} of the CPUs)")
            continue
        kept += 1
        seen["waited"] = max(seen.get("waited", 0.0), waited)
        seen["others"] = max(seen.get("others", 0.0), probe.others or 0.0)
        for key, value in this.items():
            merged[key] = _best_of(merged[key], value, merge_rules[key]) if key in merged else value
    if not kept:
        raise CalibrationError(
            f"the machine was too busy to calibrate ({what}: in {tried} rounds this process waited for a core more "
            f"than {QUIET_WAIT:.0%} of the time): nothing was cached; rerun `scaletrain doctor` when other jobs are "
            f"done (or `scaletrain doctor --clock cpu`, one thread timed by CPU time, on a shared machine)")
    return merged


def _calibrate(device: torch.device, dtypes: tuple[str, ...], log, rounds: int, clock: str, by: str) -> dict:
    entry: dict = {}
    seen: dict = {}
    peaks = _quiet_rounds(lambda: {f"matmul_flops_{d}": measure_matmul_flops(
        device, d, n=matmul_size(device, d),  # small for CPU bf16 (AVX2: ~100x slower), large on a GPU
        min_seconds=0.3, timer=_clock) for d in dtypes}, {f"matmul_flops_{d}": True for d in dtypes},
        rounds, clock if device.type == "cpu" else "wall", log, "matmul peaks", seen)
    entry.update(peaks)
    for dtype in dtypes:
        log(f"matmul {dtype}: {entry[f'matmul_flops_{dtype}'] / 1e9:,.1f} GFLOP/s")
    if device.type == "cpu":
        rules = {"op_overhead_s": False, "memory_bandwidth": True, "gemm_curve_by_rows": True, "attention_curve": True,
                 "cross_entropy_curve": False, "optimizer_curve": False, "head_curve": True,
                 "head_chunk_curve": True, "weight_cast_s_per_element": False}
        measured = _quiet_rounds(lambda: {
            "op_overhead_s": measure_op_overhead(), "memory_bandwidth": measure_memory_bandwidth(),
            "gemm_curve_by_rows": {str(m): measure_gemm_curve(m) for m in GEMM_ROWS},
            "head_curve": measure_head_curve(), "head_chunk_curve": measure_head_chunk_curve(),
            "weight_cast_s_per_element": measure_weight_cast(),
            "attention_curve": measure_attention_curve(), "cross_entropy_curve": measure_cross_entropy_curve(),
            "optimizer_curve": measure_optimizer_curve()}, rules, rounds, clock, log, "fp32 curves", seen)
        _fill_backward_rates(measured)
        entry.update(measured)
        log(f"memory bandwidth (copy): {entry['memory_bandwidth'] / 1e9:.1f} GB/s; "
            f"op dispatch {entry['op_overhead_s'] * 1e6:.1f} us")
        # The 1024-wide GEMM of the curve is the same kernel as the peak measurement: take the better of the two.
        entry["matmul_flops_fp32"] = max(entry["matmul_flops_fp32"], max(r[1] for r in entry["gemm_curve"]))
        entry["gemm_efficiency"] = sorted(r[1] for r in entry["gemm_curve"])[len(entry["gemm_curve"]) // 2] / entry[
            "matmul_flops_fp32"]
        for m, curve in entry["gemm_curve_by_rows"].items():
            log(f"nn.Linear fwd/bwd GFLOP/s by width, {m} rows: "
                + ", ".join(f"w{int(w)} {f / 1e9:.0f}/{b / 1e9:.0f}" for w, f, b in curve))
        _calibrate_block(entry, "fp32", rounds, clock, log, seen)
        if "bf16" in dtypes and entry.get("matmul_flops_bf16", 0) >= BF16_CURVES_MIN_RATIO * entry["matmul_flops_fp32"]:
            _calibrate_bf16(entry, rounds, clock, log, seen)
        entry["threads"] = torch.get_num_threads()
        entry["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        entry["memory_bytes"] = total_ram_bytes()
        entry["decode_op_s"] = measure_decode_op_seconds()  # the samples a run draws (plan/wall.py)
        entry.update(measure_nf4_dequant_rate())  # QLoRA's frozen projections (plan/finetune.py)
        log(f"eager decode: {entry['decode_op_s'] * 1e6:.1f} us an op")
    # what a checkpoint costs on this machine's disk, the whole wall's last part (plan/wall.py)
    entry.update(measure_checkpoint_write())
    log(f"checkpoint write: {entry['checkpoint_bytes_per_s'] / 1e6:,.0f} MB/s, {entry['checkpoint_latency_s']:.3f} s a "
        f"save (the cache folder's disk)")
    entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    entry["rounds"] = rounds
    entry["clock"] = clock
    entry["measured_by"] = by
    entry["core_wait"] = seen.get("waited", 0.0)  # the load it saw: the worst kept round's wait for a core
    entry["other_processes_cpu"] = seen.get("others", 0.0)
    if device.type == "cpu":  # one core's peaks (CPU clock, robust to other jobs): what the check compares with
        for dtype in dtypes:
            peak_flops(device, dtype)
    problems = calibration_problems(entry, device)
    if problems:
        raise CalibrationError("this calibration contradicts itself, so it was not cached: " + "; ".join(problems)
                               + " (another job was probably running: rerun `scaletrain doctor` on a quiet machine)")
    key = device_fingerprint(device)
    data = load_calibration()
    data[key] = {**data.get(key, {}), **entry}
    save_calibration(data)
    return data[key]


def _fill_backward_rates(measured: dict) -> None:
    """A backward that no round could time cleanly (``_backward_rate``) is taken to run at its forward's rate
    rather than left at 0; the most rows' GEMM curve is also the plain ``gemm_curve`` (gemm_efficiency's)."""
    for row in entry_rows(measured):
        if row[2] <= 0:
            row[2] = row[1]
    measured["gemm_curve"] = measured["gemm_curve_by_rows"][str(max(GEMM_ROWS))]


# A calibration at N threads whose matmul is slower than this fraction of one core's (the trainer's own
# one-thread measurement, ``peak.peak_flops``) contradicts itself: more cores never make a large matmul
# slower on a quiet machine. And the bf16/fp32 ratio cannot differ between thread counts by more than this.
MIN_THREAD_SCALING = 0.8
MAX_RATIO_DISAGREEMENT = 3.0


def calibration_problems(entry: dict, device: torch.device | str = "cpu", cache: dict | None = None) -> list[str]:
    """What makes ``entry`` (a CPU calibration) contradict itself or this machine's one-core peaks (in ``cache``,
    the calibration file, read when not given); empty if nothing. Used before caching one (``doctor``) and
    before planning with one (``--hardware auto``)."""
    if torch.device(device).type != "cpu" or "matmul_flops_fp32" not in entry:
        return []
    one = (load_calibration() if cache is None else cache).get(device_fingerprint(device, threads=1), {})
    threads = int(entry.get("threads", torch.get_num_threads()))
    problems = []
    for dtype in ("fp32", "bf16"):
        mine, single = entry.get(f"matmul_flops_{dtype}"), one.get(f"matmul_flops_{dtype}")
        if mine and single and threads > 1 and mine < MIN_THREAD_SCALING * single:
            problems.append(f"{threads}-thread {dtype} matmul {mine / 1e9:.1f} GFLOP/s is slower than one "
                            f"thread's {single / 1e9:.1f}")
    if entry.get("matmul_flops_bf16") and one.get("matmul_flops_bf16") and one.get("matmul_flops_fp32"):
        ratio = entry["matmul_flops_bf16"] / entry["matmul_flops_fp32"]
        single = one["matmul_flops_bf16"] / one["matmul_flops_fp32"]
        if max(ratio / single, single / ratio) > MAX_RATIO_DISAGREEMENT:
            problems.append(f"bf16 runs {ratio:.2g}x fp32 with {threads} thread(s) but {single:.2g}x with one")
    gemm = entry.get("gemm_curve")
    if gemm and max(r[1] for r in gemm) > 1.5 * entry["matmul_flops_fp32"]:
        problems.append("an nn.Linear ran 1.5x faster than the matmul peak")
    return problems


# bf16 curves are measured where bf16 matmuls run at least this fraction of fp32's: on an AVX2-only core (~0.01x)
# they would take minutes, and neither the trainer's ``auto`` nor a sensible plan picks bf16 there (the time
# model then scales the fp32 curves by the matmul ratio: ``timing.precision_rates``).
BF16_CURVES_MIN_RATIO = 0.5


def _calibrate_block(entry: dict, precision: str, rounds: int, clock: str, log, seen: dict) -> None:
    """The elementwise curve and aten op count of the reference block in ``precision`` (keys suffixed
    ``_bf16`` for bf16), the best of ``rounds`` quiet rounds."""
    suffix = "" if precision == "fp32" else f"_{precision}"
    # measure_block_elementwise counts the block's aten ops too (the same number every round)
    measured = _quiet_rounds(lambda: dict(zip(("curve", "ops"), measure_block_elementwise(entry, precision))),
                             {"curve": False, "ops": False}, rounds, clock, log, f"{precision} block", seen)
    curve, ops = measured["curve"], measured["ops"]
    entry[f"elementwise_curve{suffix}"] = curve
    entry[f"elementwise_s_per_element{suffix}"] = curve[len(curve) // 2][1]
    entry[f"block_ops{suffix}"] = float(ops)
    log(f"{precision} elementwise ns per saved activation element: " + ", ".join(
        f"{units / 1e6:.1f}M: {sec * 1e9:.2f}" for units, sec in curve) + f"; {ops:.0f} ops per block fwd+bwd")


def _calibrate_bf16(entry: dict, rounds: int, clock: str, log, seen: dict) -> None:
    """The curves the CPU time model uses for ``train.precision = bf16`` (the trainer's autocast: fp32 weights
    cast per forward, bf16 GEMMs and attention, the loss in fp32): GEMM, attention, cross-entropy and the
    reference block, each as measured under autocast. The optimizer's curve is fp32's (fp32 weights)."""
    measured = _quiet_rounds(lambda: {
        "gemm_curve_by_rows": {str(m): measure_gemm_curve(m, "bf16") for m in GEMM_ROWS},
        "attention_curve": measure_attention_curve(precision="bf16"),
        "cross_entropy_curve": measure_cross_entropy_curve(precision="bf16"),
        "head_curve": measure_head_curve("bf16"), "head_chunk_curve": measure_head_chunk_curve("bf16")},
        {"gemm_curve_by_rows": True, "attention_curve": True, "cross_entropy_curve": False, "head_curve": True,
         "head_chunk_curve": True},
        rounds, clock, log,
        "bf16 curves", seen)
    _fill_backward_rates(measured)
    entry.update({f"{key}_bf16": value for key, value in measured.items()})
    # The widest bf16 GEMMs are the matmul peak's kernel at larger sizes than its 256^3: take the better.
    entry["matmul_flops_bf16"] = max(entry["matmul_flops_bf16"], max(r[1] for r in measured["gemm_curve"]))
    for m, curve in measured["gemm_curve_by_rows"].items():
        log(f"bf16 (autocast) nn.Linear fwd/bwd GFLOP/s by width, {m} rows: "
            + ", ".join(f"w{int(w)} {f / 1e9:.0f}/{b / 1e9:.0f}" for w, f, b in curve))
    _calibrate_block(entry, "bf16", rounds, clock, log, seen)


def total_ram_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def missing_calibration_line(cache: dict, device: torch.device | str = "cpu") -> str:
    """What is measured when this thread count has no calibration, and, when ``doctor --clock cpu`` calibrated
    one thread (a key of its own: rates depend on the thread count), the command that plans with that one."""
    threads = torch.get_num_threads()
    single = cache.get(device_fingerprint(device, threads=1), {})
    if threads != 1 and "elementwise_s_per_element" in single:
        return (f"no calibration of this machine at {threads} threads (torch's count here) yet: the cached one, "
                f"from `doctor --clock cpu`, is for 1 thread, which `OMP_NUM_THREADS=1 scaletrain plan ...` plans "
                f"with; measuring {threads} threads now (about a minute; `scaletrain doctor` does this too)")
    return "no calibration for this machine yet: measuring (about a minute; `scaletrain doctor` does this too)"


def calibration_entry(device: torch.device | str = "cpu", measure_if_missing: bool = True, log=print) -> dict:
    """This machine's full calibration, measuring it (~30 s) when the cache lacks it."""
    data = load_calibration()
    entry = data.get(device_fingerprint(device), {})
    if "elementwise_s_per_element" not in entry and torch.device(device).type == "cpu" and measure_if_missing:
        log(missing_calibration_line(data, device))
        entry = calibrate(device, log=log, rounds=2, by="`scaletrain plan --hardware auto` (no doctor calibration "
                                                            "was cached)")
        data = load_calibration()  # with the one-core peaks calibrate measured
    problems = calibration_problems(entry, device, data)
    if problems:  # written by an older version, or by hand: never plan with it
        raise CalibrationError(f"the cached calibration of this machine ({calibration_path()}) contradicts itself: "
                               + "; ".join(problems) + "; rerun `scaletrain doctor` on a quiet machine")
    return {**entry, **data.get(comm_fingerprint(device), {})}
