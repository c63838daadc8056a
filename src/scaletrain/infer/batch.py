"""Continuous batching: many generations share one decode, each joining at a step boundary and leaving when done.

A ``Batcher`` holds a ``SlotCache``: ``slots`` rows of the session's whole context, each row at its own length
(unlike ``model/cache.py``'s caches, whose rows all advance together from one left-padded prompt). A request
is prefilled alone (its prompt's forward through a ``KVCache``, copied into a free row), then decoded with
every other request in one forward a step: each row attends to its own slots only and takes its own rotary
positions, so its tokens do not depend on which other rows are running, or on whether any are: greedy output is
the same alone and inside a full batch (``tests/serve/test_serve.py``). A request that finishes, or whose client went
away (``Job.cancel``), frees its row at the next step boundary; a request that finds every row taken waits
in a bounded queue (``submit`` raises ``QueueFull`` past it: a server answers 503).

One thread runs the loop (``start``); the requests' callbacks (``Job.emit``) are called from it, with the
text that became final at each step (``StreamPrinter``'s rule: nothing a stop string may still claim, no half
UTF-8 character).

With the session's compiled decode (``Session.decoder``: ``scaletrain serve --compile``) the decode step is
``StaticDecoder.run_step`` over the cache's every row, used or not: its shapes are the slot count's whatever
joins or leaves, so it compiles once (a request joining, leaving or cancelled changes values, not shapes; the
prefill stays eager) and gives the eager step's greedy tokens (``tests/serve/test_serve.py``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from scaletrain.infer.session import Session, TextSink
from scaletrain.infer.text import StreamPrinter
from scaletrain.model.cache import KVCache
from scaletrain.model.decode import supports
from scaletrain.model.generate import Sampling, choose


class QueueFull(RuntimeError):
    """Every slot is taken and the queue holds its limit: try again later."""


class SlotLayer:
    """One block's keys and values in a ``SlotCache``: (slots, KV, capacity, hd) each."""

    def __init__(self, owner: SlotCache):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def load(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A prefilled prompt's keys and values, k, v (KV, L, hd), into ``row``'s first L slots."""
        if self.k is None:
            shape = (self.owner.slots, k.shape[0], self.owner.capacity, k.shape[2])
            self.k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(shape, dtype=v.dtype, device=v.device)
            static_address(self.k, self.v)
        self.k[row, :, :k.shape[1]] = k
        self.v[row, :, :v.shape[1]] = v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's k, v (n, KV, 1, hd) at each row's next slot; return the n rows' slots (n, KV, C, hd)."""
        n = k.shape[0]
        rows = torch.arange(n, device=k.device)
        self.k[rows, :, self.owner.write] = k[:, :, 0]  # (n, KV, hd) at (row, :, its slot)
        self.v[rows, :, self.owner.write] = v[:, :, 0]
        return self.k[:n], self.v[:n]


def static_address(*tensors: torch.Tensor) -> None:
    """On a GPU: the compiled step's CUDA graph may write these buffers in place (the same memory every step)."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            torch._dynamo.mark_static_address(tensor)


class SlotCache:
    """The decode step's cache (``Transformer.forward(tokens, cache=...)``'s interface: ``begin``, ``positions``,
    ``mask``, ``layer``, ``window_mask``, ``end``) over the first ``rows`` of ``slots`` rows, each of which has
    ``lengths[row]`` slots filled: the step's token of a row goes to its slot ``lengths[row]``, at that rotary
    position, and attends to its slots up to it. Rows not in use compute a step nobody reads (their length
    stays 0: a query that sees only itself, finite)."""

    def __init__(self, slots: int, capacity: int, device: torch.device):
        self.slots, self.capacity = slots, capacity
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # (slots,)
        self.in_use = torch.zeros(slots, dtype=torch.bool, device=device)  # (slots,)
        self.slot_ids = torch.arange(capacity, device=device)  # (C,)
        static_address(self.lengths, self.in_use)
        self.rows = 0
        self.layers: dict[str, SlotLayer] = {}
        self.write: torch.Tensor | None = None  # (n,): this step's slot of each row
        self.positions: torch.Tensor | None = None  # (n, 1)
        self.mask: torch.Tensor | None = None  # (n, 1, 1, C)
        self._windows: dict[int, torch.Tensor] = {}

    def layer(self, name: str) -> SlotLayer:
        if name not in self.layers:
            self.layers[name] = SlotLayer(self)
        return self.layers[name]

    def load(self, row: int, prefill: KVCache) -> None:
        """Take ``row`` for a prompt prefilled alone (a one-row ``KVCache`` without padding)."""
        for name, layer in prefill.layers.items():
            self.layer(name).load(row, layer.k[0, :, :prefill.length], layer.v[0, :, :prefill.length])
        self.lengths[row] = prefill.length
        self.in_use[row] = True

    def free(self, row: int) -> None:
        self.lengths[row] = 0
        self.in_use[row] = False

    def begin(self, n_tokens: int, seqlen: int, padding: torch.Tensor | None, device: torch.device) -> None:
        if n_tokens != 1 or seqlen != 1 or padding is not None:
            raise ValueError("a slot cache decodes one token a row (a prompt is prefilled alone)")
        self.write = self.lengths[:self.rows]
        self.positions = self.write[:, None]  # (n, 1): a row's slots hold its tokens from position 0
        self.mask = (self.slot_ids[None, :] <= self.write[:, None])[:, None, None, :]  # (n, 1, 1, C)
        self._windows = {}

    def window_mask(self, window: int) -> torch.Tensor:
        """``mask`` confined to the last ``window`` positions of each row's query (Gemma 3's local layers)."""
        if window not in self._windows:
            recent = self.slot_ids[None, None, :] > self.positions[:, :, None] - window  # (n, 1, C)
            self._windows[window] = self.mask & recent.unsqueeze(1)
        return self._windows[window]

    def end(self, seqlen: int) -> None:
        self.lengths[:self.rows] += self.in_use[:self.rows].long()


@dataclass
class Event:
    """What a request's callback receives: the text that became final since the last event (``text``), the
    generated tokens so far (``completion_tokens``) and, on the last event, why it ended (``finish_reason``:
    'stop' at an end token or stop string, 'length' at max_tokens or the context, 'error' with ``error``)."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    error: str = ""


@dataclass
class Job:
    """One generation: ``prompt`` ids, at most ``max_tokens`` new tokens, ``sampling`` (greedy at temperature 0),
    ``generator`` (a seed's), ``stops`` (texts that end it, not included), ``emit`` (called from the batcher's
    thread with each ``Event``)."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    emit: Callable[[Event], None]
    generator: torch.Generator | None = None
    stops: list[str] = field(default_factory=list)
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)
    printer: StreamPrinter | None = None
    sink: TextSink = field(default_factory=TextSink)

    def cancel(self) -> None:
        """The client went away: the batcher frees its row at the next step boundary (thread-safe: one flag)."""
        self.cancelled = True


class Batcher:
    """Continuous batching over a session (module docstring). ``slots``: requests decoded together;
    ``queue_size``: requests that may wait for a slot."""

    def __init__(self, session: Session, slots: int = 8, queue_size: int = 64):
        reason = supports(session.model)
        if reason:
            raise ValueError(f"batched decoding cannot run this model: {reason}")
        self.session, self.queue_size = session, queue_size
        self.device = next(session.model.parameters()).device
        self.cache = SlotCache(slots, session.context, self.device)
        self.rows: list[Job | None] = [None] * slots
        self.pending: deque[Job] = deque()
        self.stop_ids = set(session.stop_ids)
        self.decoder = session.decoder  # the compiled step (every row a step), or None: the eager forward
        self.steps = 0  # decode steps run (for /health and tests)
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- the caller's side (any thread) --
    def submit(self, *requests: Job) -> None:
        """Queue ``requests`` (the choices of one API request: all or none); ``QueueFull`` when they would take
        the queue past ``queue_size``."""
        with self._wake:
            if len(self.pending) + len(requests) > self.queue_size:
                raise QueueFull(f"{len(self.pending)} requests are waiting for a slot (the queue's limit: "
                                f"{self.queue_size})")
            for request in requests:
                request.printer = StreamPrinter(self.session.tokenizer.decode, request.stops, request.sink)
                self.pending.append(request)
            self._wake.notify()

    def wake(self) -> None:
        """Make the loop look at its requests now (a cancelled one frees its row)."""
        with self._wake:
            self._wake.notify()

    def warm_up(self) -> None:
        """Before ``start``: one short greedy request run here, so that the compiled step compiles now and not in
        a client's first request (with an eager step: the first forward's allocations)."""
        done = threading.Event()
        self.submit(Job([0], 2, Sampling(temperature=0.0), lambda event: event.finish_reason and done.set()))
        while not done.is_set():
            self.run_once()
        self.steps = 0

    def start(self) -> Batcher:
        self._thread = threading.Thread(target=self._loop, name="scaletrain-batcher", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def busy(self) -> int:
        return sum(r is not None for r in self.rows)

    # -- the batcher's thread --
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._closed and not self.pending and not self.busy:
                        self._wake.wait()
                    if self._closed:
                        break
                self.run_once()
        for row, request in enumerate(self.rows):  # closing: every request still here ends
            if request is not None:
                self._finish(row, "error", "the server is shutting down")

    @torch.inference_mode()
    def run_once(self) -> None:
        """One step boundary: drop the cancelled, admit waiting requests into free rows, one decode step."""
        try:
            self._drop_cancelled()
            self._admit()
            if self.busy:
                self._step()
        except Exception as exc:  # noqa: BLE001  (a failed forward ends the requests in it, not the server)
            for row, request in enumerate(self.rows):
                if request is not None:
                    self._finish(row, "error", f"generation failed: {type(exc).__name__}: {exc}")

    def _drop_cancelled(self) -> None:
        for row, request in enumerate(self.rows):
            if request is not None and request.cancelled:
                self.rows[row] = None
                self.cache.free(row)
        with self._wake:
            self.pending = deque(r for r in self.pending if not r.cancelled)

    def _admit(self) -> None:
        while None in self.rows:
            with self._wake:
                if not self.pending:
                    return
                request = self.pending.popleft()
            row = self.rows.index(None)
            try:
                prefill = KVCache(1, len(request.prompt))
                tokens = torch.tensor([request.prompt], dtype=torch.long, device=self.device)
                logits = self.session.model(tokens, cache=prefill, last_only=True)[:, -1]  # (1, V)
            except Exception as exc:  # noqa: BLE001  (this request fails, not the ones decoding)
                request.emit(Event("", 0, "error", f"generation failed: {type(exc).__name__}: {exc}"))
                continue
            self.cache.load(row, prefill)
            self.rows[row] = request
            self._advance(row, self._choose(logits, [row])[0])

    def _step(self) -> None:
        # eager: the rows up to the last in use; compiled: every row (one shape, one graph)
        n = len(self.rows) if self.decoder else max(row for row, r in enumerate(self.rows) if r is not None) + 1
        tokens = torch.tensor([[r.tokens[-1] if r is not None else 0] for r in self.rows[:n]], dtype=torch.long,
                              device=self.device)  # (n, 1)
        self.cache.rows = n
        if self.decoder:
            logits = self.decoder.run_step(tokens, self.cache)  # (n, V)
        else:
            logits = self.session.model(tokens, cache=self.cache, last_only=True)[:, -1]  # (n, V)
        self.steps += 1
        rows = [row for row in range(n) if self.rows[row] is not None]
        for row, token in zip(rows, self._choose(logits[rows], rows)):
            self._advance(row, token)

    def _choose(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        """logits (len(rows), V) -> each row's next token, with its own request's sampling and generator."""
        logits = logits[:, :self.session.tokenizer.vocab_size].float()
        greedy = logits.argmax(-1).tolist()
        chosen = []
        for i, row in enumerate(rows):
            request = self.rows[row]
            if request.sampling.temperature <= 0:
                chosen.append(greedy[i])
            else:
                chosen.append(int(choose(logits[i:i + 1], request.sampling, request.generator).item()))
        return chosen

    def _advance(self, row: int, token: int) -> None:
        """``row``'s request takes ``token``: it ends at an end token (not produced), a stop string, max_tokens
        or the context; else the text that became final goes to its callback."""
        request = self.rows[row]
        if token in self.stop_ids:
            return self._finish(row, "stop")
        request.tokens.append(token)
        request.printer.add(token)
        if request.printer.stopped:
            return self._finish(row, "stop")
        full = len(request.prompt) + len(request.tokens) >= self.cache.capacity
        if len(request.tokens) >= request.max_tokens or full:
            return self._finish(row, "length")
        text = request.sink.take()
        if text:
            request.emit(Event(text, len(request.tokens)))

    def _finish(self, row: int, reason: str, error: str = "") -> None:
        request = self.rows[row]
        self.rows[row] = None
        self.cache.free(row)
        if not error:
            request.printer.finish()
        request.emit(Event(request.sink.take(), len(request.tokens), reason, error))
