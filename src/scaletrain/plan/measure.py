"""Measure a real training step, to check the planner: exact peak tensor bytes and median step time.

The memory tracker is a ``TorchDispatchMode`` that sees every tensor an aten op returns, counts each
storage once while it is alive (a weakref finalizer subtracts it when freed) and keeps the peak. It
counts tensor bytes exactly, unlike RSS (which also holds the allocator's cache, libraries and Python).

The step is the trainer's defaults: forward, cross-entropy, backward, clip_grad_norm_(1.0), AdamW
(foreach, decay on matrices only), zero_grad(set_to_none=True), fp32.
"""

from __future__ import annotations

import statistics
import time
import weakref
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scaletrain.config import ModelConfig


class LiveTensorBytes(TorchDispatchMode):
    """Track live tensor-storage bytes (and their peak) of everything created while the mode is active."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        for tensor in existing:
            self._track(tensor)

    def _track(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if hasattr(tensor, "_local_tensor"):  # DTensor: count the local shard
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        key = id(storage)  # storages keep their Python object alive as long as the storage lives
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self._track(tensor)
        return out


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: int = 2) -> None:
    """Wrap blocks in non-reentrant checkpointing: all of them (full) or every ``every``-th (selective)."""
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    for i, block in enumerate(model.layers.values()):
        if mode == "full" or (i + 1) % every == 0:
            forward = block.forward
            block.forward = lambda *a, _f=forward: checkpoint(_f, *a, use_reentrant=False)


def build_optimizer(model: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW with decay on matrices, none on norms and embeddings (config.OptimConfig's documented groups)."""
    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in embedding]
    no_decay = [p for p in model.parameters() if not (p.ndim >= 2 and id(p) not in embedding)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), foreach=True)


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
              targets: torch.Tensor, vocab_size: int, grad_clip: float = 1.0) -> Callable[[], float]:
    """One optimizer step. Logits are not kept by the caller: they die inside cross_entropy."""

    def step() -> float:
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def measure_step(step: Callable[[], object], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 extra: Iterable[torch.Tensor] = (), steps: int = 5, warmup: int = 2) -> dict:
    """Peak tensor bytes of one steady-state step (optimizer states exist) and median seconds per step."""
    for _ in range(warmup):
        step()
    existing = [*model.parameters(), *model.buffers(), *extra,
                *(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
    with LiveTensorBytes(existing) as tracker:
        at_rest = tracker.live
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak_bytes": tracker.peak, "at_rest_bytes": at_rest, "step_s": statistics.median(times),
            "step_s_min": min(times), "step_s_all": times}


def matmul_probe(seconds: float = 0.3) -> float:
    """FLOP/s of a 1024^3 matmul right now: tells a quiet machine from one shared with other work."""
    from scaletrain.plan.calibration import measure_matmul_flops

    return measure_matmul_flops("cpu", "fp32", n=1024, min_seconds=seconds)


def single_process_run(model_cfg: ModelConfig, batch: int, seq: int, ac: str = "none", ac_every: int = 2,
                       steps: int = 5, seed: int = 0) -> dict:
    """Build scaletrain's Llama, apply activation checkpointing, and measure a training step on CPU."""
    from scaletrain.model.llama import build_model

    model = build_model(model_cfg, "cpu", seed=seed)
    apply_activation_checkpointing(model, ac, ac_every)
    optimizer = build_optimizer(model)
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, model_cfg.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, model_cfg.vocab_size, (batch, seq), generator=gen)
    step = make_step(model, optimizer, inputs, targets, model_cfg.vocab_size)
    # The rope buffers and the batch are counted as at-rest bytes (the planner adds them the same way).
    return measure_step(step, model, optimizer, extra=(inputs, targets), steps=steps)


def resident_extras(model_cfg: ModelConfig, batch: int, seq: int) -> int:
    """Bytes the planner adds outside the model states: rope tables and one batch of int64 tokens."""
    head_dim = model_cfg.dim // model_cfg.n_heads
    return 2 * model_cfg.max_seq_len * head_dim * 4 + 2 * batch * seq * 8
