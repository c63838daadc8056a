"""A resumable, rank-sharded loader over memory-mapped token shards.

The split is cut into windows of ``seq_len + 1`` tokens (inputs and next-token targets) at stride
``seq_len``, starting at a per-epoch offset in [0, seq_len) so successive epochs see different cuts.
Each epoch visits every window once in an order fixed by (seed, epoch). All ranks walk the *same*
global order; global micro-batch k holds samples [k*B*W, (k+1)*B*W) and rank r takes its B-slice, so
ranks never see the same sample within an epoch.

The state is just (epoch, global sample cursor). Because the global order does not depend on the world
size, a run resumed on a different number of ranks continues at exactly the next unseen sample, as
long as the global batch (B x W x grad_accum) is kept constant.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache

import numpy as np
import torch

from scaletrain.data.shards import open_split, read_manifest
from scaletrain.data.tokenizer import DataError


class TokenStream:
    """A split's shards viewed as one contiguous token array (reads may cross shard boundaries)."""

    def __init__(self, data_dir: str, split: str):
        self.manifest = read_manifest(data_dir)
        self.shards = open_split(data_dir, split, self.manifest)
        self.starts = [0]
        for s in self.shards:
            self.starts.append(self.starts[-1] + len(s))
        self.total = self.starts[-1]

    def read(self, start: int, length: int) -> np.ndarray:
        i = bisect_right(self.starts, start) - 1
        offset = start - self.starts[i]
        if offset + length <= len(self.shards[i]):  # the common case: one slice, no copy until astype
            return self.shards[i][offset:offset + length]
        parts, need = [], length
        while need > 0:
            piece = self.shards[i][offset:offset + need]
            parts.append(piece)
            need -= len(piece)
            i, offset = i + 1, 0
        return np.concatenate(parts)


class TokenLoader:
    """Yields ``(inputs, targets)``, each (B, T) int64, forever (epoch after epoch)."""

    def __init__(self, data_dir: str, split: str, seq_len: int, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True):
        self.stream = TokenStream(data_dir, split)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        if self.stream.total < seq_len + 1:
            raise DataError(f"{data_dir}: the {split} split has {self.stream.total} tokens, fewer than one "
                            f"sequence of {seq_len + 1}; lower data.seq_len or add text")
        self.epoch, self.cursor = 0, 0

    # -- the global order ------------------------------------------------------------------------
    def _offset(self, epoch: int) -> int:
        if not self.shuffle or epoch == 0:
            return 0
        return int(np.random.default_rng([self.seed, epoch, 1]).integers(0, self.seq_len))

    def num_windows(self, epoch: int) -> int:
        return (self.stream.total - 1 - self._offset(epoch)) // self.seq_len

    @lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        n = self.num_windows(epoch)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _window(self, epoch: int, index: int) -> np.ndarray:
        start = self._offset(epoch) + int(self._order(epoch)[index]) * self.seq_len
        return self.stream.read(start, self.seq_len + 1)

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        global_batch = self.batch_size * self.world_size
        first = self.rank * self.batch_size
        for j in range(global_batch):
            if self.cursor >= self.num_windows(self.epoch):
                self.epoch, self.cursor = self.epoch + 1, 0
            if first <= j < first + self.batch_size:
                rows.append(self._window(self.epoch, self.cursor))
            self.cursor += 1
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "total_tokens": self.stream.total}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seq_len", "seed", "total_tokens"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise DataError(f"cannot resume the data stream: {key} was {state[key]}, now {mine}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def eval_batches(data_dir: str, split: str, seq_len: int, batch_size: int, num_batches: int):
    """A fixed set of windows spread evenly over the whole split (the same at every evaluation, so
    val losses are comparable across steps and runs)."""
    stream = TokenStream(data_dir, split)
    n_windows = (stream.total - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"{data_dir}: the {split} split is shorter than one sequence of {seq_len + 1} tokens")
    wanted = min(num_batches * batch_size, n_windows)
    picks = np.linspace(0, n_windows - 1, wanted).round().astype(np.int64)
    for i in range(0, wanted, batch_size):
        rows = [stream.read(int(w) * seq_len, seq_len + 1) for w in picks[i:i + batch_size]]
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        yield batch[:, :-1], batch[:, 1:]
