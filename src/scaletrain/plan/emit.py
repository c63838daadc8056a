"""Write a plan as a runnable job config (a full ``JobConfig`` TOML that ``load_config`` reads back)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from scaletrain.config import DataConfig, JobConfig, ParallelConfig, ScheduleConfig, TrainConfig, to_toml
from scaletrain.plan.spec import Plan, Workload


def job_config(workload: Workload, plan: Plan, device_kind: str) -> JobConfig:
    """The JobConfig that runs ``plan``: model, seq_len, batch, steps, precision and the [parallel] section."""
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
                        precision="bf16" if bf16 else "fp32")
    schedule = ScheduleConfig(warmup_steps=min(ScheduleConfig().warmup_steps, steps))
    data = DataConfig(seq_len=workload.seq_len)
    model = dataclasses.replace(workload.model)
    return JobConfig(model=model, data=data, train=train, schedule=schedule, parallel=parallel)


def write_config(path: str | Path, workload: Workload, plan: Plan, device_kind: str, header: str = "") -> Path:
    """Write the TOML (with each field's help as a comment) and return its path."""
    text = to_toml(job_config(workload, plan, device_kind))
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + "\n" + text
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
