"""Plan search: every way to split the job that can be built and fits, ranked by predicted throughput.

Enumerates dp_replicate x dp_shard x tp x pp x cp factorizations of the world size, the ZeRO stage that
goes with them, a mixture of experts' expert-parallel degree (``ep_degrees``), the per-rank micro-batch,
activation checkpointing and (GPU) CPU offload. Each candidate
is checked (``spec.check_plan``), its memory simulated (``memory``) and, if it fits, its step timed
(``timing``). The result keeps the failures too, each with its reason.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace

from scaletrain.config import ConfigError
from scaletrain.hardware.catalog import Cluster
from scaletrain.plan.memory import MemoryBreakdown, memory_breakdown
from scaletrain.plan.timing import TimeBreakdown, step_time
from scaletrain.plan.workload import Plan, Workload, check_plan

GiB = 2**30


@dataclass
class Candidate:
    plan: Plan
    memory: MemoryBreakdown | None = None
    time: TimeBreakdown | None = None
    fits: bool = False
    reason: str = ""  # why it fails, or why it ranks where it does

    def as_dict(self) -> dict:

        return {"plan": {k: v for k, v in asdict(self.plan).items() if k != "notes"}, "label": self.plan.label(),
                "fits": self.fits, "reason": self.reason,
                "memory": self.memory.as_dict() if self.memory else None,
                "time": self.time.as_dict() if self.time else None}


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fitting plans, fastest first
    rejected: list[Candidate] = field(default_factory=list)  # built but too big, with the shortfall
    considered: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ep_degrees(data_parallel: int, experts: int) -> list[int]:
    """Expert-parallel degrees to try: the divisors of the data-parallel ranks that divide the expert count (ep
    borrows data-parallel ranks, each holding E / ep experts); [1] for a dense model."""
    return [d for d in _divisors(data_parallel) if experts and experts % d == 0] or [1]


def _micro_batches(global_batch: int, data_parallel: int) -> list[int]:
    """Micro-batch sizes to try: the powers of two dividing each rank's share, and the share itself. Found
    without listing the share's divisors (a loop as long as the batch: minutes for --global-batch 1e9)."""
    per_rank = global_batch // data_parallel if global_batch % data_parallel == 0 else 0
    if not per_rank:
        return [1]
    powers = [1 << k for k in range(per_rank.bit_length()) if per_rank % (1 << k) == 0]
    return powers + ([per_rank] if per_rank not in powers else [])


def _buildable(workload: Workload, plan: Plan, cluster: Cluster, fixed: dict) -> bool:
    """The plan keeps the pinned fields and passes the trainer's own checks (``check_plan``)."""
    if any(getattr(plan, k) != v for k, v in fixed.items()):
        return False
    try:
        check_plan(workload, plan, cluster.world_size, cluster.hardware.kind)
    except ConfigError:
        return False
    return True


def enumerate_plans(workload: Workload, cluster: Cluster, fixed: dict | None = None) -> list[Plan]:
    """Every buildable plan (``check_plan`` passes); ``fixed`` pins fields (e.g. {"tp": 2}). ``fixed["engine"]``:
    native (the default), deepspeed, or all (both, ranked together)."""
    fixed = dict(fixed or {})
    engine = fixed.pop("engine", "native")
    plans = _deepspeed_plans(workload, cluster, fixed) if engine in ("deepspeed", "all") else []
    if engine == "deepspeed":
        return plans
    world, gpu = cluster.world_size, cluster.hardware.kind == "gpu"
    for tp, pp, cp in itertools.product(_divisors(world), repeat=3):
        if world % (tp * pp * cp) or tp > cluster.devices_per_node:
            continue  # tensor parallelism stays inside a node: its traffic is per layer
        dp = world // (tp * pp * cp)
        for dp_shard in _divisors(dp):
            dp_rep = dp // dp_shard
            stages = [2, 3] if dp_shard > 1 else [0, 1] if dp_rep > 1 else [0]
            micro = _micro_batches(workload.global_batch, dp)
            # A mixture of experts' tensor parallelism is tried with and without sequence parallelism: with it the
            # sparse input is all-gathered over tp (more traffic, timing.tp_traffic_factor), less activation memory.
            sequence = (True, False) if tp > 1 and workload.model.moe_experts else (True,)
            for zero, mb, ac, offload, ep, sp in itertools.product(stages, micro, ("none", "selective", "full"),
                                                                   (False, True) if gpu else (False,),
                                                                   ep_degrees(dp, workload.model.moe_experts),
                                                                   sequence):
                if offload and zero < 2:
                    continue
                plan = Plan(dp_replicate=dp_rep, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, micro_batch=mb,
                            zero_stage=zero, activation_checkpointing=ac, cpu_offload=offload, ep=ep,
                            sequence_parallel=sp)
                if _buildable(workload, plan, cluster, fixed):
                    plans.append(plan)
    return plans


def _deepspeed_plans(workload: Workload, cluster: Cluster, fixed: dict) -> list[Plan]:
    """The DeepSpeed engine's candidates: ZeRO-1/2/3 over every rank (it is data parallel only), each without
    offload and with the optimizer state (at ZeRO-3 also the parameters) offloaded to CPU memory (GPUs) or NVMe.
    The trainer's rules for the target decide what is buildable; this machine's libraries (DeepSpeed, libaio) do not."""
    world, gpu = cluster.world_size, cluster.hardware.kind == "gpu"
    micro = _micro_batches(workload.global_batch, world)
    plans = []
    for stage, mb, offload in itertools.product((1, 2, 3), micro, ("none", "cpu", "nvme") if gpu else
                                                ("none", "nvme")):
        plan = Plan(dp_replicate=world if stage < 3 else 1, dp_shard=world if stage == 3 else 1, micro_batch=mb,
                    zero_stage=stage, engine="deepspeed", offload=offload)
        if _buildable(workload, plan, cluster, fixed):
            plans.append(plan)
    return plans


def evaluate(workload: Workload, plan: Plan, cluster: Cluster) -> Candidate:
    """Memory, and time when it fits."""
    mem = memory_breakdown(workload, plan, cluster.hardware.kind, allocator=cluster.hardware.allocator)
    budget = cluster.hardware.memory_bytes / (cluster.devices_per_node if cluster.hardware.kind == "cpu" else 1)
    if mem.total > budget:
        return Candidate(plan, mem, None, False, f"needs {mem.total / GiB:.2f} GiB per device, has "
                                                 f"{budget / GiB:.2f} GiB: short by "
                                                 f"{(mem.total - budget) / GiB:.2f} GiB")
    return Candidate(plan, mem, step_time(workload, plan, cluster), True)


def search(workload: Workload, cluster: Cluster, fixed: dict | None = None) -> SearchResult:
    """Rank every fitting plan by predicted tokens/s (``rank``: ties within 1% go to the simpler plan) and
    explain each. A mixture of experts searches the expert-parallel degree too (``ep_degrees``)."""
    plans = enumerate_plans(workload, cluster, fixed)
    pinned = {k: v for k, v in (fixed or {}).items() if not (k == "engine" and v == "all")}
    if not plans and workload.model.moe_experts and not pinned:
        # Say why (the trainer's own reason: e.g. a mixture of experts it cannot yet run on this many ranks).
        check_plan(workload, Plan(dp_shard=cluster.world_size, zero_stage=3 if cluster.world_size > 1 else 0),
                   cluster.world_size, cluster.hardware.kind)
    if not plans and pinned:
        # Say why the pinned degrees are impossible instead of "nothing found".
        probe = Plan(**{"dp_shard": max(1, cluster.world_size // _prod(pinned)), **pinned})
        check_plan(workload, probe, cluster.world_size, cluster.hardware.kind)
    results = [evaluate(workload, p, cluster) for p in plans]
    ranked = rank([c for c in results if c.fits])
    rejected = sorted((c for c in results if not c.fits), key=lambda c: c.memory.total)
    for c in ranked:
        c.reason = explain(c, ranked[0], cluster)
    return SearchResult(ranked, rejected, len(plans))


TIE = 0.01  # plans predicted within 1% of each other count as equally fast


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest first; plans within ``TIE`` of the fastest of their group count as equal (the model is not
    more precise than that: a 0.2% predicted gain is no reason to take on a technique), and among equals
    the simpler plan comes first (fewer parallel dimensions, no ZeRO sharding, recomputation or offload),
    then the one with more headroom."""
    by_speed = sorted(candidates, key=lambda c: -c.time.tokens_per_second)
    out: list[Candidate] = []
    while by_speed:
        lead = by_speed[0].time.tokens_per_second
        group = [c for c in by_speed if c.time.tokens_per_second >= lead * (1 - TIE)]
        by_speed = by_speed[len(group):]
        out += sorted(group, key=_simplicity)
    return out


def _simplicity(c: Candidate) -> tuple:
    p = c.plan
    techniques = (sum(d > 1 for d in (p.tp, p.pp, p.cp, p.ep)) + (p.zero_stage > 0)
                  + (p.activation_checkpointing != "none") + p.cpu_offload
                  + (p.engine != "native") + (p.offload != "none"))  # the optional engine is one more piece
    return (techniques, c.memory.total)


def _prod(fixed: dict) -> int:
    out = 1
    for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        out *= int(fixed.get(k, 1))
    return max(1, out)


def explain(c: Candidate, best: Candidate, cluster: Cluster) -> str:
    """Why a plan ranks where it does: its memory headroom and where its step time goes, versus the best."""
    t, budget = c.time, cluster.hardware.memory_bytes / (cluster.devices_per_node if cluster.hardware.kind == "cpu"
                                                            else 1)
    used = f"uses {c.memory.total / budget:.0%} of memory"
    parts = {"compute": t.compute, "optimizer": t.optimizer, "bubble": t.bubble, "exposed comm": t.comm_exposed}
    top = max(parts, key=parts.get)
    split = f"{top} {parts[top] / t.step:.0%} of the step"
    if c is best:
        return f"fastest that fits; {used}; {split}"
    slower = best.time.tokens_per_second / t.tokens_per_second - 1
    if slower < TIE:
        return (f"as fast as #1 within the model's precision ({TIE:.0%}); ranked after it as "
                f"{'more complex' if _simplicity(c)[0] > _simplicity(best)[0] else 'using more memory'}; {used}")
    diffs = []
    if c.plan.activation_checkpointing != "none" and best.plan.activation_checkpointing == "none":
        diffs.append("recomputes activations")
    if t.comm_exposed > best.time.comm_exposed * 1.05 + 1e-9:
        worst = max(t.comm_detail, key=t.comm_detail.get) if t.comm_detail else "comm"
        diffs.append(f"more exposed communication ({worst})")
    if t.bubble > best.time.bubble + 1e-9:
        diffs.append("pipeline bubble")
    if t.optimizer > best.time.optimizer * 1.05:
        diffs.append("slower optimizer step" + (" (offloaded)" if c.plan.cpu_offload or c.plan.offload != "none"
                                                 else ""))
    if c.plan.micro_batch < best.plan.micro_batch and not diffs:
        diffs.append("smaller micro-batch (less efficient kernels, more per-op overhead)")
    why = ", ".join(diffs) or "smaller per-kernel efficiency"
    return f"{slower:+.0%} slower than #1: {why}; {used}"


def what_would_fit(workload: Workload, plan: Plan, cluster: Cluster) -> str:
    """For a plan that does not fit: the single knob that makes it fit, tried from cheapest to dearest."""
    tries: list[tuple[str, Plan]] = []
    if plan.activation_checkpointing != "full":
        tries.append(("activation_checkpointing = full", replace(plan, activation_checkpointing="full")))
    if plan.micro_batch > 1:
        tries.append(("micro_batch = 1 (more gradient accumulation)", replace(plan, micro_batch=1)))
    if plan.dp_replicate > 1 or (plan.dp_shard > 1 and plan.zero_stage < 3):
        tries.append(("zero_stage 3 over all data-parallel ranks (dp_shard = dp)",
                      replace(plan, dp_shard=plan.dp, dp_replicate=1, zero_stage=3)))
    if cluster.hardware.kind == "gpu" and plan.zero_stage >= 2 and not plan.cpu_offload:
        tries.append(("cpu_offload = true", replace(plan, cpu_offload=True)))
    budget = cluster.hardware.memory_bytes / (cluster.devices_per_node if cluster.hardware.kind == "cpu" else 1)
    for text, variant in tries:
        try:
            check_plan(workload, variant, cluster.world_size, cluster.hardware.kind)
        except ConfigError:
            continue
        mem = memory_breakdown(workload, variant, cluster.hardware.kind, allocator=cluster.hardware.allocator)
        if mem.total <= budget:
            return f"{text} would fit ({mem.total / GiB:.2f} GiB of {budget / GiB:.2f} GiB)"
    # Nothing on this hardware: how many devices ZeRO-3 + full AC + micro-batch 1 would need.
    lean = replace(plan, activation_checkpointing="full", micro_batch=1, zero_stage=3, dp_replicate=1,
                   dp_shard=plan.dp, cpu_offload=False)
    for scale in (2, 4, 8, 16, 32, 64):
        n = lean.dp_shard * scale
        more = replace(lean, dp_shard=n)
        needed = memory_breakdown(workload, more, cluster.hardware.kind, allocator=cluster.hardware.allocator).total
        if needed <= budget:
            return (f"no knob on {cluster.world_size} devices fits; with activation_checkpointing=full, micro_batch=1 "
                    f"and zero_stage 3 it needs about {n * plan.tp * plan.pp * plan.cp} devices "
                    f"(or a device with more memory)")
    return "it does not fit even fully sharded over 64x the devices: use a device with more memory or a smaller model"
