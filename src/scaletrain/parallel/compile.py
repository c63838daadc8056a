"""``torch.compile``: the whole model where nothing wraps its parts, else block by block.

Whole model: one graph from the embedding to the logits, so inductor fuses across block boundaries
(residual adds, the final norm, the output projection) and a step pays one guard check instead of one
per block. On the nanoGPT baby recipe this was 0.86-0.91x the eager nanoGPT-layout step across runs,
against 0.92x per block in the same comparison (benchmarks/shakespeare_char.py times it side by side).
It is used when no technique hooks into the blocks: no FSDP2 (whose per-block hooks must stay outside
the compiled region), no DDP (one compiled backward would hand DDP every gradient at its very end, so
no bucket's all-reduce could overlap the backward; per block it still can), no pipeline stages, no tensor
parallelism (DTensor plans per block) and no activation
checkpointing (which wraps blocks). A single process and low-communication replicas (DiLoCo, local
SGD: no per-step gradient traffic) compile the whole model.

Per block otherwise: every transformer block has the same code, so compiling the blocks one by one
compiles that code once and reuses it, and it composes with FSDP2, TP, AC and pipeline stages.
``Module.compile()`` compiles in place, keeping parameter names, so checkpoints do not see it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch
from torch import nn

from scaletrain.config import JobConfig
from scaletrain.parallel.distributed import say


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run here, or None. On a CPU inductor builds C++ kernels, so it needs
    a C++ compiler: a laptop without one would otherwise fail at the first step with a long traceback."""
    if device.type == "cpu":
        candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        if not any(c and shutil.which(c) for c in candidates):
            return "no C++ compiler (g++/clang++, or $CXX) found for inductor's CPU kernels"
    return None


def compile_enabled(cfg: JobConfig) -> bool:
    """Whether the run compiles: train.compile as ``resolve_compile`` left it ("true"; "auto" is decided there)."""
    return cfg.train.compile in ("true", True)


def compiles_whole_model(dims, parallel) -> bool:
    """The whole model as one graph (nothing wraps the blocks: see the module docstring), else block by block."""
    return (dims.pp == 1 and dims.tp == 1 and dims.dp_shard == 1 and dims.cp == 1
            and (dims.dp_replicate == 1 or parallel.low_comm != "none") and parallel.activation_checkpointing == "none")


def resolve_compile(cfg: JobConfig, device: torch.device, announce: bool) -> JobConfig:
    """``cfg`` with train.compile turned off, and one warning line, where torch.compile cannot run (a CPU
    without a C++ compiler): a recipe that compiles still trains, eagerly. ("auto" is decided before this, by
    ``train.compile_choice``; without a compiler it quietly means eager.)"""
    reason = compile_unavailable(device) if compile_enabled(cfg) or cfg.train.compile == "auto" else None
    if reason is None:
        return cfg
    if announce and compile_enabled(cfg):
        say(f"warning: train.compile=true but {reason}; training eagerly "
            "(install g++ to compile, or set train.compile=false to silence this)")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile="false"))


def compile_mode_refusal(cfg: JobConfig, device_type: str, whole_model: bool) -> str | None:
    """Why train.compile_mode cannot work for this job (one line), or None. reduce-overhead records CUDA graphs:
    it needs a GPU, and a whole-model graph (per-block compiles sit between FSDP/DDP hooks, tensor-parallel
    collectives, pipeline stages or recomputation, which a graph replay would skip)."""
    mode = cfg.train.compile_mode
    if mode == "default":
        return None
    if cfg.train.compile == "false":
        return f"train.compile_mode={mode} needs train.compile=true (or auto); it is false"
    if mode == "reduce-overhead" and device_type != "cuda":
        return ("train.compile_mode=reduce-overhead records CUDA graphs and needs a GPU; use default or "
                "max-autotune-no-cudagraphs on a CPU")
    if mode == "reduce-overhead" and not whole_model:
        return ("train.compile_mode=reduce-overhead needs the whole model compiled as one graph (a single process or "
                "DDP-free replicas, no FSDP, TP, pipeline or activation checkpointing); use "
                "max-autotune-no-cudagraphs here")
    return None


def apply_compile(model: nn.Module, *, whole_model: bool = False, mode: str = "default") -> None:
    """``Module.compile`` of the whole model or each block, in torch.compile's ``mode`` (train.compile_mode)."""
    kwargs = {} if mode == "default" else {"mode": mode}
    if whole_model:
        model.compile(**kwargs)
        return
    for block in model.layers.values():
        block.compile(**kwargs)
