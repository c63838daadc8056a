"""Muon for the blocks' weight matrices, AdamW for everything else, as one optimizer.

Muon (Keller Jordan 2024, https://kellerjordan.github.io/posts/muon/) keeps one momentum buffer per matrix and
replaces the update by its nearest semi-orthogonal matrix (5 Newton-Schulz iterations); embeddings, the output
head, norms and biases stay on AdamW, as in every Muon recipe. ``torch.optim.Muon`` (torch >= 2.9) is the
algorithm; ``Muon`` below is that class with three things its ``step`` lacks:

* under FSDP2 a parameter is a DTensor shard, but Newton-Schulz needs the whole matrix: each rank all-gathers
  the (momentum) update of each matrix (``DTensor.full_tensor``), orthogonalizes it - the same full matrix on
  every rank, so the result is the single-process one - and keeps its own shard. The extra communication is
  one all-gather of every Muon matrix per step (``MuonAdamW.gathered_bytes`` counts it);
* Newton-Schulz runs in bf16 on a GPU (as torch's and Keller Jordan's), in fp32 on a CPU, where bf16 matmuls
  range from 2x faster to 120x slower than fp32 by CPU (../shared/PLATFORM.md) and the matrices are small;
* each operation runs once per group, not once per matrix (torch's loops over the matrices): momentum, weight
  decay and the update as ``torch._foreach_*`` ops, and Newton-Schulz on stacks of the matrices of one shape
  (``newton_schulz_batched``: 3 batched matmuls an iteration for all of a layer stack's q, k, v, o, where torch
  issues 3 per matrix). On the AMD EPYCs that is bit for bit the per-matrix computation, on an AMX Xeon within
  1e-6 in fp32 (tests/train/test_muon.py; matrices under ~400 multiply-adds a product go through another kernel of
  torch's ``bmm``: within 1e-5); on a GPU
  cuBLAS's batched kernels may round otherwise (not checked yet). Under FSDP2 the matrices are gathered one by
  one, then orthogonalized in the same stacks.

Everything else - momentum as an EMA with Nesterov, decoupled weight decay at the unadjusted lr, the lr
adjustment by shape ("original": sqrt(max(1, rows/cols)); "match_rms_adamw", Moonlight (Liu et al. 2025,
arXiv:2502.16982): 0.2 sqrt(max(rows, cols)), which lets Muon reuse AdamW's lr and weight decay) - is
``torch.optim.Muon``'s, and tests/train/test_muon.py checks the step against it bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's quintic)


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The semi-orthogonal factor of ``update`` (rows, cols) by ``steps`` quintic Newton-Schulz iterations in
    ``dtype``, as ``torch.optim.Muon`` computes it (which uses bf16): the one-matrix definition that
    ``newton_schulz_batched`` computes for many at once."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # iterate on the wide orientation: the Gram matrix is the smaller one
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T  # (m, m), m = min(rows, cols)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def newton_schulz_batched(updates: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int,
                          eps: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """``newton_schulz`` of each matrix in ``updates``, the matrices of one wide shape (a tall one transposed)
    stacked so that each iteration is 3 batched matmuls for the stack instead of 3 per matrix (on the nano model
    28 matrices make 2 stacks: 16 x (128, 128) and 12 x (128, 344)). Each matrix is normalized by its own
    Frobenius norm, taken as ``newton_schulz`` takes it (on the matrix, not the transposed copy), so that on a CPU
    the result is bit for bit ``newton_schulz``'s (tests/train/test_muon.py; tiny matrices below ~400 multiply-adds
    go through another kernel in torch's ``bmm`` and differ in the last bits)."""
    a, b, c = coefficients
    stacks: dict[tuple[int, int], list[int]] = {}  # (min, max) of the shape -> indices into updates
    for i, update in enumerate(updates):
        stacks.setdefault((min(update.shape), max(update.shape)), []).append(i)
    out: list[torch.Tensor] = [update for update in updates]
    for indices in stacks.values():
        matrices = [updates[i].to(dtype) for i in indices]
        tall = [m.size(0) > m.size(1) for m in matrices]
        norms = torch.stack(torch._foreach_norm(matrices)).clamp(min=eps)  # (B,)
        x = torch.stack([m.T if t else m for m, t in zip(matrices, tall)])  # (B, m, n), m <= n
        x = x / norms.view(-1, 1, 1)  # spectral norm <= Frobenius norm <= 1, matrix by matrix
        for _ in range(steps):
            gram = torch.bmm(x, x.mT)  # (B, m, m)
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        for i, t, ortho in zip(indices, tall, x.unbind(0)):
            out[i] = ortho.T if t else ortho
    return out


CHUNK_ELEMENTS = 1 << 24  # 16M elements (64 MB fp32) of matrices per batched step: bounds its transient memory


def chunks(params: list[torch.Tensor], limit: int = CHUNK_ELEMENTS) -> list[list[torch.Tensor]]:
    """``params`` in consecutive chunks of at most ``limit`` elements (a larger matrix alone): the batched step
    holds each chunk's updates, stacks and results at once, so a large model's step must not hold them for all
    its matrices (nor, under FSDP2, gather them all). A small model is one chunk."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if out[-1] and size + p.numel() > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out if out[-1] else []


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s lr by matrix shape: "original" (the default) or "match_rms_adamw"."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose step also takes FSDP2's DTensor shards (gathered per matrix for Newton-Schulz),
    runs Newton-Schulz in ``ns_dtype`` and does each operation once for a whole group: momentum, weight decay
    and the update as ``torch._foreach_*`` over the group's matrices, Newton-Schulz batched by shape."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.gathered_bytes = 0  # bytes all-gathered for sharded matrices (each rank's received share counted)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for params in chunks([p for p in group["params"] if p.grad is not None]):
                self._step_chunk(group, params)
        return None

    def _step_chunk(self, group: dict, params: list[torch.Tensor]) -> None:
        """Muon's update of ``params`` (a few matrices, ``chunks``): each matrix's arithmetic is its own, so the
        result does not depend on how the matrices are chunked."""
        lr, momentum = float(group["lr"]), group["momentum"]
        grads = [p.grad for p in params]
        bufs = [self._momentum_buffer(p) for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        orthos = self._sharded_back(params, newton_schulz_batched(
            self._gathered(updates), group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype))
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        by_lr: dict[float, list[int]] = {}  # the lr adjustment depends on the shape only
        for i, p in enumerate(params):
            by_lr.setdefault(adjusted_lr(lr, group["adjust_lr_fn"], p.shape), []).append(i)
        for step_lr, indices in by_lr.items():
            torch._foreach_add_([params[i] for i in indices], [orthos[i] for i in indices], alpha=-step_lr)

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _gathered(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """FSDP2: Newton-Schulz needs whole matrices, so each DTensor shard's matrix is all-gathered (one
        collective per matrix); plain tensors (one process, DDP, pipeline stages) pass through."""
        from torch.distributed.tensor import DTensor

        whole = []
        for update in updates:
            if isinstance(update, DTensor):
                self.gathered_bytes += (update.numel() - update.to_local().numel()) * update.element_size()
                update = update.full_tensor()
            whole.append(update)
        return whole

    @staticmethod
    def _sharded_back(params: list[torch.Tensor], orthos: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each orthogonalized matrix laid out as its parameter: the same full matrix on every rank, so a DTensor
        parameter's rank keeps its own shard (no communication)."""
        from torch.distributed.tensor import DTensor, Replicate

        return [DTensor.from_local(ortho, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
                .redistribute(p.device_mesh, p.placements) if isinstance(p, DTensor) else ortho
                for p, ortho in zip(params, orthos)]


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: AdamW's parameter groups first, then Muon's (dicts shared with the inner
    optimizers, so the trainer's per-group lr reaches them), and one ``state`` - what the checkpoint saves by
    parameter name (AdamW's exp_avg / exp_avg_sq / step, Muon's momentum_buffer)."""

    def __init__(self, adamw: torch.optim.AdamW, muon: Muon):
        self.adamw, self.muon = adamw, muon
        super().__init__(adamw.param_groups + muon.param_groups, {})
        self._link()

    def _link(self) -> None:
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.adamw.state = self.muon.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the group dicts: hand the new ones to the inner two
        self._link()

    @property
    def gathered_bytes(self) -> int:
        return self.muon.gathered_bytes

    @torch.no_grad()
    def step(self, closure=None):
        self.adamw.step()
        self.muon.step()
        return None


def muon_matrices(model: nn.Module, adapters: bool = False) -> set[int]:
    """ids of the parameters Muon takes: the trainable ``weight`` of every Linear inside the blocks
    (``layers.<i>.``). The embedding and a separate output head stay on AdamW (Muon's authors: their gradients
    are not matrices of a hidden transformation), as do LoRA's adapters (parameters beside the frozen weight)
    unless ``adapters`` (``optim.muon_adapters``): then each trainable ``lora_A`` (rank, in) and ``lora_B``
    (out, rank) is a Muon matrix of its own (DoRA's magnitude, a vector, stays on AdamW)."""
    ids = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and ".layers." in f".{name}." and weight is not None \
                and weight.requires_grad and weight.ndim == 2:
            ids.add(id(weight))
        if adapters:
            for adapter in (getattr(module, "lora_A", None), getattr(module, "lora_B", None)):
                if isinstance(adapter, nn.Parameter) and adapter.requires_grad and adapter.ndim == 2:
                    ids.add(id(adapter))
    return ids
