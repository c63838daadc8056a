"""DeepSpeed as an optional engine (``parallel.engine = "deepspeed"``, extra ``scaletrain[deepspeed]``).

This module holds what does not depend on the trainer: the rules a DeepSpeed job must pass (asked by
``train/validate.py:check_runnable``), the ``ds_config`` built from our config and merged with a user's
``ds_config.json`` (ours fills what theirs leaves out; a key both set to different values is a one-line
error), and ``deepspeed.initialize``. The engine the trainer holds (build, step, checkpoints) is
``train/deepspeed_engine/engine.py``.

DeepSpeed here is data parallel only (every rank a ZeRO data-parallel rank): tensor, context and pipeline
parallelism stay with the native engine.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.config import ConfigError, DeepSpeedConfig, JobConfig, ModelConfig
from scaletrain.hardware.allocator import return_freed_memory_promptly
from scaletrain.model.decoder import Transformer
from scaletrain.model.presets import ffn_hidden_dim
from scaletrain.parallel.dims import ParallelDims

# Top-level keys of a ds_config.json that DeepSpeed 0.x documents (deepspeed.ai/docs/config-json). DeepSpeed
# itself ignores an unknown top-level key silently; a typo there would silently change nothing, so we refuse it.
KNOWN_TOP_LEVEL = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "amp", "torch_autocast", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
    "sparse_gradients", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "aio",
    "activation_checkpointing", "flops_profiler", "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet",
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "communication_data_type",
    "seq_parallel_communication_data_type", "elasticity", "autotuning", "data_efficiency", "curriculum_learning",
    "compression_training", "checkpoint", "data_types", "sparse_attention", "pipeline", "pld", "eigenvalue",
    "quantize_training", "nebula", "compile", "disable_allgather", "use_data_before_expert_parallel_",
    "zero_quantized_weights", "zero_quantized_gradients", "graph_harvesting", "timers", "tensor_parallel",
    "weight_quantization", "hybrid_engine", "load_universal_checkpoint", "use_node_local_storage",
})
# Sections the trainer owns: our AdamW (param groups, [optim]) and our schedule (set every step).
OWNED_SECTIONS = {"optimizer": "[optim] (AdamW: lr, beta1, beta2, eps, weight_decay)",
                  "scheduler": "[schedule] (the trainer sets the learning rate every step)"}


def deepspeed_missing_reason() -> str | None:
    """None when ``import deepspeed`` works, else why not (one line)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        return f"DeepSpeed is not installed ({exc}); pip install 'scaletrain[deepspeed]'"
    return None


def read_user_config(path: str) -> dict:
    """The user's ds_config.json, checked for unknown keys (top level and ``zero_optimization``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deepspeed.config: file not found: {p}")
    try:
        theirs = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"deepspeed.config {p}: not valid JSON ({exc})") from None
    if not isinstance(theirs, dict):
        raise ConfigError(f"deepspeed.config {p}: must hold a JSON object")
    for key in theirs:
        if key not in KNOWN_TOP_LEVEL:
            raise ConfigError(f"deepspeed.config {p}: unknown key {key!r} (not a DeepSpeed ds_config key; "
                              f"see deepspeed.ai/docs/config-json)")
        if key in OWNED_SECTIONS:
            raise ConfigError(f"deepspeed.config {p}: {key!r} is set by scaletrain from {OWNED_SECTIONS[key]}; "
                              f"remove it and set those fields instead")
    zero = theirs.get("zero_optimization", {})
    if zero:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        try:
            DeepSpeedZeroConfig(**zero)
        except Exception as exc:  # pydantic's ValidationError: name the first offending field in one line
            errors = getattr(exc, "errors", lambda: [])()
            what = (f"{'.'.join(map(str, errors[0]['loc']))}: {errors[0]['msg']}" if errors
                    else str(exc).splitlines()[0])
            raise ConfigError(f"deepspeed.config {p}: zero_optimization.{what}") from None
    return theirs


def zero_stage(cfg: JobConfig, theirs: dict) -> int:
    """parallel.zero_stage, or (-1) the user's ds_config's stage, or 3 with dp_shard > 1, else 0."""
    if cfg.parallel.zero_stage != -1:
        return cfg.parallel.zero_stage
    if "stage" in theirs.get("zero_optimization", {}):
        return int(theirs["zero_optimization"]["stage"])
    return 3 if cfg.parallel.dp_shard not in (0, 1) else 0


def largest_parameter(model: ModelConfig) -> int:
    """Elements of the model's largest weight (the embedding / head, or an MLP matrix)."""
    return max(model.vocab_size * model.dim, model.dim * ffn_hidden_dim(model), model.dim * model.dim)


def _offload(device: str, nvme_path: str, param_buffer: int | None) -> dict:
    section: dict[str, Any] = {"device": device, "pin_memory": torch.cuda.is_available()}
    if device == "nvme":
        section["nvme_path"] = nvme_path
        if param_buffer is not None:
            # Parameter offload stages through buffer_count buffers of buffer_size elements each, and each must
            # hold the largest parameter. DeepSpeed's default (1e8 elements = 400 MB fp32, x5) would be 2 GB of
            # staging memory whatever the model; sized to the model it is what is needed.
            # max_in_cpu=0: no parameter partition is also kept in a CPU buffer (DeepSpeed's default, 1e9 elements,
            # keeps up to 4 GB of fp32 parameters in memory besides NVMe). This needs the model built under
            # zero.Init with our dtype (build_partitioned_model); converted later, DeepSpeed 0.19.8's swapper
            # takes bf16 on a CPU ("expected m1 and m2 to have the same dtype").
            section |= {"buffer_count": 5, "buffer_size": max(param_buffer, 1 << 20), "max_in_cpu": 0}
    return section


def our_config(cfg: JobConfig, stage: int, dp_size: int, precision: str) -> dict:
    """The ds_config our fields define."""
    ds, train = cfg.deepspeed, cfg.train
    zero: dict[str, Any] = {"stage": stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(ds.offload_optimizer, ds.nvme_path, None)
        if ds.offload_optimizer == "nvme" and stage == 3:
            # ZeRO-3 swaps the optimizer state in sub-groups of this many elements, with buffers of that size;
            # DeepSpeed's default (1e9) makes the whole model one sub-group, so NVMe offload would hold it all.
            zero["sub_group_size"] = max(largest_parameter(cfg.model), 1 << 22)
    if ds.offload_param != "none":
        largest = largest_parameter(cfg.model)
        zero["offload_param"] = _offload(ds.offload_param, ds.nvme_path, largest)
        # Parameters offloaded means memory is what is short: DeepSpeed's defaults gather up to 1e9 parameters at
        # once and fill a 5e8-element gradient bucket (as large as the model itself up to 500M parameters);
        # sized to the largest weight (a FeedForward gathers three) they bound what is resident. No prefetch and
        # no reuse: with parameters on NVMe, DeepSpeed 0.19.8 keeps the parameters it will reuse soon (the first
        # layers, after backward) in swap buffers, and then has none left for the next step ("Not enough buffers
        # 0 for swapping 1"), or prefetches one that holds a buffer already ("already assigned swap buffer").
        zero |= {"stage3_max_live_parameters": 4 * largest, "stage3_prefetch_bucket_size": 0,
                 "stage3_max_reuse_distance": 0, "reduce_bucket_size": largest}
    return {
        "train_micro_batch_size_per_gpu": train.batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": train.batch_size * train.grad_accum_steps * dp_size,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        # DeepSpeed's mixed precision: the module in bf16 / fp16, fp32 master weights in the optimizer partitions;
        # fp16 with DeepSpeed's dynamic loss scaler (loss_scale 0), which skips a step whose gradients overflow.
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": True, "loss_scale": 0} if precision == "fp16" else {"enabled": False},
        # Our AdamW (param groups without decay on norms/embeddings) under ZeRO, and DeepSpeedCPUAdam with offload.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # the trainer logs; DeepSpeed's own step lines would interleave
        "wall_clock_breakdown": False,
    }


# Our fields that fill a ds_config key, for the conflict message.
FIELD_OF = {"train_micro_batch_size_per_gpu": "train.batch_size", "gradient_accumulation_steps":
            "train.grad_accum_steps", "train_batch_size": "train.batch_size x train.grad_accum_steps x ranks",
            "gradient_clipping": "optim.grad_clip", "zero_optimization.stage": "parallel.zero_stage",
            "bf16.enabled": "train.precision", "fp16.enabled": "train.precision",
            "zero_optimization.offload_optimizer.device": "deepspeed.offload_optimizer",
            "zero_optimization.offload_param.device": "deepspeed.offload_param",
            "zero_optimization.offload_optimizer.nvme_path": "deepspeed.nvme_path",
            "zero_optimization.offload_param.nvme_path": "deepspeed.nvme_path"}


def merge(theirs: dict, ours: dict, where: str, prefix: str = "") -> dict:
    """``theirs`` with every key it leaves out filled from ``ours``; a leaf set in both to different values
    is a ConfigError naming the key and our field."""
    out = copy.deepcopy(theirs)
    for key, value in ours.items():
        name = f"{prefix}{key}"
        if key not in out:
            out[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = merge(out[key], value, where, f"{name}.")
        elif out[key] != value and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                         and isinstance(out[key], (int, float)) and float(out[key]) == value):
            field = FIELD_OF.get(name)
            if field is None:  # a setting of ours the user may override (e.g. steps_per_print)
                continue
            raise ConfigError(f"deepspeed.config {where}: {name} = {json.dumps(out[key])} conflicts with {field} "
                              f"(= {json.dumps(value)}); change one of them or drop the key from the file")
    return out


def _theirs_offload(theirs: dict, kind: str) -> str:
    return str(theirs.get("zero_optimization", {}).get(f"offload_{kind}", {}).get("device", "none"))


def effective_offload(cfg: JobConfig, theirs: dict) -> JobConfig:
    """``cfg`` with the user's ds_config offload devices / nvme path filled in where ours says none/empty."""
    ds = cfg.deepspeed
    opt_dev = ds.offload_optimizer if ds.offload_optimizer != "none" else _theirs_offload(theirs, "optimizer")
    par_dev = ds.offload_param if ds.offload_param != "none" else _theirs_offload(theirs, "param")
    zero = theirs.get("zero_optimization", {})
    nvme = ds.nvme_path or zero.get("offload_optimizer", {}).get("nvme_path") or \
        zero.get("offload_param", {}).get("nvme_path") or ""
    return replace(cfg, deepspeed=replace(ds, offload_optimizer=opt_dev, offload_param=par_dev, nvme_path=str(nvme)))


def check_nvme_path(path: str) -> None:
    """The NVMe offload folder is writable, or can be made: the folder (or its nearest existing parent) is a
    directory this process may write. Nothing is created (the planner asks this of every plan it considers;
    DeepSpeed makes the folder when the run starts)."""
    if not path:
        raise ConfigError("deepspeed.offload_* = nvme needs deepspeed.nvme_path (a folder on a fast local disk)")
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "not a folder" if not existing.is_dir() else "no write permission"
        raise ConfigError(f"deepspeed.nvme_path {path} is not writable ({existing}: {why}); give a folder on a "
                          f"local disk this user can write")


def check_deepspeed(cfg: JobConfig, world_size: int, device_type: str, precision: str,
                    here: bool = True) -> ParallelDims:
    """Every rule of a DeepSpeed job, in one line each; returns the data-parallel degrees the trainer uses
    (ZeRO-3: every rank a shard, so nothing samples from a partial model on one rank; else replicas).

    ``here``: the job runs on this machine, so this machine's installation counts too (DeepSpeed importable,
    libaio for the NVMe op, the NVMe folder writable). The planner passes False: it plans for a target machine,
    whose libraries are not the planning machine's."""
    p = cfg.parallel
    theirs = read_user_config(cfg.deepspeed.config) if cfg.deepspeed.config else {}
    stage = zero_stage(cfg, theirs)
    if stage == 3 and p.pp > 1:
        raise ConfigError(f"ZeRO-3 with pipeline parallelism (parallel.zero_stage=3, parallel.pp={p.pp}) is not "
                          f"supported: ZeRO-3 partitions the very parameters a pipeline stage owns (DeepSpeed's "
                          f"pipeline engine allows ZeRO-1 only); use the native engine (FSDP2 x PP: "
                          f"--parallel.engine=native --parallel.dp_shard=-1) or set parallel.pp=1")
    if p.tp > 1 or p.pp > 1 or p.cp > 1:
        raise ConfigError("parallel.engine=deepspeed is data parallel only here (parallel.tp, pp and cp must be 1); "
                          "use the native engine for tensor / pipeline / context parallelism")
    if p.low_comm != "none":
        raise ConfigError("parallel.low_comm is a native-engine feature; set parallel.engine=native")
    if p.activation_checkpointing != "none":  # the engine wraps the plain model: nothing would apply it
        raise ConfigError("parallel.activation_checkpointing is not applied by the deepspeed engine; set it to none "
                          "or use the native engine")
    if precision == "fp16" and device_type != "cuda":
        raise ConfigError("train.precision=fp16 on the deepspeed engine needs a GPU (DeepSpeed's CPU accelerator "
                          "has no fp16); use bf16 or fp32 on the CPU")
    if not 0 <= stage <= 3:
        raise ConfigError(f"zero_optimization.stage must be 0..3 (got {stage})")
    merged = effective_offload(cfg, theirs)
    ds = merged.deepspeed
    if ds.offload_param != "none" and stage != 3:
        raise ConfigError(f"deepspeed.offload_param={ds.offload_param} needs ZeRO-3 (parallel.zero_stage=3); "
                          f"stage {stage} keeps whole parameters on every rank")
    if ds.offload_optimizer != "none" and stage == 0:
        raise ConfigError(f"deepspeed.offload_optimizer={ds.offload_optimizer} needs ZeRO (parallel.zero_stage "
                          f"1, 2 or 3)")
    if here:
        check_deepspeed_installation(ds)
    dims = ParallelDims.from_config(replace(p, dp_replicate=-1, dp_shard=1, zero_stage=0), world_size) if stage < 3 \
        else ParallelDims.from_config(replace(p, dp_replicate=1, dp_shard=-1, zero_stage=3), world_size)
    # The merge itself can fail (a conflict); check it now, before any process group exists.
    build_ds_config(cfg, dims.dp_size, precision)
    return dims


def check_deepspeed_installation(ds: DeepSpeedConfig) -> None:
    """What this machine must have to run the job: DeepSpeed itself, and for NVMe offload a writable folder and
    the async-io op (libaio)."""
    nvme = "nvme" in (ds.offload_optimizer, ds.offload_param)
    if nvme:
        check_nvme_path(ds.nvme_path)
    missing = deepspeed_missing_reason()
    if missing:
        raise ConfigError(f"parallel.engine=deepspeed: {missing}")
    if nvme:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            raise ConfigError("NVMe offload needs DeepSpeed's async_io op, which needs libaio "
                              "(apt install libaio-dev, then it compiles on first use)")


def build_ds_config(cfg: JobConfig, dp_size: int, precision: str) -> dict:
    """The ds_config of this job: the user's file (if any) filled from our fields."""
    theirs = read_user_config(cfg.deepspeed.config) if cfg.deepspeed.config else {}
    merged = effective_offload(cfg, theirs)
    ours = our_config(merged, zero_stage(cfg, theirs), dp_size, precision)
    return merge(theirs, ours, cfg.deepspeed.config or "(none)")


def ensure_process_group_env() -> None:
    """A single process without torchrun: give DeepSpeed a 1-rank rendezvous on localhost."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})


def skip_inference_comm_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce (``deepspeed_shm_comm``) when its comm starts.
    The op serves ``inference_all_reduce`` (tensor-parallel inference) only, which ZeRO training never calls, and
    without it that call falls back to ``torch.distributed.all_reduce``; its first-use JIT compile costs 1-2
    minutes on 2 cores (measured 87 s on this loaded machine), paid by every fresh install's first run."""
    try:  # by its module path: the package attribute deepspeed.comm.torch is torch itself
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        return
    if hasattr(ds_torch, "build_shm_op"):
        ds_torch.build_shm_op = lambda: None


def build_partitioned_model(model_cfg: ModelConfig, ds_config: dict, seed: int) -> Transformer:
    """The model built under ``deepspeed.zero.Init`` (ZeRO-3): each module's parameters are partitioned over the
    ranks (and, with ``offload_param``, moved to the CPU or swapped to NVMe) as soon as the module is created, so
    no process ever holds the whole model. Weights are then initialised one module at a time, gathered, in
    ``init_weights``' order from ``seed``: the same values as ``build_model(model_cfg, seed=seed)``."""
    import deepspeed

    ensure_process_group_env()
    skip_inference_comm_op()
    deepspeed.init_distributed()  # zero.Init reads the world size from DeepSpeed's comm
    if "offload_param" in ds_config["zero_optimization"]:
        # The allocator's mmap threshold grows (glibc: up to 32 MB) as large blocks are freed, after which blocks
        # that size stay resident once freed: building a 257M-parameter model module by module under NVMe offload
        # left 0.8 GB resident this way (0.1 GB with a fixed 1 MB threshold). jemalloc's pages wait 10 s.
        return_freed_memory_promptly()
    # mem_efficient_linear=False: DeepSpeed's default replaces torch.nn.functional.linear process-wide.
    with deepspeed.zero.Init(config_dict_or_path=ds_config, mem_efficient_linear=False):
        model = Transformer(model_cfg)
    torch.manual_seed(seed)  # the RoPE buffers were computed at construction (from the config, no randomness)
    seen: set[int] = set()
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(own, modifier_rank=0), torch.no_grad():
            # A tied weight is drawn again by its second module (as init_weights does before re-tying), and
            # the first draw kept.
            kept = [(p, p.data.clone()) for p in own if id(p) in seen]
            model.init_module(name, module)
            for p, value in kept:
                p.data.copy_(value)
        seen.update(id(p) for p in own)
    return model


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict):
    """``deepspeed.initialize`` over an initialised model and our optimizer; returns the engine (an
    ``nn.Module`` whose forward is the model's) and DeepSpeed's optimizer wrapper."""
    import deepspeed

    ensure_process_group_env()
    skip_inference_comm_op()
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                                      dist_init_required=True)
    return engine, ds_optimizer
