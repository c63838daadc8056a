"""Measure a real training step, to check the planner: exact peak tensor bytes and median step time.

The memory tracker is a ``TorchDispatchMode`` that sees every tensor an aten op returns, counts each
storage once while it is alive (a weakref finalizer subtracts it when freed) and keeps the peak. It
counts tensor bytes exactly, unlike RSS (which also holds the allocator's cache, libraries and Python).

The step is the trainer's (``scaletrain.train``) with its defaults: forward, cross-entropy, backward,
clip_grad_norm_(1.0), AdamW (fused, decay on matrices only), zero_grad(set_to_none=True), fp32;
activation checkpointing and the distributed layouts come from ``scaletrain.parallel``.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scaletrain.config import JobConfig, OptimConfig, ParallelConfig, TrainConfig
from scaletrain.hardware.peak import measure_matmul_flops
from scaletrain.model.config import ModelConfig, has_local_rope, head_width
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.distributed import init_distributed
from scaletrain.train.precision import autocast
from scaletrain.train.step import StepOptions, build_parallel_training, training_step


class LiveTensorBytes(TorchDispatchMode):
    """Track live tensor-storage bytes (and their peak) of everything created while the mode is active."""

    def __init__(self, existing: Iterable[torch.Tensor] = (), track_resize: bool = False):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        # FSDP2 frees and re-allocates unsharded parameters with storage.resize_(), which no aten op
        # reports; with track_resize every op re-reads the size of every live storage (slower, exact).
        self.track_resize = track_resize
        self._refs: dict[int, weakref.ref] = {}
        for tensor in existing:
            self._track(tensor)

    def _track(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if hasattr(tensor, "_local_tensor"):  # DTensor: count the local shard
            tensor = tensor._local_tensor
        elif hasattr(tensor, "__tensor_flatten__"):  # a wrapper subclass (QLoRA's NF4): the tensors it holds
            for name in tensor.__tensor_flatten__()[0]:
                self._track(getattr(tensor, name))
            return
        storage = tensor.untyped_storage()
        key = id(storage)  # storages keep their Python object alive as long as the storage lives
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        if self.track_resize:
            self._refs[key] = weakref.ref(storage)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _resync(self) -> None:
        for key, ref in list(self._refs.items()):
            storage = ref()
            if storage is not None and storage.nbytes() != self._sizes.get(key, 0):
                self.live += storage.nbytes() - self._sizes[key]
                self._sizes[key] = storage.nbytes()
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.track_resize:
            self._resync()  # sizes changed since the last op (e.g. an unsharded param freed)
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self._track(tensor)
        if self.track_resize:
            self._resync()
        return out


def measure_step(step: Callable[[], object], tracker: LiveTensorBytes, steps: int = 5, warmup: int = 2) -> dict:
    """Peak tensor bytes of one steady-state step and median seconds per step.

    ``tracker`` must already be active (entered before the model was built, so that every storage the
    step touches, DDP's buckets included, is known). Warm-up steps create the optimizer states; the peak
    is reset to the live bytes before the measured step; the mode is left before the timed steps.
    """
    for _ in range(warmup):
        step()
    at_rest = tracker.live
    tracker.peak = tracker.live
    step()
    tracker.__exit__(None, None, None)
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    # CPU time (user + system, all threads of this process) is what a one-thread run on a machine shared
    # with other jobs can still measure reliably; wall time is what a dedicated machine would show.
    return {"peak_bytes": tracker.peak, "at_rest_bytes": at_rest, "step_s": statistics.median(times),
            "step_s_min": min(times), "step_s_all": times, "step_cpu_s": statistics.median(cpu_times),
            "threads": torch.get_num_threads()}


def matmul_probe(seconds: float = 0.3) -> float:
    """FLOP/s of a 1024^3 matmul right now: tells a quiet machine from one shared with other work."""
    return measure_matmul_flops("cpu", "fp32", n=1024, min_seconds=seconds)


def wait_for_quiet(peak: float, threshold: float = 0.85, tries: int = 40, log=print) -> float:
    """Wait (up to ``tries`` probes, 3 s apart) until a matmul runs at ``threshold`` x the calibrated
    ``peak``: other work on shared cores inflates step times. Returns the last probe (FLOP/s)."""
    probe = 0.0
    for i in range(tries):
        probe = matmul_probe(0.2)
        if probe >= threshold * peak:
            return probe
        if i == 0:
            log(f"  machine busy (matmul {probe / 1e9:.0f} of {peak / 1e9:.0f} GFLOP/s): waiting")
        time.sleep(3)
    return probe


def single_process_run(model_cfg: ModelConfig, batch: int, seq: int, ac: str = "none", ac_every: int = 2,
                       steps: int = 5, seed: int = 0, accum: int = 1, precision: str = "fp32",
                       optim: OptimConfig | None = None) -> dict:
    """Measure the trainer's own training step on CPU in one process, with activation checkpointing
    ``ac`` (``batch`` sequences per optimizer step, in ``accum`` micro-batches), in ``precision`` (fp32, or
    bf16: the trainer's autocast); ``optim``: AdamW's defaults unless given."""
    tracker = LiveTensorBytes().__enter__()  # from the start: every storage of the run is seen
    parallel = ParallelConfig(activation_checkpointing=ac, ac_every=ac_every)
    # The rope buffers and the batch are counted as at-rest bytes (the planner adds them the same way).
    return _measure_trainer_step(model_cfg, parallel, 1, batch, seq, accum, seed, steps, tracker, precision, optim)


def _measure_trainer_step(model_cfg: ModelConfig, parallel: ParallelConfig, world_size: int, batch: int, seq: int,
                          accum: int, seed: int, steps: int, tracker: LiveTensorBytes, precision: str = "fp32",
                          optim: OptimConfig | None = None) -> dict:
    """``build_parallel_training`` + ``training_step`` (AdamW defaults unless ``optim``, clip 1.0, the trainer's
    autocast for ``precision``) on random tokens: ``batch`` rows per rank per optimizer step in ``accum``
    micro-batches; data-parallel ranks read different rows, tensor-parallel ranks the same ones."""
    cfg = JobConfig(model=model_cfg, parallel=parallel, optim=optim or OptimConfig(),
                    train=TrainConfig(seed=seed, grad_accum_steps=accum))
    device = torch.device("cpu")
    dims = ParallelDims.from_config(parallel, world_size)
    pm, optimizer = build_parallel_training(cfg, dims, device)
    gen = torch.Generator().manual_seed(seed + 1000 * pm.dp_rank)
    inputs = torch.randint(0, model_cfg.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, model_cfg.vocab_size, (batch, seq), generator=gen)
    micro = list(zip(inputs.chunk(accum), targets.chunk(accum), [None] * accum))

    def step() -> float:
        options = StepOptions(grad_clip=cfg.optim.grad_clip, autocast=lambda: autocast(precision, device))
        return training_step(pm, optimizer, iter(micro), accum, options).loss

    return measure_step(step, tracker, steps=steps)


def resident_extras(model_cfg: ModelConfig, batch: int, seq: int) -> int:
    """Bytes the planner adds outside the model states: rope tables (two sets with Gemma 3's local layers' own
    base) and one batch of int64 tokens."""
    head_dim = head_width(model_cfg)
    tables = 2 if has_local_rope(model_cfg) else 1
    return tables * 2 * model_cfg.max_seq_len * head_dim * 4 + 2 * batch * seq * 8


def distributed_run(model_cfg: ModelConfig, parallel: dict, batch_per_rank: int, seq: int, steps: int = 5,
                    seed: int = 0, accum: int = 1) -> dict:
    """Inside a torchrun process group: this rank's peak tensor bytes and median time of the trainer's
    own step (``build_parallel_training`` + ``training_step``) for the ``parallel`` fields."""
    env = init_distributed("cpu")
    tracker = LiveTensorBytes(track_resize=True).__enter__()
    result = _measure_trainer_step(model_cfg, ParallelConfig(**parallel), env.world_size, batch_per_rank, seq,
                                   accum, seed, steps, tracker)
    result["rank"] = env.rank
    return result
