"""Step time: compute at a calibrated rate, plus communication from link bandwidths, plus pipeline bubbles.

GPU: ``model FLOPs executed / (peak FLOP/s of the dtype x achievable utilisation)``; the utilisation is an
MFU fitted to published runs (``gpu_utilisation``: a ceiling per device kind, lower for narrow models and for
attention's share of the FLOPs; the fit and its sources are in the catalog and benchmarks/gpu_utilisation.py)
and already contains the elementwise work, so nothing is added.

CPU: every term is a measured rate from ``scaletrain doctor`` (calibration.py), charged per operation of
scaletrain's Llama block: GEMMs at the throughput measured for their width, causal SDPA at the rate
measured for its head_dim and length, elementwise work at the measured cost per saved activation element,
aten dispatch at the measured per-op overhead, cross-entropy per logit and AdamW per parameter.
Recomputation (activation checkpointing) pays what torch.utils.checkpoint recomputes: a checkpointed block's
forward but its last GEMM (``RECOMPUTED_GEMMS``). Nothing is fitted to the checked rows.

Muon (``Workload.optimizer``): its Newton-Schulz FLOPs over every whole matrix, at the measured fp32 GEMM rates
(CPU) or the bf16 peak x the GEMM utilisation (GPU), added to the optimizer step (``newton_schulz_seconds``),
and under FSDP2 one all-gather of the Muon matrices a step.

Communication: ring collectives, ``2(n-1)/n`` of the bytes for all-reduce and ``(n-1)/n`` for all-gather /
reduce-scatter, over the slowest link the group spans (NVLink/PCIe within a node, InfiniBand/Ethernet
across). On GPUs data-parallel traffic overlaps the backward (FSDP: forward too); tensor-, pipeline- and
context-parallel traffic is exposed. On CPU (gloo) the same cores compute and communicate: none overlaps.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import inspect
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from scaletrain.config import ConfigError, ModelConfig
from scaletrain.hardware.allocator import GLIBC_MMAP_THRESHOLD_MAX
from scaletrain.hardware.catalog import LINKS, Cluster, Hardware
from scaletrain.hardware.peak import devices_in_job
from scaletrain.model.config import head_width, is_moe_layer
from scaletrain.model.decoder import TransformerBlock, rope_tables
from scaletrain.model.presets import expert_hidden_dim, ffn_hidden_dim, flops_per_token, kv_heads
from scaletrain.plan.aten_ops import count_aten_ops
from scaletrain.plan.memory import (
    MOE_LOAD_IMBALANCE,
    RECIPES,
    block_activation_elements,
    checkpointed_blocks,
    loss_rows,
    masked_attention_layers,
    moe_activation_bytes,
    muon_shapes,
    rank_block_params,
    routed_rows,
    stage_params,
)
from scaletrain.plan.workload import Plan, Workload
from scaletrain.train.metrics import mfu
from scaletrain.train.muon import CHUNK_ELEMENTS

# aten ops one scaletrain block dispatches in forward + backward (aten_ops.count_aten_ops; 206 on
# torch 2.13) and the host-side cost of launching one CUDA kernel (a few microseconds, per NVIDIA's CUDA
# C++ Best Practices Guide; 5 us is typical of eager PyTorch).
OPS_PER_BLOCK = 206
GPU_LAUNCH_SECONDS = 5e-6

# aten ops of one cached decode step (timing.decode_ops), counted with aten_ops.count_aten_ops on torch 2.13
# (tests/plan/test_plan_wall.py counts them again): a Llama block's one-token forward with a KVCache, and the rest of
# the step: the embedding, final norm and last position's head (34), and the sample's draw (11: temperature,
# top-k, softmax, multinomial, the next input). Counted, not imported here: counting loads DTensor, which
# `scaletrain plan` must not pay for.
DECODE_OPS_PER_BLOCK = 74
DECODE_OPS_OTHER = 45

# Parameter tensors of one block (wq, wk, wv, wo, w1, w2, w3, two norms), and the foreach ops of one
# AdamW step plus clip_grad_norm_ (step count, weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv;
# norm, mul) -- read from torch.optim.adam._multi_tensor_adam and torch.nn.utils.clip_grad.
PARAM_TENSORS_PER_BLOCK = 9
FOREACH_OPS_PER_STEP = 11

DTYPE_OF_PRECISION = {"fp32": "fp32", "bf16": "bf16", "mixed": "bf16", "fp16": "fp16"}


def interp_curve(curve: list[list[float]], x: float, column: int = 1, log_y: bool = True) -> float:
    """Piecewise-linear interpolation in log(x) (clamped at the ends) of a measured curve."""
    xs = [row[0] for row in curve]
    ys = [row[column] for row in curve]
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    w = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    if log_y:
        return math.exp((1 - w) * math.log(ys[i - 1]) + w * math.log(ys[i]))
    return (1 - w) * ys[i - 1] + w * ys[i]


# The calibration keys whose bf16 version (``KEY_bf16``: measured under the trainer's autocast) replaces them when
# the step runs in bf16; the optimizer's and the dispatch rates are the same (fp32 weights, same ops).
BF16_KEYS = ("gemm_curve_by_rows", "gemm_curve", "attention_curve", "cross_entropy_curve", "elementwise_curve",
             "elementwise_s_per_element", "block_ops")
# and those a bf16 step reads only in their bf16 version when it has one (never fp32's rates for a bf16 head)
BF16_OPTIONAL = ("head_curve", "head_chunk_curve")


def precision_rates(entry: dict, precision: str) -> dict:
    """The calibration ``entry`` as the CPU time model reads it for a step in ``precision``: for bf16 (mixed),
    the curves measured under autocast. A calibration without them (older, or a CPU whose bf16 matmuls are too
    slow to be worth measuring) gets its fp32 GEMM and attention rates scaled by the measured bf16/fp32 matmul
    ratio, the rest unchanged."""
    if DTYPE_OF_PRECISION.get(precision, "fp32") != "bf16" or "gemm_curve" not in entry:
        return entry
    if all(f"{key}_bf16" in entry for key in BF16_KEYS):
        optional = {key: entry[f"{key}_bf16"] for key in BF16_OPTIONAL if f"{key}_bf16" in entry}
        return {**{k: v for k, v in entry.items() if k not in BF16_OPTIONAL}, **optional,
                **{key: entry[f"{key}_bf16"] for key in BF16_KEYS}}
    ratio = float(entry.get("matmul_flops_bf16", 0.0)) / float(entry.get("matmul_flops_fp32", 1.0))
    if ratio <= 0:
        return entry

    def scaled(curve: list[list[float]]) -> list[list[float]]:
        return [[row[0], *(rate * ratio for rate in row[1:])] for row in curve]

    rates = {**entry, "gemm_curve": scaled(entry["gemm_curve"]),
             "attention_curve": {hd: scaled(c) for hd, c in entry.get("attention_curve", {}).items()}}
    for key in BF16_OPTIONAL:
        if key in entry:
            rates[key] = scaled(entry[key])
    if "gemm_curve_by_rows" in entry:
        rates["gemm_curve_by_rows"] = {m: scaled(c) for m, c in entry["gemm_curve_by_rows"].items()}
    return rates


def gemm_rate(entry: dict, width: float, rows: float, backward: bool = False) -> float:
    """FLOP/s of an ``nn.Linear`` of ``width`` on ``rows`` rows: the curves measured at several row counts
    (``gemm_curve_by_rows``) interpolated in log(rows), held beyond them; older calibrations have one curve."""
    column = 2 if backward else 1
    by_rows = entry.get("gemm_curve_by_rows")
    if not by_rows:
        return interp_curve(entry["gemm_curve"], width, column)
    points = sorted((float(m), interp_curve(curve, width, column)) for m, curve in by_rows.items())
    return interp_curve([[m, rate] for m, rate in points], rows)


def gemm_seconds(m: int, n: int, k: int, entry: dict, backward: bool = False) -> float:
    """A linear layer's forward GEMM (m x k) @ (k x n), or its two backward GEMMs, on CPU at the throughput
    measured for an ``nn.Linear`` of width sqrt(n*k) on m rows."""
    flops = 2.0 * m * n * k * (2 if backward else 1)
    return flops / gemm_rate(entry, math.sqrt(n * k), m, backward)


def head_gemm_seconds(tokens: int, vocab: int, dim: int, entry: dict, backward: bool = False) -> float:
    """The output head's forward GEMM (tokens x dim) @ (dim x vocab), or its two backward GEMMs, at the rate
    measured for the head's shape by model width (``head_curve``); older calibrations: the square GEMM curve."""
    if "head_curve" not in entry:
        return gemm_seconds(tokens, vocab, dim, entry, backward)
    flops = 2.0 * tokens * vocab * dim * (2 if backward else 1)
    return flops / interp_curve(entry["head_curve"], dim, 2 if backward else 1)


# The chunked loss (model/loss.py) runs the head on ``chunk_rows(vocab)`` positions at a time (55 of a 151,936-token
# vocabulary): few rows a product, each streaming the whole (V, d) weight, far from the rate of the head curve's 512
# rows. Doctor measures the head's two products at those row counts (``head_chunk_curve``: hidden (n, d) @ W^T and the
# input gradient (n, V) @ W, W already in the compute dtype, as the loss casts it once) on a weight of this shape.
HEAD_CHUNK_ROWS = (16, 32, 64, 128, 256, 512)
HEAD_CHUNK_VOCAB = 131072
HEAD_CHUNK_DIM = 1024


def chunked_head_seconds(tokens: int, rows: int, vocab: int, dim: int, entry: dict, cast: bool) -> float | None:
    """CPU seconds of a frozen head's products in the chunked loss over ``tokens`` positions, ``rows`` a chunk: each
    chunk's logits twice (the forward, and the backward's recomputation) and its input gradient, at the rates
    ``head_chunk_curve`` measured for the chunk's rows (scaled to ``dim`` by the head curve), plus, when ``cast``
    (an fp32 weight under autocast), the loss's one cast of the weight to bf16 (``weight_cast_s_per_element``;
    without it 6 bytes an element at the copy bandwidth). None when the calibration has no such curve."""
    curve = entry.get("head_chunk_curve")
    if not curve:
        return None
    chunks = [rows] * (tokens // rows) + ([tokens % rows] if tokens % rows else [])
    seconds = 0.0
    for column, passes in ((1, 2), (2, 1)):  # forward (twice), input gradient
        scale = interp_curve(entry["head_curve"], dim, column) / interp_curve(entry["head_curve"], HEAD_CHUNK_DIM,
                                                                                column) if "head_curve" in entry else 1
        seconds += passes * sum(2.0 * n * dim * vocab / (interp_curve(curve, n, column) * scale) for n in chunks)
    if cast:
        seconds += vocab * dim * entry.get("weight_cast_s_per_element", 6.0 / entry["memory_bandwidth"])
    return seconds


def loss_recompute_seconds(workload: Workload, plan: Plan, tokens: int, cluster: Cluster, entry: dict | None
                           ) -> float:
    """The chunked loss's backward recomputes each chunk's logits from the saved hidden states (model/loss.py):
    one more forward head GEMM per micro-batch, where ``memory.loss_rows`` says the loss is chunked. Measured on
    the reference CPU, one thread, vocab 32,768, d 256, 4 x 256 tokens: +184 ms on a 779 ms head + loss; this
    charges +202 on a planned 808. On a GPU: its FLOPs at the fitted utilisation."""
    cfg = workload.model
    if loss_rows(workload, plan, tokens, plan.engine == "deepspeed", cluster.hardware.kind) >= tokens:
        return 0.0
    if entry is not None:
        return head_gemm_seconds(tokens, cfg.vocab_size, cfg.dim, entry)
    hw = cluster.hardware
    rate = hw.flops(DTYPE_OF_PRECISION[workload.precision]) * gpu_utilisation(hw, cfg, workload.seq_len)
    return 2.0 * tokens * cfg.vocab_size * cfg.dim / rate


def attention_seconds(batch_heads: int, seq: int, head_dim: int, entry: dict) -> tuple[float, float]:
    """(forward, backward) seconds of causal SDPA, from the curve of the nearest measured head_dim."""
    curves = entry["attention_curve"]
    nearest = min(curves, key=lambda hd: abs(math.log(int(hd)) - math.log(head_dim)))
    flops = 4.0 * batch_heads * seq * seq * head_dim
    return flops / interp_curve(curves[nearest], seq, 1), 2 * flops / interp_curve(curves[nearest], seq, 2)


# torch's CPU flash-attention kernel walks the keys in blocks of 512 and, when causal, stops at the diagonal's
# block; with an explicit mask (the sliding-window layers, ``Attention.windowed``) it walks them all. The masked
# layer therefore costs what the causal calibration curve prices times 2n / (n + 1) over n = T / 512 key blocks:
# 1 up to 512 positions, ~1.6 at 2048 (measured 1.0 at 512, 1.7 at 2048, forward + backward, one thread).
CPU_ATTENTION_KEY_BLOCK = 512


def masked_attention_factor(seq: int) -> float:
    """CPU seconds of a masked (sliding-window) layer's SDPA over a causal one's at sequence ``seq``: the window
    saves nothing on this kernel, which skips only the causal upper triangle's key blocks."""
    n = max(1.0, seq / CPU_ATTENTION_KEY_BLOCK)
    return 2 * n / (n + 1)


def family_block_ops(cfg: ModelConfig) -> int:
    """aten ops (forward + backward) the family options add to a block over the calibrated Llama block
    (``block_ops``): q/k norms, post-sublayer norms, (1 + w) norms, biases; counted on a tiny block of the same
    options (aten_ops.count_aten_ops), 0 for a Llama."""
    options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
               if f.name in ("qkv_bias", "qk_norm", "activation", "norm_plus_one", "post_norms")}
    return _family_block_ops(tuple(sorted(options.items())), cfg.n_heads // (cfg.n_kv_heads or cfg.n_heads))


@functools.cache
def _family_block_ops(options: tuple, group: int) -> int:
    def ops(cfg: ModelConfig) -> int:
        block = TransformerBlock(cfg)
        cos, sin = rope_tables(8, 4, 10000.0)
        x = torch.randn(1, 4, cfg.dim, requires_grad=True)
        return count_aten_ops(lambda: block(x, cos, sin).sum().backward())

    tiny = ModelConfig(dim=16, n_heads=2 * group, n_kv_heads=2, head_dim=8, ffn_hidden_dim=16, vocab_size=16,
                       max_seq_len=4)
    if not any(v not in (False, "silu") for _, v in options):
        return 0
    return max(0, ops(dataclasses.replace(tiny, **dict(options))) - ops(tiny))


def decode_ops(cfg: ModelConfig) -> float:
    """aten ops one cached decode step of the trainer's sample dispatches (``model.generate.generate`` with
    top-k, as ``train/run_evaluation.py`` samples): ``DECODE_OPS_PER_BLOCK`` a block (plus a third of what the
    family's options add to a block's forward and backward, ``family_block_ops``) and ``DECODE_OPS_OTHER``.
    Eager decoding pays them one by one: on a CPU they, not the FLOPs, are a small model's sample."""
    return DECODE_OPS_OTHER + cfg.n_layers * (DECODE_OPS_PER_BLOCK + family_block_ops(cfg) / 3)


def _block_gemms(cfg: ModelConfig, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    d, hd, h = cfg.dim, head_width(cfg), ffn_hidden_dim(cfg)
    q, kv = cfg.n_heads * hd // tp, kv_heads(cfg) * hd // tp
    return [(tokens, q, d), (tokens, kv, d), (tokens, kv, d), (tokens, d, q),
            (tokens, h // tp, d), (tokens, h // tp, d), (tokens, d, h // tp)]


# torch.utils.checkpoint (non-reentrant, as parallel/activation_checkpoint.py calls it) stops recomputing once
# every tensor the backward saved is back (its early stop, on by default): a block's last operators, the
# feed-forward's down projection w2 and the residual add, produce no saved tensor, so they are not run again.
# The GEMMs a checkpointed block recomputes are therefore its forward's but the last (counted with a dispatch
# mode on scaletrain's block: tests/plan/test_plan_search.py::test_recompute_charges_what_checkpoint_recomputes).
RECOMPUTED_GEMMS = slice(0, -1)


def block_gemm_attention_seconds(cfg: ModelConfig, batch: int, seq: int, entry: dict, recompute: bool,
                                 tp: int = 1) -> float:
    """CPU seconds of one block's GEMMs (forward, backward, and if checkpointed the forward's GEMMs it recomputes,
    ``RECOMPUTED_GEMMS``) and its attention (recomputed too)."""
    shapes = _block_gemms(cfg, batch * seq, tp)
    fwd = sum(gemm_seconds(m, n, k, entry) for m, n, k in shapes)
    bwd = sum(gemm_seconds(m, n, k, entry, backward=True) for m, n, k in shapes)
    again = sum(gemm_seconds(m, n, k, entry) for m, n, k in shapes[RECOMPUTED_GEMMS]) if recompute else 0.0
    att_f, att_b = attention_seconds(batch * cfg.n_heads // tp, seq, head_width(cfg), entry)
    return fwd + again + (1 + recompute) * att_f + bwd + att_b


def recomputed_share(cfg: ModelConfig, seq: int) -> float:
    """FLOPs a checkpointed block recomputes over its forward's: its GEMMs but the last (``RECOMPUTED_GEMMS``)
    and its attention (QK^T, AV: 4 T H hd a token)."""
    gemms = [2.0 * n * k for _, n, k in _block_gemms(cfg, 1, 1)]
    attention = 4.0 * seq * cfg.n_heads * head_width(cfg)
    return (sum(gemms[RECOMPUTED_GEMMS]) + attention) / (sum(gemms) + attention)


# Newton-Schulz iterations of a Muon step: torch.optim.Muon's default, which train/muon.py's Muon keeps.
NS_STEPS = inspect.signature(torch.optim.Muon.__init__).parameters["ns_steps"].default


def newton_schulz_flops(shapes: list[tuple[int, int]], steps: int = NS_STEPS) -> float:
    """FLOPs of Muon's orthogonalization of each (rows, cols) matrix: per iteration, with m <= n its sides, the
    Gram matrix X X^T (2 m^2 n), its square (2 m^3) and that times X (2 m^2 n) (train/muon.py)."""
    return steps * sum((4.0 * m * m * n + 2.0 * m ** 3) * count
                       for (m, n), count in _by_shape(shapes).items())


def newton_schulz_seconds(shapes: list[tuple[int, int]], hw: Hardware) -> float:
    """Seconds of Muon's Newton-Schulz over the whole matrices ``shapes`` on one device (under FSDP2 each rank
    gathers and orthogonalizes every matrix: the work is not divided by the shards). On a CPU it runs in fp32
    (train/optimizer.py), each product at the calibration's fp32 ``nn.Linear`` rate for its shape
    (``gemm_seconds``); on a GPU in bf16, at the peak x the fitted GEMM utilisation at the matrices' smaller
    side, and no faster than the host launches its batched matmuls (3 an iteration per stack of one shape and
    chunk)."""
    by_shape = _by_shape(shapes)
    if not by_shape:
        return 0.0
    if hw.kind == "cpu":
        entry = hw.calibration
        if "gemm_curve" not in entry:
            raise ConfigError("the CPU time model needs this machine's calibration: run `scaletrain doctor` "
                              "(or plan with --hardware auto)")
        return NS_STEPS * sum(count * (gemm_seconds(m, m, n, entry) + gemm_seconds(m, m, m, entry)
                                       + gemm_seconds(m, n, m, entry)) for (m, n), count in by_shape.items())
    compute = sum(newton_schulz_flops([shape]) * count / (hw.flops("bf16") * hw.utilisation_at(shape[0], 0.0))
                  for shape, count in by_shape.items())
    chunks = max(1, math.ceil(sum(m * n * c for (m, n), c in by_shape.items()) / CHUNK_ELEMENTS))
    return max(compute, len(by_shape) * chunks * 3 * NS_STEPS * GPU_LAUNCH_SECONDS)


def _by_shape(shapes: list[tuple[int, int]]) -> collections.Counter:
    """{(m, n) with m <= n: how many matrices}: a matrix and its transpose cost the same (Muon iterates on
    the wide orientation)."""
    return collections.Counter((min(r, c), max(r, c)) for r, c in shapes)


@dataclass
class TimeBreakdown:
    """Seconds per optimizer step on one device, and what they are spent on."""

    compute: float  # forward + backward (+ recomputation) of all micro-batches
    optimizer: float
    bubble: float  # pipeline fill/drain
    comm_total: float  # all communication, overlapped or not
    comm_exposed: float  # the part that adds to the step
    step: float
    tokens_per_second: float  # whole job
    mfu: float  # model FLOPs (flops_per_token convention) / the job's peak (``job_peak_flops``)
    comm_detail: dict
    newton_schulz: float = 0.0  # of ``optimizer``: Muon's orthogonalization (optim.name = muon)

    def as_dict(self) -> dict:
        return asdict(self)


def step_time(workload: Workload, plan: Plan, cluster: Cluster) -> TimeBreakdown:
    """Predicted seconds per optimizer step of ``plan`` on ``cluster``."""
    hw = cluster.hardware
    micro_steps = plan.grad_accum(workload) * (plan.microbatches if plan.pp > 1 else 1)
    if hw.kind == "cpu":
        per_micro, optimizer = cpu_micro_seconds(workload, plan, cluster)
    else:
        per_micro, optimizer = _gpu_micro_seconds(workload, plan, cluster)
    optimizer += offload_transfer_seconds(workload, plan, hw)
    newton_schulz = 0.0
    if workload.optimizer_entry.orthogonalizes:  # every rank orthogonalizes its stage's whole matrices
        newton_schulz = newton_schulz_seconds(muon_shapes(workload.model, -(-workload.model.n_layers // plan.pp)),
                                              hw) * (cpu_rank_share(cluster) if hw.kind == "cpu" else 1.0)
        optimizer += newton_schulz
    compute = per_micro * micro_steps
    bubble = 0.0
    if plan.pp > 1:
        virtual = 2 if plan.pp_schedule == "interleaved_1f1b" else 1
        bubble = per_micro * (plan.pp - 1) / virtual * plan.grad_accum(workload)
    comm, exposed = communication(workload, plan, cluster, compute)
    step = compute + optimizer + bubble + exposed
    tokens_per_second = workload.tokens_per_step / step
    utilisation = planned_mfu(workload.flops_per_token, tokens_per_second, workload.precision, cluster)
    return TimeBreakdown(compute, optimizer, bubble, sum(comm.values()), exposed, step, tokens_per_second, utilisation,
                         comm, newton_schulz)


def job_peak_flops(cluster: Cluster, precision: str) -> float:
    """MFU's denominator for a plan, counted as the trainer counts its own (``Throughput.job_peak_flops``): one
    device's peak matmul rate times ``peak.devices_in_job``: a GPU a rank, or on a CPU one core per thread of
    every rank (each rank runs the calibration's ``threads``, as the CPU time model assumes), no more than each
    host's cores. A CPU core's peak is the one-thread rate the trainer divides by (``core_matmul_flops_*``,
    ``hardware_spec.hardware_from_calibration``); a calibration without it: its rate over its threads."""
    hw, dtype = cluster.hardware, DTYPE_OF_PRECISION[precision]
    if hw.kind != "cpu":
        return hw.flops(dtype) * devices_in_job(hw.kind, cluster.world_size, 1)
    threads = int(hw.calibration.get("threads", 1))
    core = float(hw.calibration.get(f"core_matmul_flops_{dtype}", hw.flops(dtype) / threads))
    return core * devices_in_job("cpu", cluster.world_size, threads, cluster.devices_per_node, hw.cores)


def planned_mfu(flops_per_token: float, tokens_per_second: float, precision: str, cluster: Cluster) -> float:
    """The MFU ``plan`` prints for a job at ``tokens_per_second``: the trainer's ``mfu`` over ``job_peak_flops``."""
    return mfu(flops_per_token, tokens_per_second, job_peak_flops(cluster, precision))


def cpu_rank_share(cluster: Cluster) -> float:
    """How much slower than calibrated one rank computes: ranks on one host share its cores, so each rank's rates
    are the calibration's (measured with ``threads`` threads) scaled to its share of the host's cores, never
    faster than calibrated; and they contend for its memory bandwidth and caches (doctor measures it)."""
    entry = cluster.hardware.calibration
    share = max(1.0, cluster.devices_per_node * entry.get("threads", cluster.hardware.cores or 1)
                / max(1, cluster.hardware.cores or 1))
    if cluster.devices_per_node > 1:
        share *= float(entry.get("corun_slowdown", 1.0))
    return share


def cpu_micro_seconds(workload: Workload, plan: Plan, cluster: Cluster) -> tuple[float, float]:
    """(seconds per micro-batch on one stage, optimizer seconds) from the measured CPU rates."""
    cfg, entry = workload.model, precision_rates(cluster.hardware.calibration, workload.precision)
    if "elementwise_s_per_element" not in entry:

        raise ConfigError("the CPU time model needs this machine's calibration: run `scaletrain doctor` "
                          "(or plan with --hardware auto)")
    share = cpu_rank_share(cluster)
    b, t, tp = plan.micro_batch, workload.seq_len // plan.cp, plan.tp
    layers = -(-cfg.n_layers // plan.pp)
    units = block_activation_elements(cfg, b, t, tp, plan.sequence_parallel)
    ops = entry["block_ops"] + family_block_ops(cfg)
    # Cost per element at this block's working-set size (curve), else the single reference value.
    elem = interp_curve(entry["elementwise_curve"], units) if "elementwise_curve" in entry else \
        entry["elementwise_s_per_element"]

    # A sparse block: its feed-forward's GEMMs, saved elements and aten ops are the mixture of experts'
    moe_t, moe_tp = t // plan.expert_token_split, plan.expert_tp  # folded: a rank's sequence shard, experts unsplit
    sparse_units = units + (moe_activation_bytes(cfg, b, moe_t, RECIPES["fp32"], plan.ep, moe_tp) / 4
                            - 4 * b * t * ffn_hidden_dim(cfg) / tp) if cfg.moe_experts else units

    def block(recompute: bool, sparse: bool) -> float:
        gemms = block_gemm_attention_seconds(cfg, b, t, entry, recompute, tp)
        if sparse:
            gemms += moe_gemm_seconds(cfg, b * moe_t, entry, recompute, moe_tp, plan.ep)
        rate_bound = gemms + (sparse_units if sparse else units) * elem * (
            1 + recompute / 3)  # the forward is about a third of a block's elementwise work
        return rate_bound * share + (ops + sparse * moe_block_ops(cfg)) * (1 + recompute / 3) * entry["op_overhead_s"]

    ckpt = checkpointed_blocks(layers, plan.activation_checkpointing, plan.ac_every)
    blocks = sum(block(i in ckpt, is_moe_layer(cfg, i)) for i in range(layers))
    masked = masked_attention_layers(cfg, t, range(layers))
    if masked:  # sliding-window layers: SDPA with an explicit mask, over every key block (masked_attention_factor)
        att_f, att_b = attention_seconds(b * cfg.n_heads // tp, t, head_width(cfg), entry)
        blocks += masked * (masked_attention_factor(t) - 1) * (att_f + att_b) * share
    tokens, vocab = b * t, cfg.vocab_size // tp
    # Output head GEMMs, cross-entropy per logit, final norm, and the embedding's dense V x d gradient.
    head = (head_gemm_seconds(tokens, vocab, cfg.dim, entry) + head_gemm_seconds(tokens, vocab, cfg.dim, entry, True)
            + tokens * vocab * interp_curve(entry["cross_entropy_curve"], vocab)
            + (3 * tokens * cfg.dim + cfg.vocab_size * cfg.dim / tp) * elem
            + loss_recompute_seconds(workload, plan, tokens, cluster, entry))
    psi = stage_params(cfg, plan.pp, tp, plan.ep, plan.expert_tp) / (
        plan.dp_shard * plan.cp if plan.zero_stage >= 2 else plan.dp_replicate if plan.zero_stage == 1 else 1)
    tensors = layers * PARAM_TENSORS_PER_BLOCK + (2 if cfg.tie_embeddings else 3)
    return blocks + head * share, optimizer_seconds(entry, plan, cluster, psi, tensors, share)


def optimizer_layout(plan: Plan) -> str:
    """Which of doctor's measured optimizer-step rates (``optimizer_step``) a plan's parameters pay: ``tp``
    (DTensors with TP placements), ``fsdp`` (FSDP2's Shard(0) DTensors: ZeRO-2/3) or ``plain`` (plain tensors:
    DDP, ZeRO-1, one process)."""
    if plan.tp > 1:
        return "tp"
    return "fsdp" if plan.zero_stage >= 2 and plan.dp_shard * plan.cp > 1 else "plain"


def optimizer_seconds(entry: dict, plan: Plan, cluster: Cluster, psi: float, tensors: int, share: float) -> float:
    """CPU seconds of one optimizer step (gradient clipping + AdamW) over the ``psi`` elements in ``tensors``
    parameter tensors this rank updates; charged once per step.

    Several ranks: the rates ``torchrun ... doctor`` measured with every rank stepping at once, per tensor and per
    element, for the plan's layout (``optimizer_step``: DTensor dispatch per tensor, the clipping's collective,
    the ranks sharing the memory bandwidth this step is bound by). Without them (one process, or an older
    calibration): the single-process AdamW curve times the rank's share of the cores, plus DTensor's per-op
    overhead on each foreach op of the step (FOREACH_OPS_PER_STEP) for each parameter tensor."""
    measured = entry.get("optimizer_step", {}).get(optimizer_layout(plan)) if cluster.world_size > 1 else None
    if measured:
        return tensors * measured["per_tensor_s"] + psi * measured["per_element_s"]
    optimizer = psi * interp_curve(entry["optimizer_curve"], psi) * share
    if optimizer_layout(plan) != "plain":  # DTensors (FSDP2 shards, TP placements)
        optimizer += tensors * FOREACH_OPS_PER_STEP * entry.get("dtensor_op_overhead_s", 0.0)
    return optimizer


# torch._grouped_mm on this CPU (fp32, one thread), against the calibrated nn.Linear rate at the rows each expert
# gets: the experts' E GEMMs of r rows took 1.10-2.76x (median 1.38) E times one expert's GEMM of r rows at
# shapes E x r x d x h of 8x16x128x176 .. 64x8x256x128 (benchmarks/plan_moe.py measures it again): each expert's
# weights are cold in cache where the calibration's one Linear is warm. Against a loop over the experts it is
# 0.73-1.21x: the loop (the fallback) costs the same.
GROUPED_GEMM_CPU_SLOWDOWN = 1.38


# CPU (gloo): the fixed host cost of one of the ep path's rows all-to-alls (``all_to_all_single_autograd``, forward
# or backward) beyond the ``collective_latency_s`` every collective is charged: the functional collective's dispatch
# and wait, gloo's alltoallv on its worker thread (a hand-off each way), the autograd node. benchmarks/ep_host.py
# (collectives part) times it on 2 ranks of the reference CPU kind, one thread each, with a GEMM of ~2 ms between
# calls as in a step (back to back it costs about half), at 256 and 2,048 rows of nano-moe's width: the intercept
# of the busiest rank's CPU time through the two sizes less the 4-byte all-reduce's timed the same way, the mean
# of the forward's (0.85 ms) and the backward's (0.83 ms), results/ep_host.json all_to_all_fit (load average ~6:
# other sessions' work). NCCL's is a few microseconds: 0 on GPUs.
GLOO_ALL_TO_ALL_HOST_S = 8.4e-4


def rank_load(ep: int) -> float:
    """The busiest expert-parallel rank's load over the mean: ``memory.MOE_LOAD_IMBALANCE`` under ep > 1; one
    process computes every expert, its load is the whole batch's."""
    return MOE_LOAD_IMBALANCE if ep > 1 else 1.0


def grouped_gemm_efficiency_gpu(hw: Hardware, rows: float) -> float:
    """A GPU grouped GEMM's rate over a wide dense GEMM's, with ``rows`` rows an expert: an expert's (h, d) weights
    are read once for its rows, so below the roofline's ridge (peak bf16 FLOP/s over memory bandwidth, ~295 rows
    on an H100) it is bound by reading them: rows / ridge. An assumption from the roofline, not measured here."""
    ridge = hw.flops("bf16") / hw.memory_bandwidth
    return min(1.0, rows / ridge)


def moe_gemm_seconds(cfg: ModelConfig, tokens: int, entry: dict, recompute: bool, tp: int, ep: int) -> float:
    """CPU seconds a sparse block's feed-forward adds over the dense one ``_block_gemms`` charges: the router
    (tokens, E, d), the routed experts (E / ep on this rank, ``routed_rows`` over them, a grouped GEMM at
    ``GROUPED_GEMM_CPU_SLOWDOWN`` times the calibrated rate), the shared experts; less the dense w1, w3, w2.
    Forward, backward, and with ``recompute`` the forward again (all of a sparse block's expert GEMMs; the dense
    block's w2 is not recomputed, ``RECOMPUTED_GEMMS``)."""
    d, h, dense = cfg.dim, expert_hidden_dim(cfg), ffn_hidden_dim(cfg)
    local = cfg.moe_experts // ep
    rows = routed_rows(cfg, tokens, ep) / local  # each local expert's

    def passes(m: float, n: int, k: int, count: float = 1.0, last: bool = False) -> float:
        fwd, bwd = gemm_seconds(int(m), n, k, entry), gemm_seconds(int(m), n, k, entry, backward=True)
        return count * (fwd * (1 + (recompute and not last)) + bwd)

    # Recomputed whole: the combine saves the slots the routed w2 fills, and the balancing terms (after the shared
    # experts) save tensors too, so checkpoint's early stop comes after every expert GEMM of a sparse block.
    experts = GROUPED_GEMM_CPU_SLOWDOWN * 3 * passes(rows, h // tp, d, local)
    shared = h * cfg.moe_shared_experts // tp
    shared_s = 3 * passes(tokens, shared, d) if shared else 0.0
    removed = 2 * passes(tokens, dense // tp, d) + passes(tokens, d, dense // tp, last=True)
    return passes(tokens, cfg.moe_experts, d) + experts + shared_s - removed


def moe_block_ops(cfg: ModelConfig) -> int:
    """aten ops (forward + backward) a sparse block dispatches beyond a dense one: routing (scores, top-k, sort,
    gather), the grouped experts and the combine; counted on a tiny block of the same routing options
    (aten_ops.count_aten_ops), 0 for a dense model."""
    if not cfg.moe_experts:
        return 0
    return _moe_block_ops(bool(cfg.moe_shared_experts), cfg.moe_bias_rate > 0, cfg.moe_capacity_factor > 0)


@functools.cache
def _moe_block_ops(shared: bool, bias: bool, capacity: bool) -> int:
    def ops(cfg: ModelConfig) -> int:
        block = TransformerBlock(cfg)
        cos, sin = rope_tables(8, 4, 10000.0)
        x = torch.randn(1, 4, cfg.dim, requires_grad=True)
        return count_aten_ops(lambda: block(x, cos, sin).sum().backward())

    tiny = ModelConfig(dim=16, n_heads=2, head_dim=8, ffn_hidden_dim=16, vocab_size=16, max_seq_len=4)
    sparse = dataclasses.replace(tiny, moe_experts=4, moe_top_k=2, moe_hidden_dim=16, moe_shared_experts=int(shared),
                                 moe_bias_rate=0.001 if bias else 0.0, moe_capacity_factor=1.0 if capacity else 0.0)
    return max(0, ops(sparse) - ops(tiny))


def all_to_all_seconds(workload: Workload, plan: Plan, cluster: Cluster, tokens: int, latency: float,
                       host: float = 0.0) -> float:
    """Seconds one micro-batch's expert-parallel all-to-alls take: each sparse block dispatches its tokens' top-k
    copies to the ranks holding their experts and combines them back, forward and again backward (4 all-to-alls
    of tokens x top_k x dim activations, (ep - 1) / ep of them leaving the rank), and a checkpointed block's
    recomputed forward dispatches and combines again (2 more: the all-to-alls are inside the checkpointed block,
    in our trainer as in Megatron's full recompute). Before dispatching, each forward (a recomputed one too)
    exchanges the rows each rank sends each expert (parallel/expert.py: an (ep, E/ep) table, one more collective
    of no bytes to speak of: ``latency``). ``host``: the fixed host cost of one rows' all-to-all beyond
    ``latency`` (``GLOO_ALL_TO_ALL_HOST_S`` on a CPU, 0 on GPUs). Over the link the ep group spans
    (``ep_group_stride``); not overlapped with compute (torchtitan's default; Megatron's is a separate option,
    "1f1b overlap")."""
    cfg = workload.model
    bw, _ = group_link(cluster, plan.ep, ep_group_stride(plan))
    own = tokens / plan.expert_token_split  # folded: each rank dispatches its sequence shard
    sent = own * cfg.moe_top_k * cfg.dim * RECIPES[workload.precision].activation * (plan.ep - 1) / plan.ep
    layers = -(-cfg.n_layers // plan.pp)
    ckpt = checkpointed_blocks(layers, plan.activation_checkpointing, plan.ac_every)
    forwards = sum(1 + (i in ckpt) for i in range(layers) if is_moe_layer(cfg, i))  # a sparse block's forwards
    collectives = sum(4 + 2 * (i in ckpt) for i in range(layers) if is_moe_layer(cfg, i))
    return collectives * (sent * rank_load(plan.ep) / bw + latency + host) + forwards * latency


def ep_group_stride(plan: Plan) -> int:
    """The stride of the ep group's ranks: tp x cp in our trainer's layout (the innermost data-parallel ranks,
    parallel/expert.py; tp for the plans the trainer runs, which have cp = 1: the ranks of one tp coordinate), 1
    when the expert layers are folded onto their own mesh (``Plan.ep_folded``: Megatron-Core's expert-TP 1)."""
    return 1 if plan.ep_folded else plan.tp * plan.cp


def gpu_utilisation(hw: Hardware, cfg: ModelConfig, seq_len: int) -> float:
    """The MFU the catalog's fit predicts for ``cfg`` at ``seq_len`` on ``hw`` (``Hardware.utilisation_at``):
    GEMM width ``cfg.dim``, attention share ``12 L T d`` of ``flops_per_token``."""
    attention = 12.0 * cfg.n_layers * seq_len * cfg.dim
    return hw.utilisation_at(cfg.dim, attention / flops_per_token(cfg, seq_len))


def workload_utilisation(workload: Workload, hw: Hardware) -> float:
    """The utilisation the time model uses for ``workload`` on ``hw`` (printed by ``scaletrain plan``): the fit
    on a GPU, the catalog's measured GEMM efficiency on a CPU (whose time model uses measured rates instead)."""
    return gpu_utilisation(hw, workload.model, workload.seq_len) if hw.kind == "gpu" else hw.utilisation


def _gpu_micro_seconds(workload: Workload, plan: Plan, cluster: Cluster) -> tuple[float, float]:
    """(seconds per micro-batch on one stage, optimizer seconds) at peak x the fitted utilisation."""
    cfg, hw = workload.model, cluster.hardware
    layers = -(-cfg.n_layers // plan.pp)
    n_ckpt = len(checkpointed_blocks(layers, plan.activation_checkpointing, plan.ac_every))
    tokens = plan.micro_batch * workload.seq_len
    # Model FLOPs of this device's share; a checkpointed block pays again the part of its forward (a third of its
    # FLOPs) that checkpoint recomputes (recomputed_share: all but the last GEMM).
    model_flops = workload.flops_per_token * tokens / (plan.tp * plan.pp * plan.cp)
    block_share = 1.0 - 6.0 * cfg.vocab_size * cfg.dim / workload.flops_per_token  # all but the head
    executed = model_flops * (1 + block_share * (n_ckpt / layers) / 3 * recomputed_share(cfg, workload.seq_len))
    # A sliding-window layer runs SDPA with an explicit mask: the memory-efficient kernel over the whole square,
    # twice the causal kernel's work (the window saves nothing there); counted once more at the same rate.
    masked = masked_attention_layers(cfg, workload.seq_len, range(layers))
    executed += masked * 12.0 * workload.seq_len * cfg.n_heads * head_width(cfg) * tokens / (plan.tp * plan.cp)
    rate = hw.flops(DTYPE_OF_PRECISION[workload.precision]) * gpu_utilisation(hw, cfg, workload.seq_len)
    if cfg.moe_experts:  # the routed experts: the busiest rank's load, at the grouped GEMM's efficiency
        sparse = sum(is_moe_layer(cfg, i) for i in range(layers))
        expert_flops = 18.0 * cfg.dim * expert_hidden_dim(cfg) * sparse * tokens / (plan.tp * plan.cp)
        own = tokens / plan.expert_token_split  # folded: a rank's sequence shard, experts unsplit
        rows = routed_rows(cfg, own, plan.ep) * plan.ep / cfg.moe_experts  # a local expert's
        load = rank_load(plan.ep)
        executed += expert_flops * cfg.moe_top_k * (load / grouped_gemm_efficiency_gpu(hw, rows) - 1)
    # Kernels run asynchronously, but a micro-batch cannot finish faster than the host launches its kernels:
    # eager PyTorch issues ~OPS_PER_BLOCK aten ops per block (counted on scaletrain's block, fwd + bwd).
    launches = (layers + n_ckpt / 3) * OPS_PER_BLOCK * GPU_LAUNCH_SECONDS
    if cfg.moe_experts:
        launches += sum(is_moe_layer(cfg, i) for i in range(layers)) * moe_block_ops(cfg) * GPU_LAUNCH_SECONDS
    psi = stage_params(cfg, plan.pp, plan.tp, plan.ep, plan.expert_tp) / (
        plan.dp_shard * plan.cp if plan.zero_stage >= 2 else plan.dp_replicate if plan.zero_stage == 1 else 1)
    # Adam reads/writes params, grads, m, v (+ master): ~3 passes of 16-20 bytes per parameter.
    opt_bytes = psi * 3 * 20
    if plan.engine == "deepspeed" and plan.offload != "none":  # the step on the host (~20 GB/s of DRAM)
        optimizer = opt_bytes / 20e9
    elif plan.cpu_offload:
        # Offloaded states: the step runs on the host (~20 GB/s of DRAM per GPU's share), and params go
        # back and forth over PCIe every step.
        optimizer = opt_bytes / 20e9 + psi * 6 / (LINKS["pcie4"].bandwidth * LINKS["pcie4"].efficiency)
    else:
        optimizer = opt_bytes / hw.memory_bandwidth
    recompute = loss_recompute_seconds(workload, plan, tokens, cluster, None)
    return max(executed / rate + recompute, launches), optimizer


def offload_transfer_seconds(workload: Workload, plan: Plan, hw) -> float:
    """Seconds a DeepSpeed plan's offload moves data every step, over the parameters a rank updates: gradients
    down and parameters up over PCIe (GPU), the fp32 master + Adam moments (12 bytes a parameter) read and
    written on NVMe, and at ZeRO-3 the parameters read from NVMe for forward and backward and written back."""
    if plan.engine != "deepspeed" or plan.offload == "none" or (hw.kind == "cpu" and plan.offload == "cpu"):
        return 0.0
    psi = stage_params(workload.model, plan.pp, plan.tp, plan.ep, plan.expert_tp) / (
        plan.dp if plan.zero_stage >= 1 else 1)
    param_bytes = 2 if DTYPE_OF_PRECISION[workload.precision] in ("bf16", "fp16") else 4
    seconds = 0.0
    if hw.kind != "cpu":
        pcie = LINKS[hw.intra_node if hw.intra_node.startswith("pcie") else "pcie4"]
        seconds += psi * (4 + param_bytes) / (pcie.bandwidth * pcie.efficiency)
    if plan.offload == "nvme":
        nvme = LINKS["nvme-gen4"]
        swapped = psi * 12 * 2 + (psi * param_bytes * 3 if plan.zero_stage == 3 else 0.0)
        seconds += swapped / (nvme.bandwidth * nvme.efficiency)
    return seconds


def group_link(cluster: Cluster, degree: int, inner: int) -> tuple[float, str]:
    """Bus bandwidth (bytes/s) of a process group of ``degree`` ranks whose stride is ``inner``.

    Across nodes, NCCL builds one ring (channel) a NIC, so a group with ``k`` ranks on each node moves its
    inter-node share over ``k`` ports at once (rail-optimized InfiniBand: one port a GPU), no faster than the
    node's own link; a node's shared Ethernet port (``Link.per_node``) counts once. A group with one rank a node
    (HSDP's replicas, stride = the node) gets one port."""
    hw = cluster.hardware
    spans_nodes = degree * inner > cluster.devices_per_node
    if hw.kind == "cpu" and not spans_nodes and "allreduce_busbw" in hw.calibration:
        return float(hw.calibration["allreduce_busbw"]), "measured gloo all-reduce"
    if not spans_nodes:
        link = LINKS[hw.intra_node]
        return link.bandwidth * link.efficiency, link.name
    link, intra = LINKS[hw.inter_node], LINKS[hw.intra_node]
    ports = 1 if link.per_node else max(1, min(degree, cluster.devices_per_node // inner))
    bandwidth = min(ports * link.bandwidth * link.efficiency, intra.bandwidth * intra.efficiency)
    return bandwidth, link.name if ports == 1 else f"{ports} x {link.name}"


def tp_bandwidth_seconds(cfg: ModelConfig, micro_batch: int, seq: int, tp: int, bus_bandwidth: float,
                         layers: int, activation_bytes: int = 4) -> float:
    """Seconds ``layers`` tensor-parallel blocks spend moving activations per micro-batch: 2 all-reduces of the
    (B, T, d) activation forward and 2 backward (with sequence parallelism the same bytes as all-gathers +
    reduce-scatters), ring volume 2(tp-1)/tp each."""
    act = micro_batch * seq * cfg.dim * activation_bytes
    return layers * 4 * 2 * (tp - 1) / tp * act / bus_bandwidth


def tp_traffic_factor(cfg: ModelConfig, plan: Plan, layers: int) -> float:
    """A stage's tensor-parallel activation bytes over as many dense blocks' (attention's all-reduce and the MLP's,
    each way). A sparse block under expert TP (``Plan.expert_tp`` > 1, parallel/tensor.py:apply_expert_tp, with or
    without ep) all-reduces the experts' output and input gradient on the tokens' top-k routed copies, and the
    shared experts' on the tokens once more: 1 + k (+ 1) units where a dense block has 2. With sequence parallelism
    the sparse feed-forward also all-gathers its input's sequence shard, and its output's gradient, over tp
    (parallel/tensor.py:_sparse_sequence_parallel; the output back to the shard is a local slice): half a unit
    more (an all-gather moves half an all-reduce's bytes). Folded (expert TP 1) the experts take no tp traffic;
    priced as a dense block, as before."""
    if not cfg.moe_experts or plan.expert_tp == 1:
        return 1.0
    sparse = sum(is_moe_layer(cfg, i) for i in range(layers))
    per_sparse = 1 + cfg.moe_top_k + (1 if cfg.moe_shared_experts else 0) + (0.5 if plan.sequence_parallel else 0)
    return (2 * (layers - sparse) + sparse * per_sparse) / (2 * layers)


def fresh_mapped_params(cfg: ModelConfig, plan: Plan) -> float:
    """Parameters (per tensor-parallel rank, of the busiest stage) in FSDP2 units whose fp32 buffers -- the
    gradients' reduce-scatter, the gathered parameters in fp32 -- pass glibc's mmap threshold (32 MiB): glibc
    serves each with a fresh mapping, page-faulted and zeroed by the kernel at every collective (a torchrun
    worker runs on glibc unless the environment preloads another malloc). The units are each block and the root
    (embedding, final norm, head)."""
    layers = -(-cfg.n_layers // plan.pp)
    block = rank_block_params(cfg, plan.tp, plan.ep, plan.expert_tp)
    root = stage_params(cfg, plan.pp, plan.tp, plan.ep, plan.expert_tp) - layers * block
    return sum(n * count for n, count in ((block, layers), (root, 1)) if n * 4 > GLIBC_MMAP_THRESHOLD_MAX)


class Unit(NamedTuple):
    """One FSDP2 unit (a block, or the root's embedding / head) in one pass, as the overlap model sees it (a named
    tuple: the search builds hundreds for every candidate plan)."""

    gather: float  # seconds of the all-gather its compute waits for (prefetched while the previous unit computes)
    compute: float  # seconds of its compute in this pass
    reduce: float = 0.0  # seconds of the gradient collective issued when its compute ends (reduce-scatter, DDP)
    replicate: float = 0.0  # HSDP: the all-reduce across replicas that follows ``reduce``, on the replicas' link


def overlap_exposed(units: list[Unit]) -> float:
    """Seconds the collectives of ``units`` (run in this order) add to their compute on a GPU.

    Two streams, as FSDP2 and DDP run them: compute, and one link a process group (the shard group's all-gathers
    and reduce-scatters share it, in the order they are issued; HSDP's all-reduce across replicas has its own).
    A unit's all-gather is issued when the previous unit's compute starts (FSDP2's prefetch of the next unit), its
    compute starts when that gather and the previous compute are done, its reduce is issued when its compute
    ends. What stays exposed: the first gather (nothing computes before it), a unit whose gather takes longer than
    the previous unit's compute (the difference), and the reduces still running when the last compute ends."""
    if not units:
        return 0.0
    link = ready = units[0].gather  # when the shard group's link is free; when the next unit's gather is done
    clock = replicas = busy = 0.0  # when the compute stream is free; the replicas' link; compute so far
    nexts = [unit.gather for unit in units[1:]] + [None]
    for (_, compute, reduce, replicate), next_gather in zip(units, nexts):
        start = clock if clock > ready else ready
        if next_gather is not None:  # prefetch: the next unit's gather is issued as this unit's compute starts
            link = ready = (link if link > start else start) + next_gather
        clock = start + compute
        busy += compute
        if reduce or replicate:
            link = (link if link > clock else clock) + reduce
            replicas = (replicas if replicas > link else link) + replicate
    return max(clock, link, replicas) - busy


def _pass_weights(workload: Workload, plan: Plan) -> tuple[float, float, list[tuple[float, float]]]:
    """A micro-batch's compute split over FSDP2's units, as fractions of it: (head forward, head backward,
    [(forward, backward) of each block]). By FLOPs: the head's 6 V d a token, the blocks' the rest; backward twice
    the forward, and a checkpointed block's backward first recomputes its forward (``recomputed_share``)."""
    cfg = workload.model
    layers = -(-cfg.n_layers // plan.pp)
    ckpt = checkpointed_blocks(layers, plan.activation_checkpointing, plan.ac_every)
    head = 6.0 * cfg.vocab_size * cfg.dim / workload.flops_per_token
    block, again = (1.0 - head) / layers, recomputed_share(cfg, workload.seq_len)
    blocks = [(block / 3, block * (2 + again * (i in ckpt)) / 3) for i in range(layers)]
    total = head + sum(f + b for f, b in blocks)
    return head / 3 / total, 2 * head / 3 / total, [(f / total, b / total) for f, b in blocks]


def data_parallel_units(workload: Workload, plan: Plan, per_micro: float, gather: float, reduce: float,
                        replicate: float, last: bool) -> list[Unit]:
    """One micro-batch's forward and backward as FSDP2 / DDP units, in the order they run: the root's gather
    (embedding, final norm, head: FSDP2 keeps it gathered until the backward ends), the blocks, the head; then the
    head's backward, the blocks' in reverse, the embedding's. ``gather`` / ``reduce`` / ``replicate`` are the
    seconds per parameter of the shard group's all-gather, its gradient collective and HSDP's all-reduce across
    replicas (0 where the plan has none); ZeRO-3 gathers each block again for its backward; ``last``: the
    step's last micro-batch (DDP all-reduces only there, in 25 MB buckets as the gradients of a bucket are
    ready; FSDP2 reduces every micro-batch, each unit's gradients as its backward ends)."""
    cfg = workload.model
    layers = -(-cfg.n_layers // plan.pp)
    block = rank_block_params(cfg, plan.tp, plan.ep, plan.expert_tp)
    root = stage_params(cfg, plan.pp, plan.tp, plan.ep, plan.expert_tp) - layers * block
    head_f, head_b, blocks = _pass_weights(workload, plan)
    again = gather if plan.zero_stage == 3 else 0.0
    forward = [Unit(root * gather, 0.0)] + [Unit(block * gather, f * per_micro) for f, _ in blocks] + [
        Unit(0.0, head_f * per_micro)]
    if plan.zero_stage >= 2:  # FSDP2 / HSDP: each unit reduce-scatters (and all-reduces across replicas)
        backward = [Unit(0.0, head_b * per_micro)] + [
            Unit(block * again, b * per_micro, block * reduce, block * replicate) for _, b in reversed(blocks)] + [
            Unit(0.0, 0.0, root * reduce, root * replicate)]
        return forward + backward
    # DDP: the gradients of the blocks fill 25 MB buckets in the backward's order; the root's close the last one
    sizes = [0.0] + [block] * layers + [root]
    computes = [head_b * per_micro] + [b * per_micro for _, b in reversed(blocks)] + [0.0]
    backward, pending = [], 0.0
    for i, (params, compute) in enumerate(zip(sizes, computes)):
        pending += params
        full = pending * RECIPES[workload.precision].grad >= DDP_BUCKET_BYTES or i == len(sizes) - 1
        backward.append(Unit(0.0, compute, pending * replicate if last and full else 0.0))
        pending = 0.0 if full else pending
    return forward + backward


# DDP's default bucket_cap_mb (25 MiB, torch.nn.parallel.DistributedDataParallel): one all-reduce a bucket.
DDP_BUCKET_BYTES = 25 * 2**20


def data_parallel_exposed(workload: Workload, plan: Plan, per_micro: float, micro: int, gather: float,
                          reduce: float, replicate: float) -> float:
    """GPU seconds the data-parallel collectives of a step expose over its ``micro`` micro-batches of
    ``per_micro`` seconds each (``overlap_exposed`` over ``data_parallel_units``). Micro-batches after the second
    repeat the second's exposure (the link carries over the same way), so two are simulated."""
    args = (workload, plan, per_micro, gather, reduce, replicate)
    last = data_parallel_units(*args, last=True)
    if micro == 1:
        return overlap_exposed(last)
    two = overlap_exposed(data_parallel_units(*args, last=False) + last)
    if micro == 2:
        return two
    return two + (micro - 2) * (two - overlap_exposed(last))


def communication(workload: Workload, plan: Plan, cluster: Cluster, compute: float) -> tuple[dict, float]:
    """({collective: seconds per step}, exposed seconds). Mesh order outer->inner: pp, dp_rep, dp_shard, cp, tp."""
    cfg, rec = workload.model, RECIPES[workload.precision]
    gpu = cluster.hardware.kind == "gpu"
    psi = stage_params(cfg, plan.pp, plan.tp, plan.ep, plan.expert_tp)
    accum = plan.grad_accum(workload)
    micro = accum * (plan.microbatches if plan.pp > 1 else 1)
    tokens = plan.micro_batch * workload.seq_len // plan.cp
    act = tokens * cfg.dim * rec.activation
    out: dict[str, float] = {}
    exposed = 0.0
    inner_tp, inner_cp = plan.tp, plan.tp * plan.cp
    calib = cluster.hardware.calibration
    # Fixed cost of one collective (alpha of the alpha-beta model): measured by doctor under torchrun;
    # NCCL's is a few microseconds, so on GPUs it is left out.
    latency = 0.0 if gpu else float(calib.get("collective_latency_s", 0.0))
    layers = -(-cfg.n_layers // plan.pp)
    if plan.tp > 1:
        bw, _ = group_link(cluster, plan.tp, 1)
        # Per block: 2 all-reduces forward + 2 backward, or with sequence parallelism the same bytes as
        # 4 all-gathers + 4 reduce-scatters.
        collectives = 8 if plan.sequence_parallel else 4
        bandwidth = tp_bandwidth_seconds(cfg, plan.micro_batch, workload.seq_len // plan.cp, plan.tp, bw, 1,
                                         rec.activation) * tp_traffic_factor(cfg, plan, layers)
        measured = None if gpu else calib.get("tp_overhead", {}).get(
            "sequence_parallel" if plan.sequence_parallel else "replicated")
        if measured:
            # CPU: the host cost TP adds (DTensor sharding propagation on every op, redistributions, the
            # collectives' fixed cost), measured by doctor on a tiny TP model per block and per model
            # (embedding, final norm, vocabulary-parallel head and loss); not hidden behind async kernels.
            out["tp"] = micro * (layers * (bandwidth + collectives * latency + measured["per_block_s"])
                                 + measured["per_model_s"])
        else:
            out["tp"] = micro * layers * (bandwidth + collectives * latency)
            if not gpu:  # older calibrations: DTensor's per-op overhead on every op of a block
                out["tp"] += micro * layers * calib.get("block_ops", OPS_PER_BLOCK) * calib.get(
                    "dtensor_op_overhead_s", 0.0)
        exposed += out["tp"]
    if plan.cp > 1:
        bw, _ = group_link(cluster, plan.cp, inner_tp)
        kv = tokens * kv_heads(cfg) * head_width(cfg) * 2 * rec.activation / plan.tp
        out["cp"] = micro * cfg.n_layers / plan.pp * 3 * (plan.cp - 1) * kv / bw
        exposed += max(0.0, out["cp"] - 0.5 * compute) if gpu else out["cp"]
    shard = plan.dp_shard * plan.cp
    gather = reduce = replicate = 0.0  # GPU: seconds per parameter of each data-parallel collective
    if plan.zero_stage >= 2 and shard > 1:
        bw, _ = group_link(cluster, plan.dp_shard, inner_cp)
        gathers = 2 if plan.zero_stage == 3 else 1  # stage 3 gathers again for backward
        frac = (shard - 1) / shard
        out["fsdp"] = micro * ((gathers * psi * rec.param + psi * max(rec.grad, 4)) * frac / bw
                               + (gathers + 1) * (layers + 1) * latency)  # one collective per unit and pass
        measured = None if gpu else calib.get("fsdp_overhead")
        if measured:
            # CPU: the host work around each collective (copy-in/out of the flat buffers, hooks, DTensor
            # parameter swaps), measured by doctor on a tiny ZeRO-3 model per block and per model (the root
            # unit); same core as the compute, nothing hides it. Measured at ZeRO-3: charged to ZeRO-2 too
            # (one gather fewer: an upper bound there). Units beyond glibc's mmap threshold also pay the kernel's
            # fresh pages per parameter (``fresh_mapped_params``; older calibrations have no ``per_param_s``).
            out["fsdp"] += micro * (layers * measured["per_block_s"] + measured["per_model_s"]
                                    + fresh_mapped_params(cfg, plan) * measured.get("per_param_s", 0.0))
        if gpu:  # exposed with the replicas' all-reduce below, per unit (data_parallel_exposed)
            gather, reduce = rec.param * frac / bw, max(rec.grad, 4) * frac / bw
        else:
            exposed += out["fsdp"]
    if workload.optimizer_entry.orthogonalizes and plan.zero_stage >= 2 and shard > 1:
        # Muon under FSDP2: the optimizer step all-gathers each matrix's fp32 update (one collective a matrix),
        # once per step, after the backward: nothing to overlap it with
        bw, _ = group_link(cluster, plan.dp_shard, inner_cp)
        shapes = muon_shapes(cfg, layers)
        out["muon_gather"] = (shard - 1) / shard * 4 * sum(r * c for r, c in shapes) / bw + len(shapes) * latency
        exposed += out["muon_gather"]
    if plan.dp_replicate > 1:
        bw, _ = group_link(cluster, plan.dp_replicate, plan.dp_shard * inner_cp)
        n = plan.dp_replicate
        grad_bytes = max(rec.grad, 4) / shard if plan.zero_stage >= 2 else rec.grad
        grads = psi * grad_bytes
        buckets = max(1.0, grads / DDP_BUCKET_BYTES)  # DDP's buckets, one all-reduce each
        # FSDP2 (HSDP) all-reduces each unit's reduce-scattered gradients every micro-batch; DDP once a step
        out["dp"] = (micro if plan.zero_stage >= 2 else 1) * (2 * (n - 1) / n * grads / bw + buckets * latency)
        replicate = 2 * (n - 1) / n * grad_bytes / bw
        broadcast = 0.0
        if plan.zero_stage == 1:  # ZeroRedundancyOptimizer broadcasts the updated shards, one broadcast per
            tensors = layers * PARAM_TENSORS_PER_BLOCK + (2 if cfg.tie_embeddings else 3)  # parameter tensor
            broadcast = (n - 1) / n * psi * rec.param / bw + tensors * latency
            out["dp"] += broadcast
        # GPU: the broadcast follows the optimizer step, nothing to overlap it with
        exposed += broadcast if gpu else out["dp"]
    if gpu and (gather or reduce or replicate):
        exposed += data_parallel_exposed(workload, plan, compute / micro, micro, gather, reduce, replicate)
    if plan.ep > 1:  # expert parallelism: each sparse block dispatches and combines its routed tokens
        host = 0.0 if gpu else GLOO_ALL_TO_ALL_HOST_S
        out["ep"] = micro * all_to_all_seconds(workload, plan, cluster, tokens, latency, host)
        exposed += out["ep"]
    if plan.pp > 1:
        bw, _ = group_link(cluster, plan.pp, plan.dp * inner_cp)
        out["pp"] = micro * 2 * act / bw
        exposed += out["pp"]
    return out, exposed
