"""The whole wall of a run, not only its steps: the evaluations, samples and checkpoints the trainer's loop makes
beside them (``train/trainer.py:Trainer.train``), which its ``done:`` line counts as stalls of the loop's wall
(``eval/sample/checkpoint X% of W s``).

- Evaluations: at step 0 when train.eval_interval is set, every eval_interval steps before the last, and after
  the last step; each scores train.eval_batches batches of train.batch_size x data.seq_len tokens on every rank
  (``train/evaluate.py:validation_loss``), eagerly and without gradients. A batch costs the planner's no-grad
  forward (``finetune.finetune_step_time``'s ``base_forward_seconds``: the frozen DPO reference's, over the whole
  vocabulary's head and loss), at this rank's share of the cores (``timing.cpu_rank_share``) and over the
  tensor-parallel ranks; a LoRA's adapters in it are left out (a few thin GEMMs).
- Samples (rank 0, train.sample_tokens after each evaluation, not when the model is sharded): one cached decode
  step a token, its aten ops (``timing.decode_ops``) at the seconds an eager decode op measured
  (``calibration.measure_decode_op_seconds``), or the weights read once (``memory_bandwidth``) and their FLOPs
  at the GEMM rate, whichever is slower.
- Checkpoints: every checkpoint.interval steps before the last and one at the end, each its size
  (``model.presets.checkpoint_size``) over the checkpoint write rate ``scaletrain doctor`` measured on
  this machine (``calibration.measure_checkpoint_write``) plus its fixed cost, else the reference machine's
  (a catalog GPU node: a local NVMe SSD, ``checkpoint_seconds``).

``evaluation_note`` is the line ``plan``, ``train`` and ``finetune`` print when the evaluations would take more
than a quarter of the predicted wall (issue 49: an 8-step LoRA of a 151,936-token base evaluated 269 s of 397).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scaletrain.config import ConfigError, FinetuneConfig, JobConfig
from scaletrain.finetune.objectives import objective_of
from scaletrain.hardware.catalog import CATALOG, LINKS, Cluster, Hardware, with_calibration
from scaletrain.model.presets import checkpoint_size, matmul_params, num_params
from scaletrain.parallel import ParallelDims
from scaletrain.plan.calibration import calibration_entry
from scaletrain.plan.finetune import finetune_step_time, preference_step_time, trainable_parameters
from scaletrain.plan.hardware_spec import catalog_key_for_gpu
from scaletrain.plan.timing import (
    DTYPE_OF_PRECISION,
    cpu_rank_share,
    decode_ops,
    gemm_rate,
    precision_rates,
    step_time,
)
from scaletrain.plan.workload import Plan, Workload

# The checkpoint write of the reference machine (2 vCPU EPYC, its overlay disk; calibration.measure_checkpoint_write:
# CheckpointManager.save of 1 MiB and 64 MiB of fp32, best of 3: 0.057 s and 1.34 s), for a calibration without
# this machine's.
REFERENCE_CHECKPOINT_LATENCY_S = 0.037
REFERENCE_CHECKPOINT_BYTES_PER_S = 51.5e6
# Seconds an op of an eager decode step costs on the reference machine, for a calibration without this machine's
# (``calibration.measure_decode_op_seconds``): its default run drew 7 samples of 200 tokens in 4.2 s
# (docs/training.md, 2026-11-27), 341 aten ops a token (``timing.decode_ops``): 3.0 ms a token, 8.8 us an op.
REFERENCE_DECODE_OP_SECONDS = 8.8e-6
# Evaluation above this share of the predicted wall is said before the run (issue 49's "a quarter").
EVALUATION_NOTE_SHARE = 0.25


@dataclass(frozen=True)
class LoopSettings:
    """What the trainer's loop does beside its steps: the [train] and [checkpoint] settings that decide it."""

    steps: int
    eval_interval: int = 250
    eval_batches: int = 20
    eval_rows: int = 16  # train.batch_size: rows of an evaluation batch
    sample_tokens: int = 200
    checkpoint_interval: int = 500
    checkpoints_enabled: bool = True

    @classmethod
    def of_job(cls, cfg: JobConfig, steps: int | None = None, eval_rows: int | None = None) -> LoopSettings:
        """The settings of ``cfg`` (``steps`` / ``eval_rows``: a plan's own step count and micro-batch)."""
        return cls(steps or cfg.train.steps, cfg.train.eval_interval, cfg.train.eval_batches,
                   eval_rows or cfg.train.batch_size, cfg.train.sample_tokens, cfg.checkpoint.interval,
                   cfg.checkpoint.enabled)

    def evaluations(self) -> int:
        """Evaluations of a run to ``steps``: at step 0 with an interval, every interval before the last step,
        and after the last step (``Trainer.train``)."""
        if not self.eval_interval:
            return 1
        return 2 + (self.steps - 1) // self.eval_interval

    def checkpoints(self) -> int:
        """Saves of a run to ``steps``: every interval before the last step, and at the end."""
        if not self.checkpoints_enabled:
            return 0
        return 1 + ((self.steps - 1) // self.checkpoint_interval if self.checkpoint_interval else 0)


@dataclass
class Wall:
    """A run's predicted wall, in the parts the ``done:`` line reports."""

    steps: float  # steps x the step time
    evaluation: float
    samples: float
    checkpoints: float
    evaluations: int
    eval_batches: int  # train.eval_batches of each
    eval_batch_seconds: float
    checkpoint_count: int
    checkpoint_bytes: int

    @property
    def total(self) -> float:
        return self.steps + self.evaluation + self.samples + self.checkpoints

    @property
    def stall_share(self) -> float:
        """Evaluation, samples and checkpoints over the whole wall: the ``done:`` line's eval/sample/checkpoint."""
        return (self.total - self.steps) / self.total if self.total else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "stall_share": self.stall_share}


def eval_batch_seconds(workload: Workload, plan: Plan, cluster: Cluster, rows: int,
                       ft: FinetuneConfig | None = None) -> float:
    """Seconds of one evaluation batch of ``rows`` sequences on one rank: the planner's no-grad forward."""
    one = dataclasses.replace(workload, global_batch=rows)
    forward = finetune_step_time(one, Plan(micro_batch=rows), Cluster(cluster.hardware, 1),
                                 ft or FinetuneConfig(method="full"))["base_forward_seconds"]
    share = cpu_rank_share(cluster) if cluster.hardware.kind == "cpu" else 1.0
    return forward * share / (plan.tp * plan.cp)


def sample_token_seconds(workload: Workload, cluster: Cluster) -> float:
    """Seconds of one cached decode step (one token) of the sample: the host's dispatch of its ops
    (``timing.decode_ops`` at the measured seconds an op), or the weights read once (and on a CPU their FLOPs at
    the GEMM rate), whichever is slower."""
    cfg, hw = workload.model, cluster.hardware
    weights = matmul_params(cfg)
    per_op = float(hw.calibration.get("decode_op_s", REFERENCE_DECODE_OP_SECONDS))
    host = decode_ops(cfg) * per_op
    if hw.kind == "gpu":
        return max(weights * 4 / hw.memory_bandwidth, host)
    entry = precision_rates(hw.calibration, workload.precision)
    compute = max(2.0 * weights / gemm_rate(entry, cfg.dim, 1), weights * 4 / entry["memory_bandwidth"])
    return max(compute * cpu_rank_share(cluster), host)


def checkpoint_seconds(size_bytes: float, cluster: Cluster) -> float:
    """Seconds of one checkpoint of ``size_bytes``: the write rate and fixed cost of a save doctor measured on
    this machine; else, on a CPU, the reference machine's; on a catalog GPU node, which the reference's disk
    says nothing about, a local NVMe SSD a node (the catalog's ``nvme-gen4``: each node's ranks write their
    shards to it)."""
    calibration = cluster.hardware.calibration
    latency = float(calibration.get("checkpoint_latency_s", REFERENCE_CHECKPOINT_LATENCY_S))
    if "checkpoint_bytes_per_s" in calibration:
        rate = float(calibration["checkpoint_bytes_per_s"])
    elif cluster.hardware.kind == "gpu":
        rate = LINKS["nvme-gen4"].bandwidth * LINKS["nvme-gen4"].efficiency * cluster.nodes
    else:
        rate = REFERENCE_CHECKPOINT_BYTES_PER_S
    return latency + size_bytes / rate


def predicted_wall(workload: Workload, plan: Plan, cluster: Cluster, step_seconds: float, loop: LoopSettings,
                   ft: FinetuneConfig | None = None) -> Wall:
    """The run's wall: ``loop.steps`` steps of ``step_seconds``, its evaluations, samples and checkpoints."""
    evaluations = loop.evaluations()
    batch = eval_batch_seconds(workload, plan, cluster, loop.eval_rows, ft) if loop.eval_batches > 0 else 0.0
    sharded = plan.dp_shard > 1 or plan.tp > 1 or plan.pp > 1 or plan.cp > 1  # ParallelModel.sharded: no sample
    samples = 0.0 if sharded or not loop.sample_tokens else \
        evaluations * loop.sample_tokens * sample_token_seconds(workload, cluster)
    total = num_params(workload.model)
    trainable = trainable_parameters(workload.model, ft) if ft is not None else total
    size = checkpoint_size(total, trainable, ft is not None)
    count = loop.checkpoints()
    batches = max(loop.eval_batches, 0)
    return Wall(loop.steps * step_seconds, evaluations * batches * batch, samples,
                count * checkpoint_seconds(size, cluster), evaluations, batches, batch, count,
                size)


def evaluation_note(wall: Wall, loop: LoopSettings) -> str | None:
    """The one line said before a run whose evaluations would take more than a quarter of its predicted wall,
    naming the settings that decide it; None otherwise."""
    if not wall.total or wall.evaluation <= EVALUATION_NOTE_SHARE * wall.total:
        return None
    every = loop.eval_interval
    interval = ("train.eval_interval = 0: at the end only" if not every else
                f"train.eval_interval = {every}, beyond the run's {loop.steps} steps: at step 0 and the end"
                if every >= loop.steps else
                f"train.eval_interval = {every}: at step 0, every {every} steps and the end")
    cheaper = max(1, math.floor(loop.eval_batches * EVALUATION_NOTE_SHARE * (wall.total - wall.evaluation)
                                / ((1 - EVALUATION_NOTE_SHARE) * wall.evaluation)))
    return (f"note: evaluation is predicted to take {_seconds(wall.evaluation)} of the run's "
            f"{_seconds(wall.total)} ({wall.evaluation / wall.total:.0%}): {wall.evaluations} evaluation(s) x "
            f"train.eval_batches = {loop.eval_batches} batches of {loop.eval_rows} row(s) "
            f"({_seconds(wall.eval_batch_seconds)} each; {interval}); lower train.eval_batches ({cheaper} or fewer "
            f"keeps it under {EVALUATION_NOTE_SHARE:.0%}) or raise train.eval_interval (0 evaluates at the end only)")


def _seconds(x: float) -> str:
    return f"{x:.2g} s" if x < 10 else f"{x:,.0f} s"


def job_evaluation_note(cfg: JobConfig, precision: str, device_type: str, dims: ParallelDims) -> str | None:
    """``train`` / ``finetune``'s line before the first step (``evaluation_note``): the job as the planner
    predicts it here, with this machine's calibration where ``scaletrain doctor`` measured one, else the
    reference CPU's (a share, which the machine's speed moves little), a GPU's catalog entry; None when the
    evaluation is not a quarter of the wall, or when the planner cannot price this job (never a reason to stop)."""
    hardware = _this_hardware(device_type)
    if hardware is None:
        return None
    ft = cfg.finetune if cfg.finetune.source else None
    pairs = objective_of(ft).rows_per_example if ft is not None else 1  # a preference pair: two rows
    batch = cfg.train.batch_size * cfg.train.grad_accum_steps * dims.dp_replicate * dims.dp_shard
    precision = precision if precision in DTYPE_OF_PRECISION else "bf16"  # fp8: its step is bf16's elsewhere
    try:
        workload = Workload(cfg.model, cfg.data.seq_len, batch, cfg.train.steps * batch * cfg.data.seq_len, precision,
                            cfg.optim.name, cfg.optim.muon_adapters)
        plan = Plan(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp, cp=dims.cp,
                    micro_batch=cfg.train.batch_size, zero_stage=max(dims.zero_stage, 0),
                    activation_checkpointing=cfg.parallel.activation_checkpointing, ac_every=cfg.parallel.ac_every,
                    ep=getattr(dims, "ep", 1))  # expert parallelism, where dims has it
        cluster = Cluster(hardware, dims.world_size)
        if ft is None:
            step = step_time(workload, plan, cluster).step
        elif pairs == 2:
            step = preference_step_time(workload, plan, cluster, ft)["step_seconds"]
        else:
            step = finetune_step_time(workload, plan, cluster, ft)["step_seconds"]
        loop = LoopSettings.of_job(cfg, eval_rows=cfg.train.batch_size * pairs)
        return evaluation_note(predicted_wall(workload, plan, cluster, step, loop, ft), loop)
    except (ConfigError, KeyError):  # a layout or calibration the time model has no rates for
        return None


def _this_hardware(device_type: str) -> Hardware | None:
    """This machine for ``job_evaluation_note``, measured nothing: the CPU's cached calibration (else the
    reference CPU), or a GPU's catalog entry (None when it has none)."""
    if device_type == "cuda":
        import torch

        key = catalog_key_for_gpu(torch.cuda.get_device_name(0))
        return CATALOG[key] if key else None
    try:
        entry = calibration_entry("cpu", measure_if_missing=False)
    except ConfigError:  # a cached calibration that contradicts itself: plan refuses it, the note uses none
        entry = {}
    return with_calibration(CATALOG["cpu"], entry) if "elementwise_s_per_element" in entry else CATALOG["cpu"]
