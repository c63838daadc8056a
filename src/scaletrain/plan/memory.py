"""Memory per device: model states (the ZeRO paper's accounting) plus activations, transients and buffers.

Two layers:

* ``model_states`` is the textbook accounting of Rajbhandari et al. 2020 (ZeRO), exact and tested:
  mixed-precision Adam keeps 2Psi params + 2Psi grads + 12Psi optimizer (4Psi fp32 master + 4Psi m + 4Psi v);
  stage 1 shards the 12Psi, stage 2 also the grads, stage 3 also the params.
* ``memory_breakdown`` follows one training step of scaletrain's Llama in time (forward, loss, backward
  block by block, optimizer) and reports the breakdown at its peak. The activation counts are the tensors
  autograd saves in ``scaletrain.model.decoder`` (checked against ``saved_tensors_hooks`` in the tests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scaletrain.config import ModelConfig
from scaletrain.model.config import head_width, is_moe_layer, is_sliding
from scaletrain.model.loss import rows_at_once
from scaletrain.model.presets import (  # projection_shapes: re-exported, the planner's modules read it here
    block_params,
    block_vector_params,
    expert_hidden_dim,
    ffn_hidden_dim,
    kv_heads,
    moe_extra_params,
    num_params,
    projection_shapes,
    routed_expert_params,
    sparse_layers,
)
from scaletrain.plan.workload import Plan, Workload
from scaletrain.train.muon import CHUNK_ELEMENTS
from scaletrain.train.optimizer import OPTIMIZERS


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each model state, and bytes per activation element."""

    param: int
    grad: int
    master: int  # fp32 copy kept by the optimizer when params are low precision
    optimizer: int  # Adam m and v
    activation: int
    autocast: bool = False  # fp32 weights with low-precision matmuls (torch.autocast): see block_activation_bytes


RECIPES = {
    # Plain fp32 (the CPU default): no master copy, Adam m and v in fp32.
    "fp32": Recipe(param=4, grad=4, master=0, optimizer=8, activation=4),
    # Mixed precision as in the ZeRO paper (bf16/fp16 params and grads, fp32 master, m, v).
    "bf16": Recipe(param=2, grad=2, master=4, optimizer=8, activation=2),
}
RECIPES["mixed"] = RECIPES["bf16"]
# DeepSpeed ZeRO (parallel.engine = "deepspeed") in fp32: its optimizer keeps a flat fp32 copy of this rank's
# partition next to the fp32 parameters, so a master copy is there even without mixed precision (measured:
# tests/train/test_deepspeed.py).
RECIPES["deepspeed-fp32"] = Recipe(param=4, grad=4, master=4, optimizer=8, activation=4)
RECIPES["fp16"] = RECIPES["bf16"]
# The native trainer's bf16 / fp16 without FSDP's param_dtype (train/precision.autocast): the weights, their
# gradients and Adam's moments stay fp32, torch.autocast runs the matmuls in bf16 and keeps a bf16 copy of each
# weight from its forward to its backward; the residual stream and the norms stay fp32 (block_activation_bytes).
RECIPES["autocast"] = Recipe(param=4, grad=4, master=0, optimizer=8, activation=2, autocast=True)

# Stated margins on top of tensor bytes: the CUDA caching allocator fragments (~10% is what torchtitan /
# PyTorch memory snapshots commonly show); a CUDA context + NCCL takes ~1 GiB; a CPU rank's Python +
# torch libraries take ~0.4 GiB of RSS. Tensor bytes (what the accuracy benchmark checks) exclude them.
ALLOCATOR_MARGIN = {"gpu": 0.10, "cpu": 0.0}
# On a CPU the margin depends on the allocator serving malloc (hardware/allocator.py). Measured as peak RSS of
# `scaletrain train` (small preset, BPE 8192, 4 x 512, 6 steps) minus the planner's tensor bytes minus
# RUNTIME_BYTES: glibc, which the trainer tells to keep freed blocks (allocator.keep_freed_memory), holds 22%
# (fp32) and 12% (bf16) of the tensor peak beyond it; jemalloc nothing measurable (-0.4%, -1.2% total error).
# tcmalloc is not measured: taken as jemalloc. A fresh machine has no jemalloc, so a catalog CPU plans glibc.
CPU_ALLOCATOR_MARGIN = {"system": 0.17, "jemalloc": 0.0, "tcmalloc": 0.0, "custom": 0.17}
RUNTIME_BYTES = {"gpu": 1.0 * 2**30, "cpu": 0.4 * 2**30}
# FSDP2 over gloo (a CPU run on several ranks): gloo passes each all-gather and reduce-scatter through buffers of
# its own, and malloc keeps much of what they held once freed: a rank's resident set climbs for ~5 steps and
# settles well above its live tensors (exact: plan/measure.py's tracker) plus the runtime and glibc's margin.
# Measured on 2 ranks, glibc (benchmarks/planner_two_rank.py), the excess is a share of the bytes one step's
# collectives move (``fsdp_collective_bytes``): 0.87x for a 23M model at ZeRO-3, 0.66x for a 46M one with a 32k
# vocabulary, 0.75x at ZeRO-2; 0.75 is taken. Checked on a shape none of these saw (issue 36's smollm2-135m
# blocks, 49k vocabulary, 2 ranks): 3.51 GiB planned against 3.57-3.63 measured at ZeRO-3 (before: 2.16).
# DDP's in-place all-reduce of its buckets keeps nothing measurable, nor do tensor parallelism's small activation
# collectives. jemalloc is not measured (not installed on the machines measured): the same is assumed, as the
# buffers are gloo's own.
GLOO_KEPT_SHARE = 0.75


def allocator_margin(device_kind: str, allocator: str = "system") -> float:
    """The fraction of the tensor peak the allocator holds beyond it (``ALLOCATOR_MARGIN``, on a CPU by malloc)."""
    if device_kind == "cpu":
        return CPU_ALLOCATOR_MARGIN.get(allocator, CPU_ALLOCATOR_MARGIN["system"])
    return ALLOCATOR_MARGIN[device_kind]


def model_states(psi: float, stage: int, shards: int, recipe: Recipe) -> dict[str, float]:
    """Bytes of params, grads, fp32 master and optimizer states per rank for ZeRO ``stage`` over ``shards``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3 (got {stage})")
    n = max(1, shards)
    return {
        "params": psi * recipe.param / (n if stage >= 3 else 1),
        "grads": psi * recipe.grad / (n if stage >= 2 else 1),
        "master": psi * recipe.master / (n if stage >= 1 else 1),
        "optimizer": psi * recipe.optimizer / (n if stage >= 1 else 1),
    }


# --------------------------------------------------------------------------------------------------
# Activations of scaletrain's Llama block (elements), from the tensors autograd saves
# --------------------------------------------------------------------------------------------------


def block_activation_elements(cfg: ModelConfig, batch: int, seq: int, tp: int = 1,
                              sequence_parallel: bool = False) -> float:
    """Elements one TransformerBlock saves for backward.

    Per block: the two RMSNorms each save their input and rstd (2*BTd + 2*BT), and their weighted outputs
    y, y2 are saved by the linears they feed (2*BTd); SDPA saves q, k and v (after GQA repeat: full
    heads), its output (4*BT*H*hd, = 4*BTd by default) and the log-sum-exp (B*H*T); SwiGLU saves w1 out,
    silu out, w3 out and their product (4*BTh).
    Under tensor parallelism the norms run on DTensors through ``nn.RMSNorm``, whose CPU autograd also
    saves the normalized x (2*BTd more); heads and the SwiGLU hidden are split, and sequence parallelism
    also splits the norm region except the all-gathered linear inputs (y, y2), which stay full.
    """
    bt = batch * seq
    d, h = cfg.dim, ffn_hidden_dim(cfg)
    attn = cfg.n_heads * head_width(cfg)  # = d unless head pruning set model.head_dim
    sharded = (4 * bt * attn + 4 * bt * h + batch * cfg.n_heads * seq) / tp
    if tp == 1:
        norm_region = 4 * bt * d + 2 * bt
    elif sequence_parallel:
        norm_region = (4 * bt * d + 2 * bt) / tp + 2 * bt * d
    else:
        norm_region = 6 * bt * d + 2 * bt
    return sharded + norm_region + family_norm_elements(cfg, batch, seq) / tp


def family_norm_elements(cfg: ModelConfig, batch: int, seq: int, autocast: bool = False,
                         norms_train: bool = True) -> float:
    """Elements the norms of the family options save beyond the Llama block's two (0 for a Llama).

    Every norm saves its input and rstd; it also saves its normalized input when its gain gets a gradient
    (``norms_train``) through a separate product: Gemma's ``(1 + w)`` norm (``OffsetRMSNorm``), or under autocast
    a norm whose input is bf16 (q, k and each sublayer's output: ``nn.RMSNorm``'s decomposition, as the fused
    fp32 one needs equal dtypes); under autocast the input it saves is an fp32 copy. The (1 + w) norms also save
    1 + w. Per block:

    * ``norm_plus_one``: the two pre-norms' normalized inputs (2 BTd) when they train;
    * ``post_norms``: two more norms of width d over the sublayer outputs;
    * ``qk_norm``: one norm of width head_dim over each query and key head, (H + KV) BT rows (``qk_norm_width``
      projection: one over each token's queries and one over its keys, 2 BT rows).

    Checked against ``saved_tensors_hooks`` in tests/plan/test_plan_families.py (fp32 and autocast, trained and frozen
    norms). Under autocast all of it is fp32 (``block_activation_bytes``)."""
    bt, d, hd = batch * seq, cfg.dim, head_width(cfg)
    offset_normed = norms_train and cfg.norm_plus_one  # (1 + w) saves normed x for w's gradient
    low_normed = norms_train and (cfg.norm_plus_one or autocast)  # ... and so does a decomposed bf16-input norm
    total = 2 * bt * d if offset_normed else 0.0
    if cfg.post_norms:
        total += 2 * (bt * d * (1 + low_normed) + bt)
    if cfg.qk_norm:
        # one rstd per head, or per token for each of q and k (qk_norm_width projection)
        rstd_rows = 2 if cfg.qk_norm_width == "projection" else cfg.n_heads + kv_heads(cfg)
        total += bt * ((cfg.n_heads + kv_heads(cfg)) * hd * (1 + low_normed) + rstd_rows)
    if cfg.norm_plus_one:  # 1 + w of each norm
        total += 2 * d + (2 * d if cfg.post_norms else 0) + (2 * hd if cfg.qk_norm else 0)
    return total


def masked_attention_layers(cfg: ModelConfig, seq: int, layers: range | None = None) -> int:
    """How many of ``layers`` (default: all) attend through an explicit (T, T) mask at sequence ``seq``: the
    sliding-window layers once ``seq`` exceeds the window (``Attention.windowed``; shorter, the window is the
    whole causal context and plain causal SDPA runs)."""
    if cfg.sliding_window <= 0 or seq <= cfg.sliding_window:
        return 0
    return sum(is_sliding(cfg, i) for i in (layers if layers is not None else range(cfg.n_layers)))


def attention_mask_bytes(cfg: ModelConfig, seq: int, recipe: Recipe) -> float:
    """Bytes one masked layer's SDPA saves for its mask: the (T, T) boolean window converted to an additive mask
    in the attention's dtype (fp32, bf16 under autocast), one per layer, shared by the batch."""
    return seq * seq * recipe.activation


def block_activation_bytes(cfg: ModelConfig, batch: int, seq: int, recipe: Recipe, tp: int = 1,
                           sequence_parallel: bool = False, norms_train: bool = True) -> float:
    """Bytes one TransformerBlock saves for backward (``block_activation_elements`` x the recipe's bytes).

    Under autocast the tensors are of two kinds: the residual stream and the norms stay fp32 (each norm's input,
    its rstd, and SDPA's log-sum-exp), while the bf16 copies the linears cast their inputs to (y, y2), q, k, v,
    the attention output and SwiGLU's four tensors are bf16. ``norms_train`` False (a fine-tune's frozen norms):
    the family norms save no normalized copies (``family_norm_elements``)."""
    family = family_norm_elements(cfg, batch, seq)
    elements = block_activation_elements(cfg, batch, seq, tp, sequence_parallel) - family / tp
    if not recipe.autocast:
        return (elements + family_norm_elements(cfg, batch, seq, False, norms_train) / tp) * recipe.activation
    bt = batch * seq
    fp32 = (2 * bt * cfg.dim + 2 * bt) / (tp if sequence_parallel and tp > 1 else 1) + batch * cfg.n_heads * seq / tp
    fp32_family = family_norm_elements(cfg, batch, seq, True, norms_train) / tp
    return (fp32 + fp32_family) * 4 + (elements - fp32) * recipe.activation


def block_matrix_params(cfg: ModelConfig, ep: int = 1, tp: int = 1, etp: int | None = None) -> float:
    """Parameters of one block's linear layers on a rank (what autocast casts to bf16 on each forward), a sparse
    block's experts averaged over the blocks (``rank_block_params``)."""
    return rank_block_params(cfg, tp, ep, etp) - block_vector_params(cfg) / tp


# A mixture of experts' load: the busiest expert's tokens over the mean. With expert parallelism a rank computes
# what every rank routed to its experts, and the busiest rank sets the step's pace and memory; measured on nano-moe
# after 200 steps of the Gutenberg folder with the Switch auxiliary loss (benchmarks/results/moe_balance.json,
# "aux": 1.16 averaged over the layers, 1.25 the worst; the expert bias 1.06, no balancing 2.2). Taken for a rank's
# load, which is an upper bound when a rank holds several experts (their loads average).
MOE_LOAD_IMBALANCE = 1.16


def rank_block_params(cfg: ModelConfig, tp: int = 1, ep: int = 1, etp: int | None = None) -> float:
    """Parameters of one block on a rank: ``block_params`` plus, for a mixture of experts, the router, shared and
    routed experts that replace the dense feed-forward, averaged over the blocks (not every block need be sparse),
    the routed experts split over ``ep`` ranks and ``etp`` (the experts' tensor-parallel degree: ``tp`` unless
    given, ``Plan.expert_tp``); the rest over ``tp``."""
    routed = routed_expert_params(cfg)
    dense = block_params(cfg) + (sparse_layers(cfg) * moe_extra_params(cfg, active=False) - routed) / cfg.n_layers
    return dense / tp + routed / cfg.n_layers / (ep * (tp if etp is None else etp))


def stage_params(cfg: ModelConfig, pp: int, tp: int, ep: int = 1, etp: int | None = None) -> float:
    """Parameters held by the busiest pipeline stage, per tensor-parallel rank (the routed experts per expert-
    parallel rank: ``ep`` of the data-parallel ranks each hold E / ep of them, split over ``etp``, ``tp`` unless
    given)."""
    blocks = -(-cfg.n_layers // pp)  # ceil: the first stages get the extra block
    embed = cfg.vocab_size * cfg.dim
    if pp == 1:
        routed = routed_expert_params(cfg)
        return (num_params(cfg) - routed) / tp + routed / (ep * (tp if etp is None else etp))
    # The first stage holds the embedding, the last the final norm + head (tied weights are duplicated).
    return blocks * rank_block_params(cfg, tp, ep, etp) + (embed + cfg.dim) / tp


def stage_expert_params(cfg: ModelConfig, pp: int, tp: int, ep: int) -> float:
    """The routed experts' share of ``stage_params``: sharded over ``ep`` (and ``tp``), the rest is dense."""
    return routed_expert_params(cfg) / ep / tp * (-(-cfg.n_layers // pp) / cfg.n_layers)


def moe_activation_bytes(cfg: ModelConfig, batch: int, seq: int, recipe: Recipe, ep: int = 1, tp: int = 1) -> float:
    """Bytes a sparse block's feed-forward saves for backward (in place of the dense one's 4 BT h), as autograd
    saves them in model/moe.py (checked with ``saved_tensors_hooks`` in tests/plan/test_plan_moe.py): for each routed
    copy of a token (N k of them; under expert parallelism the busiest rank's, ``MOE_LOAD_IMBALANCE`` times that)
    its row gathered for the experts and its slot of the combine (2 d), the experts' four SwiGLU tensors (4 h_e);
    the router's fp32 scores (N E), the choices' int64 indices (3 a copy) and fp32 weights (2 a copy), two fp32
    sums a token; and the shared experts' SwiGLU (4 N h_e a shared expert)."""
    n, k, d, h = batch * seq, cfg.moe_top_k, cfg.dim, expert_hidden_dim(cfg)
    routed = n * k * (MOE_LOAD_IMBALANCE if ep > 1 else 1.0)
    a = recipe.activation
    experts = (2 * routed * d + 4 * routed * h / tp) * a
    router = 4 * n * cfg.moe_experts + 8 * 3 * routed + 4 * 2 * n * k + 4 * 2 * n + 8 * cfg.moe_experts
    shared = 4 * n * h * cfg.moe_shared_experts / tp * a
    return experts + router + shared


def routed_rows(cfg: ModelConfig, tokens: int, ep: int) -> float:
    """Rows the busiest rank's experts compute for ``tokens`` tokens of its own: each token's top-k copies, under
    expert parallelism the busiest rank's share of every rank's (``MOE_LOAD_IMBALANCE`` times the mean)."""
    return tokens * cfg.moe_top_k * (MOE_LOAD_IMBALANCE if ep > 1 else 1.0)


@dataclass
class MemoryBreakdown:
    """Bytes per device at the step's peak, by what holds them (the parts sum to ``tensor_total``)."""

    params: float
    grads: float
    master: float
    optimizer: float
    activations: float  # saved activations live at the peak
    transients: float  # logits / backward temporaries / optimizer temporaries live at the peak
    comm_buffers: float
    tensor_total: float
    gloo_buffers: float  # not tensors: what gloo's collectives leave held by malloc (CPU FSDP2: GLOO_KEPT_SHARE)
    allocator_margin: float
    runtime: float
    total: float
    peak_phase: str
    saved_activations: float  # at the end of the forward, for reference
    offloaded: float  # bytes moved to host memory by cpu_offload

    def as_dict(self) -> dict:
        return asdict(self)


def muon_matrix_params(cfg: ModelConfig, layers: int, tp: int = 1) -> float:
    """Parameters Muon takes (``optim.name = muon``, train/muon.py) in ``layers`` blocks per tensor-parallel
    rank: every block weight but the two norms."""
    return layers * block_matrix_params(cfg) / tp


def muon_shapes(cfg: ModelConfig, layers: int) -> list[tuple[int, int]]:
    """(out, in) of every matrix Muon orthogonalizes in ``layers`` blocks: each block's projections."""
    return [(o, i) for i, o in projection_shapes(cfg).values()] * layers


def muon_step_transient_bytes(matrix_params: float, largest_matrix: float) -> float:
    """fp32 bytes the Muon step holds besides the states (train/muon.py): the batched Newton-Schulz over one chunk
    of (gathered) matrices keeps the chunk's updates, its stacked iterate and the next one, ~3x the chunk, plus
    one matrix's Gram work, charged as 4x the largest matrix."""
    return 4 * (3 * min(matrix_params, CHUNK_ELEMENTS) + 4 * largest_matrix)


def loss_rows(workload: Workload, plan: Plan, positions: int, deepspeed: bool = False, device_kind: str = "gpu"
              ) -> int:
    """Positions whose fp32 logits the loss holds at once on a rank: the micro-batch's ``positions``, or a chunk
    of them with the chunked loss (``model.loss.rows_at_once``, the trainer's own rule: its auto chunk is larger
    on an accelerator), which runs without tensor or pipeline parallelism and outside DeepSpeed
    (``train.loss.loss_chunk_rows``)."""
    if plan.tp > 1 or plan.pp > 1 or deepspeed:
        return positions
    return rows_at_once(positions, workload.model.vocab_size, workload.loss_chunk_rows, device_kind)


def chunked_loss_backward(rows: int, positions: int, dim: int, vocab: int, autocast: bool,
                          head_trains: bool = True) -> tuple[float, float]:
    """(transient bytes, head-gradient elements) of the chunked loss's backward: a chunk's recomputed logits and
    their gradient (2 chunks; its bf16 copy under autocast), the hidden states' gradient (positions x dim, fp32),
    and the head's fp32 gradient (vocab x dim elements), accumulated in place when the head trains. Measured on
    4 x 1024 x 151,936 x 896, fp32: 2.44 chunks with a frozen head, 18.73 with a trained one (the 519 MiB
    gradient)."""
    chunk = rows * vocab * 4
    transients = (2.5 if autocast else 2.0) * chunk + positions * dim * 4
    if head_trains and autocast:
        transients += vocab * dim * 2  # each chunk's bf16 (V, d) product before it is added in fp32
    return transients, (vocab * dim if head_trains else 0.0)


def memory_breakdown(workload: Workload, plan: Plan, device_kind: str = "gpu",
                     foreach_optimizer: bool | None = None, allocator: str = "system",
                     optimizer: str | None = None) -> MemoryBreakdown:
    """Simulate the live bytes of one step and return the breakdown at its peak.

    ``foreach_optimizer``: AdamW's foreach kernel (``optim.implementation = foreach``) allocates one temporary
    the size of the largest parameter group for sqrt(v); the fused kernel (the default on CPU and GPU) does not.
    ``allocator`` (CPU): the malloc the run uses (``CPU_ALLOCATOR_MARGIN``), ``Hardware.allocator``.
    ``optimizer`` (default: the workload's, ``Workload.optimizer``): its entry of the optimizer table
    (train/optimizer.py) sets the state bytes per parameter, on the blocks' matrices only when ``matrices`` (Muon:
    one fp32 momentum buffer instead of AdamW's two moments), and with ``orthogonalizes`` the step holds
    Newton-Schulz's temporaries of the largest matrix (the whole matrix, gathered, under FSDP).
    """
    cfg, rec = workload.model, recipe_for(workload, plan)
    entry = OPTIMIZERS[optimizer or workload.optimizer]
    foreach = bool(foreach_optimizer)
    tp, pp, ep, etp = plan.tp, plan.pp, plan.ep, plan.expert_tp
    psi = stage_params(cfg, pp, tp, ep, etp)
    deepspeed = plan.engine == "deepspeed"
    shards = plan.dp if deepspeed else plan.dp_shard * plan.cp if plan.zero_stage >= 2 else plan.dp_replicate
    # The routed experts, split over ep ranks, are sharded by ZeRO over what is left of the shard group (the
    # experts' own data-parallel group, torchtitan's edp; folded, Megatron's, its tp ranks too); the dense part as
    # ever.
    experts = stage_expert_params(cfg, pp, etp, ep)
    expert_states = model_states(experts, plan.zero_stage, max(1, shards * tp // (ep * etp)), rec)
    states = {k: v + expert_states[k] for k, v in model_states(psi - experts, plan.zero_stage, shards, rec).items()}
    layers = -(-cfg.n_layers // pp)
    if psi:  # the entry's state bytes on its parameters (Muon: half AdamW's on the matrices, m only, no v)
        share = muon_matrix_params(cfg, layers, tp) / psi if entry.matrices else 1.0
        states["optimizer"] *= 1 - share * (1 - entry.state_share())
    offloaded = 0.0
    if plan.cpu_offload:  # FSDP2 CPUOffloadPolicy: sharded params, grads and states live in host memory
        offloaded = sum(states.values())
        states = {k: 0.0 for k in states}
    if deepspeed and plan.offload != "none":
        states, offloaded = deepspeed_offload(states, plan, device_kind)

    a = rec.activation
    b, t = plan.micro_batch, workload.seq_len // plan.cp
    d, v = cfg.dim, cfg.vocab_size
    blk = block_activation_bytes(cfg, b, t, rec, tp, plan.sequence_parallel)
    # A checkpointed block keeps its input: the residual stream, fp32 under autocast.
    ckpt_input = b * t * d * (4 if rec.autocast else a) / (tp if plan.sequence_parallel and tp > 1 else 1)
    ckpt = checkpointed_blocks(layers, plan.activation_checkpointing, plan.ac_every)
    in_flight = 1 if pp == 1 else (plan.microbatches if plan.pp_schedule == "gpipe" else min(pp, plan.microbatches))
    # A sliding-window layer's SDPA also saves its (T, T) mask (not under checkpointing: only in the recompute).
    mask = attention_mask_bytes(cfg, t, rec)
    # A sparse block saves its routed tokens' tensors instead of the dense feed-forward's four (B, T, h).
    # Folded (Plan.ep_folded): a rank's sequence-parallel share of the tokens, through experts unsplit by tp.
    sparse = (moe_activation_bytes(cfg, b, t // plan.expert_token_split, rec, ep, etp)
              - 4 * b * t * ffn_hidden_dim(cfg) / tp * rec.activation)
    full_block = [blk + mask * masked_attention_layers(cfg, t, range(i, i + 1)) + sparse * is_moe_layer(cfg, i)
                  for i in range(layers)]
    per_block = [ckpt_input if i in ckpt else full_block[i] for i in range(layers)]
    # Other in-flight pipeline micro-batches keep their whole stage's saved activations.
    others = (in_flight - 1) * sum(per_block)
    saved_blocks = sum(per_block) + others
    # Final norm (input, normalized, output) and log-softmax output; logits in fp32 for the loss.
    bt = b * t
    held = loss_rows(workload, plan, bt, deepspeed, device_kind)
    chunked = held < bt  # the chunked loss (model/loss.py): a chunk's logits at a time, a log-sum-exp a row saved
    tail = 3 * bt * d * (4 if rec.autocast else a) + (bt * 4 if chunked else bt * v / tp * 4)
    logits = held * v / tp * 4
    # Under autocast the head returns bf16 logits, which the loss casts to fp32: both are alive in the forward.
    # A chunk: its logits and log-sum-exp's temporary (measured 2.00 chunks, 4 x 1024 x 151,936, fp32).
    fwd_logits = 2 * logits if chunked else logits * (1.5 if rec.autocast else 1.0)
    loss_bwd, loss_grads = chunked_loss_backward(held, bt, d, v, rec.autocast) if chunked else (2 * logits, 0.0)
    # Autocast's bf16 weight copies: each saved by its linear from the forward until that linear's backward.
    cast_block = 2 * block_matrix_params(cfg, ep, tp, etp) if rec.autocast else 0.0
    cast_head = 2 * v * d / tp if rec.autocast else 0.0

    block_p = rank_block_params(cfg, tp, ep, etp)
    head_p = psi - layers * block_p
    unsharded_p = psi * rec.param if plan.zero_stage >= 2 else 0.0  # FSDP gathers to full size on use
    comm = _comm_buffers(plan, rec, psi, block_p, bt, d)
    # FSDP2's working set moves with the step: around the loss the root unit (embedding, final norm, head)
    # is gathered; in a block's backward that block and the prefetched next one are gathered and the
    # block's full gradient waits for its reduce-scatter.
    fsdp = plan.zero_stage >= 2 and plan.dp_shard * plan.cp > 1 and not plan.cpu_offload
    fsdp_at_loss = head_p * rec.param if fsdp and plan.zero_stage == 3 else 0.0
    fsdp_in_block = ((2 * block_p * rec.param if plan.zero_stage == 3 else 0.0) + block_p * max(rec.grad, 4)
                     if fsdp else 0.0)

    # At-rest bytes (before a step): params, master, optimizer; grads are None between steps.
    base = states["params"] + states["master"] + states["optimizer"] + comm
    # reshard_after_forward=False (stage 2) keeps every gathered param from forward to backward. FSDP2 keeps the
    # parameters sharded at rest at stage 2 too (the optimizer's parameter is the shard), so the gathered copy lives
    # beside the shard (measured: 403 MiB of tensors, not 359, for a 23M model on 2 ranks).
    held_params = unsharded_p - states["params"] if plan.zero_stage == 2 else 0.0
    if fsdp and plan.zero_stage == 2 and not deepspeed:
        states["params"] = unsharded_p / shards
        held_params = unsharded_p
        base = states["params"] + states["master"] + states["optimizer"] + comm
    # DDP (gradient_as_bucket_view=True in scaletrain.parallel.ddp) keeps gradients inside its buckets,
    # counted once as communication buffers; otherwise gradients appear as backward produces them.
    in_buckets = plan.dp_replicate > 1 and plan.zero_stage <= 1
    grad_scale = 0.0 if in_buckets or not psi else states["grads"] / psi
    full_grad_bytes = 0.0 if plan.cpu_offload or in_buckets else states["grads"]
    # Gradient of the hidden state plus SwiGLU gradients while the block's own saved tensors are being freed.
    ffn_rows = max(bt * ffn_hidden_dim(cfg), routed_rows(cfg, bt, ep) * expert_hidden_dim(cfg) if cfg.moe_experts
                   else 0.0)  # a sparse block's: its routed copies' SwiGLU gradients
    bwd_tmp = (2 * bt * d + 1.5 * ffn_rows / tp) * a

    phases: list[tuple[str, dict]] = []
    # End of forward: every saved activation plus logits and log-softmax output side by side.
    # A checkpointed block's forward saves nothing, its casts included: they live again only in its recompute.
    casts = (layers - len(ckpt)) * cast_block + cast_head
    phases.append(("forward (loss)", dict(activations=saved_blocks + tail, transients=fwd_logits,
                                          held=held_params + casts, comm=fsdp_at_loss)))
    # Loss backward: grad of log-probs and grad of logits next to the saved log-softmax output.
    phases.append(("backward (loss)", dict(activations=saved_blocks + tail, transients=loss_bwd,
                                           held=held_params + casts, comm=fsdp_at_loss,
                                           grads=loss_grads * grad_scale)))
    # Backward of each block, last first: saved activations shrink as gradients grow. A checkpointed block
    # is re-materialised whole (recomputed) just before its backward.
    for i in range(layers - 1, -1, -1):
        live = sum(per_block[:i]) + full_block[i] + others
        done = head_p + (layers - i) * block_p
        phases.append((f"backward (block {i})", dict(activations=live, transients=bwd_tmp,
                                                      held=held_params + cast_block * (
                                                          1 + sum(j not in ckpt for j in range(i))),
                                                      grads=done * grad_scale, comm=fsdp_in_block)))
    # Optimizer: all grads present; foreach AdamW allocates sqrt(v) for the largest param group.
    opt_tmp = (layers * block_p + (0 if cfg.tie_embeddings else v * d / tp)) * 4 / max(1, shards if
                                                                                       plan.zero_stage >= 1 else 1)
    opt_transient = opt_tmp if foreach and not plan.cpu_offload else 0.0
    if entry.orthogonalizes:  # batched Newton-Schulz over a chunk of (gathered) matrices (train/muon.py: chunks)
        opt_transient = muon_step_transient_bytes(muon_matrix_params(cfg, layers), max(d, ffn_hidden_dim(cfg)) * d)
    phases.append(("optimizer step", dict(activations=0.0, transients=opt_transient, held=0.0,
                                          grads=full_grad_bytes)))

    best_name, best, best_total = "", {}, -1.0
    for name, ph in phases:
        total = (base + ph["activations"] + ph["transients"] + ph.get("held", 0.0) + ph.get("grads", 0.0)
                 + ph.get("comm", 0.0))
        if total > best_total:
            best_name, best, best_total = name, ph, total
    # glibc's CPU margin comes from gradients allocated anew every step between the activations; DDP keeps them in
    # its buckets (allocated once), and 2-rank DDP runs measured no margin (946 MiB vs 946 of tensors and runtime
    # for a 23M model, 1368 vs 1389 for a 46M one: benchmarks/planner_two_rank.py).
    margin = 0.0 if device_kind == "cpu" and in_buckets else best_total * allocator_margin(device_kind, allocator)
    runtime = RUNTIME_BYTES[device_kind]
    gloo = GLOO_KEPT_SHARE * fsdp_collective_bytes(plan, psi, layers * block_p, rec) \
        if device_kind == "cpu" and fsdp and not deepspeed else 0.0
    return MemoryBreakdown(
        params=states["params"] + best.get("held", 0.0), grads=best.get("grads", 0.0), master=states["master"],
        optimizer=states["optimizer"], activations=best["activations"], transients=best["transients"],
        comm_buffers=comm + best.get("comm", 0.0), tensor_total=best_total, gloo_buffers=gloo,
        allocator_margin=margin, runtime=runtime, total=best_total + gloo + margin + runtime, peak_phase=best_name,
        saved_activations=saved_blocks + tail, offloaded=offloaded)


def fsdp_collective_bytes(plan: Plan, psi: float, blocks_p: float, rec: Recipe) -> float:
    """Bytes one step's FSDP2 collectives move on a rank, counted at their unsharded size: the all-gathers of the
    parameters (ZeRO-3: each block in the forward and again in the backward, the root unit, embedding and head,
    once, as FSDP2 keeps the root gathered from forward to backward; ZeRO-2: everything once) and the
    reduce-scatter of every gradient (in fp32). ``blocks_p``: the blocks' parameters, the rest is the root's."""
    gathered = 2 * blocks_p + (psi - blocks_p) if plan.zero_stage == 3 else psi
    return gathered * rec.param + psi * max(rec.grad, 4)


def deepspeed_offload(states: dict[str, float], plan: Plan, device_kind: str) -> tuple[dict[str, float], float]:
    """(states left on the device, bytes moved off it) under DeepSpeed's offload: the fp32 master and Adam
    moments always, the parameter partition at ZeRO-3 (offload_param), and on a GPU the gradient partition
    (DeepSpeed keeps it in host memory for the host-side step). On a CPU only NVMe moves anything, and the fp32
    gradient partition stays in memory (measured: benchmarks/deepspeed_nvme.py)."""
    if device_kind == "cpu" and plan.offload != "nvme":
        return states, 0.0
    moved = {"master", "optimizer"} | ({"params"} if plan.zero_stage == 3 else set())
    if device_kind != "cpu":
        moved.add("grads")
    return ({k: 0.0 if k in moved else v for k, v in states.items()},
            sum(v for k, v in states.items() if k in moved))


def checkpointed_blocks(layers: int, mode: str, every: int) -> set[int]:
    """Indices of the blocks ``scaletrain.parallel.apply_ac`` wraps: all (full), or 0, k, 2k, ... (selective)."""
    if mode == "none":
        return set()
    return set(range(layers)) if mode == "full" else set(range(0, layers, every))


def _comm_buffers(plan: Plan, rec: Recipe, psi: float, block_p: float, bt: int, d: int) -> float:
    """Communication buffers held for the whole step (FSDP's moving working set is added per phase)."""
    total = 0.0
    if plan.dp_replicate > 1 and plan.zero_stage <= 1:
        total += psi * rec.grad  # DDP gradient buckets: they hold the gradients for the whole step
    if plan.pp > 1:
        total += 2 * bt * d * rec.activation  # send + receive buffers of one micro-batch's hidden states
    if plan.cp > 1:
        total += 2 * bt * plan.cp * d * rec.activation  # ring attention's full-sequence K and V of one layer
    return total


def recipe_for(workload: Workload, plan: Plan) -> Recipe:
    """The bytes recipe of ``plan``'s step: mixed precision without FSDP's bf16 ``param_dtype`` (which the
    planner's jobs set for sharded plans, ``spec.job_config``) is the native trainer's autocast; DeepSpeed keeps
    its own (the module in bf16, an fp32 master in the optimizer; in fp32 a flat fp32 copy too)."""
    deepspeed = plan.engine == "deepspeed"
    if deepspeed and workload.precision == "fp32":
        return RECIPES["deepspeed-fp32"]
    sharded = plan.zero_stage >= 2 and plan.dp_shard * plan.cp > 1
    if not deepspeed and not sharded and workload.precision in ("bf16", "mixed", "fp16"):
        return RECIPES["autocast"]
    return RECIPES[workload.precision]
