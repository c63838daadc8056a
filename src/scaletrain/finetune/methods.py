"""Fine-tuning methods as transforms of the pure model, applied on the meta device before ``parallelize``.

``FinetuneMethod.convert`` freezes what the method keeps fixed and swaps in the adapter modules (its entry
of method_table.py's ``METHODS``: lora.py, prompt.py); the model file is untouched. After ``parallelize`` has
materialized the model, ``load_base_and_adapters`` writes the base's weights and the adapters' initial values
into every rank's parameters (sharded or not): the same values in every layout, as ``parallel/init.py`` does
for pretraining. ``FinetuneMethod`` is the two as one model converter (train/converters.py).
"""

from __future__ import annotations

import hashlib
from collections import ChainMap
from collections.abc import Mapping

import torch
from torch import nn

from scaletrain.config import ConfigError, FinetuneConfig
from scaletrain.finetune.base import open_base
from scaletrain.finetune.lora import (
    ExpertAdapter,
    LoRALinear,
    is_nf4,
    magnitude_weight_name,
    put_back,
    qlora_compiled,
    quantize_from_base,
)
from scaletrain.finetune.method_table import method_entry
from scaletrain.finetune.prompt import PrefixAttention, PromptEmbedding
from scaletrain.parallel.init import copy_full_into


def _generator(seed: int, name: str) -> torch.Generator:
    """A generator per adapter module, seeded by (seed, module name): the same initial values whatever the
    layout, the order of modules or the device."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % 2**63)


@torch.no_grad()
def initial_adapter_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full-size initial values of every adapter parameter (name -> CPU fp32 tensor), peft's initialisation."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        gen = _generator(seed, name)
        if isinstance(module, LoRALinear):
            bound = 1.0 / module.in_features ** 0.5  # kaiming_uniform(a=sqrt(5)) of an (r, in) matrix
            out[f"{name}.lora_A"] = torch.empty(tuple(module.lora_A.shape)).uniform_(-bound, bound, generator=gen)
            out[f"{name}.lora_B"] = torch.zeros(tuple(module.lora_B.shape))
        elif isinstance(module, ExpertAdapter):  # each expert's A as LoRALinear's (its fan-in: the last axis)
            bound = 1.0 / module.lora_A.shape[-1] ** 0.5
            out[f"{name}.lora_A"] = torch.empty(tuple(module.lora_A.shape)).uniform_(-bound, bound, generator=gen)
            out[f"{name}.lora_B"] = torch.zeros(tuple(module.lora_B.shape))
        elif isinstance(module, PromptEmbedding):
            out[f"{name}.prompt"] = torch.empty(tuple(module.prompt.shape)).normal_(generator=gen)
        elif isinstance(module, PrefixAttention):
            for key in ("prefix_key", "prefix_value"):
                out[f"{name}.{key}"] = torch.empty(tuple(getattr(module, key).shape)).normal_(generator=gen)
    return out


def load_base_and_adapters(parts: list[nn.Module], base_state: Mapping[str, torch.Tensor], seed: int,
                           adapters: dict[str, torch.Tensor] | None = None) -> None:
    """Write the base weights and the adapters' values (``adapters``, default: their initial values) into
    the parameters of ``parts`` (this rank's, plain or DTensor shards)."""
    for part in parts:
        # Looked up name by name (adapters first): a lazily read base (base.RunWeights) is never whole in memory.
        full = ChainMap(adapters if adapters is not None else initial_adapter_state(part, seed), base_state)
        # A 4-bit weight (QLoRA) was read and quantized before materializing (hold_out_base): not copied again.
        params = {name: p for name, p in part.named_parameters(remove_duplicate=False) if not is_nf4(p)}
        for name in params:  # a fresh DoRA magnitude is the base's row norms: the adapted model starts as the base
            weight = base_state.get(magnitude_weight_name(name)) if name.endswith(".lora_magnitude") else None
            if name not in full and weight is not None:  # (E, out) for an expert's stacked (E, out, in)
                full[name] = torch.linalg.norm(weight.float(), dim=-1)
        missing = [name for name in params if name not in full]
        if missing:
            raise ConfigError(f"finetune.source: the base has no weight for {missing[0]}")
        copy_full_into(part, full, names=list(params))


class FinetuneMethod:
    """``finetune.method`` on the base ``finetune.source``, as a model converter (train/converters.py) and for
    the single-device build of a run (finetune/run.py): ``convert`` freezes the meta model and swaps in the
    adapters (QLoRA: reads and quantizes its 4-bit base, never whole in fp32); once the model is materialized,
    ``load`` writes the base's weights and the adapters' values into it. The method is its entry of
    method_table.py's ``METHODS``, looked up once here, where the training is built."""

    def __init__(self, ft: FinetuneConfig, seed: int, device: torch.device | str = "cpu"):
        self.ft, self.seed, self.device = ft, seed, device
        self.entry = method_entry(ft.method)
        self.base_state: Mapping[str, torch.Tensor] = {}
        self.held: list = []

    def convert(self, model: nn.Module) -> None:
        """On the meta model, before ``parallelize``: the entry's ``apply`` (freeze, swap in the adapters); QLoRA's
        4-bit base read and quantized tensor by tensor on ``device`` (``lora.quantize_from_base``), to give to
        ``put_back`` in ``load``."""
        self.entry.apply(model, self.ft)
        self.base_state = open_base(self.ft.source).state()
        if self.entry.quantized_base:
            self.held = quantize_from_base(model, self.base_state, device=self.device)

    def load(self, parts: list[nn.Module], adapters: dict[str, torch.Tensor] | None = None) -> None:
        """The 4-bit base back in place (dequantized through torch.compile if ``finetune.qlora_compile`` says so on
        this device), then the base's weights and ``adapters`` (default: initial values)."""
        put_back(self.held, qlora_compiled(self.ft.qlora_compile, self.device))
        load_base_and_adapters(parts, self.base_state, self.seed, adapters)

    def after_parallelize(self, pm) -> None:
        """Every rank's parameters (plain or DTensor shards) of ``pm`` (a ``ParallelModel``)."""
        self.load(pm.modules)


def parameter_counts(modules: list[nn.Module]) -> tuple[int, int]:
    """(trainable, total) parameters of the model (a 4-bit weight counts as its logical size)."""
    seen, trainable, total = set(), 0, 0
    for m in modules:
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            total += n
            trainable += n if p.requires_grad else 0
    return trainable, total


TRAINABLE_KINDS = ("attention", "experts", "router", "other")


def _kind(name: str) -> str:
    """Which part of the model a parameter belongs to (by name): attention, the routed or shared experts, the
    router, or the rest (a dense feed-forward, embeddings, norms, virtual tokens)."""
    if ".attention." in f".{name}":
        return "attention"
    if ".experts." in name or ".shared_experts." in name:
        return "experts"
    return "router" if ".router." in name else "other"


def trainable_by_kind(modules: list[nn.Module]) -> tuple[dict[str, int], int]:
    """({kind: trainable parameters} over ``TRAINABLE_KINDS``, the trainable parameters' bytes: what an adapter
    file holds besides its header)."""
    seen, counts, nbytes = set(), dict.fromkeys(TRAINABLE_KINDS, 0), 0
    for m in modules:
        for name, p in m.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            counts[_kind(name)] += p.numel()
            nbytes += p.numel() * p.element_size()
    return counts, nbytes
