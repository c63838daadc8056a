"""The optimizer table (``OPTIMIZERS``: one ``OptimizerEntry`` per ``optim.name``) and the builders that read it.

AdamW with parameter groups: weight decay on matrices only; or Muon on the blocks' matrices + AdamW on the rest
(``optim.name = "muon"``, train/muon.py). Each entry holds what the trainer builds, what the job validation refuses
(``train/validate.py:check_optimizer``) and what the planner charges (``plan/memory.py``, ``plan/timing.py``,
``plan/finetune.py``); ``plan --optim.name`` takes its names. Adding an optimizer is one entry plus tests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from scaletrain.config import ConfigError, JobConfig, OptimConfig
from scaletrain.finetune.method_table import method_entry
from scaletrain.model.moe import GroupedExperts
from scaletrain.parallel.ddp import build_zero1_optimizer
from scaletrain.train.muon import Muon, MuonAdamW, muon_matrices

if TYPE_CHECKING:  # the planner reads the table: no parallelize (DTensor, pipelining) on its import path
    from scaletrain.parallel import ParallelModel


def _is_matrix_module(module: nn.Module) -> bool:
    """A Linear layer, or a mixture of experts' stacked expert weights (each expert's slice is a Linear weight)."""
    return isinstance(module, (nn.Linear, GroupedExperts))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights of Linear layers and the experts' stacked (E, out, in) ones, as the dense feed-forward
    they replace; never norms or embeddings (decaying the embedding table pulls rare tokens' vectors to zero, and
    norm gains towards zero, neither of which helps)."""
    decay, no_decay, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue  # a tied weight is listed once
            seen.add(id(p))
            ndim = len(getattr(p, "ds_shape", p.shape))  # DeepSpeed ZeRO-3 leaves an empty tensor, ds_shape
            (decay if _is_matrix_module(module) and ndim >= 2 else no_decay).append(p)
    # The tied output head is an nn.Linear whose weight *is* the embedding: keep it undecayed.
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    no_decay += [p for p in decay if id(p) in emb_ids]
    decay = [p for p in decay if id(p) not in emb_ids]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def mup_param_groups(model: nn.Module, weight_decay: float, width_mult: float) -> list[dict]:
    """``param_groups`` split for muP (model/mup.py, as the ``mup`` package's MuAdam): the hidden matrices (the
    Linear layers inside blocks, both dimensions growing with the width, and the experts' stacked weights: each
    expert's width is the dense one's / top-k, growing with it) get ``lr_scale = 1 / width_mult`` and
    weight decay ``* width_mult`` (AdamW multiplies the decay by the lr, so their product stays put); the
    embedding, norms and the readout (output) keep the base lr. The trainer sets each group's lr to the
    schedule's lr times its ``lr_scale``."""
    decay, no_decay = param_groups(model, weight_decay)
    hidden_ids = {id(p) for name, module in model.named_modules() if _is_matrix_module(module)
                  and ".layers." in f".{name}." for p in module.parameters(recurse=False)}
    hidden = [p for p in decay["params"] if id(p) in hidden_ids]
    rest = [p for p in decay["params"] if id(p) not in hidden_ids]
    return [{"params": hidden, "weight_decay": weight_decay * width_mult, "lr_scale": 1.0 / width_mult},
            {"params": rest, "weight_decay": weight_decay, "lr_scale": 1.0},
            {**no_decay, "lr_scale": 1.0}]


def lora_plus_groups(model: nn.Module, groups: list[dict], ratio: float) -> list[dict]:
    """LoRA+ (Hayou et al. 2024): each group split, the LoRA adapters' B matrices (``lora_B``) moved to a group of
    their own whose ``lr_scale`` is ``ratio`` times the group's (peft's ``create_loraplus_optimizer`` does the
    same). The paper shows that one rate for both is inefficient for wide layers, and that the update learns
    faster with B's rate ~16x A's."""
    b_ids = {id(p) for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "lora_B"}
    out = []
    for group in groups:
        scale = group.get("lr_scale", 1.0)
        out.append({**group, "params": [p for p in group["params"] if id(p) not in b_ids], "lr_scale": scale})
        b = [p for p in group["params"] if id(p) in b_ids]
        if b:
            out.append({**group, "params": b, "lr_scale": scale * ratio})
    return out


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_supported(model: nn.Module, device: torch.device) -> bool:
    """Whether torch's fused AdamW can take every trainable parameter of ``model``: all on ``device``'s type,
    CUDA or CPU, in a floating dtype its kernel has (a parameter elsewhere, e.g. offloaded to another device
    type, or in another dtype makes ``fused=True`` raise at the first step). The fused kernel is also what skips
    a non-finite step on the device (train/step.py ``skips_on_device``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return device.type in ("cuda", "cpu") and all(p.device.type == device.type and p.dtype in FUSED_DTYPES
                                                  for p in params)


def adamw_param_groups(model: nn.Module, cfg: OptimConfig, width_mult: float = 1.0,
                       lora_plus_ratio: float = 1.0) -> list[dict]:
    """``param_groups``; ``width_mult`` != 1 (muP): ``mup_param_groups``; ``lora_plus_ratio`` != 1:
    ``lora_plus_groups``. Each group's initial lr is already times its ``lr_scale``."""
    groups = param_groups(model, cfg.weight_decay) if width_mult == 1.0 else \
        mup_param_groups(model, cfg.weight_decay, width_mult)
    if lora_plus_ratio != 1.0:
        groups = lora_plus_groups(model, groups, lora_plus_ratio)
    groups = split_by_tensor_kind(groups)
    return [{**g, "lr": cfg.lr * g["lr_scale"]} if "lr_scale" in g else g for g in groups]


def split_by_tensor_kind(groups: list[dict]) -> list[dict]:
    """Each group that mixes DTensor and plain parameters split in two, the same settings in both: the fused and
    foreach kernels take one kind a call (DDP's plain dense weights next to expert-parallel experts,
    parallel/expert.py, which are DTensors). A group of one kind is kept as it is."""
    from torch.distributed.tensor import DTensor

    out = []
    for group in groups:
        kinds = [[p for p in group["params"] if isinstance(p, DTensor) is want] for want in (False, True)]
        out.extend([{**group, "params": params} for params in kinds if params] if all(kinds) else [group])
    return out


def adamw_kernel(model: nn.Module, cfg: OptimConfig, device: torch.device) -> dict:
    """torch.optim.AdamW's kernel keywords for optim.implementation (auto: fused when ``fused_supported``: one
    kernel per step; on the CPU too since torch 2.4, where foreach took ~4x longer)."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if fused_supported(model, device) else "foreach"
    if impl == "loop":
        return {"foreach": False}
    return {"fused": True} if impl == "fused" else {"fused": False, "foreach": True}


def build_adamw(model: nn.Module, groups: list[dict], cfg: OptimConfig, device: torch.device,
                kernel: dict) -> torch.optim.AdamW:
    """torch.optim.AdamW over ``groups`` (``kernel``: ``adamw_kernel``'s fused / foreach / loop)."""
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    width_mult: float = 1.0, lora_plus_ratio: float = 1.0) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.name`` (its entry of ``OPTIMIZERS``) over its parameter groups."""
    entry = optimizer_entry(cfg.name)
    groups = entry.param_groups(model, cfg, width_mult, lora_plus_ratio)
    return entry.build(model, groups, cfg, device, adamw_kernel(model, cfg, device))


def build_muon(model: nn.Module, groups: list[dict], cfg: OptimConfig, device: torch.device,
               kernel: dict) -> MuonAdamW:
    """``groups`` (AdamW's) with the blocks' matrices (``muon_matrices``) moved to one Muon group at
    ``optim.muon_lr`` (0: optim.lr), ``lr_scale`` = muon_lr / lr so the trainer's schedule scales both alike.
    Newton-Schulz in bf16 on a GPU, fp32 on a CPU (train/muon.py)."""
    matrices = muon_matrices(model, adapters=cfg.muon_adapters)
    by_id = {id(p): p for g in groups for p in g["params"]}
    adamw_groups = [{**g, "params": [p for p in g["params"] if id(p) not in matrices]} for g in groups]
    adamw_groups = [g for g in adamw_groups if g["params"]]
    scale = (cfg.muon_lr or cfg.lr) / cfg.lr
    muon_group = {"params": [by_id[i] for i in by_id if i in matrices], "lr_scale": scale, "lr": cfg.lr * scale}
    adamw = torch.optim.AdamW(adamw_groups or [{"params": []}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                              eps=cfg.eps, **kernel)
    muon = Muon([muon_group], lr=cfg.lr * scale, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                adjust_lr_fn=cfg.muon_adjust_lr, ns_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return MuonAdamW(adamw, muon)


def build_parallel_optimizer(pm: ParallelModel, cfg: OptimConfig, device: torch.device, zero_stage: int,
                             width_mult: float = 1.0, lora_plus_ratio: float = 1.0):
    """The optimizer over this rank's parameters (all parts), or ZeRO-1 (``ZeroRedundancyOptimizer``) around
    AdamW (``check_optimizer`` refuses ZeRO-1 for an optimizer that is not AdamW)."""
    adamw = build_optimizer(nn.ModuleList(pm.modules), cfg, device, width_mult, lora_plus_ratio)
    if zero_stage != 1 or pm.dims.dp_replicate == 1:
        return adamw
    accepted = inspect.signature(torch.optim.AdamW.__init__).parameters
    kwargs = {k: v for k, v in adamw.defaults.items() if k in accepted and k not in ("weight_decay", "params")}
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "lr": g["lr"],
               **({"lr_scale": g["lr_scale"]} if "lr_scale" in g else {})} for g in adamw.param_groups]
    return build_zero1_optimizer(groups, pm.group("dp_replicate"), **kwargs)


def muon_refusal(cfg: JobConfig) -> str | None:
    """optim.name = muon (train/muon.py): Newton-Schulz needs each whole matrix, which FSDP2 gathers per matrix
    but tensor / context parallelism splits across ranks that compute different things; ZeRO-1, DeepSpeed and
    low-communication replicas build their own AdamW; muP scales the hidden matrices' lr its own way."""
    o, par, ft = cfg.optim, cfg.parallel, cfg.finetune
    if par.tp > 1 or par.cp > 1:
        return ("optim.name=muon needs whole weight matrices: not with parallel.tp > 1 or parallel.cp > 1 "
                "(FSDP2, parallel.dp_shard, gathers each matrix for its update)")
    if par.ep > 1:
        return ("optim.name=muon is not written for expert-parallel experts (parallel.ep > 1: each rank holds a "
                "slice of the stacked experts); use optim.name=adamw, or parallel.ep=1")
    if par.engine != "native" or par.zero_stage == 1 or par.low_comm != "none":
        return ("optim.name=muon runs on the native engine with DDP or FSDP2 (parallel.zero_stage 0, 2 or 3, "
                "parallel.low_comm=none); ZeRO-1, DeepSpeed and local SGD / DiLoCo build their own AdamW")
    if o.muon_adapters and not method_entry(ft.method).lora:
        return (f"optim.muon_adapters puts LoRA's adapter matrices under Muon: it needs finetune.method=lora "
                f"or qlora (got {ft.method}); drop it")
    if o.muon_adapters and ft.lora_plus_ratio != 1.0:
        return ("optim.muon_adapters with finetune.lora_plus_ratio != 1: LoRA+ sets the B matrices' AdamW "
                "lr, Muon scales each matrix's lr by its shape; use one of them")
    if cfg.model.parametrization == "mup":
        return ("optim.name=muon with model.parametrization=mup is not supported (muP scales the hidden "
                "matrices' AdamW lr; Muon scales its own by shape): use one of them")
    return None


# AdamW's state per parameter: m and v in fp32 (the planner's Recipe.optimizer, plan/memory.py).
ADAMW_STATE_BYTES = 8


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer: how the trainer builds it, what a job with it is refused, what the planner charges."""

    name: str  # optim.name (in train and plan alike)
    # the planner's words for it (plan's tables); ``{adapters}`` is filled when optim.muon_adapters is planned
    summary: str
    # (model, param groups, optim, device, AdamW's kernel keywords: adamw_kernel) -> the optimizer
    build: Callable[[nn.Module, list[dict], OptimConfig, torch.device, dict], torch.optim.Optimizer]
    # (model, optim, muP's width_mult, LoRA+'s ratio) -> param groups, each with its initial lr
    param_groups: Callable[[nn.Module, OptimConfig, float, float], list[dict]] = adamw_param_groups
    # a job this optimizer cannot train: one line, or None (train/validate.py:check_optimizer raises it)
    refusal: Callable[[JobConfig], str | None] = lambda cfg: None
    fields: tuple[str, ...] = ()  # the optim.* fields only this optimizer reads: set with another, refused
    # The planner: optimizer-state bytes per parameter its own rule updates (fp32); on the blocks' weight
    # matrices only when ``matrices`` (AdamW's ADAMW_STATE_BYTES on the rest), else on every trainable parameter.
    state_bytes: float = ADAMW_STATE_BYTES
    matrices: bool = False
    orthogonalizes: bool = False  # Newton-Schulz on each whole matrix: its temporaries, FLOPs and FSDP2's gathers
    states_label: str = "m, v"  # the memory breakdown's row: "optimizer states (<this>)"

    def state_share(self) -> float:
        """Its state bytes per parameter over AdamW's (1 for AdamW, 0.5 for Muon's one momentum buffer)."""
        return self.state_bytes / ADAMW_STATE_BYTES


OPTIMIZERS: dict[str, OptimizerEntry] = {entry.name: entry for entry in (
    OptimizerEntry("adamw", "m, v per parameter", build_adamw),
    OptimizerEntry("muon", "Muon with one momentum buffer on the blocks' matrices{adapters}, Newton-Schulz in the "
                   "step; AdamW on the rest", build_muon, refusal=muon_refusal,
                   fields=("muon_lr", "muon_adjust_lr", "muon_momentum", "muon_adapters"),
                   state_bytes=4, matrices=True, orthogonalizes=True, states_label="Muon m; AdamW m, v"),
)}


def optimizer_entry(name: str, where: str = "optim.name") -> OptimizerEntry:
    """The entry of ``name``; a one-line ConfigError naming the optimizers there are."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"{where}: no optimizer {name!r} (there are {', '.join(OPTIMIZERS)}: "
                          f"train/optimizer.py's OPTIMIZERS)")
    return OPTIMIZERS[name]
