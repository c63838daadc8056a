"""The next-token loss computed from the final hidden states in chunks of rows, so the whole logits tensor
(tokens x vocabulary, in fp32, and its gradient) never exists: neither in the forward nor in the backward.

At 4 x 1024 tokens a 151,936-token vocabulary (Qwen2.5) is 2.5 GB of fp32 logits a copy, and the plain loss
holds two or three copies (the head's output, its fp32 cast / log-softmax, the gradient): more than a LoRA-trained
0.5B model itself. Here a chunk of ``rows`` positions at a time goes through the head and the cross-entropy;
the forward keeps only each row's log-sum-exp (N floats), and the backward recomputes each chunk's logits from
the saved hidden states and the head's weight, turns them into the softmax gradient and multiplies it straight
back into d(hidden) and d(weight).

Why a custom ``autograd.Function`` and not ``torch.utils.checkpoint`` per chunk: a checkpointed chunk's
backward gives a fresh (V, d) gradient of the head's weight per chunk that autograd then adds into the running
one (two V x d buffers, plus the checkpoint's bookkeeping), and it recomputes the log-sum-exp the forward already
had; here the weight's gradient is accumulated in place in one buffer, and not computed at all when the head is
frozen (LoRA, QLoRA, prompt/prefix tuning), and the backward is one pass of two matrix products a chunk.

What the head does to the logits is applied in the same order as ``Transformer.head`` and the plain loss
(``train.loss.cross_entropy``): the matrix product in the compute dtype (the autocast dtype under autocast),
muP's output multiplier in that dtype, the cast to fp32, an optional soft-cap (c * tanh(z / c), Gemma 2's
``final_logit_softcapping``), the padding columns of a padded vocabulary at -inf, then the mean over the targets
that are not -100 (``IGNORE_INDEX``): the loss and the gradients equal the unchunked ones to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

# The attribute a module of the model leaves its auxiliary loss terms in (name -> weighted 0-dim tensor; an MoE
# router's balancing losses): train/loss.py collects them for the step's loss. One name for both sides.
AUXILIARY = "auxiliary_loss"

IGNORE_INDEX = -100

# The most bytes of fp32 logits one chunk holds (its backward holds about two such buffers). A chunk of 32 MB is
# 55 positions of a 151,936-token vocabulary: a (55 x 896) @ (896 x 151,936) product, big enough to run at the
# matrix unit's speed, small enough not to matter next to the model.
CHUNK_BYTES = 32 * 2**20
# On an accelerator the auto chunk is 16x larger. Each chunk costs the host a fixed time: the loop and the 40
# operators its forward and backward dispatch (0.17 ms on a 2-core EPYC with tiny tensors, benchmarks/
# chunked_loss.py --host), each a kernel launch on a GPU (~5 us more apiece), while a 32 MB chunk is about as
# much of an H100's work (gpt2-124m: a 13 GFLOP product and its backward, a dozen passes over 32 MB at ~3 TB/s):
# gpt2-124m's 64 x 1024 micro-batch would be 395 host-bound chunks a step. At 512 MB it is 25 chunks, each ~16x
# the device work of its launches, and the logits held are still a small share of the card.
ACCELERATOR_CHUNK_BYTES = 512 * 2**20
ACCELERATORS = ("cuda", "gpu", "xpu", "hpu", "mps")  # torch's device types and the planner's hardware kind 'gpu'


def chunk_bytes(device_type: str = "cpu") -> int:
    """The auto chunk's most fp32-logit bytes on this kind of device (the CPU's on 'cpu' and 'meta')."""
    return ACCELERATOR_CHUNK_BYTES if device_type in ACCELERATORS else CHUNK_BYTES


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's fp32 logits take at most ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def rows_at_once(positions: int, vocab_size: int, setting: int = -1, device_type: str = "cpu") -> int:
    """Positions whose logits the loss holds at once for a batch of ``positions`` under ``train.loss_chunk_rows``
    = ``setting`` (-1 auto: ``chunk_rows`` of ``chunk_bytes(device_type)``; 0 off; N): ``positions`` when the
    whole logits are computed (off, or when they fit in one chunk anyway). The trainer
    (``train.loss.loss_chunk_rows``) and the planner (``plan.memory``) both ask this."""
    if setting == 0:
        return positions
    return min(positions, setting if setting > 0 else chunk_rows(vocab_size, chunk_bytes(device_type)))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, multiplier: float, softcap: float,
                  vocab_limit: int) -> torch.Tensor:
    """hidden (n, d), weight (V, d) -> fp32 logits (n, V) exactly as the head + the plain loss compute them."""
    logits = hidden @ weight.t()  # (n, V) in the compute dtype
    if multiplier != 1.0:
        logits = logits * multiplier
    logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if vocab_limit < logits.shape[1]:
        logits[:, vocab_limit:] = float("-inf")  # padding takes no softmax mass
    return logits


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over the counted targets of -log softmax(logits)[target], from hidden (N, d) and weight (V, d)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, multiplier: float,
                softcap: float, vocab_limit: int, rows: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.zeros(len(hidden), dtype=torch.float32, device=hidden.device)  # (N,) log-sum-exp per row
        for start in range(0, len(hidden), rows):
            part = targets[start:start + rows]
            counted = part != IGNORE_INDEX
            logits = _chunk_logits(hidden[start:start + rows], weight, multiplier, softcap, vocab_limit)  # (n, V)
            chunk_lse = torch.logsumexp(logits, dim=-1)  # (n,)
            lse[start:start + rows] = chunk_lse
            picked = logits.gather(1, part.clamp(min=0)[:, None]).squeeze(1)  # (n,) the target's logit
            total += torch.where(counted, chunk_lse - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.settings = (multiplier, softcap, vocab_limit, rows)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        multiplier, softcap, vocab_limit, rows = ctx.settings
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None  # one buffer, in place
        for start in range(0, len(hidden), rows):
            chunk = hidden[start:start + rows]  # (n, d)
            part = targets[start:start + rows]
            logits = _chunk_logits(chunk, weight, multiplier, softcap, vocab_limit)  # (n, V) recomputed
            # d(c tanh(z / c)) / dz = 1 - tanh^2, from the capped value itself (0 on the -inf padding columns)
            slope = (1.0 - (logits / softcap).square_()).clamp_(min=0.0) if softcap else None
            grad = torch.exp_(logits.sub_(lse[start:start + rows, None]))  # softmax, in the logits' buffer
            counted = part != IGNORE_INDEX
            # minus one at each row's target (no data-dependent shapes: the rows without one are zeroed next)
            grad.scatter_add_(1, part.clamp(min=0)[:, None], torch.full_like(lse[start:start + rows, None], -1.0))
            grad.mul_((grad_total * counted)[:, None])  # rows whose target is -100 contribute nothing
            if slope is not None:
                grad.mul_(slope)
            grad = grad.to(hidden.dtype)
            if multiplier != 1.0:
                grad = grad * multiplier
            if want_hidden:
                grad_hidden[start:start + rows] = grad @ weight  # (n, d)
            if want_weight and grad.dtype == torch.float32:
                grad_weight.addmm_(grad.t(), chunk)  # (V, d), accumulated in place
            elif want_weight:
                grad_weight += (grad.t() @ chunk).float()
        return (grad_hidden, grad_weight.to(weight.dtype) if want_weight else None, None, None, None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          multiplier: float = 1.0, softcap: float = 0.0, vocab_limit: int | None = None,
                          rows: int | None = None) -> torch.Tensor:
    """The mean next-token loss of hidden (..., d) through a head of ``weight`` (V, d) against targets (...),
    ignoring -100, holding the logits of ``rows`` positions at a time (default ``chunk_rows`` of the device's
    ``chunk_bytes``). The mean over no counted target is NaN, as ``F.cross_entropy``'s."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    dtype = _compute_dtype(hidden)
    hidden, weight = hidden.to(dtype), weight.to(dtype)  # what autocast would do to the head's inputs
    limit = weight.shape[0] if vocab_limit is None else min(vocab_limit, weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):  # the casts are done; the backward runs outside it
        total = _ChunkedCrossEntropy.apply(hidden, weight, targets, float(multiplier), float(softcap), limit,
                                           rows or chunk_rows(weight.shape[0], chunk_bytes(hidden.device.type)))
    return total / (targets != IGNORE_INDEX).sum()


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's matrix product runs in: the autocast dtype when autocast is on, else the input's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def chunkable_head(head: nn.Module | None) -> bool:
    """Whether the loss can run the head as a plain weight (V, d): an ``nn.Linear`` without a bias (prompt
    tuning's head, which drops the virtual positions first, is one). Tensor parallelism's DTensor head is left
    to its caller (``train.loss.loss_chunk_rows``)."""
    return isinstance(head, nn.Linear) and head.bias is None
