"""What is being planned: the workload (model, data, batch) and one candidate parallel plan.

``Plan`` is a point of the search space: the degrees and options of a ``[parallel]`` section plus the
per-rank micro-batch. It carries no rules of its own: ``job_config`` turns it into the job the trainer would
run and ``check_plan`` asks the trainer's checks (``train/validate.check_runnable``) whether that job runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from scaletrain.config import (
    ConfigError,
    DataConfig,
    DeepSpeedConfig,
    JobConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)
from scaletrain.model.presets import flops_per_token, num_params
from scaletrain.train.optimizer import OPTIMIZERS, OptimizerEntry
from scaletrain.train.validate import check_runnable

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022, the usual rounding of their compute-optimal fit


@dataclass(frozen=True)
class Workload:
    """A model, a sequence length, a global batch (sequences per optimizer step), tokens to train, and the
    precision and optimizer they train with."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    train_tokens: float
    precision: str = "fp32"  # a key of memory.RECIPES
    # optim.name: an entry of the optimizer table (train/optimizer.py: OPTIMIZERS), whose state bytes, matrices
    # and Newton-Schulz set the optimizer's memory and time (``optimizer_entry``)
    optimizer: str = "adamw"
    muon_adapters: bool = False  # optim.muon_adapters: with muon, LoRA's lora_A / lora_B are Muon matrices too
    loss_chunk_rows: int = -1  # train.loss_chunk_rows: the chunked loss (model/loss.py) holds fewer logits at once

    def __post_init__(self):
        # the memory and time models read the table's entries; a name without one cannot be planned
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"the planner models optimizers {', '.join(OPTIMIZERS)}, not {self.optimizer!r} (its "
                              f"state bytes and step would be AdamW's guesses)")

    @property
    def optimizer_entry(self) -> OptimizerEntry:
        return OPTIMIZERS[self.optimizer]

    @property
    def params(self) -> int:
        return num_params(self.model)

    @property
    def params_non_embedding(self) -> int:
        return num_params(self.model, exclude_embedding=True)

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model, self.seq_len)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.train_tokens / self.tokens_per_step))

    @property
    def total_flops(self) -> float:
        return self.flops_per_token * self.steps * self.tokens_per_step


@dataclass(frozen=True)
class Plan:
    """One way to run the workload. Degrees multiply to the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1  # sequences per rank per forward
    zero_stage: int = 0  # resolved: 0 DDP, 1 ZeRO-1 over DDP, 2 FSDP2 keep params, 3 FSDP2 reshard
    activation_checkpointing: str = "none"
    ac_every: int = 2
    cpu_offload: bool = False
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0 = 2 x pp
    engine: str = "native"  # or "deepspeed": ZeRO zero_stage over all ranks (data parallel only)
    offload: str = "none"  # deepspeed: optimizer state (and at ZeRO-3 the params) to "cpu" or "nvme"
    # Expert parallelism (a mixture of experts): the routed experts split over ep ranks borrowed from the
    # data-parallel ones (torchtitan's dp2ep: ep divides dp_replicate * dp_shard, adds no ranks); 1 = none.
    ep: int = 1
    # Where the ep group sits. False: our trainer's layout (parallel/expert.py), the ep ranks are the innermost
    # data-parallel ones, at stride tp x cp (the trainer runs ep with cp = 1: with tp = 1 ep consecutive ranks, one
    # node's for ep <= its devices; with tp > 1 the ranks of one tp coordinate, each expert's hidden units split
    # over tp, ``expert_tp`` = tp). True: Megatron-Core's MoE parallel folding with expert-TP 1, the expert layers
    # on a mesh of their own: ep consecutive ranks whatever tp is, each dispatching its sequence-parallel share of
    # the tokens (tokens / tp; Megatron runs MoE with TP only under sequence parallelism), the experts unsplit by
    # tp (``expert_tp`` 1: a rank holds E / ep whole experts, sharded by ZeRO over the dp x tp / ep others). Priced
    # only (search.evaluate; search never proposes it, and check_plan refuses it with tp or cp > 1: the trainer
    # splits the experts over tp instead; with tp = cp = 1 the two layouts are one).
    ep_folded: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def expert_tp(self) -> int:
        """The routed experts' tensor-parallel degree: tp in our trainer's layout, 1 folded (``ep_folded``)."""
        return 1 if self.ep_folded else self.tp

    @property
    def expert_token_split(self) -> int:
        """What a rank's expert layers see of its micro-batch's tokens, as a divisor: folded (``ep_folded``) each tp
        rank routes its sequence-parallel share (tokens / tp); in our trainer's layout every tp rank routes them all."""
        return self.tp if self.ep_folded else 1

    @property
    def microbatches(self) -> int:
        return self.pp_microbatches or 2 * self.pp

    def grad_accum(self, workload: Workload) -> int:
        """Micro-batches per rank per optimizer step (outside the pipeline's own micro-batching)."""
        per_rank = workload.global_batch // self.dp
        per_forward = self.micro_batch * (self.microbatches if self.pp > 1 else 1)
        return max(1, per_rank // per_forward)

    def label(self) -> str:
        parts = [f"{k}{v}" for k, v in (("dp", self.dp_replicate), ("fsdp", self.dp_shard), ("tp", self.tp),
                                          ("pp", self.pp), ("cp", self.cp)) if v > 1] or ["single"]
        ac = {"none": "", "full": " ac=full", "selective": f" ac=sel/{self.ac_every}"}[self.activation_checkpointing]
        if self.engine == "deepspeed":
            return (f"deepspeed dp{self.dp} zero{self.zero_stage} mb{self.micro_batch}"
                    + (f" offload={self.offload}" if self.offload != "none" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (" etp1" if self.ep_folded else ""))
        return (" ".join(parts) + f" zero{self.zero_stage} mb{self.micro_batch}{ac}"
                + (" offload" if self.cpu_offload else ""))


def job_config(workload: Workload, plan: Plan, device_kind: str) -> JobConfig:
    """The JobConfig that runs ``plan``: model, seq_len, batch, steps, precision, the [parallel] section and
    a run folder named after the plan (``runs/plan-fsdp8-zero3-mb8``), so running an emitted plan never
    writes into another run's folder (what ``plan --emit`` writes, and what ``check_plan`` asks the
    trainer about)."""
    steps = workload.steps
    per_forward = plan.micro_batch * (plan.microbatches if plan.pp > 1 else 1)
    bf16 = workload.precision in ("bf16", "mixed")
    parallel = ParallelConfig(
        dp_replicate=plan.dp_replicate, dp_shard=plan.dp_shard, tp=plan.tp, pp=plan.pp, cp=plan.cp,
        zero_stage=plan.zero_stage, sequence_parallel=plan.sequence_parallel, pp_schedule=plan.pp_schedule,
        pp_microbatches=plan.microbatches if plan.pp > 1 else 0,
        activation_checkpointing=plan.activation_checkpointing, ac_every=plan.ac_every,
        param_dtype="bf16" if bf16 and plan.zero_stage >= 2 else "fp32", cpu_offload=plan.cpu_offload)
    train = TrainConfig(steps=steps, batch_size=per_forward, grad_accum_steps=plan.grad_accum(workload),
                        device="cuda" if device_kind == "gpu" else "cpu",
                        precision="bf16" if bf16 else "fp32", run_dir=plan_run_dir(plan))
    schedule = ScheduleConfig(warmup_steps=min(ScheduleConfig().warmup_steps, steps))
    data = DataConfig(seq_len=workload.seq_len)
    deepspeed = DeepSpeedConfig()
    if plan.engine == "deepspeed":
        parallel = ParallelConfig(engine="deepspeed", zero_stage=plan.zero_stage, dp_replicate=plan.dp_replicate,
                                  dp_shard=plan.dp_shard)
        if plan.offload != "none":
            deepspeed = DeepSpeedConfig(offload_optimizer=plan.offload,
                                        offload_param=plan.offload if plan.zero_stage == 3 else "none",
                                        nvme_path=f"{plan_run_dir(plan)}/nvme" if plan.offload == "nvme" else "")
    # The optimizer, so that the trainer's checks refuse the plans it cannot run with (Muon: no TP / CP, ZeRO-1
    # or DeepSpeed); muon_adapters is a fine-tune's (plan --finetune.method), not part of a pretraining job.
    optim = OptimConfig(name=workload.optimizer)
    if "ep" in {f.name for f in dataclasses.fields(ParallelConfig)}:  # parallel.ep, once expert parallelism exists
        parallel = dataclasses.replace(parallel, ep=plan.ep)
    return JobConfig(model=dataclasses.replace(workload.model), data=data, train=train, schedule=schedule,
                     parallel=parallel, deepspeed=deepspeed, optim=optim)


def plan_run_dir(plan: Plan) -> str:
    """``runs/plan-<label>``: the plan's label as a folder name ("fsdp8 zero3 mb8 ac=full" ->
    ``runs/plan-fsdp8-zero3-mb8-ac-full``)."""
    return "runs/plan-" + re.sub(r"[^a-z0-9]+", "-", plan.label().lower()).strip("-")


def check_plan(workload: Workload, plan: Plan, world_size: int, device_kind: str = "gpu") -> None:
    """A plan is valid when the job it would run passes the trainer's own checks
    (``train/validate.check_runnable``: the same call ``Trainer`` makes) and it splits the workload's
    global batch exactly. Raises ``ConfigError`` with the trainer's reason."""
    if plan.micro_batch < 1:
        raise ConfigError(f"micro_batch must be >= 1 (got {plan.micro_batch})")
    if plan.world_size != world_size:
        raise ConfigError(f"dp_replicate*dp_shard*tp*pp*cp = {plan.world_size} but the hardware has "
                          f"{world_size} devices")
    # The planner's own arithmetic (not a rule of the trainer): the global batch must split into
    # data-parallel ranks x micro-batch x pipeline micro-batches x gradient accumulation.
    per_forward = plan.micro_batch * (plan.microbatches if plan.pp > 1 else 1)
    if workload.global_batch % (plan.dp * per_forward):
        raise ConfigError(f"global batch {workload.global_batch} is not a multiple of dp ({plan.dp}) x micro_batch "
                          f"({plan.micro_batch})"
                          + (f" x pipeline micro-batches ({plan.microbatches})" if plan.pp > 1 else ""))
    if plan.ep_folded and plan.tp * plan.cp > 1:
        raise ConfigError(f"ep_folded with tp {plan.tp} x cp {plan.cp}: Megatron-Core's MoE parallel folding is "
                          "priced only (search.evaluate); the trainer splits the experts over tp (expert-TP = tp, "
                          "ep_folded false) and runs parallel.ep with cp = 1")
    experts = workload.model.moe_experts
    if plan.ep > 1 and (plan.dp % plan.ep or not experts or experts % plan.ep):
        # the planner's own arithmetic, as the batch's: expert ranks are data-parallel ranks, each holding E / ep
        raise ConfigError(f"ep {plan.ep} must divide the data-parallel ranks ({plan.dp}) and the experts "
                          f"(model.moe_experts = {experts})")
    cfg = job_config(workload, plan, device_kind)
    # here=False: the target machine's libraries (DeepSpeed, libaio for NVMe offload) are not this machine's.
    check_runnable(cfg, world_size, cfg.train.device, cfg.train.precision, here=False)
