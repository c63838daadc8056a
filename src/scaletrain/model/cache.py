"""A key/value cache for incremental decoding: prefill the prompt once, then one token a forward pass.

``Transformer.forward(tokens, cache=cache)`` writes each block's keys and values of the new positions into the
cache and attends over everything cached so far; without a cache (training, evaluation) the forward is the
one it always was. The buffers are static (allocated once, at the first forward, for ``max_tokens`` slots per
row, in the dtype and device of the keys), as in gpt-fast's ``KVCache``; the model reads only the filled
prefix.

Batches of prompts of different lengths are **left-padded**: every row's last prompt token sits in the same
slot, so one decode step serves all rows. The slots of the padding are marked invalid: no query attends to
them, and each row's rotary positions count only its valid slots (a row padded by 3 has its first token at
position 0, as when it is run alone). A padding query attends to itself only, so its (unused) output is
finite - a row of a mask with nothing visible would make softmax NaN, and NaN times a zero weight is NaN.

Positions an embedding puts in front of the tokens (prompt tuning's virtual tokens) are valid slots too:
the cache is given the token count and the model's sequence length, and counts the difference as front
positions of the first forward (``extra``).
"""

from __future__ import annotations

import torch


class LayerCache:
    """One block's keys and values, (B, KV, slots, hd) each, allocated at its first ``update``."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        """(B, T) rotary positions of this forward's new slots."""
        return self.owner.positions

    @property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, S) bool: which of the S filled slots each new position may attend to."""
        return self.owner.mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values k, v (B, KV, T, hd); return all filled ones, (B, KV, S, hd)."""
        start, end = self.owner.length, self.owner.length + k.shape[2]
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.owner.capacity, k.shape[3])
            self.k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every block for ``batch_size`` rows and up to ``max_tokens`` tokens a row
    (padding included). Pass it to every forward of one generation; ``length`` slots are filled."""

    def __init__(self, batch_size: int, max_tokens: int):
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.capacity = 0  # slots: max_tokens + the front positions of the first forward (``extra``)
        self.extra = 0
        self.length = 0
        self.valid: torch.Tensor | None = None  # (B, capacity) bool: the slot holds a token, not padding
        self.positions: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.slot_positions: torch.Tensor | None = None  # (B, S): the rotary position of every filled slot
        self._windows: dict[int, torch.Tensor] = {}  # sliding window -> its mask, for this forward
        self.layers: dict[str, LayerCache] = {}

    @property
    def tokens(self) -> int:
        """Token slots filled (padding included, front positions not)."""
        return self.length - self.extra

    def layer(self, name: str) -> LayerCache:
        if name not in self.layers:
            self.layers[name] = LayerCache(self)
        return self.layers[name]

    def begin(self, n_tokens: int, seqlen: int, padding: torch.Tensor | None, device: torch.device) -> None:
        """Called by the model before its blocks: ``n_tokens`` tokens became ``seqlen`` positions (more when the
        embedding put positions in front, at the first forward only); ``padding`` (B, n_tokens) bool marks
        left padding. Sets this forward's ``positions`` and ``mask``."""
        if self.valid is None:
            self.extra = seqlen - n_tokens
            self.capacity = self.max_tokens + self.extra
            self.valid = torch.ones(self.batch_size, self.capacity, dtype=torch.bool, device=device)
        start, end = self.length, self.length + seqlen
        if end > self.capacity:
            raise ValueError(f"KV cache full: {self.tokens} + {n_tokens} tokens > {self.max_tokens} slots")
        if padding is not None:
            self.valid[:, end - n_tokens:end] = ~padding.to(device)
        valid = self.valid[:, :end]  # (B, S)
        # a slot's position = the valid slots before it (padding slots get their neighbour's, unused)
        self.slot_positions = (valid.cumsum(1) - 1).clamp_(min=0)  # (B, S)
        self.positions = self.slot_positions[:, start:end]  # (B, T)
        self._windows = {}
        slots = torch.arange(end, device=device)
        query_slots = slots[start:end, None]  # (T, 1)
        causal = slots[None, :] <= query_slots  # (T, S)
        self.mask = ((causal[None] & valid[:, None, :]) | (slots[None, :] == query_slots)[None]).unsqueeze(1)

    def window_mask(self, window: int) -> torch.Tensor:
        """(B, 1, T, S) bool: ``mask``, and each new position sees only the slots of the last ``window`` positions
        (itself included): a sliding-window layer's mask (Gemma 3's local layers). Every slot stays cached, so
        it is exact for any length the cache holds; built once a forward for all such layers."""
        if window not in self._windows:
            recent = self.slot_positions[:, None, :] > self.positions[:, :, None] - window  # (B, T, S)
            self._windows[window] = self.mask & recent.unsqueeze(1)
        return self._windows[window]

    def end(self, seqlen: int) -> None:
        """Called by the model after its head: the new positions are now cached."""
        self.length += seqlen


def static_address(buffer: torch.Tensor) -> None:
    """Mark a static cache's buffer for CUDA graphs (replayed on these very buffers: no copy in, no re-record).
    Only on CUDA: a marked tensor counts as one of the graph's parameters, so the CPU's frozen step
    (``model/decode.py``'s ``FROZEN_CPU``) folded the cache it compiled with into the graph as a constant, and
    dynamo, which does not guard an unguarded static address, ran that graph for another decoder's cache of the
    same shape: the first cache's slots written, an index past its end (a crash) or the wrong keys read
    (``tests/model/test_decode_compiled.py``: two decoders of one model)."""
    if buffer.device.type == "cuda":
        torch._dynamo.mark_static_address(buffer)


class StaticLayerCache(LayerCache):
    """One block's keys and values in a ``StaticKVCache``: (B, KV, capacity, hd) each, allocated at the first
    ``update`` (the prefill, eager) and written in place by slot index from then on; its ``mask`` is
    (B, 1, T, C) over every slot (the owner's)."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values k, v (B, KV, T, hd) at this forward's slots; return every slot, (B, KV, C, hd):
        the slots not yet written (or padding) are masked out by ``StaticKVCache.mask``."""
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.owner.capacity, k.shape[3])
            self.k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(shape, dtype=v.dtype, device=v.device)
            static_address(self.k)
            static_address(self.v)
        self.k.index_copy_(2, self.owner.query_slots, k)
        self.v.index_copy_(2, self.owner.query_slots, v)
        return self.k, self.v


class StaticKVCache:
    """A KV cache whose every shape is fixed for a generation: ``capacity`` slots a row, attended in full under a
    mask, with the next slot to write held as a tensor (``slot``), so the one-token decode step is the same graph
    at every position and can be ``torch.compile``d (and captured in a CUDA graph) once - gpt-fast's design.

    The same interface as ``KVCache`` (``begin``, ``positions``, ``mask``, ``layer``, ``window_mask``, ``end``),
    so ``Transformer.forward(tokens, cache=...)`` runs unchanged on either; the left padding's rules are the same
    (padding slots never attended to, rotary positions counting valid slots only). What differs: the first forward
    (the prefill, eager) fixes every slot's rotary position, the future ones included (a slot after the prompt is
    always a token); each forward attends over all ``capacity`` slots, those after it masked (their softmax weight
    is exactly 0, so the tokens are today's). Nothing in ``begin``/``update``/``end`` reads a Python number that
    changes between steps: ``tokens`` (the Python count) is kept by the caller (``model/decode.py``), outside
    the compiled step. No positions in front of the tokens (prompt tuning keeps the dynamic ``KVCache``)."""

    def __init__(self, batch_size: int, capacity: int, device: torch.device):
        self.batch_size = batch_size
        self.max_tokens = self.capacity = capacity
        self.extra = 0
        self.tokens = 0  # slots filled, counted by the caller (not read inside a compiled step)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the next slot to write
        self.slot_ids = torch.arange(capacity, device=device)  # (C,)
        self.valid = torch.ones(batch_size, capacity, dtype=torch.bool, device=device)  # (B, C): not padding
        self.slot_positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # (B, C)
        for buffer in (self.slot, self.valid, self.slot_positions):
            static_address(buffer)
        self.query_slots: torch.Tensor | None = None  # (T,): this forward's slots
        self.positions: torch.Tensor | None = None  # (B, T)
        self.mask: torch.Tensor | None = None  # (B, 1, T, C)
        self._windows: dict[int, torch.Tensor] = {}
        self.layers: dict[str, StaticLayerCache] = {}

    def layer(self, name: str) -> StaticLayerCache:
        if name not in self.layers:
            self.layers[name] = StaticLayerCache(self)
        return self.layers[name]

    def begin(self, n_tokens: int, seqlen: int, padding: torch.Tensor | None, device: torch.device) -> None:
        """``KVCache.begin`` for the slots ``slot`` .. ``slot + seqlen``. ``padding`` (prefill only) marks left padding
        and fixes the rotary position of every slot."""
        if seqlen != n_tokens:
            raise ValueError("a static KV cache takes no positions in front of the tokens (prompt tuning)")
        self.query_slots = self.slot + torch.arange(seqlen, device=device)  # (T,)
        if padding is not None:
            self.valid[:, :seqlen] = ~padding.to(device)
            self.valid[:, seqlen:] = True
            self.slot_positions.copy_((self.valid.cumsum(1) - 1).clamp_(min=0))
        self.positions = self.slot_positions.index_select(1, self.query_slots)  # (B, T)
        self._windows = {}
        query = self.query_slots[:, None]  # (T, 1)
        causal = self.slot_ids[None, :] <= query  # (T, C)
        itself = (self.slot_ids[None, :] == query)[None]  # (1, T, C): a padding query sees itself (finite output)
        self.mask = ((causal[None] & self.valid[:, None, :]) | itself).unsqueeze(1)  # (B, 1, T, C)

    def window_mask(self, window: int) -> torch.Tensor:
        """``KVCache.window_mask``: ``mask`` confined to the last ``window`` positions of each query."""
        if window not in self._windows:
            recent = self.slot_positions[:, None, :] > self.positions[:, :, None] - window  # (B, T, C)
            self._windows[window] = self.mask & recent.unsqueeze(1)
        return self._windows[window]

    def end(self, seqlen: int) -> None:
        """The new slots are written: move ``slot`` past them (in place: the compiled step's buffer)."""
        self.slot.add_(seqlen)
