"""The fine-tuning method table (``METHODS``: one ``MethodEntry`` per ``finetune.method``), as
``train/optimizer.py:OPTIMIZERS`` is the optimizers'.

An entry says how the method changes the model (``apply``, run by the converter in finetune/methods.py), what
trains, whether it adds virtual tokens, its peft adapter, what the planner charges and what it refuses. The
trainer's checks (train/validate.py), the data's packing, export, compress and the planner read these fields,
never the method's name: a new method is one entry here plus its tests (tests/finetune/test_method_table.py).
``FinetuneConfig.method``'s choices are this table's names (a test holds them equal: config.py sits below it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.config import ConfigError, FinetuneConfig, JobConfig, ModelConfig
from scaletrain.finetune.lora import apply_lora, check_lora_targets
from scaletrain.finetune.peft_format import lora_adapter, prefix_adapter, prompt_adapter
from scaletrain.finetune.prompt import apply_prefix_tuning, apply_prompt_tuning
from scaletrain.model.presets import block_params, expert_hidden_dim, num_params, projection_shapes, sparse_layers

PeftWriter = Callable[[nn.Module, JobConfig], tuple[dict, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class MethodEntry:
    """One fine-tuning method: its converter, what it trains, its virtual tokens, export and refusals."""

    name: str  # the value of finetune.method (train, finetune and plan: --finetune.method)
    # (meta or real model, finetune config) -> None: freezes what stays fixed and swaps in the adapters, in place
    apply: Callable[[nn.Module, FinetuneConfig], None]
    # (model config, finetune config) -> the parameters that train (the planner's count; the trainer counts modules)
    trainable_parameters: Callable[[ModelConfig, FinetuneConfig], int]
    trains_base: bool = False  # the base's own weights train (full fine-tuning, less finetune.freeze_*)
    lora: bool = False  # LoRA adapters on finetune.lora_targets (the lora_* fields, LoRA+, optim.muon_adapters)
    quantized_base: bool = False  # the blocks' frozen projections held in 4-bit NF4 (QLoRA): one process, eager
    input_tokens: bool = False  # finetune.virtual_tokens trained embeddings ahead of every row (prompt tuning)
    prefix_tokens: bool = False  # finetune.virtual_tokens trained keys / values in every attention (prefix tuning)
    data_parallel_only: bool = True  # runs under DDP / FSDP2 only (no tp / pp / cp / low_comm)
    peft_adapter: PeftWriter | None = None  # its peft adapter folder's contents; None: it exports as a model
    # a job this method cannot train beyond what the fields above refuse: one line, or None (check_finetune)
    refusal: Callable[[JobConfig, int], str | None] = lambda cfg, world_size: None

    @property
    def virtual_tokens(self) -> bool:
        """Trained positions outside the data (prompt, prefix): no packing, no document mask, no merge."""
        return self.input_tokens or self.prefix_tokens

    def extra_positions(self, ft: FinetuneConfig) -> int:
        """Positions the rotary tables cover beyond data.seq_len: the virtual tokens in front of the real ones."""
        return ft.virtual_tokens if self.virtual_tokens else 0

    def first_input_frozen(self) -> bool:
        """Nothing below the first block trains (no embedding, no virtual input), so autograd skips the input
        gradient of its q, k, v (the planner's step time)."""
        return not self.trains_base and not self.input_tokens


def _freeze_full(model: nn.Module, ft: FinetuneConfig) -> None:
    """All weights train but finetune.freeze_embeddings / freeze_blocks (<= the base's: train/validate.py)."""
    if ft.freeze_embeddings:
        model.tok_embeddings.weight.requires_grad_(False)
    for index in range(ft.freeze_blocks):
        model.layers[str(index)].requires_grad_(False)


def _apply_lora(model: nn.Module, ft: FinetuneConfig) -> None:
    model.requires_grad_(False)
    check_lora_targets(ft.lora_targets)  # also train/validate.py's rule; here for callers that skip it
    apply_lora(model, ft.lora_targets, ft.lora_rank, ft.lora_alpha, ft.lora_dropout, ft.rslora, ft.dora)


def _apply_prompt(model: nn.Module, ft: FinetuneConfig) -> None:
    model.requires_grad_(False)
    apply_prompt_tuning(model, ft.virtual_tokens)


def _apply_prefix(model: nn.Module, ft: FinetuneConfig) -> None:
    model.requires_grad_(False)
    apply_prefix_tuning(model, ft.virtual_tokens)


def _full_trainable(cfg: ModelConfig, ft: FinetuneConfig) -> int:
    frozen = (cfg.vocab_size * cfg.dim if ft.freeze_embeddings else 0) + ft.freeze_blocks * block_params(cfg)
    return num_params(cfg) - frozen


def _lora_trainable(cfg: ModelConfig, ft: FinetuneConfig) -> int:
    """A rank-r adapter (+ DoRA's magnitude per row) per targeted projection; in a sparse block the feed-forward
    roles adapt every expert (E adapters of the expert's shape) and the shared experts, and ``router`` the
    router."""
    def adapter(i: int, o: int) -> int:
        return ft.lora_rank * (i + o) + (o if ft.dora else 0)

    shapes = projection_shapes(cfg)
    ffn = {"gate", "up", "down"}
    dense = sum(adapter(*shapes[t]) for t in ft.lora_targets if t in shapes)
    total = cfg.n_layers * sum(adapter(*shapes[t]) for t in ft.lora_targets if t in shapes and t not in ffn)
    sparse = sparse_layers(cfg)
    total += (cfg.n_layers - sparse) * (dense - sum(adapter(*shapes[t]) for t in ft.lora_targets
                                                    if t in shapes and t not in ffn))
    if sparse:
        d, h = cfg.dim, expert_hidden_dim(cfg)
        expert = {"gate": (d, h), "up": (d, h), "down": (h, d)}
        shared = {"gate": (d, h * cfg.moe_shared_experts), "up": (d, h * cfg.moe_shared_experts),
                  "down": (h * cfg.moe_shared_experts, d)}
        per_block = sum(cfg.moe_experts * adapter(*expert[t]) + (adapter(*shared[t]) if cfg.moe_shared_experts
                                                                   else 0) for t in ft.lora_targets if t in ffn)
        per_block += adapter(d, cfg.moe_experts) if "router" in ft.lora_targets else 0
        total += sparse * per_block
    return total


def _prompt_trainable(cfg: ModelConfig, ft: FinetuneConfig) -> int:
    return ft.virtual_tokens * cfg.dim


def _prefix_trainable(cfg: ModelConfig, ft: FinetuneConfig) -> int:
    return cfg.n_layers * 2 * ft.virtual_tokens * projection_shapes(cfg)["k"][1]


METHODS: dict[str, MethodEntry] = {entry.name: entry for entry in (
    MethodEntry("full", _freeze_full, _full_trainable, trains_base=True, data_parallel_only=False),
    MethodEntry("lora", _apply_lora, _lora_trainable, lora=True, peft_adapter=lora_adapter),
    MethodEntry("qlora", _apply_lora, _lora_trainable, lora=True, quantized_base=True, peft_adapter=lora_adapter),
    MethodEntry("prompt", _apply_prompt, _prompt_trainable, input_tokens=True, peft_adapter=prompt_adapter),
    MethodEntry("prefix", _apply_prefix, _prefix_trainable, prefix_tokens=True, peft_adapter=prefix_adapter),
)}


def method_entry(name: str, where: str = "finetune.method") -> MethodEntry:
    """The entry of ``name``; a one-line ConfigError naming the methods there are."""
    if name not in METHODS:
        raise ConfigError(f"{where}: no fine-tuning method {name!r} (there are {', '.join(METHODS)}: "
                          f"finetune/method_table.py's METHODS)")
    return METHODS[name]


def packs_instructions(cfg: JobConfig) -> bool:
    """Whether finetune.packing packs the instruction rows: true, or auto for the methods whose examples can share
    a row (not the virtual-token methods: the virtual tokens in front of a row would be every example's) and a
    layout the mask reaches (not pipeline or context parallelism). ``train.validate`` refuses ``true`` where it
    cannot."""
    packing = cfg.finetune.packing
    if packing != "auto":
        return packing == "true"
    return not method_entry(cfg.finetune.method).virtual_tokens and cfg.parallel.pp == 1 and cfg.parallel.cp == 1
