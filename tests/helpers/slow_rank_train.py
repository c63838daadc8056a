"""``tests/helpers/dist_train.py`` (or, with a first argument ``train``, the ``scaletrain`` command) with one rank made
slower: a stand-in for an unequal worker (parallel.balance tests and benchmarks/balance.py), or with every rank
slowed, a run long enough to add and remove nodes during it (the elastic test and benchmarks/elastic.py).

SLOW_RANK=<rank> (or ``all``) SLOW_SECONDS=<s> adds that many seconds before every micro-batch's forward on that
rank (a slower device does the same work later); SLOW_THREADS=<n> also gives that rank n torch threads.
HOLD_FILE=<path>: while that file exists, the slowed ranks wait before each micro-batch (a test holds a run
at a step until a second node has joined).

    SLOW_RANK=1 SLOW_SECONDS=0.02 torchrun --standalone --nproc-per-node 2 tests/helpers/slow_rank_train.py \\
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

SLOW = os.environ.get("SLOW_RANK", "-1") in (os.environ.get("RANK", "0"), "all")
SECONDS = float(os.environ.get("SLOW_SECONDS", "0"))
THREADS = int(os.environ.get("SLOW_THREADS", "0"))
HOLD = os.environ.get("HOLD_FILE", "")

if SLOW and (SECONDS or HOLD):
    _forward_backward = step.forward_backward

    def _slow_forward_backward(*args, **kwargs):
        while HOLD and os.path.exists(HOLD):
            time.sleep(0.01)
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
    if sys.argv[1:2] == ["train"]:
        from scaletrain.cli import main as cli_main

        sys.exit(cli_main(sys.argv[1:]))
    sys.exit(main())
