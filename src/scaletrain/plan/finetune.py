"""What fine-tuning changes in the memory model: frozen weights without gradients or optimizer states, a
4-bit base for QLoRA, small adapter states (``scaletrain plan --method``, docs/finetuning.md).

The activations and the loss's transients are pretraining's (``memory.memory_breakdown``: LoRA still
backpropagates through every block to reach the adapters of the lower ones), over ``seq_len +
virtual_tokens`` positions for prompt tuning - less what frozen projections do not save: a linear layer
keeps its input only for its weight gradient, so the attention norm's output (q, k, v's input), the SwiGLU
norm's output (gate, up) and the SwiGLU product (down) are not saved when none of the projections that
read them trains (``unsaved_activation_elements``). Checked by ``benchmarks/finetune_plan.py``.
"""

from __future__ import annotations

import dataclasses

from scaletrain.config import FinetuneConfig, ModelConfig
from scaletrain.model.presets import ffn_hidden_dim, kv_heads, num_params
from scaletrain.plan.memory import RECIPES, block_params, memory_breakdown
from scaletrain.plan.spec import Plan, Workload

# Bytes per weight of torchao's NF4 with double quantization at QLoRA's blocks (64 weights a scale, 256
# scales a factor): 4-bit codes, one int8 scale a block, one fp32 factor and mean per 256 scales.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 8 / (64 * 256)


def _projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable projection of a block."""
    d, h = cfg.dim, ffn_hidden_dim(cfg)
    kv = kv_heads(cfg) * (d // cfg.n_heads)
    return {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d), "gate": (d, h), "up": (d, h), "down": (h, d)}


def trainable_parameters(cfg: ModelConfig, ft: FinetuneConfig) -> int:
    """Parameters that train under ``ft.method`` (adapters, or the unfrozen weights of a full fine-tune)."""
    shapes = _projection_shapes(cfg)
    if ft.method in ("lora", "qlora"):
        return cfg.n_layers * sum(ft.lora_rank * (shapes[t][0] + shapes[t][1]) for t in ft.lora_targets)
    if ft.method == "prompt":
        return ft.virtual_tokens * cfg.dim
    if ft.method == "prefix":
        return cfg.n_layers * 2 * ft.virtual_tokens * shapes["k"][1]
    frozen = (cfg.vocab_size * cfg.dim if ft.freeze_embeddings else 0) + ft.freeze_blocks * block_params(cfg)
    return num_params(cfg) - frozen


def frozen_bytes(cfg: ModelConfig, ft: FinetuneConfig, param_bytes: int = 4) -> float:
    """Bytes of the frozen base: everything but the trainable weights; QLoRA's block projections in NF4."""
    if ft.method == "full":
        return (num_params(cfg) - trainable_parameters(cfg, ft)) * param_bytes
    total = num_params(cfg)
    if ft.method != "qlora":
        return total * param_bytes
    projections = cfg.n_layers * sum(i * o for i, o in _projection_shapes(cfg).values())
    return projections * NF4_BYTES_PER_WEIGHT + (total - projections) * param_bytes


def _trains(ft: FinetuneConfig, targets: tuple[str, ...]) -> bool:
    """Whether any of the projections ``targets`` gets a weight (or adapter) gradient under ``ft``."""
    if ft.method in ("lora", "qlora"):
        return any(t in ft.lora_targets for t in targets)
    return ft.method == "full"  # (a full fine-tune's frozen first blocks are not modelled: rarely many)


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
    if ft.method == "prompt":
        workload = dataclasses.replace(workload, seq_len=workload.seq_len + ft.virtual_tokens)
    rec = RECIPES[workload.precision]
    pretrain = memory_breakdown(workload, plan, device_kind)
    trainable = trainable_parameters(workload.model, ft)
    frozen = frozen_bytes(workload.model, ft, rec.param)
    at_rest = frozen + trainable * (rec.param + rec.master + rec.optimizer)
    bt, vocab = plan.micro_batch * workload.seq_len, workload.model.vocab_size
    logits = bt * vocab * 4
    # End of forward / loss backward: saved activations, log-softmax output, gradient of the logits.
    # Checkpointed blocks save only their input; the frozen-input saving applies to un-checkpointed ones.
    unsaved = unsaved_activation_elements(workload.model, ft, plan.micro_batch, workload.seq_len) \
        if plan.activation_checkpointing == "none" else 0.0
    activations = pretrain.saved_activations - rec.activation * unsaved
    loss_phase = at_rest + activations + 2 * logits
    # Optimizer: every trainable gradient, and foreach AdamW's sqrt(v) temporary of the largest group.
    optimizer_phase = at_rest + trainable * rec.grad + (trainable * 4 if device_kind == "cpu" else 0)
    tensor_total = max(loss_phase, optimizer_phase)
    return {"method": ft.method, "trainable_parameters": trainable, "frozen_bytes": frozen,
            "trainable_state_bytes": trainable * (rec.param + rec.grad + rec.master + rec.optimizer),
            "activations": activations, "tensor_total": tensor_total,
            "peak_phase": "loss" if loss_phase >= optimizer_phase else "optimizer step",
            "pretraining_tensor_total": pretrain.tensor_total}


def finetune_answer(workload: Workload, memory_bytes: float, device_kind: str, ft: FinetuneConfig,
                    micro_batch: int | None = None, activation_checkpointing: str = "none") -> dict:
    """Whether fine-tuning ``workload`` with ``ft`` fits one device of ``memory_bytes`` (data parallelism
    replicates the same per-device memory): the estimate at ``micro_batch`` (default: the largest that fits,
    up to the global batch, or 1), with the runtime and allocator margins the planner adds to pretraining.
    With activation checkpointing the activations are pretraining's checkpointed ones (no frozen-input saving
    is subtracted beyond what the recomputed blocks hold)."""
    from scaletrain.plan.memory import ALLOCATOR_MARGIN, RUNTIME_BYTES

    def total(mb: int) -> tuple[float, dict]:
        est = finetune_memory(workload, Plan(micro_batch=mb, activation_checkpointing=activation_checkpointing),
                              ft, device_kind)
        return est["tensor_total"] * (1 + ALLOCATOR_MARGIN[device_kind]) + RUNTIME_BYTES[device_kind], est

    if micro_batch is None:
        micro_batch = 1
        while micro_batch * 2 <= workload.global_batch and total(micro_batch * 2)[0] <= memory_bytes:
            micro_batch *= 2
    needed, est = total(micro_batch)
    return {**est, "micro_batch": micro_batch, "seq_len": workload.seq_len, "per_device_bytes": needed,
            "device_memory_bytes": memory_bytes, "fits": needed <= memory_bytes,
            "total_parameters": num_params(workload.model)}
