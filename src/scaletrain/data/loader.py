"""A resumable, rank-sharded, prefetching loader over memory-mapped token shards (stage 8).

The split is cut into windows of ``seq_len + 1`` tokens (inputs and next-token targets) at stride
``seq_len``, starting at a per-epoch offset so successive epochs see different cuts. Documents are packed
back to back (separated by EOS), so no token is padding. Each epoch visits every window once in an order
fixed by (seed, epoch). All ranks walk the *same* global order; global micro-batch k holds samples
[k*B*W, (k+1)*B*W) and rank r takes its B-slice, so ranks never see the same sample within an epoch.

What is guaranteed on resume. The state is (epoch, global sample cursor), identical on every rank, and
it describes the next batch the *consumer* gets (not what the prefetch thread has read ahead). So:
- same world size: a resumed run sees exactly the batches the uninterrupted run would have seen;
- another world size W' (or batch size B'): the global order does not depend on W or B, so the run
  continues at exactly the next unseen sample of the same epoch, with no sample repeated or skipped;
  only the grouping of samples into steps changes (global batch B'*W' from then on);
- another seq_len, seed or data: refused with a DataError (it would be a different stream).

Document boundaries: with ``return_doc_ids=True`` each batch also carries ``doc_ids`` (B, T): the index
of the document each input token belongs to, counted from 0 within its row (a token right after EOS
starts a new document). ``block_causal_mask(doc_ids)`` turns that into the (B, 1, T, T) boolean mask
(True = attend) that keeps attention inside a document.
"""

from __future__ import annotations

import queue
import threading
from bisect import bisect_right
from functools import lru_cache

import numpy as np
import torch

from scaletrain.data.shards import open_doc_index, open_split, read_manifest
from scaletrain.data.tokenizer import DataError


class TokenStream:
    """A split's shards viewed as one contiguous token array (reads may cross shard boundaries)."""

    def __init__(self, data_dir: str, split: str):
        self.manifest = read_manifest(data_dir)
        self.shards = open_split(data_dir, split, self.manifest)
        self.doc_ends = open_doc_index(data_dir, split, self.manifest)
        self.eos_id = self.manifest.get("eos_id")
        self.starts = [0]
        for s in self.shards:
            self.starts.append(self.starts[-1] + len(s))
        self.total = self.starts[-1]

    def read(self, start: int, length: int) -> np.ndarray:
        i = bisect_right(self.starts, start) - 1
        offset = start - self.starts[i]
        if offset + length <= len(self.shards[i]):  # the common case: one slice, no copy
            return self.shards[i][offset:offset + length]
        parts, need = [], length
        while need > 0:
            piece = self.shards[i][offset:offset + need]
            parts.append(piece)
            need -= len(piece)
            i, offset = i + 1, 0
        return np.concatenate(parts)

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int64 windows starting at ``starts``. When they all lie in one shard (the
        common case) this is one gather instead of a Python loop of slices, so a prefetch thread holds the
        GIL for ~20 us a batch instead of ~100 us."""
        shard = bisect_right(self.starts, int(starts.min())) - 1
        if int(starts.max()) + length <= self.starts[shard + 1]:
            offsets = (starts - self.starts[shard])[:, None] + np.arange(length)  # (rows, length)
            return self.shards[shard][offsets].astype(np.int64)
        return np.stack([self.read(int(s), length) for s in starts]).astype(np.int64)

    def doc_ids(self, starts: np.ndarray, windows: np.ndarray, length: int) -> np.ndarray:
        """(rows, length) document index of each input token, relative to the row's first token."""
        if self.doc_ends is not None:
            positions = starts[:, None] + np.arange(length)                # (rows, length) global token index
            ids = np.searchsorted(self.doc_ends, positions, side="right")  # doc k ends (exclusive) at doc_ends[k]
        elif self.eos_id is not None:
            is_eos = windows[:, :length] == self.eos_id
            ids = np.cumsum(is_eos, axis=1) - is_eos  # the EOS closes its document; the next token opens one
        else:
            ids = np.zeros((len(starts), length), dtype=np.int64)
        return (ids - ids[:, :1]).astype(np.int64)


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool mask, True where query t may attend to key s:
    s <= t and both tokens in the same document. Broadcasts over heads."""
    T = doc_ids.shape[-1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]                          # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()      # (T, T)
    return (same_doc & causal)[:, None]                                            # (B, 1, T, T)


class TokenLoader:
    """Yields ``(inputs, targets)`` - or ``(inputs, targets, doc_ids)`` with ``return_doc_ids`` - each
    (B, T) int64, forever (epoch after epoch). ``prefetch`` batches are prepared in a background thread."""

    def __init__(self, data_dir: str, split: str, seq_len: int, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, return_doc_ids: bool = False,
                 prefetch: int = 2):
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        self.stream = TokenStream(data_dir, split)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.return_doc_ids, self.prefetch = return_doc_ids, prefetch
        if self.stream.total < seq_len + 1:
            raise DataError(f"{data_dir}: the {split} split has {self.stream.total} tokens, fewer than one "
                            f"sequence of {seq_len + 1}; lower data.seq_len or add text")
        self.epoch, self.cursor = 0, 0
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the global order (a pure function of seed, epoch and the data) --------------------------------
    def _offset(self, epoch: int) -> int:
        if not self.shuffle or epoch == 0:
            return 0
        # < total - seq_len, so every epoch keeps at least one full window
        high = min(self.seq_len, self.stream.total - self.seq_len)
        return int(np.random.default_rng([self.seed, epoch, 1]).integers(0, high))

    def num_windows(self, epoch: int) -> int:
        return (self.stream.total - 1 - self._offset(epoch)) // self.seq_len

    @lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        n = self.num_windows(epoch)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _plan(self, epoch: int, cursor: int) -> tuple[list[tuple[int, int, int]], int, int]:
        """This rank's slice of the next global batch: [(epoch, first order index, count)], and the
        state after it. Crossing an epoch end mid-batch continues with the next epoch's order."""
        picks = []
        first, last = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        j, remaining = 0, self.batch_size * self.world_size
        while remaining:
            n = self.num_windows(epoch)
            if cursor >= n:
                epoch, cursor = epoch + 1, 0
                continue
            take = min(remaining, n - cursor)
            lo, hi = max(first, j), min(last, j + take)
            if lo < hi:
                picks.append((epoch, cursor + lo - j, hi - lo))
            j, cursor, remaining = j + take, cursor + take, remaining - take
        return picks, epoch, cursor

    def _make_batch(self, epoch: int, cursor: int) -> tuple[tuple[torch.Tensor, ...], int, int]:
        picks, epoch, cursor = self._plan(epoch, cursor)
        starts = np.concatenate([self._offset(e) + self._order(e)[i:i + n].astype(np.int64) * self.seq_len
                                 for e, i, n in picks])
        windows = self.stream.read_windows(starts, self.seq_len + 1)  # (B, T+1)
        batch = torch.from_numpy(windows)
        out: tuple[torch.Tensor, ...] = (batch[:, :-1], batch[:, 1:])
        if self.return_doc_ids:
            out += (torch.from_numpy(self.stream.doc_ids(starts, windows, self.seq_len)),)
        return out, epoch, cursor

    # -- iteration ---------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        if self.prefetch <= 0:
            batch, self.epoch, self.cursor = self._make_batch(self.epoch, self.cursor)
            return batch
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._thread = None
            raise item
        batch, self.epoch, self.cursor = item  # the consumer's state moves only when it takes a batch
        return batch

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, args=(self.epoch, self.cursor, self._queue),
                                        name="TokenLoader-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, epoch: int, cursor: int, q: queue.Queue) -> None:
        try:
            while not self._stop.is_set():
                item = self._make_batch(epoch, cursor)
                _, epoch, cursor = item
                while not self._stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # hand the error to the consumer instead of dying silently
            q.put(exc)

    def close(self) -> None:
        """Stop the prefetch thread (it restarts on the next batch)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "total_tokens": self.stream.total}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seq_len", "seed", "total_tokens"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise DataError(f"cannot resume the data stream: {key} was {state[key]}, now {mine}")
        self.close()  # batches read ahead from the old position are discarded
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def eval_batches(data_dir: str, split: str, seq_len: int, batch_size: int, num_batches: int,
                 return_doc_ids: bool = False):
    """A fixed set of windows spread evenly over the whole split (the same at every evaluation, so
    val losses are comparable across steps and runs). ``num_batches`` <= 0: every window."""
    stream = TokenStream(data_dir, split)
    n_windows = (stream.total - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"{data_dir}: the {split} split is shorter than one sequence of {seq_len + 1} tokens")
    wanted = n_windows if num_batches <= 0 else min(num_batches * batch_size, n_windows)
    picks = np.linspace(0, n_windows - 1, wanted).round().astype(np.int64)
    for i in range(0, wanted, batch_size):
        starts = picks[i:i + batch_size] * seq_len
        windows = stream.read_windows(starts, seq_len + 1)
        batch = torch.from_numpy(windows)
        out = (batch[:, :-1], batch[:, 1:])
        if return_doc_ids:
            out += (torch.from_numpy(stream.doc_ids(starts, windows, seq_len)),)
        yield out
