"""Before the first step: does the job fit this machine's memory?

The planner's own estimate (``memory.memory_breakdown`` for pretraining, ``finetune.finetune_answer`` for a
fine-tune: the numbers ``scaletrain plan`` prints) against the memory available to this process: host RAM on a
CPU (shared by the ranks on this host), the device's free memory on a GPU. A job that does not fit is refused
in one line with both numbers and what to change, instead of the kernel's OOM killer ending it (exit 137, no
message, the whole machine under memory pressure) or the allocator's traceback after the model is built.

The margin errs towards running. The estimate counts a fixed runtime (``memory.RUNTIME_BYTES``), which puts
it above the measured peak of small CPU runs (the default run: 516 MiB estimated, 411 MiB peak resident; the
tests' tiny run ~410 vs ~340 MiB), while on bigger ones it is close (a LoRA of 45M adapter weights: 1,210 MiB
estimated, 1,373 MiB peak). So the slack is a fixed ``SLACK_BYTES`` on top of what is available, not a factor:
a job is refused only when its estimate exceeds the available memory by more than that.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from scaletrain.config import JobConfig
from scaletrain.core.files import human_bytes
from scaletrain.finetune.method_table import method_entry
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.finetune import finetune_answer
from scaletrain.plan.memory import memory_breakdown
from scaletrain.plan.workload import Plan, Workload

SLACK_BYTES = 256 * 2**20  # the estimate's runtime overshoots small runs' peaks by ~100 MiB (see above)


def job_workload(cfg: JobConfig, precision: str) -> Workload:
    """The planner's workload of a resolved job (model with its vocabulary, the trainer's precision)."""
    t = cfg.train
    return Workload(cfg.model, cfg.data.seq_len, t.batch_size * max(1, t.grad_accum_steps), float(t.steps),
                    "bf16" if precision in ("bf16", "fp16", "fp8") else "fp32", cfg.optim.name,
                    muon_adapters=cfg.optim.muon_adapters, loss_chunk_rows=t.loss_chunk_rows)


def job_plan(cfg: JobConfig, dims: ParallelDims | None = None) -> Plan:
    """The planner's plan of a job: its resolved degrees (one process when ``dims`` is None), micro-batch and
    activation checkpointing."""
    p = cfg.parallel
    degrees = {} if dims is None else dict(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp,
                                           pp=dims.pp, cp=dims.cp, zero_stage=dims.zero_stage,
                                           ep=getattr(dims, "ep", 1))  # expert parallelism, where dims has it
    return Plan(**degrees, micro_batch=cfg.train.batch_size, activation_checkpointing=p.activation_checkpointing,
                ac_every=p.ac_every, cpu_offload=p.cpu_offload, engine=p.engine,
                offload=cfg.deepspeed.offload_optimizer if p.engine == "deepspeed" else "none")


def estimated_bytes(cfg: JobConfig, precision: str, device_kind: str, dims: ParallelDims | None = None,
                    allocator: str = "system") -> float:
    """Bytes per device the planner predicts for one step of ``cfg`` (runtime and allocator margin included)."""
    workload, plan = job_workload(cfg, precision), job_plan(cfg, dims)
    if cfg.finetune.source and not method_entry(cfg.finetune.method).trains_base:
        return finetune_answer(workload, 0.0, device_kind, cfg.finetune, micro_batch=plan.micro_batch,
                               activation_checkpointing=plan.activation_checkpointing,
                               allocator=allocator)["per_device_bytes"]
    return memory_breakdown(workload, plan, device_kind, allocator=allocator).total


def available_bytes(device: torch.device) -> tuple[float, str]:
    """(bytes this process may still use, what they are): a GPU's free memory plus what torch already holds on
    it; on a CPU the host's available RAM shared by this host's ranks, plus this process's own resident memory
    (the estimate counts the runtime this process already holds)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device)), f"free on {torch.cuda.get_device_name(device)}"
    import psutil

    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    own = psutil.Process().memory_info().rss
    share = f", shared by {ranks_here} ranks" if ranks_here > 1 else ""
    return float(psutil.virtual_memory().available / ranks_here + own), f"host RAM available{share}"


def memory_refusal(cfg: JobConfig, precision: str, device: torch.device, dims: ParallelDims | None = None,
                   available: float | None = None) -> str | None:
    """The one-line refusal of a job whose estimated memory exceeds what is available by ``SLACK_BYTES``
    (``available``: bytes, default measured by ``available_bytes``), naming what to change; None when it fits."""
    from scaletrain.hardware.allocator import in_use

    kind = "gpu" if device.type == "cuda" else "cpu"
    allocator = in_use() if kind == "cpu" else "system"
    needed = estimated_bytes(cfg, precision, kind, dims, allocator)
    what = "available"
    if available is None:
        available, what = available_bytes(device)
    if needed <= available + SLACK_BYTES:
        return None
    return (f"this job needs about {human_bytes(needed)} per {'GPU' if kind == 'gpu' else 'process'} (the planner's "
            f"estimate, scaletrain plan) but {human_bytes(available)} is {what}; "
            f"{_advice(cfg, precision, kind, dims, allocator, available)}")


def _advice(cfg: JobConfig, precision: str, kind: str, dims: ParallelDims | None, allocator: str,
            available: float) -> str:
    """What to change: the largest micro-batch that fits (keeping the global batch with accumulation), or, when
    not even one sequence fits, the size of what is trained."""
    t, batch = cfg.train, 1 << (cfg.train.batch_size.bit_length() - 1)  # powers of two below the batch
    if batch == t.batch_size:
        batch *= 2
    while batch > 1:
        batch //= 2
        smaller = dataclasses.replace(cfg, train=dataclasses.replace(t, batch_size=batch))
        if estimated_bytes(smaller, precision, kind, dims, allocator) <= available + SLACK_BYTES:
            accum = -(-t.batch_size * max(1, t.grad_accum_steps) // batch)
            return (f"lower train.batch_size (at most {batch} fits; --train.batch_size={batch} "
                    f"--train.grad_accum_steps={accum} keeps {t.batch_size * max(1, t.grad_accum_steps):,} "
                    f"sequences a step), or data.seq_len")
    ft = cfg.finetune
    if ft.source and method_entry(ft.method).lora:
        return f"lower finetune.lora_rank ({ft.lora_rank:,}) or data.seq_len"
    return "choose a smaller model (model.*) or data.seq_len, shard it over more devices (parallel.*), or " \
           "turn on parallel.activation_checkpointing"
