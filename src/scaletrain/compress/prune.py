"""Unstructured and 2:4 pruning of the blocks' Linear weights: magnitude (|W|) or Wanda (|W| x ||X||).

Wanda (Sun et al. 2023, "A Simple and Effective Pruning Approach for LLMs") scores each weight by its
magnitude times the L2 norm of its input feature over a calibration set, and compares weights within each
output row. Only the transformer blocks' projections are pruned (as in the paper): the embedding and the
output head hold most of a small model's parameters but are lookups / the last projection, where zeros
hurt most. The masks are applied to the dense weights (zeros written in place); a weight that is zero after
pruning is the mask, so the saved checkpoint holds it and ``masks_from_zeros`` reads it back.

Wanda's norms are measured block by block by default, as the paper's code does (``sequential_wanda``): each
block is calibrated on the outputs of the blocks before it, already pruned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from scaletrain.core.options import ConfigError

METHODS = ("magnitude", "wanda")
SCOPES = ("layer", "global")


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The prunable projections by name: every nn.Linear inside ``model.layers`` (not embedding, not head)."""
    return {f"layers.{name}": m for name, m in model.layers.named_modules() if isinstance(m, nn.Linear)}


def _norms_of(linears: dict[str, nn.Linear], run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """||X_j||_2 over every token ``run()`` feeds through each of ``linears`` (a forward hook per layer)."""
    sums = {n: torch.zeros(m.in_features, dtype=torch.float64) for n, m in linears.items()}
    hooks = []
    for name, module in linears.items():
        def hook(_module, args, _out, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] += (x * x).sum(0)
        hooks.append(module.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return {n: s.sqrt().float() for n, s in sums.items()}


@torch.no_grad()
def input_norms(model: nn.Module, batches: Iterable[torch.Tensor], names: Iterable[str] | None = None
                ) -> dict[str, torch.Tensor]:
    """||X_j||_2 over every calibration token for each input feature j of each block Linear (Wanda's
    activation statistic), all from one forward pass of the dense model per batch of token ids (B, T)."""
    linears = block_linears(model)
    wanted = set(names) if names is not None else set(linears)

    def run() -> None:
        was_training = model.training
        model.eval()
        for tokens in batches:
            model(tokens)
        model.train(was_training)
    return _norms_of({n: m for n, m in linears.items() if n in wanted}, run)


@torch.no_grad()
def sequential_wanda(model: nn.Module, batches: Iterable[torch.Tensor],
                     masks_for: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
                     ) -> dict[str, torch.Tensor]:
    """Wanda block by block, as the reference implementation (locuslab/wanda ``prune_wanda``) does: block i's
    input norms are measured on the outputs of blocks 0..i-1 *already pruned*, its masks are chosen
    (``masks_for``: scores of one block's Linears -> keep-masks) and applied, and its outputs are recomputed
    with the pruned weights before block i+1 is calibrated. So each block is pruned for the inputs it will
    really see, and the error of earlier blocks is not hidden from later ones. Within a block every Linear is
    calibrated on the dense block (as in the reference). Returns all the masks (already applied)."""
    was_training = model.training
    model.eval()
    hidden = [model.tok_embeddings(tokens) for tokens in batches]  # the inputs of block 0, one per batch
    masks: dict[str, torch.Tensor] = {}

    def through(block: nn.Module) -> list[torch.Tensor]:
        return [block(h, model.rope_cos[:h.shape[1]], model.rope_sin[:h.shape[1]]) for h in hidden]
    for block_name, block in model.layers.items():
        linears = {f"layers.{block_name}.{n}": m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        norms = _norms_of(linears, lambda block=block: through(block))
        block_masks = masks_for({n: scores(m.weight, "wanda", norms[n]) for n, m in linears.items()})
        apply_masks(model, block_masks)
        masks.update(block_masks)
        hidden = through(block)  # what the next block sees: this block's output, pruned
    model.train(was_training)
    return masks


def scores(weight: torch.Tensor, method: str, norm: torch.Tensor | None) -> torch.Tensor:
    """The importance of each weight: |W| (magnitude) or |W| * ||X_j|| broadcast over rows (Wanda)."""
    s = weight.detach().abs().float()
    if method == "wanda":
        if norm is None:
            raise ValueError("Wanda needs calibration input norms")
        s = s * norm.to(s.device)[None, :]
    return s


def check_sparsity(sparsity: float) -> None:
    if not 0.0 < sparsity < 1.0:
        raise ConfigError(f"--sparsity {sparsity}: must be in (0, 1) (the fraction of weights set to zero, "
                          f"e.g. 0.5)")


def unstructured_masks(score: dict[str, torch.Tensor], sparsity: float, method: str, scope: str
                       ) -> dict[str, torch.Tensor]:
    """Keep-masks (True = kept) zeroing ``sparsity`` of the weights with the lowest score.

    scope "layer": Wanda compares weights within each output row (the paper's grouping), magnitude within
    the whole layer; scope "global": one threshold over every prunable weight of the model."""
    check_sparsity(sparsity)
    if scope not in SCOPES:
        raise ConfigError(f"--scope {scope!r}: choose one of {', '.join(SCOPES)}")
    masks = {}
    if scope == "global":
        flat = torch.cat([s.flatten() for s in score.values()])
        k = int(flat.numel() * sparsity)
        threshold = torch.kthvalue(flat, k).values if k > 0 else flat.min() - 1
        for name, s in score.items():
            masks[name] = s > threshold
        return masks
    for name, s in score.items():
        if method == "wanda":  # per output row
            k = int(s.shape[1] * sparsity)
            drop = torch.topk(s, k, dim=1, largest=False).indices
            mask = torch.ones_like(s, dtype=torch.bool)
            mask.scatter_(1, drop, False)
        else:
            k = int(s.numel() * sparsity)
            drop = torch.topk(s.flatten(), k, largest=False).indices
            mask = torch.ones(s.numel(), dtype=torch.bool)
            mask[drop] = False
            mask = mask.view_as(s)
        masks[name] = mask
    return masks


def semi_structured_masks(score: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """n:m masks: in every group of m consecutive weights of a row (along the input dimension) keep the n
    highest scores. 2:4 is the pattern sm80+ GPUs' sparse tensor cores run at up to 2x."""
    masks = {}
    for name, s in score.items():
        rows, cols = s.shape
        if cols % m:
            raise ConfigError(f"{name}: {cols} input features do not divide into groups of {m} for {n}:{m} "
                              f"sparsity")
        groups = s.reshape(rows, cols // m, m)
        keep = torch.topk(groups, n, dim=-1).indices
        mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
        masks[name] = mask.reshape(rows, cols)
    return masks


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """Zero the pruned weights in place (the dense weights carry the mask)."""
    linears = block_linears(model)
    for name, mask in masks.items():
        linears[name].weight.mul_(mask.to(linears[name].weight.device, linears[name].weight.dtype))


def masks_from_zeros(model: nn.Module) -> dict[str, torch.Tensor]:
    """The keep-masks a pruned checkpoint carries: every block weight that is not exactly zero."""
    return {name: m.weight.detach() != 0 for name, m in block_linears(model).items()}


def sparsity_of(model: nn.Module) -> float:
    """Fraction of exact zeros over the block Linear weights."""
    zeros = total = 0
    for m in block_linears(model).values():
        zeros += int((m.weight == 0).sum())
        total += m.weight.numel()
    return zeros / max(total, 1)


def is_n_m_sparse(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """Whether every group of m consecutive weights of each row has at most n non-zeros."""
    rows, cols = weight.shape
    if cols % m:
        return False
    return bool(((weight.reshape(rows, cols // m, m) != 0).sum(-1) <= n).all())


@torch.no_grad()
def prune(model: nn.Module, method: str, sparsity: float = 0.5, scope: str = "layer", pattern: str = "unstructured",
          calibration: Iterable[torch.Tensor] | None = None, sequential: bool = True) -> dict:
    """Prune ``model``'s block Linears in place; returns what was done (method, pattern, measured sparsity).

    pattern "unstructured" (at ``sparsity``, ``scope`` layer or global) or "2:4" (sparsity is 50% by
    construction). Wanda needs ``calibration`` (batches of token ids); ``sequential`` (the default) calibrates
    block by block on the pruned earlier blocks' outputs (``sequential_wanda``), False takes every norm from
    one dense forward pass. A global threshold needs every layer's score before any is pruned, so Wanda with
    scope "global" is one pass."""
    if method not in METHODS:
        raise ConfigError(f"--method {method!r}: choose one of {', '.join(METHODS)}")
    if method == "wanda" and calibration is None:
        raise ConfigError("Wanda pruning needs a calibration set (--calibration-sequences > 0)")
    if pattern == "2:4":
        def masks_for(score: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return semi_structured_masks(score)
    elif pattern == "unstructured":
        check_sparsity(sparsity)
        if scope not in SCOPES:
            raise ConfigError(f"--scope {scope!r}: choose one of {', '.join(SCOPES)}")

        def masks_for(score: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return unstructured_masks(score, sparsity, method, scope)
    else:
        raise ConfigError(f"--pattern {pattern!r}: choose unstructured or 2:4")
    calibration = list(calibration) if calibration is not None else None
    sequential = sequential and method == "wanda" and not (pattern == "unstructured" and scope == "global")
    if sequential:
        sequential_wanda(model, calibration, masks_for)
    else:
        linears = block_linears(model)
        norms = input_norms(model, calibration) if method == "wanda" else {}
        apply_masks(model, masks_for({name: scores(m.weight, method, norms.get(name)) for name, m in linears.items()}))
    return {"method": method, "pattern": pattern, "scope": scope if pattern == "unstructured" else "n:m",
            "calibration": ("sequential" if sequential else "one pass") if method == "wanda" else "none",
            "target_sparsity": 0.5 if pattern == "2:4" else sparsity, "sparsity": round(sparsity_of(model), 6)}


def use_sparse_kernels(model: nn.Module, device: torch.device | str) -> int:
    """On a CUDA GPU with sm80+ (2:4 sparse tensor cores), swap the weights of the block Linears that are 2:4
    sparse for torchao's semi-structured sparse format (``sparsify_`` with ``SemiSparseWeightConfig``), so their
    matmuls run on the sparse kernels; returns how many. Elsewhere 0: the masks stay in the dense weights
    (quality only). UNTESTED on a GPU here (none is lent); written against torchao 0.18's documented API."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return 0
    from torchao.sparsity import sparsify_
    from torchao.sparsity.sparse_api import SemiSparseWeightConfig

    chosen = {name for name, m in block_linears(model).items() if is_n_m_sparse(m.weight)}
    if chosen:
        sparsify_(model, SemiSparseWeightConfig(), filter_fn=lambda m, fqn: fqn in chosen)
    return len(chosen)
