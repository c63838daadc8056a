"""Adaptive batch: the batch-size ramp, load balancing across unequal ranks, the gradient noise scale.

All three only decide how many micro-batches of ``train.batch_size`` sequences each rank runs in a step
and by what the loss is divided; the step itself is ``train/step.py:training_step`` (docs/tuning.md).

- ``BatchRamp``: Megatron's ``rampup_batch_size = [start, increment, samples]``. The global batch of a step
  is a pure function of the sequences consumed before it, which is a pure function of the step, so a resume
  (on any world size) picks the same batch again; the ramp is done through gradient accumulation.
  The learning-rate rule: the schedule stays in optimizer steps (``lr_at``), and during the ramp its LR is
  multiplied by ``B / B_full`` (linear) or ``sqrt(B / B_full)`` (sqrt, the rule for Adam of Malladi et al.
  2022) or left as it is (none, Megatron's behaviour).
- ``LoadBalancer``: ``parallel.balance = "throughput"``. Every rank times its micro-batches; every
  ``balance_interval`` steps the ranks all-gather their mean micro-batch seconds and split the step's M
  micro-batches in proportion to speed (each at least one). All ranks read the same global stream of
  micro-batches and rank r keeps the r-th contiguous run of its count, and every micro-batch's loss is
  divided by M / W (DDP then averages over W), so the gradient is exactly the mean over the M micro-batches:
  the uniform-batch gradient. The counts are saved with the checkpoint (deterministic resume).
- ``Adaptive``: the three together as the trainer's step uses them: ``plan`` a step (how many micro-batches
  this rank runs, which it skips, the loss divisor), read its ``batches``, then ``after_step``.
- ``NoiseScale``: McCandlish et al. 2018, appendix A. From the squared norms of small-batch gradients
  (one micro-batch, B_small sequences) and of the step's gradient (B_big sequences):
  |G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small) and
  tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big); both are averaged (an exponential
  moving average each, as the paper advises, not of their ratio) and B_simple = tr(Sigma) / |G|^2 is the
  suggested critical batch (in sequences).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from scaletrain.config import BatchConfig, ConfigError, JobConfig
from scaletrain.parallel import ParallelDims
from scaletrain.train.monitor import timed


def _check_ramp(cfg: JobConfig, dp_size: int) -> None:
    """The batch ramp's rules (``check_adaptive``)."""
    b = cfg.batch
    per_micro = cfg.train.batch_size * dp_size
    full = per_micro * cfg.train.grad_accum_steps
    if b.ramp_start == 0 and (b.ramp_increment or b.ramp_samples):
        raise ConfigError("batch.ramp_increment / batch.ramp_samples are set but batch.ramp_start is 0 (no ramp); "
                          "set batch.ramp_start to the first global batch, or the others to 0")
    if not b.ramp_start:
        return
    if cfg.parallel.engine != "native":
        raise ConfigError("batch.ramp_start: the batch ramp runs on the native engine (DeepSpeed fixes its "
                          "accumulation at initialisation); drop --parallel.engine=deepspeed or the ramp")
    if not b.ramp_increment or not b.ramp_samples:
        raise ConfigError("batch.ramp_start needs batch.ramp_increment > 0 and batch.ramp_samples > 0")
    if b.ramp_start >= full:
        raise ConfigError(f"batch.ramp_start ({b.ramp_start}) must be below the full global batch ({full} = "
                          f"train.batch_size x train.grad_accum_steps x {dp_size} data-parallel rank(s)); "
                          f"raise train.grad_accum_steps or lower batch.ramp_start")
    if (full - b.ramp_start) % b.ramp_increment:
        raise ConfigError(f"batch.ramp_increment ({b.ramp_increment}) must divide the ramp's span "
                          f"({full} - {b.ramp_start} = {full - b.ramp_start} sequences)")
    if b.ramp_start % per_micro or b.ramp_increment % per_micro:
        raise ConfigError(f"batch.ramp_start ({b.ramp_start}) and batch.ramp_increment ({b.ramp_increment}) "
                          f"must be multiples of train.batch_size x data-parallel ranks ({per_micro}): the "
                          f"ramp is done by gradient accumulation")


def check_adaptive(cfg: JobConfig, dp_size: int, precision: str) -> None:
    """The [batch] and parallel.balance rules (called by ``train/validate.py:check_runnable``): one line each."""
    b, par = cfg.batch, cfg.parallel
    _check_ramp(cfg, dp_size)
    if par.balance == "throughput" and dp_size > 1:
        if par.dp_shard > 1 or par.tp > 1 or par.pp > 1 or par.cp > 1 or par.low_comm != "none" \
                or par.engine != "native":
            raise ConfigError("parallel.balance=throughput runs with replicated data parallelism only (DDP / ZeRO-1: "
                              "dp_shard, tp, pp, cp = 1, low_comm = none, native engine)")
        if cfg.finetune.instructions:
            raise ConfigError("parallel.balance=throughput reads token shards; it does not take finetune.instructions")
        if cfg.train.grad_accum_steps < 2:
            raise ConfigError("parallel.balance=throughput needs train.grad_accum_steps >= 2 (micro-batches to move "
                              "between ranks)")
    if b.noise_scale_interval:
        if par.dp_shard > 1 or par.tp > 1 or par.pp > 1 or par.cp > 1 or par.low_comm != "none" \
                or par.engine != "native":
            raise ConfigError("batch.noise_scale_interval needs whole local gradients: replicated data parallelism "
                              "only (dp_shard, tp, pp, cp = 1, low_comm = none, native engine)")
        if precision == "fp16":
            raise ConfigError("batch.noise_scale_interval does not run with train.precision=fp16 (scaled gradients)")


class BatchRamp:
    """The global batch (sequences) of each optimizer step, and the LR factor that goes with it."""

    def __init__(self, cfg: BatchConfig, full: int):
        self.cfg, self.full = cfg, full
        self._before = [0]  # sequences consumed before step i
        if cfg.ramp_start:
            self.per_increment = cfg.ramp_samples / ((full - cfg.ramp_start) // cfg.ramp_increment)

    def batch_for_samples(self, consumed: int) -> int:
        """Megatron's rule: start + increment x floor(consumed / samples per increment), capped at full."""
        if not self.cfg.ramp_start:
            return self.full
        return min(self.full, self.cfg.ramp_start + self.cfg.ramp_increment * int(consumed / self.per_increment))

    def samples_before(self, step: int) -> int:
        while len(self._before) <= step:
            self._before.append(self._before[-1] + self.batch_for_samples(self._before[-1]))
        return self._before[step]

    def batch_at(self, step: int) -> int:
        """Global sequences of optimizer step ``step`` (0-based: the update from step to step + 1)."""
        return self.batch_for_samples(self.samples_before(step))

    def lr_factor(self, step: int) -> float:
        ratio = self.batch_at(step) / self.full
        return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.cfg.lr_scaling]


def split_counts(total: int, seconds: list[float]) -> list[int]:
    """``total`` micro-batches over ranks in proportion to speed (1 / seconds per micro-batch), each >= 1,
    by largest remainder (ties to the lower rank), so every rank computes the same split."""
    n = len(seconds)
    if total < n:
        raise ValueError(f"{total} micro-batches cannot give each of {n} ranks one")
    speed = [1.0 / max(s, 1e-9) for s in seconds]
    share = [(total - n) * v / sum(speed) for v in speed]  # the part beyond the guaranteed one each
    counts = [1 + int(x) for x in share]
    order = sorted(range(n), key=lambda r: (-(share[r] - int(share[r])), r))
    for r in order[:total - sum(counts)]:
        counts[r] += 1
    return counts


class LoadBalancer:
    """Micro-batches per rank for ``parallel.balance = "throughput"`` (stateful: the current shares)."""

    def __init__(self, rank: int, world_size: int, interval: int, device: torch.device):
        self.rank, self.world_size, self.interval, self.device = rank, world_size, interval, device
        self.shares = [1.0 / world_size] * world_size  # fraction of the step's micro-batches per rank
        self._seconds: list[float] = []                 # this rank's micro-batch times since the last split
        self.last_seconds: list[float] = []             # every rank's mean, at the last split (for the log)

    def counts(self, total: int) -> list[int]:
        """The step's ``total`` micro-batches split by the current shares (a pure function of them)."""
        return split_counts(total, [1.0 / max(s, 1e-12) for s in self.shares])

    def record(self, seconds: list[float]) -> None:
        self._seconds.extend(seconds)

    def after_step(self, step: int) -> bool:
        """Every ``interval`` steps (collective): all-gather the ranks' mean micro-batch seconds and take new
        shares in proportion to speed. True when a new split was taken."""
        if self.world_size == 1 or step % self.interval:
            return False
        mine = sum(self._seconds) / len(self._seconds) if self._seconds else float("nan")
        box = torch.zeros(self.world_size, dtype=torch.float64, device=self.device)
        box[self.rank] = mine
        dist.all_reduce(box)
        seconds = box.tolist()
        self._seconds = []
        if any(not math.isfinite(s) or s <= 0 for s in seconds):
            return False  # a rank had no timed micro-batch (only its synchronised one): keep the split
        speed = [1.0 / s for s in seconds]
        self.shares = [v / sum(speed) for v in speed]
        self.last_seconds = seconds
        return True

    def state_dict(self) -> dict:
        return {"shares": list(self.shares), "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("world_size", 0)) == self.world_size:  # another world size: start from equal shares
            self.shares = [float(s) for s in state["shares"]]


def timed_micro_batches(batches: Iterator, out: list[float]) -> Iterator:
    """Pass ``batches`` through; append the seconds between two successive requests (one micro-batch's forward
    and backward, data reading excluded) to ``out``. The last micro-batch of a step is not timed: its backward
    waits for the other ranks in the gradient all-reduce."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        handed = time.perf_counter()
        yield batch
        out.append(time.perf_counter() - handed)  # the consumer asks for the next one: this one is computed


class NoiseScale:
    """Running estimate of B_simple from (B_small, |G_small|^2) and (B_big, |G_big|^2) pairs."""

    def __init__(self, beta: float = 0.9):
        self.beta = beta
        self.g2 = self.trace = 0.0  # exponential moving averages (bias-corrected by ``weight``)
        self.weight = 0.0

    def update(self, b_small: float, small_sq: float, b_big: float, big_sq: float) -> dict:
        """One measurement; returns the log record (this step's estimates and the running B_simple)."""
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        self.g2 = self.beta * self.g2 + (1 - self.beta) * g2
        self.trace = self.beta * self.trace + (1 - self.beta) * trace
        self.weight = self.beta * self.weight + (1 - self.beta)
        return {"gns_grad_sq": g2, "gns_trace": trace, "gns_b_simple": self.b_simple()}

    def b_simple(self) -> float:
        """tr(Sigma) / |G|^2 of the running averages, in sequences (nan until |G|^2 averages above 0)."""
        return self.trace / self.g2 if self.g2 > 0 else float("nan")

    def state_dict(self) -> dict:
        return {"g2": self.g2, "trace": self.trace, "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.g2, self.trace, self.weight = float(state["g2"]), float(state["trace"]), float(state["weight"])


def micro_grad_sq_mean(values: list[float], device: torch.device, world_size: int) -> float:
    """Mean of the ranks' micro-batch squared gradient norms (collective when world_size > 1; a rank with none
    contributes nothing). nan when no rank measured any."""
    box = torch.tensor([sum(values), float(len(values))], dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(box)
    return float(box[0] / box[1]) if box[1] > 0 else float("nan")


@dataclass
class StepPlan:
    """One step's share of the global stream of micro-batches for this rank (``Adaptive.plan``)."""

    global_batch: int  # sequences over all ranks (the ramp's)
    mine: int  # micro-batches this rank runs (the step's ``accum``)
    skip_before: int = 0  # other ranks' micro-batches before mine in the global stream (parallel.balance)
    skip_after: int = 0  # ... and after mine
    counts: list[int] | None = None  # every rank's micro-batches (parallel.balance), for the log
    loss_divisor: float | None = None  # what each micro-batch's loss is divided by (None: ``mine``)
    micro_grad_sq: list[float] | None = None  # filled by the step on a noise-scale step
    micro_seconds: list[float] = field(default_factory=list)  # this rank's timed micro-batches (parallel.balance)


class Adaptive:
    """The batch ramp, the load balancer and the noise-scale estimate of one run. The last two are saved with
    the checkpoint: ``__init__`` adds them to ``local_state``."""

    def __init__(self, cfg: JobConfig, dims: ParallelDims, dp_rank: int, device: torch.device, world_size: int,
                 local_state: dict):
        self.batch_size, self.seq_len, self.dp_size, self.dp_rank = \
            cfg.train.batch_size, cfg.data.seq_len, dims.dp_size, dp_rank
        self.device, self.world_size = device, world_size
        self.noise_interval, self.log_batch = cfg.batch.noise_scale_interval, bool(cfg.batch.ramp_start)
        self.ramp = BatchRamp(cfg.batch, cfg.train.batch_size * cfg.train.grad_accum_steps * dims.dp_size)
        self.balancer = None
        if cfg.parallel.balance == "throughput" and dims.dp_size > 1:
            self.balancer = LoadBalancer(dp_rank, dims.dp_size, cfg.parallel.balance_interval, device)
            local_state["balance"] = self.balancer
        self.noise = NoiseScale() if cfg.batch.noise_scale_interval else None
        if self.noise is not None:
            local_state["noise_scale"] = self.noise
        self.latest: dict = {}  # the balancer's and noise scale's latest values, in every logged record

    def lr_factor(self, step: int) -> float:
        """The ramp's learning-rate factor (1 without a ramp)."""
        return self.ramp.lr_factor(step)

    def plan(self, step: int) -> StepPlan:
        """This rank's micro-batches of ``step``: the ramp's global batch, split by the balancer."""
        global_batch = self.ramp.batch_at(step)
        per_rank = global_batch // (self.batch_size * self.dp_size)
        plan = StepPlan(global_batch, per_rank)
        if self.balancer is not None:
            plan.counts = counts = self.balancer.counts(per_rank * self.dp_size)
            r = self.dp_rank
            plan.mine, plan.skip_before, plan.skip_after = counts[r], sum(counts[:r]), sum(counts[r + 1:])
            plan.loss_divisor = float(per_rank)  # M / W: DDP's average over W then makes it the mean over all M
        if self.noise is not None and (step + 1) % self.noise_interval == 0:
            plan.micro_grad_sq = []
        return plan

    def batches(self, plan: StepPlan, loader: Iterator, to_device: Callable, data_seconds: list[float]) -> Iterator:
        """This rank's ``plan.mine`` micro-batches on the device, after skipping the other ranks' share before
        them; ``data_seconds[0]`` accumulates the wait for the loader (``monitor.timed``)."""
        def mine() -> Iterator:
            for _ in range(plan.skip_before):
                next(loader)
            for _ in range(plan.mine):
                yield to_device(next(loader))

        batches = timed(mine(), data_seconds)
        return timed_micro_batches(batches, plan.micro_seconds) if self.balancer is not None else batches

    def skip_rest(self, plan: StepPlan, loader: Iterator) -> None:
        """Past the other ranks' micro-batches after this rank's (the loader stays on the global stream)."""
        for _ in range(plan.skip_after):
            next(loader)

    def after_step(self, plan: StepPlan, step: int, grad_norm: float, record: dict) -> None:
        """The ramp's batch, the balancer's split and re-measurement, the noise-scale update (collective where
        they gather from the ranks); their latest values go into ``record``. ``step``: the one just done."""
        if self.log_batch:
            record["global_batch"] = plan.global_batch
        if self.balancer is not None:
            self.balancer.record(plan.micro_seconds)
            record["micro_batches_per_rank"] = plan.counts
            if self.balancer.after_step(step):
                self.latest["balance_micro_seconds"] = self.balancer.last_seconds
        if plan.micro_grad_sq is not None:
            small_sq = micro_grad_sq_mean(plan.micro_grad_sq, self.device, self.world_size)
            b_small, b_big = self.batch_size, plan.global_batch
            if math.isfinite(small_sq) and math.isfinite(grad_norm) and b_big > b_small:
                gns = self.noise.update(b_small, small_sq, b_big, grad_norm ** 2)
                self.latest.update({"gns_b_simple": gns["gns_b_simple"], "gns_step": step,
                                    "critical_batch_tokens": gns["gns_b_simple"] * self.seq_len})
        record.update(self.latest)
