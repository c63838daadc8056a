"""``tests/dist_train.py`` with one rank made slower: a stand-in for an unequal worker (parallel.balance tests
and benchmarks/balance.py).

SLOW_RANK=<rank> SLOW_SECONDS=<s> adds that many seconds before every micro-batch's forward on that rank (a
slower device does the same work later); SLOW_THREADS=<n> also gives that rank n torch threads.

    SLOW_RANK=1 SLOW_SECONDS=0.02 torchrun --standalone --nproc-per-node 2 tests/slow_rank_train.py \\
        --config c.toml --out r.json "balanced:parallel.balance=throughput,parallel.dp_replicate=2"
"""

from __future__ import annotations

import os
import sys
import time

import torch

import scaletrain.train.step as step
from scaletrain.train.trainer import Trainer

sys.path.insert(0, os.path.dirname(__file__))
from dist_train import main  # noqa: E402

SLOW = os.environ.get("RANK", "0") == os.environ.get("SLOW_RANK", "-1")
SECONDS = float(os.environ.get("SLOW_SECONDS", "0"))
THREADS = int(os.environ.get("SLOW_THREADS", "0"))

if SLOW and SECONDS:
    _forward_backward = step.forward_backward

    def _slow_forward_backward(*args, **kwargs):
        time.sleep(SECONDS)
        return _forward_backward(*args, **kwargs)

    step.forward_backward = _slow_forward_backward

if SLOW and THREADS:
    _init = Trainer.__init__

    def _init_with_threads(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        torch.set_num_threads(THREADS)  # after the trainer's own train.threads

    Trainer.__init__ = _init_with_threads

if __name__ == "__main__":
    sys.exit(main())
