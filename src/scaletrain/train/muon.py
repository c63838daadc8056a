"""Muon for the blocks' weight matrices, AdamW for everything else, as one optimizer.

Muon (Keller Jordan 2024, https://kellerjordan.github.io/posts/muon/) keeps one momentum buffer per matrix and
replaces the update by its nearest semi-orthogonal matrix (5 Newton-Schulz iterations); embeddings, the output
head, norms and biases stay on AdamW, as in every Muon recipe. ``torch.optim.Muon`` (torch >= 2.9) is the
algorithm; ``Muon`` below is that class with two additions its ``step`` lacks:

* under FSDP2 a parameter is a DTensor shard, but Newton-Schulz needs the whole matrix: each rank all-gathers
  the (momentum) update of each matrix (``DTensor.full_tensor``), orthogonalizes it - the same full matrix on
  every rank, so the result is the single-process one - and keeps its own shard. The extra communication is
  one all-gather of every Muon matrix per step (``MuonAdamW.gathered_bytes`` counts it);
* Newton-Schulz runs in bf16 on a GPU (as torch's and Keller Jordan's), in fp32 on a CPU, where bf16 matmuls
  range from 2x faster to 120x slower than fp32 by CPU (../shared/PLATFORM.md) and the matrices are small.

Everything else - momentum as an EMA with Nesterov, decoupled weight decay at the unadjusted lr, the lr
adjustment by shape ("original": sqrt(max(1, rows/cols)); "match_rms_adamw", Moonlight (Liu et al. 2025,
arXiv:2502.16982): 0.2 sqrt(max(rows, cols)), which lets Muon reuse AdamW's lr and weight decay) - is
``torch.optim.Muon``'s, and tests/test_muon.py checks the step against it bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's quintic)


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The semi-orthogonal factor of ``update`` (rows, cols) by ``steps`` quintic Newton-Schulz iterations in
    ``dtype``, as ``torch.optim.Muon`` computes it (which uses bf16)."""
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


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s lr by matrix shape: "original" (the default) or "match_rms_adamw"."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose step also takes FSDP2's DTensor shards (gathered per matrix for Newton-Schulz)
    and runs Newton-Schulz in ``ns_dtype``."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.gathered_bytes = 0  # bytes all-gathered for sharded matrices (each rank's received share counted)

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor, Replicate

        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                sharded = isinstance(update, DTensor)
                if sharded:  # FSDP2: Newton-Schulz needs the whole matrix
                    self.gathered_bytes += (update.numel() - update.to_local().numel()) * update.element_size()
                    update = update.full_tensor()
                ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                      self.ns_dtype)
                if sharded:  # the same full matrix on every rank: keep this rank's shard (no communication)
                    ortho = DTensor.from_local(ortho, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                               run_check=False).redistribute(p.device_mesh, p.placements)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return None


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


def muon_matrices(model: nn.Module) -> set[int]:
    """ids of the parameters Muon takes: the trainable ``weight`` of every Linear inside the blocks
    (``layers.<i>.``). The embedding and a separate output head stay on AdamW (Muon's authors: their gradients
    are not matrices of a hidden transformation), as do LoRA's adapters (parameters beside the frozen weight)."""
    ids = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and ".layers." in f".{name}." and weight is not None \
                and weight.requires_grad and weight.ndim == 2:
            ids.add(id(weight))
    return ids
