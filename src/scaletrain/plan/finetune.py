"""What fine-tuning changes in the memory model: frozen weights without gradients or optimizer states, a
4-bit base for QLoRA, small adapter states (``scaletrain plan --method``, docs/finetuning.md).

The activations and the loss's transients are pretraining's (``memory.memory_breakdown``: LoRA still
backpropagates through every block to reach the adapters of the lower ones), over ``seq_len +
virtual_tokens`` positions for prompt tuning - less what frozen projections do not save: a linear layer
keeps its input only for its weight gradient, so the attention norm's output (q, k, v's input), the SwiGLU
norm's output (gate, up) and the SwiGLU product (down) are not saved when none of the projections that
read them trains (``unsaved_activation_elements``). Checked by ``benchmarks/finetune_plan.py``.

Step time (``finetune_step_time``): pretraining's time model (``timing.py``: GEMMs, attention, elementwise
work and dispatch at the measured CPU rates, or FLOPs at peak x utilisation on a GPU) with what a frozen
weight does not cost: a frozen linear layer's backward is one GEMM (the input gradient) instead of two, and
none at all where its input needs no gradient (q, k, v of the first block when nothing below trains);
the frozen head has no weight gradient and the embedding none; AdamW steps only the trainable tensors.
With ``optim.name = muon`` the trainable matrices Muon takes (``finetune_muon_shapes``: a full fine-tune's
block matrices, LoRA's adapters with ``muon_adapters``) keep one momentum buffer instead of two moments and
add Newton-Schulz to the step (``timing.newton_schulz_seconds``).
LoRA adds its two thin GEMMs a target, forward and backward (DoRA also the row norms of W + s B A each
forward). QLoRA dequantizes every 4-bit weight once in
the forward and once more for the input gradient (torchao's ``LinearNF4``), at the rate
``measure_nf4_dequant`` measures (CPU; under autocast each input gradient's dequantization also casts its fp32
result to bf16, ``nf4_gradient_cast_rate``) or, on a GPU, as ``GPU_NF4_DEQUANT_BYTES_PER_WEIGHT`` bytes of traffic a
weight at memory bandwidth (calibrated on the GPU check's measured QLoRA step). With ``finetune.qlora_compile`` on
(the trainer's own rule, ``finetune.lora.qlora_compiled``: auto compiles on a GPU) the dequantization is compiled
and charged at its own named rates (``nf4_dequant_rate``): measured on the CPU, and on a GPU still today's eager
value until the GPU check's ``qlora-compiled`` row measures it.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from scaletrain.config import ConfigError, FinetuneConfig, ModelConfig
from scaletrain.finetune.flops import trained_flops_per_token
from scaletrain.finetune.method_table import method_entry
from scaletrain.finetune.objectives import objective_entry
from scaletrain.hardware.catalog import Cluster
from scaletrain.model.config import head_width, is_moe_layer
from scaletrain.model.loss import CHUNK_BYTES
from scaletrain.model.presets import ffn_hidden_dim, matmul_params, moe_extra_params, num_params, sparse_layers
from scaletrain.plan.memory import (
    RECIPES,
    RUNTIME_BYTES,
    allocator_margin,
    block_activation_bytes,
    block_activation_elements,
    block_matrix_params,
    checkpointed_blocks,
    chunked_loss_backward,
    loss_rows,
    masked_attention_layers,
    memory_breakdown,
    muon_shapes,
    muon_step_transient_bytes,
    projection_shapes,
    recipe_for,
)
from scaletrain.plan.timing import (
    DTYPE_OF_PRECISION,
    GPU_LAUNCH_SECONDS,
    OPS_PER_BLOCK,
    attention_seconds,
    chunked_head_seconds,
    family_block_ops,
    gemm_seconds,
    gpu_utilisation,
    group_link,
    head_gemm_seconds,
    interp_curve,
    loss_recompute_seconds,
    masked_attention_factor,
    newton_schulz_seconds,
    planned_mfu,
    precision_rates,
)
from scaletrain.plan.workload import Plan, Workload

# Bytes per weight of torchao's NF4 with double quantization at QLoRA's blocks (64 weights a scale, 256
# scales a factor): 4-bit codes, one int8 scale a block, one fp32 factor and mean per 256 scales.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 8 / (64 * 256)


def trainable_parameters(cfg: ModelConfig, ft: FinetuneConfig) -> int:
    """Parameters that train under ``ft.method`` (adapters, or the unfrozen weights of a full fine-tune)."""
    return method_entry(ft.method).trainable_parameters(cfg, ft)  # finetune/method_table.py


def finetune_muon_shapes(workload: Workload, ft: FinetuneConfig) -> list[tuple[int, int]]:
    """(rows, cols) of the trainable matrices Muon takes when ``workload.optimizer``'s entry takes the
    ``matrices`` (muon; train/muon.py:muon_matrices): a full fine-tune's block matrices (of the blocks not frozen); with
    ``workload.muon_adapters`` each LoRA / QLoRA target's lora_A (rank, in) and lora_B (out, rank), not DoRA's
    magnitude vectors. Nothing else: frozen weights have no update and the other methods train no block matrix."""
    cfg = workload.model
    if not workload.optimizer_entry.matrices:
        return []
    shapes = projection_shapes(cfg)
    if method_entry(ft.method).trains_base:
        return muon_shapes(cfg, max(0, cfg.n_layers - ft.freeze_blocks))
    if method_entry(ft.method).lora and workload.muon_adapters:
        r = ft.lora_rank
        return [pair for t in ft.lora_targets for pair in ((r, shapes[t][0]), (shapes[t][1], r))] * cfg.n_layers
    return []


def frozen_bytes(cfg: ModelConfig, ft: FinetuneConfig, param_bytes: int = 4) -> float:
    """Bytes of the frozen base: everything but the trainable weights; QLoRA's block projections in NF4."""
    if method_entry(ft.method).trains_base:
        return (num_params(cfg) - trainable_parameters(cfg, ft)) * param_bytes
    total = num_params(cfg)
    if not method_entry(ft.method).quantized_base:
        return total * param_bytes
    projections = quantized_weights(cfg)
    return projections * NF4_BYTES_PER_WEIGHT + (total - projections) * param_bytes


def quantized_weights(cfg: ModelConfig) -> int:
    """Weights QLoRA holds in NF4: every block's projections and, of a sparse block, the router and every expert's
    stacked gate / up / down (``lora._quantize_experts``) in place of the dense feed-forward."""
    dense = cfg.n_layers * sum(i * o for i, o in projection_shapes(cfg).values())
    return dense + sparse_layers(cfg) * moe_extra_params(cfg, active=False)


def _trains(ft: FinetuneConfig, targets: tuple[str, ...]) -> bool:
    """Whether any of the projections ``targets`` gets a weight (or adapter) gradient under ``ft``."""
    if method_entry(ft.method).lora:
        return any(t in ft.lora_targets for t in targets)
    return method_entry(ft.method).trains_base  # (a full fine-tune's frozen first blocks are not modelled: rarely many)


def unsaved_activation_elements(cfg: ModelConfig, ft: FinetuneConfig, batch: int, seq: int) -> float:
    """Elements pretraining saves for backward that a fine-tune under ``ft`` does not: inputs of projections
    none of whose readers trains."""
    bt, d, h = batch * seq, cfg.dim, ffn_hidden_dim(cfg)
    per_block = ((0 if _trains(ft, ("q", "k", "v")) else bt * d)  # attention norm's output
                 + (0 if _trains(ft, ("gate", "up")) else bt * d)  # SwiGLU norm's output
                 + (0 if _trains(ft, ("down",)) else bt * h))  # silu(gate) * up
    return cfg.n_layers * per_block


def finetune_memory(workload: Workload, plan: Plan, ft: FinetuneConfig, device_kind: str = "cpu") -> dict:
    """Peak bytes per device of one fine-tuning step on one process (data parallelism replicates it), with
    the parts that make it. The same phases as pretraining, with the model states replaced:
    frozen weights + trainable weights, their gradients and AdamW states."""
    method = method_entry(ft.method)  # finetune/method_table.py
    if method.input_tokens:
        workload = dataclasses.replace(workload, seq_len=workload.seq_len + ft.virtual_tokens)
    rec = recipe_for(workload, plan)  # bf16: the trainer's autocast (fp32 frozen and trainable weights)
    pretrain = memory_breakdown(workload, plan, device_kind)
    trainable = trainable_parameters(workload.model, ft)
    frozen = frozen_bytes(workload.model, ft, rec.param)
    # Optimizer state: the entry's bytes on the parameters its rule updates (Muon's one momentum buffer a matrix
    # element), AdamW's two moments on the rest
    entry = workload.optimizer_entry
    muon = finetune_muon_shapes(workload, ft)
    on_muon = sum(r * c for r, c in muon)
    own = on_muon if entry.matrices else trainable  # the parameters the entry's own rule updates
    optimizer_bytes = (trainable - own) * rec.optimizer + own * rec.optimizer * entry.state_share()
    at_rest = frozen + trainable * (rec.param + rec.master) + optimizer_bytes
    bt, vocab = plan.micro_batch * workload.seq_len, workload.model.vocab_size
    held = loss_rows(workload, plan, bt, device_kind=device_kind)
    if held < bt:  # the chunked loss: a chunk's logits, the hidden states' gradient, a trained head's gradient
        transients, head_grad = chunked_loss_backward(held, bt, workload.model.dim, vocab, rec.autocast,
                                                      head_trains=method.trains_base and not ft.freeze_embeddings)
        loss_transients = transients + head_grad * rec.grad
    else:  # the whole logits: the log-softmax output and the logits' gradient
        loss_transients = 2 * bt * vocab * 4
    # End of forward / loss backward: saved activations, log-softmax output, gradient of the logits.
    # Checkpointed blocks save only their input; the frozen-input saving applies to un-checkpointed ones.
    unsaved = unsaved_activation_elements(workload.model, ft, plan.micro_batch, workload.seq_len) \
        if plan.activation_checkpointing == "none" else 0.0
    activations = pretrain.saved_activations - rec.activation * unsaved
    if not method.trains_base and plan.activation_checkpointing == "none":
        # Frozen norm gains: the family norms (q/k, post-sublayer, (1 + w)) save no normalized copy for them.
        b, t = plan.micro_batch, workload.seq_len
        model = workload.model
        activations -= model.n_layers * (block_activation_bytes(model, b, t, rec)
                                         - block_activation_bytes(model, b, t, rec, norms_train=False))
    if ft.dora and method.lora and plan.activation_checkpointing == "none":
        # DoRA's magnitude multiplies the base output and the scaled adapter output: both are saved for its
        # gradient (one (tokens, out) tensor each per adapted projection)
        shapes = projection_shapes(workload.model)
        activations += rec.activation * workload.model.n_layers * sum(2 * bt * shapes[t][1]
                                                                      for t in ft.lora_targets if t in shapes)
    # Under autocast each linear keeps the bf16 copy of its fp32 weight from its forward to its backward (pretraining's
    # ``cast_block`` / ``cast_head``): every frozen projection of the blocks that are not checkpointed, and the head;
    # QLoRA's NF4 projections keep nothing (torchao dequantizes them again for the backward).
    casts = 0.0
    if rec.autocast:
        cfg = workload.model
        kept = cfg.n_layers - len(checkpointed_blocks(cfg.n_layers, plan.activation_checkpointing, plan.ac_every))
        casts = 2 * ((0 if method.quantized_base else kept * block_matrix_params(cfg)) + cfg.vocab_size * cfg.dim)
    loss_phase = at_rest + activations + casts + loss_transients
    # Optimizer: every trainable gradient (the fused AdamW kernel, the default, allocates no temporary), and
    # Muon's Newton-Schulz temporaries
    optimizer_phase = at_rest + trainable * rec.grad
    if muon and entry.orthogonalizes:
        optimizer_phase += muon_step_transient_bytes(on_muon, max(r * c for r, c in muon))
    tensor_total = max(loss_phase, optimizer_phase)
    return {"method": ft.method, "trainable_parameters": trainable, "frozen_bytes": frozen,
            "trainable_state_bytes": trainable * (rec.param + rec.grad + rec.master) + optimizer_bytes,
            "optimizer_state_bytes": optimizer_bytes, "muon_parameters": on_muon,
            "activations": activations, "weight_casts": casts, "tensor_total": tensor_total,
            "peak_phase": "loss" if loss_phase >= optimizer_phase else "optimizer step",
            "loss_phase_bytes": loss_phase, "optimizer_phase_bytes": optimizer_phase,
            "pretraining_tensor_total": pretrain.tensor_total}


def preference_memory(workload: Workload, plan: Plan, ft: FinetuneConfig, device_kind: str = "cpu",
                      reference: str = "auto") -> dict:
    """Peak bytes of one preference step (``finetune.objective`` dpo / simpo / orpo; finetune/preference.py):
    ``plan.micro_batch`` pairs are 2 x micro_batch rows (chosen and rejected through one forward), so the
    step is ``finetune_memory``'s at twice the rows. DPO's reference (``reference``, 'auto' = what the trainer
    does): 'adapters' (LoRA/DoRA/QLoRA: the same model with its adapters off) adds, in the loss phase while the
    policy's activations are held, one no-grad forward of the same rows, at its largest moment (the logits and
    their log-softmax, or a block's SwiGLU); 'precomputed' (method=full) adds nothing to the step (two floats a pair,
    computed before training by a no-grad pass); 'copy' (a frozen second model, which the trainer does not
    build: for comparison) adds the same forward plus the frozen weights."""
    rows = dataclasses.replace(plan, micro_batch=2 * plan.micro_batch)
    est = finetune_memory(workload, rows, ft, device_kind)
    if reference == "auto":
        reference = ("none" if not objective_entry(ft.objective).reference
                     else "precomputed" if method_entry(ft.method).trains_base else "adapters")
    extra = 0.0
    if reference in ("adapters", "copy"):
        rec = recipe_for(workload, rows)
        bt, model = rows.micro_batch * workload.seq_len, workload.model
        # A no-grad forward saves nothing: its peak is its largest moment on top of the residual stream, the
        # fp32 logits with their log-softmax at the end, or the SwiGLU's gate, up and product inside a block.
        # The head runs on ``reference_rows`` rows at a time (finetune/preference.py ``scored_logps``).
        head_rows = min(rows.micro_batch, max(1, CHUNK_BYTES // (4 * model.vocab_size * workload.seq_len)))
        logits = head_rows * workload.seq_len * model.vocab_size * 4
        forward = max(2 * logits, 3 * bt * ffn_hidden_dim(model) * rec.activation) + bt * model.dim * rec.activation
        extra = forward + (num_params(model) * rec.param if reference == "copy" else 0.0)
    loss_phase = est["loss_phase_bytes"] + extra
    tensor_total = max(loss_phase, est["optimizer_phase_bytes"])
    return {**est, "objective": ft.objective, "reference": reference, "rows": rows.micro_batch,
            "reference_bytes": extra, "loss_phase_bytes": loss_phase, "tensor_total": tensor_total,
            "peak_phase": "loss" if loss_phase >= est["optimizer_phase_bytes"] else "optimizer step"}


def preference_step_time(workload: Workload, plan: Plan, cluster: Cluster, ft: FinetuneConfig,
                         reference: str = "auto") -> dict:
    """Predicted seconds per optimizer step of a preference fine-tune (dpo / simpo / orpo): ``plan.micro_batch``
    and ``workload.global_batch`` count pairs, each two rows through one forward and backward, so the step is
    ``finetune_step_time``'s at twice the rows; DPO's reference (``reference``, 'auto' as the trainer does)
    'adapters' adds the base's no-grad forward of the same rows each micro-batch; 'precomputed' (method=full)
    adds nothing to the step (its one pass before training, over the whole data, is ``reference_pass_seconds``
    a micro-batch of pairs); 'copy' (a frozen second model, for comparison) costs what 'adapters' does."""
    rows = dataclasses.replace(plan, micro_batch=2 * plan.micro_batch)
    est = finetune_step_time(dataclasses.replace(workload, global_batch=2 * workload.global_batch), rows, cluster, ft)
    if reference == "auto":
        reference = ("none" if not objective_entry(ft.objective).reference
                     else "precomputed" if method_entry(ft.method).trains_base else "adapters")
    per_step = est["base_forward_seconds"] * est["micro_steps"] if reference in ("adapters", "copy") else 0.0
    step = est["step_seconds"] + per_step
    tokens_per_second = 2 * workload.global_batch * workload.seq_len / step
    return {**est, "objective": ft.objective, "reference": reference, "reference_seconds": per_step,
            "reference_pass_seconds": est["base_forward_seconds"] if reference == "precomputed" else 0.0,
            "step_seconds": step, "tokens_per_second": tokens_per_second,
            "mfu": planned_mfu(trained_flops_per_token(workload.model, workload.seq_len, ft), tokens_per_second,
                               workload.precision, cluster)}


def finetune_answer(workload: Workload, memory_bytes: float, device_kind: str, ft: FinetuneConfig,
                    micro_batch: int | None = None, activation_checkpointing: str = "none",
                    allocator: str = "system") -> dict:
    """Whether fine-tuning ``workload`` with ``ft`` fits one device of ``memory_bytes`` (data parallelism
    replicates the same per-device memory): the estimate at ``micro_batch`` (default: the largest that fits,
    up to the global batch, or 1), with the runtime and allocator margins the planner adds to pretraining.
    With activation checkpointing the activations are pretraining's checkpointed ones (no frozen-input saving
    is subtracted beyond what the recomputed blocks hold)."""

    def total(mb: int) -> tuple[float, dict]:
        plan = Plan(micro_batch=mb, activation_checkpointing=activation_checkpointing)
        est = (preference_memory(workload, plan, ft, device_kind) if objective_entry(ft.objective).pairs
               else finetune_memory(workload, plan, ft, device_kind))  # mb pairs: 2 x mb rows
        return est["tensor_total"] * (1 + allocator_margin(device_kind, allocator)) + RUNTIME_BYTES[device_kind], est

    if micro_batch is None:
        micro_batch = 1
        while micro_batch * 2 <= workload.global_batch and total(micro_batch * 2)[0] <= memory_bytes:
            micro_batch *= 2
    needed, est = total(micro_batch)
    return {**est, "micro_batch": micro_batch, "seq_len": workload.seq_len, "per_device_bytes": needed,
            "device_memory_bytes": memory_bytes, "fits": needed <= memory_bytes,
            "total_parameters": num_params(workload.model)}


# Seconds per element of torchao's NF4 -> fp32 dequantization (``NF4Tensor.to``) on one core of the reference
# CPU (2 vCPU AMD EPYC, torch 2.13, torchao 0.18: ``measure_nf4_dequant()``, process CPU time, best of 7
# at 256^2..1024^2), used when the calibration has no ``nf4_dequant_s_per_element`` of this machine.
REFERENCE_NF4_DEQUANT_S_PER_ELEMENT = 5.0e-9
# Effective bytes of memory traffic per weight of one NF4 -> bf16 dequantization on a GPU (torchao's ``NF4Tensor``
# in eager mode: unpacking the nibbles, the code lookup and both scale levels run as a dozen elementwise kernels with
# integer and fp32 intermediates, not one pass over 4.5 bits in and 16 out). Calibrated on the GPU check
# (``lora-qlora``: a 0.99B Llama, 973M projection weights, 4 x 1024 tokens, bf16, H100 SXM at 3.35 TB/s), run twice:
# QLoRA's step took 154.7 ms against LoRA's 65.4 ms in the first run (a gap of 89.3 ms over two passes: 154 bytes a
# weight), 186.7 ms against 77.0 ms in the second (benchmarks/results/gpu_check.json: 109.7 ms, 189 bytes); the mean,
# 171. The 2.5 bytes of a single read-and-write pass predicted 92,439 tokens/s where 26,484 and 21,941 were measured.
GPU_NF4_DEQUANT_BYTES_PER_WEIGHT = 171.0
# The same for the compiled dequantization (``finetune.qlora_compile``: one fused kernel, which reads the 4.5 bits and
# writes 16 - about 2.6 bytes a weight if it ran at bandwidth). NOT MEASURED on a GPU yet: today's eager value stands
# until `scripts/gpu_check.py --only qlora-compiled` measures the compiled QLoRA step beside LoRA's; refit it then from
# its (QLoRA compiled - LoRA) step gap as the eager value was fitted (docs/gpu.md).
GPU_NF4_COMPILED_DEQUANT_BYTES_PER_WEIGHT = GPU_NF4_DEQUANT_BYTES_PER_WEIGHT
# Seconds per element of the compiled dequantization to fp32 on one core of the reference CPU
# (benchmarks/results/qlora_speed.json, dequant.compiled_s_per_element: 1.50 ns where torchao's eager measured 3.68 in
# the same run, 2.5x; process CPU time, best of 7, 1024^2), when the calibration has no
# ``nf4_compiled_dequant_s_per_element`` of this machine.
REFERENCE_NF4_COMPILED_DEQUANT_S_PER_ELEMENT = 1.5e-9
# aten ops a LoRA adapter adds to a projection, forward + backward (dropout, two matmuls, scale, add; their
# gradients): counted on ``LoRALinear`` with aten_ops.count_aten_ops.
OPS_PER_ADAPTER = 14


def measure_nf4_dequant(n: int = 512, reps: int = 7, compiled: bool = False) -> float:
    """Seconds per element of dequantizing a torchao NF4 weight to fp32 on this CPU (process CPU time, so one
    thread's rate, as the CPU calibration measures; needs ``torch.set_num_threads(1)`` to mean one core): torchao's
    eager path, or with ``compiled`` ``finetune.qlora_compile``'s (its compile is the first, untimed call)."""
    import torch

    from scaletrain.finetune.lora import compiled_dequantize_nf4, to_nf4

    weight = to_nf4(torch.randn(n, n), 64, 256)

    def dequantize():
        return compiled_dequantize_nf4(weight, torch.float32) if compiled else weight.to(torch.float32)

    dequantize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        dequantize()
        best = min(best, time.process_time() - t0)
    return best / (n * n)


def nf4_dequant_rate(ft: FinetuneConfig, kind: str, entry: dict | None = None) -> float:
    """What dequantizing one 4-bit weight costs a QLoRA step on hardware of ``kind`` ("cpu", "gpu"), eager or
    compiled as ``ft.qlora_compile`` resolves there (the trainer's own rule): on a CPU seconds per element
    (``entry``: its calibration, else the reference CPU's), on a GPU bytes of memory traffic (at its bandwidth)."""
    from scaletrain.finetune.lora import qlora_compiled

    compiled = qlora_compiled(ft.qlora_compile, "cuda" if kind == "gpu" else "cpu")
    if kind == "gpu":
        return GPU_NF4_COMPILED_DEQUANT_BYTES_PER_WEIGHT if compiled else GPU_NF4_DEQUANT_BYTES_PER_WEIGHT
    entry = entry or {}
    if compiled:
        return float(entry.get("nf4_compiled_dequant_s_per_element", REFERENCE_NF4_COMPILED_DEQUANT_S_PER_ELEMENT))
    return float(entry.get("nf4_dequant_s_per_element", REFERENCE_NF4_DEQUANT_S_PER_ELEMENT))


def nf4_gradient_cast_rate(ft: FinetuneConfig, entry: dict, autocast: bool) -> float:
    """CPU seconds per element a QLoRA input gradient's dequantization adds by casting: torchao's eager NF4 weight
    dequantizes to the fp32 it was quantized from and casts that to the gradient's bf16 under autocast
    (``LinearNF4``'s backward, ``weight.to(grad_output.dtype)``; ``LoRAExperts.stacked`` the same), a weight-sized
    fp32 -> bf16 cast at the rate doctor measured (``weight_cast_s_per_element``; without it 6 bytes an element at
    the copy bandwidth). The forward's cast is autocast's, inside the measured GEMM curve; in fp32 there is none, and
    the compiled dequantization (``finetune.qlora_compile``) writes the gradient's dtype directly."""
    from scaletrain.finetune.lora import qlora_compiled

    if not autocast or qlora_compiled(ft.qlora_compile, "cpu"):
        return 0.0
    return float(entry.get("weight_cast_s_per_element", 6.0 / entry["memory_bandwidth"]))


def _input_grad_needed(ft: FinetuneConfig, block: int, targets: tuple[str, ...]) -> bool:
    """Whether the projections ``targets`` of ``block`` must pass a gradient to their input: always, except
    for the first block's q, k, v (reading the block's input through the attention norm) when nothing below
    them trains (the embedding is frozen and there are no virtual tokens), as autograd then skips them."""
    return not (block == 0 and method_entry(ft.method).first_input_frozen() and set(targets) <= {"q", "k", "v"})


def _weight_trains(ft: FinetuneConfig, block: int) -> bool:
    return method_entry(ft.method).trains_base and block >= ft.freeze_blocks


def finetune_step_time(workload: Workload, plan: Plan, cluster: Cluster, ft: FinetuneConfig) -> dict:
    """Predicted seconds per optimizer step of fine-tuning ``workload`` with ``ft`` (one process per device,
    data parallelism over ``plan.dp``; tensor / pipeline / context parallelism are pretraining's business),
    and tokens per second of the whole job."""
    cfg, hw = workload.model, cluster.hardware
    seq = workload.seq_len + (ft.virtual_tokens if method_entry(ft.method).input_tokens else 0)
    b, tokens = plan.micro_batch, plan.micro_batch * seq
    shapes = projection_shapes(cfg)
    lora = method_entry(ft.method).lora
    targets = [t for t in ft.lora_targets if t in shapes] if lora else []
    n_ckpt = len(checkpointed_blocks(cfg.n_layers, plan.activation_checkpointing, plan.ac_every))
    trainable = trainable_parameters(cfg, ft)
    micro_steps = max(1, workload.global_batch // (b * plan.dp))
    if hw.kind == "cpu":
        rates = precision_rates(hw.calibration, workload.precision)  # bf16: the curves measured under autocast
        per_micro, optimizer, base_forward = _cpu_seconds(workload, plan, ft, rates, seq, shapes, targets, n_ckpt)
    else:
        per_micro, optimizer, base_forward = _gpu_seconds(workload, cfg, ft, hw, tokens, seq, shapes, targets,
                                                          n_ckpt, trainable)
        per_micro += gpu_memory_bound_seconds(cfg, ft, hw, tokens, shapes, targets, n_ckpt,
                                              recipe_for(workload, plan).autocast)
        # the chunked loss's recomputed logits (on a CPU part of the head's time, ``_cpu_head_parts``)
        per_micro += loss_recompute_seconds(workload, plan, b * workload.seq_len, cluster, None)
    # Muon's Newton-Schulz over its whole matrices, on every data-parallel replica
    newton_schulz = newton_schulz_seconds(finetune_muon_shapes(workload, ft), hw) \
        if workload.optimizer_entry.orthogonalizes else 0.0
    optimizer += newton_schulz
    comm = 0.0
    if plan.dp > 1:  # data parallelism all-reduces the trainable gradients only

        bw, _ = group_link(cluster, plan.dp, 1)
        comm = 2 * (plan.dp - 1) / plan.dp * trainable * 4 / bw
        if hw.kind == "gpu":  # overlapped with the backward, as for pretraining
            comm = max(0.0, comm - per_micro * micro_steps * 2 / 3)
    step = per_micro * micro_steps + optimizer + comm
    tokens_per_second = workload.global_batch * workload.seq_len / step
    return {"step_seconds": step, "compute_seconds": per_micro * micro_steps, "optimizer_seconds": optimizer,
            "newton_schulz_seconds": newton_schulz, "base_forward_seconds": base_forward, "micro_steps": micro_steps,
            "comm_exposed_seconds": comm, "tokens_per_second": tokens_per_second,
            "mfu": planned_mfu(trained_flops_per_token(cfg, workload.seq_len, ft), tokens_per_second,
                               workload.precision, cluster)}


def finetune_cpu_breakdown(workload: Workload, plan: Plan, cluster: Cluster, ft: FinetuneConfig) -> dict:
    """CPU seconds of one fine-tuning micro-batch by part (what ``finetune_step_time`` sums on a CPU): the frozen
    base's GEMMs, LoRA's, attention, elementwise work and dispatch, NF4 dequantization, the head's GEMMs and the
    loss's work over the vocabulary (with the chunked loss's recomputed logits), and the optimizer step.
    ``benchmarks/family_finetune_cpu.py`` sets it beside a profiled step."""
    cfg = workload.model
    seq = workload.seq_len + (ft.virtual_tokens if method_entry(ft.method).input_tokens else 0)
    shapes = projection_shapes(cfg)
    targets = [t for t in ft.lora_targets if t in shapes] if method_entry(ft.method).lora else []
    n_ckpt = len(checkpointed_blocks(cfg.n_layers, plan.activation_checkpointing, plan.ac_every))
    rates = precision_rates(cluster.hardware.calibration, workload.precision)
    parts, optimizer, _ = _cpu_parts(workload, plan, ft, rates, seq, shapes, targets, n_ckpt)
    return {**parts, "optimizer": optimizer}


def _cpu_seconds(workload: Workload, plan: Plan, ft: FinetuneConfig, entry: dict, seq: int, shapes: dict,
                 targets: list[str], n_ckpt: int) -> tuple[float, float, float]:
    parts, optimizer, base_forward = _cpu_parts(workload, plan, ft, entry, seq, shapes, targets, n_ckpt)
    return sum(parts.values()), optimizer, base_forward


def _cpu_parts(workload: Workload, plan: Plan, ft: FinetuneConfig, entry: dict, seq: int, shapes: dict,
               targets: list[str], n_ckpt: int) -> tuple[dict, float, float]:
    """({part: CPU seconds of one micro-batch}, optimizer seconds, the base's no-grad forward) of the step."""
    cfg, b, trainable = workload.model, plan.micro_batch, trainable_parameters(workload.model, ft)
    head_tokens = b * workload.seq_len  # the head and the loss see the real positions, not prompt tuning's
    held = loss_rows(workload, plan, head_tokens, plan.engine == "deepspeed", "cpu")
    autocast = recipe_for(workload, plan).autocast
    method = method_entry(ft.method)  # finetune/method_table.py
    if "elementwise_s_per_element" not in entry:

        raise ConfigError("the CPU time model needs this machine's calibration: run `scaletrain doctor` "
                          "(or plan with --hardware auto)")
    tokens, d, r = b * seq, cfg.dim, ft.lora_rank
    units = block_activation_elements(cfg, b, seq)
    elem = interp_curve(entry["elementwise_curve"], units) if "elementwise_curve" in entry else \
        entry["elementwise_s_per_element"]
    dequant = nf4_dequant_rate(ft, "cpu", entry)
    grad_dequant = dequant + nf4_gradient_cast_rate(ft, entry, autocast)
    att_f, att_b = attention_seconds(b * cfg.n_heads, seq, head_width(cfg), entry)
    if method.prefix_tokens:  # every query also reads the P prefix keys: causal T^2/2 -> T^2/2 + T*P
        att_f, att_b = (a * (1 + 2 * ft.virtual_tokens / seq) for a in (att_f, att_b))
    parts: dict[str, float] = collections.defaultdict(float)
    base_forward = 0.0
    bandwidth = entry["memory_bandwidth"]
    for block in range(cfg.n_layers):
        recompute = block >= cfg.n_layers - n_ckpt if n_ckpt else False
        again = 1 + recompute  # a checkpointed block runs its forward twice
        masked = masked_attention_factor(seq) if masked_attention_layers(cfg, seq, range(block, block + 1)) else 1.0
        gemms = sum(gemm_seconds(tokens, o, i, entry) for i, o in shapes.values())
        parts["attention"] += (again * att_f + att_b) * masked
        parts["base gemm"] += again * gemms
        # the base's no-grad forward (DPO's reference through disabled adapters, ``preference_step_time``): the
        # frozen GEMMs and attention, a forward's third of the elementwise work and dispatch (as a recompute)
        base_forward += att_f * masked + gemms + (units * elem + (entry["block_ops"] + family_block_ops(cfg))
                                                  * entry["op_overhead_s"]) / 3
        if method.quantized_base:
            base_forward += sum(i * o for i, o in shapes.values()) * dequant
        for name, (i, o) in shapes.items():
            both = gemm_seconds(tokens, o, i, entry, backward=True)  # input and weight gradient GEMMs
            if _weight_trains(ft, block):
                parts["base gemm"] += both
            elif _input_grad_needed(ft, block, (name,)):
                parts["base gemm"] += both / 2
                if method.quantized_base:
                    parts["nf4 dequant"] += i * o * grad_dequant
            if method.quantized_base:
                parts["nf4 dequant"] += again * i * o * dequant
        if method.quantized_base and is_moe_layer(cfg, block):
            # the router's and every expert's 4-bit weights in place of the dense feed-forward ``shapes`` prices,
            # dequantized in the forward (again under recomputation) and for the input gradient
            # (lora.FrozenExpertsMM)
            parts["nf4 dequant"] += moe_extra_params(cfg, active=False) * (again * dequant + grad_dequant)
        ops = entry["block_ops"] + family_block_ops(cfg) + OPS_PER_ADAPTER * len(targets)
        for name in targets:  # x @ A^T (r wide), then @ B^T; both train, so full backward GEMMs
            i, o = shapes[name]
            parts["lora gemm"] += again * (gemm_seconds(tokens, r, i, entry) + gemm_seconds(tokens, o, r, entry)) \
                + gemm_seconds(tokens, r, i, entry, True) + gemm_seconds(tokens, o, r, entry, True)
            # Single passes over memory (not a block's fused mix, which ``elem`` prices): the scale and the
            # add to the frozen output (8 + 12 bytes an fp32 output element), the scale's gradient (8), and
            # the adapter's input gradient added to the frozen one (12 bytes an input element).
            parts["lora passes"] += again * tokens * o * 20 / bandwidth + tokens * (8 * o + 12 * i) / bandwidth
            if ft.dora:  # the row norms of W + s B A each forward (no gradient): B @ A, then add and norm passes
                parts["dora"] += again * (gemm_seconds(o, i, r, entry) + i * o * 24 / bandwidth
                                          + (i * o * dequant if method.quantized_base else 0.0))
        parts["elementwise"] += units * elem * (1 + recompute / 3)
        parts["dispatch"] += ops * (1 + recompute / 3) * entry["op_overhead_s"]
    parts.update(_cpu_head_parts(cfg, ft, entry, tokens, head_tokens, held, autocast, elem))
    optimizer = trainable * interp_curve(entry["optimizer_curve"], trainable)
    # the reference's head: logits, then a cross-entropy forward (the log-softmax: about half the measured
    # forward + backward, the backward being the softmax again less the targets)
    vocab = cfg.vocab_size
    base_forward += head_gemm_seconds(tokens, vocab, d, entry) + tokens * vocab * interp_curve(
        entry["cross_entropy_curve"], vocab) / 2 + tokens * d * elem
    return dict(parts), optimizer, base_forward


def _cpu_head_parts(cfg: ModelConfig, ft: FinetuneConfig, entry: dict, tokens: int, head_tokens: int, held: int,
                    autocast: bool, elem: float) -> dict:
    """CPU seconds of the head and the loss over ``head_tokens`` positions, ``held`` at a time (the chunked loss
    when fewer than all): a frozen head's chunked products at the rates doctor measured for the chunk's rows, with
    the loss's cast of the weight (``timing.chunked_head_seconds``); else (a trained head, an unchunked loss, an
    older calibration) the head curve's GEMMs over all the positions and, chunked, the recomputed logits again."""
    vocab, d = cfg.vocab_size, cfg.dim
    head_trains = method_entry(ft.method).trains_base
    parts = {"loss elementwise (vocab)": tokens * vocab * interp_curve(entry["cross_entropy_curve"], vocab),
             "head other": 3 * tokens * d * elem + (vocab * d * elem if head_trains and not ft.freeze_embeddings
                                                    else 0.0)}
    chunked = None if head_trains or held >= head_tokens else chunked_head_seconds(head_tokens, held, vocab, d,
                                                                                   entry, autocast)
    if chunked is not None:
        parts["head gemm"] = chunked
        return parts
    head_bwd = head_gemm_seconds(tokens, vocab, d, entry, True)
    parts["head gemm"] = head_gemm_seconds(tokens, vocab, d, entry) + (head_bwd if head_trains else head_bwd / 2)
    # the chunked loss's backward recomputes each chunk's logits (timing.loss_recompute_seconds)
    parts["loss recompute"] = head_gemm_seconds(head_tokens, vocab, d, entry) if held < head_tokens else 0.0
    return parts


# Passes over an adapted projection's input and output activations (tokens x width, bf16) one LoRA adapter makes in
# a compiled forward + backward: forward reads x, writes B A x, then the scale-and-add reads it and the frozen
# output and writes the sum; backward reads the output gradient twice (B's gradient, A's input), reads x (A's
# gradient), writes the adapter's input gradient and adds it to the frozen one. Counted on LoRALinear's graph,
# not fitted: about 6 on each side.
ADAPTER_ACTIVATION_PASSES = 6


def gpu_memory_bound_seconds(cfg: ModelConfig, ft: FinetuneConfig, hw, tokens: int, shapes: dict,
                             targets: list[str], n_ckpt: int, autocast: bool) -> float:
    """What a fine-tuning micro-batch does on a GPU beyond the FLOPs at the fitted utilisation (which was fitted
    to pretraining, where neither happens), at memory bandwidth:

    - under the native trainer's autocast the frozen weights stay fp32 (``RECIPES["autocast"]``), and autocast
      caches its bf16 copy only for weights that require gradients: every frozen matrix is read (4 bytes) and
      its bf16 copy written (2) once per forward, again for a recomputed block (QLoRA's NF4 projections are
      dequantized instead, ``GPU_NF4_DEQUANT_BYTES_PER_WEIGHT``);
    - each LoRA adapter's low-rank matmuls are too thin to use the tensor cores: the time is its
      ``ADAPTER_ACTIVATION_PASSES`` passes over the projection's input and output activations.

    For the GPU check's 1B LoRA row (4 x 1024 tokens) these are 1.8 ms and 3.1 ms of the measured 77 ms a
    micro-batch (docs/finetuning.md): the rest of its 1.8x is not explained by what was measured (docs/gpu.md)."""
    method = method_entry(ft.method)  # finetune/method_table.py
    seconds = 0.0
    if autocast:
        frozen = num_params(cfg) - trainable_parameters(cfg, ft)
        if method.quantized_base:  # the NF4 projections are not cast (dequantized: charged apart)
            frozen -= cfg.n_layers * sum(i * o for i, o in shapes.values())
        recast = 1 + n_ckpt / max(cfg.n_layers, 1)
        seconds += max(frozen, 0) * (4 + 2) * recast / hw.memory_bandwidth
    passes = sum(shapes[t][0] + shapes[t][1] for t in targets) * cfg.n_layers * ADAPTER_ACTIVATION_PASSES
    return seconds + passes * tokens * 2 / hw.memory_bandwidth


def _gpu_seconds(workload: Workload, cfg: ModelConfig, ft: FinetuneConfig, hw, tokens: int, seq: int,
                 shapes: dict, targets: list[str], n_ckpt: int, trainable: int) -> tuple[float, float]:
    """FLOPs at peak x the planner's utilisation: forward 2 per weight a token, backward 2 for the input
    gradient of every weight plus 2 more for each trainable one; attention's backward twice its forward."""
    method = method_entry(ft.method)  # finetune/method_table.py
    rec = RECIPES[workload.precision]
    n_matmul = matmul_params(cfg)
    # QK^T and AV over the heads' width (n_heads x head_dim, not dim: Qwen3, Gemma 3); a sliding-window layer's
    # masked SDPA does the whole square, twice the causal kernel's work (timing._gpu_micro_seconds)
    attention_fwd = 4.0 * (cfg.n_layers + masked_attention_layers(cfg, seq)) * seq * cfg.n_heads * head_width(cfg)
    lora_params = sum(ft.lora_rank * sum(shapes[t]) for t in targets) * cfg.n_layers
    weight_grads = (2.0 * n_matmul if method.trains_base else 0.0) + 2.0 * lora_params
    forward = 2.0 * (n_matmul + lora_params) + attention_fwd
    block_share = 1.0 - 2.0 * cfg.vocab_size * cfg.dim / forward
    executed = tokens * (forward * (1 + block_share * n_ckpt / cfg.n_layers) + 2.0 * n_matmul + 2 * attention_fwd
                         + weight_grads)
    rate = hw.flops(DTYPE_OF_PRECISION[workload.precision]) * gpu_utilisation(hw, cfg, seq)
    seconds = executed / rate
    # and, as for pretraining, no faster than the host launches the kernels (adapters add theirs)
    launches = (cfg.n_layers + n_ckpt / 3) * (OPS_PER_BLOCK + OPS_PER_ADAPTER * len(targets)) * GPU_LAUNCH_SECONDS
    seconds = max(seconds, launches)
    if ft.dora:  # the row norms of W + s B A each forward: B @ A, and passes over each adapted weight
        adapted = cfg.n_layers * sum(shapes[t][0] * shapes[t][1] for t in targets)
        seconds += 2.0 * ft.lora_rank * adapted / rate \
            + adapted * 3 * rec.param / hw.memory_bandwidth
    # QLoRA: the dequantization of every 4-bit weight (eager or compiled) at memory bandwidth
    dequant = cfg.n_layers * sum(i * o for i, o in shapes.values()) * nf4_dequant_rate(ft, hw.kind) \
        / hw.memory_bandwidth if method.quantized_base else 0.0
    seconds += 2 * dequant  # twice a micro-batch: the forward and the input gradient
    optimizer = trainable * 3 * 20 / hw.memory_bandwidth  # pretraining's ~3 passes of 20 bytes a parameter
    # the base's no-grad forward (DPO's reference through disabled adapters): its FLOPs at the same rate, and its
    # frozen weights read once more (QLoRA: dequantized once more)
    base_forward = max(tokens * (2.0 * n_matmul + attention_fwd) / rate,
                       cfg.n_layers * OPS_PER_BLOCK / 3 * GPU_LAUNCH_SECONDS)
    return seconds, optimizer, base_forward + dequant
