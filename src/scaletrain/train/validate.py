"""The trainer's rules for a job, in one place: what ``Trainer`` checks before any process-group work.

The planner asks these same functions whether a plan it considers can run (``plan/spec.check_plan``), so
the search never proposes, and ``plan --emit`` never writes, a job the trainer would refuse.
"""

from __future__ import annotations

import torch

from scaletrain.config import ConfigError, JobConfig, OptimConfig, validate_job
from scaletrain.finetune.lora import check_lora_targets, check_qlora_installed
from scaletrain.finetune.method_table import method_entry
from scaletrain.finetune.objectives import objective_of
from scaletrain.finetune.qat import check_qat
from scaletrain.parallel.compile import compile_mode_refusal, compiles_whole_model
from scaletrain.parallel.context import check_context_parallel_supported
from scaletrain.parallel.dims import ParallelDims, check_expert_model
from scaletrain.train.adaptive import check_adaptive
from scaletrain.train.deepspeed_engine.ds_config import check_deepspeed
from scaletrain.train.fp8 import check_fp8_available
from scaletrain.train.optimizer import OPTIMIZERS, optimizer_entry


def check_feature_combinations(cfg: JobConfig, precision: str) -> None:
    """Options that do not combine, refused in one line before any process-group work."""
    if cfg.data.document_attention and (cfg.parallel.pp > 1 or cfg.parallel.cp > 1):
        raise ConfigError("data.document_attention is not supported with parallel.pp > 1 or parallel.cp > 1 "
                          "(the mask does not travel through pipeline stages or sequence shards); "
                          "set data.document_attention=false")
    if cfg.parallel.pp > 1 and precision == "fp16":
        raise ConfigError("train.precision=fp16 (gradient scaler) is not supported with parallel.pp > 1; use bf16")


def check_finetune(cfg: JobConfig, world_size: int, here: bool = True) -> None:
    """What fine-tuning (finetune.source set) combines with; the rest is untested, so refused. ``here``: also
    what this machine must have installed (QLoRA: torchao)."""
    ft, par = cfg.finetune, cfg.parallel
    if ft.instructions and not ft.source:
        raise ConfigError("finetune.instructions needs finetune.source (the base whose tokenizer reads them)")
    objective_of(ft).refuse(cfg, world_size)  # its data, method and layout (finetune/objectives.py)
    if not ft.source:
        return
    method = method_entry(ft.method)  # finetune/method_table.py: what it trains, adds and refuses
    if method.lora:
        check_lora_targets(ft.lora_targets)
    if method.trains_base and ft.freeze_blocks > cfg.model.n_layers:
        raise ConfigError(f"finetune.freeze_blocks ({ft.freeze_blocks}) exceeds the base's {cfg.model.n_layers} "
                          f"blocks")
    if ft.lora_plus_ratio != 1.0 and not method.lora:
        raise ConfigError(f"finetune.lora_plus_ratio={ft.lora_plus_ratio:g} scales the LoRA B matrices' learning rate; "
                          f"finetune.method={ft.method} has none: use method=lora or qlora, or leave it at 1")
    if method.data_parallel_only and (par.tp > 1 or par.pp > 1 or par.cp > 1 or par.low_comm != "none"):
        raise ConfigError(f"finetune.method={ft.method} runs with data parallelism (DDP, FSDP2) only; set "
                          f"parallel.tp/pp/cp=1 and parallel.low_comm=none, or use finetune.method=full")
    if par.low_comm != "none":
        raise ConfigError("fine-tuning with parallel.low_comm is not supported; set parallel.low_comm=none")
    if method.quantized_base and here:
        check_qlora_installed()
    if method.quantized_base and (world_size > 1 or cfg.train.compile == "true"):
        raise ConfigError(f"finetune.method={ft.method} runs in one process without train.compile (the 4-bit torchao "
                          "base is untested with DDP/FSDP2 and a compiled model; finetune.qlora_compile compiles its "
                          "dequantization alone); use method=lora to scale out")
    if ft.packing == "true" and (method.virtual_tokens or cfg.parallel.pp > 1 or cfg.parallel.cp > 1):
        why = (f"finetune.method={ft.method}'s virtual tokens would be shared by every example of a row"
               if method.virtual_tokens else "the block-causal mask does not travel through pipeline "
               "stages or sequence shards (parallel.pp / parallel.cp)")
        raise ConfigError(f"finetune.packing=true cannot be done here: {why}; set finetune.packing=auto or false")
    if method.virtual_tokens and cfg.data.document_attention:
        raise ConfigError(f"finetune.method={ft.method} does not take data.document_attention (the virtual tokens "
                          f"sit outside the documents); set data.document_attention=false")
    if refusal := method.refusal(cfg, world_size):
        raise ConfigError(refusal)


def check_mup(cfg: JobConfig) -> None:
    """What muP (model.parametrization = "mup", model/mup.py) combines with: a tied head would need the
    embedding's lr and the readout's at once, DeepSpeed's optimizer does not take the per-group lr scales, and
    a fine-tune inherits its base's parametrization."""
    m = cfg.model
    if m.parametrization != "mup":
        return
    if m.tie_embeddings:
        raise ConfigError("model.parametrization=mup needs untied embeddings (the readout is scaled apart from the "
                          "embedding); set model.tie_embeddings=false")
    if cfg.parallel.engine == "deepspeed" or cfg.finetune.source:
        raise ConfigError("model.parametrization=mup runs on the native engine for pretraining only; drop "
                          "--parallel.engine=deepspeed / finetune.source, or use parametrization=standard")
    if (not m.head_dim and m.dim % m.n_heads) or m.mup_base_width < m.n_heads:
        raise ConfigError(f"model.mup_base_width ({m.mup_base_width}) must be >= model.n_heads ({m.n_heads}) and "
                          f"model.dim divisible by n_heads")


def check_optimizer(cfg: JobConfig) -> None:
    """optim.name's entry of the optimizer table (train/optimizer.py): it must exist, no optim.* field that only
    another optimizer reads may be set, and the entry's own refusal (e.g. Muon's: whole matrices, the native
    engine, not with muP)."""
    entry = optimizer_entry(cfg.optim.name)
    defaults = OptimConfig()
    for other in OPTIMIZERS.values():
        changed = [f for f in other.fields if f not in entry.fields
                   and getattr(cfg.optim, f) != getattr(defaults, f)]
        if changed:
            raise ConfigError(f"optim.{changed[0]} applies to optim.name={other.name} only (got optim.name="
                              f"{entry.name}); set optim.name={other.name} or drop it")
    if refusal := entry.refusal(cfg):
        raise ConfigError(refusal)


def check_distillation(cfg: JobConfig, here: bool = True) -> None:
    """finetune.qat (finetune/qat.py): a full fine-tune without tensor/pipeline/context parallelism; the same for
    finetune.keep_zeros. (finetune.teacher's rules are its objective's: finetune/objectives.py.)"""
    ft = cfg.finetune
    if ft.qat and (not method_entry(ft.method).trains_base or not ft.source):
        raise ConfigError("finetune.qat fake-quantizes the weights that train: it needs finetune.source and "
                          "finetune.method=full")
    if ft.qat and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1 or cfg.parallel.cp > 1):
        raise ConfigError("finetune.qat runs with data parallelism (DDP, FSDP2) only; set parallel.tp/pp/cp=1")
    check_qat(ft, cfg.model, here)  # torchao, the int4 group size against the model's widths
    if ft.keep_zeros and (not method_entry(ft.method).trains_base or not ft.source):
        raise ConfigError("finetune.keep_zeros holds the base's zeros in weights that train: it needs finetune.source "
                          "and finetune.method=full (LoRA keeps the frozen base's zeros anyway)")
    if ft.keep_zeros and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1 or cfg.parallel.dp_shard != 1
                          or cfg.parallel.cp > 1):
        raise ConfigError("finetune.keep_zeros masks plain parameters' gradients: use DDP (parallel.dp_shard=1) "
                          "without tp/pp/cp")


def check_moe_runnable(cfg: JobConfig, dims: ParallelDims) -> None:
    """What a mixture of experts (model.moe_experts > 0) does not run with yet, one line each: context parallelism,
    local SGD / DiLoCo (data parallelism, DDP or FSDP2, tensor and pipeline parallelism run, each with or without
    parallel.ep; parallel.ep's own layouts are ParallelDims'), DeepSpeed, muP (its learning-rate groups know no stacked
    experts), QLoRA (no 4-bit stacked experts), the other adapter methods, and LoRA with expert parallelism or Muon
    on the adapters."""
    if not cfg.model.moe_experts:
        return
    if dims.cp > 1 or cfg.parallel.low_comm != "none":
        raise ConfigError(f"model.moe_experts = {cfg.model.moe_experts}: a mixture of experts trains with data "
                          f"parallelism (DDP, FSDP2), tensor, pipeline and expert parallelism (parallel.ep) for now; "
                          f"set parallel.cp to 1 and parallel.low_comm=none")

    if cfg.parallel.engine == "deepspeed":
        raise ConfigError("model.moe_experts: a mixture of experts runs on the native engine only; drop "
                          "--parallel.engine=deepspeed")
    ft = cfg.finetune
    if ft.source and ft.method not in ("full", "lora", "qlora"):
        raise ConfigError(f"finetune.method={ft.method} is untested on a mixture of experts' base; use "
                          f"finetune.method=lora, qlora or full")
    if ft.source and method_entry(ft.method).lora and cfg.parallel.ep > 1:
        raise ConfigError(f"finetune.method={ft.method} with parallel.ep={cfg.parallel.ep}: expert parallelism "
                          f"computes slices of the stacked experts, which do not carry the experts' adapters yet; set "
                          f"parallel.ep=1 (data parallelism)")
    if ft.source and method_entry(ft.method).lora and cfg.optim.muon_adapters:
        raise ConfigError("optim.muon_adapters: the experts' adapters are stacked (E, r, in) tensors, not Muon "
                          "matrices; set optim.muon_adapters=false on a mixture of experts")


def check_runnable(cfg: JobConfig, world_size: int, device_type: str, precision: str,
                   here: bool = True) -> ParallelDims:
    """Every rule a job must pass to run on ``world_size`` ranks of ``device_type`` ("cpu", "cuda"), with
    ``precision`` already resolved: cross-field config checks, option combinations, the parallel degrees
    and what they ask of the model and batch. Returns the resolved degrees; raises ``ConfigError``.

    ``cfg.model.vocab_size`` 0 (taken from the data later) skips the vocabulary checks; the trainer runs
    ``ParallelDims.check_model`` again once the data's vocabulary is known. ``here`` False (the planner, planning
    for a target machine) skips what only this machine's installation decides (DeepSpeed, libaio)."""
    validate_job(cfg)
    check_feature_combinations(cfg, precision)
    check_finetune(cfg, world_size, here)
    check_mup(cfg)
    check_optimizer(cfg)
    check_distillation(cfg, here)
    check_expert_model(cfg.parallel, cfg.model)  # before the degrees: a dense model's ep names the model
    if precision == "fp8" and here:  # the device was checked with the precision (train/precision.py)
        check_fp8_available()
    if cfg.parallel.engine == "deepspeed":  # its own rules (ds_config, offload, ZeRO-3 x pp), data parallel only
        if cfg.finetune.source:
            raise ConfigError("fine-tuning (finetune.source) runs on the native engine only; drop "
                              "--parallel.engine=deepspeed (LoRA/QLoRA already keep the optimizer state small)")
        dims = check_deepspeed(cfg, world_size, device_type, precision, here)
    else:
        dims = ParallelDims.from_config(cfg.parallel, world_size)
    dims.check_model(cfg.parallel, cfg.model, cfg.data.seq_len, cfg.train.batch_size)
    check_moe_runnable(cfg, dims)
    check_adaptive(cfg, dims.dp_size, precision)  # batch ramp, noise scale, parallel.balance (docs/tuning.md)
    if dims.cp > 1:
        check_context_parallel_supported(torch.device(device_type))
    if refusal := compile_mode_refusal(cfg, device_type, compiles_whole_model(dims, cfg.parallel)):
        raise ConfigError(refusal)
    return dims
