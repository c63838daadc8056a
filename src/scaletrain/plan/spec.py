"""What is being planned: the workload (model, data, batch) and one candidate parallel plan.

``Plan`` mirrors ``scaletrain.config.ParallelConfig`` (same names, same zero_stage semantics) plus the
per-rank micro-batch, so the winner can be written as a runnable ``[parallel]`` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scaletrain.config import ConfigError, ModelConfig
from scaletrain.model.presets import flops_per_token, kv_heads, num_params

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022, the usual rounding of their compute-optimal fit


@dataclass(frozen=True)
class Workload:
    """A model, a sequence length, a global batch (sequences per optimizer step) and tokens to train."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    train_tokens: float
    precision: str = "fp32"  # a key of memory.RECIPES

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
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

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
        return (" ".join(parts) + f" zero{self.zero_stage} mb{self.micro_batch}{ac}"
                + (" offload" if self.cpu_offload else ""))


def check_plan(workload: Workload, plan: Plan, world_size: int, device_kind: str = "gpu") -> None:
    """Reject impossible degrees with the reason (ConfigError); a plan that passes can be built."""
    m = workload.model
    p = plan
    if min(p.dp_replicate, p.dp_shard, p.tp, p.pp, p.cp, p.micro_batch) < 1:
        raise ConfigError(f"degrees and micro_batch must be >= 1 (got {p.label()})")
    if p.world_size != world_size:
        raise ConfigError(f"dp_replicate*dp_shard*tp*pp*cp = {p.world_size} but the hardware has {world_size} devices")
    if m.n_heads % p.tp or kv_heads(m) % p.tp:
        raise ConfigError(f"tp={p.tp} must divide n_heads ({m.n_heads}) and n_kv_heads ({kv_heads(m)}): "
                          f"each rank holds whole heads")
    from scaletrain.model.presets import ffn_hidden_dim

    if ffn_hidden_dim(m) % p.tp:
        raise ConfigError(f"tp={p.tp} must divide the SwiGLU hidden size ({ffn_hidden_dim(m)})")
    if p.pp > m.n_layers:
        raise ConfigError(f"pp={p.pp} is more stages than n_layers ({m.n_layers})")
    if workload.seq_len % (2 * p.cp) and p.cp > 1:
        raise ConfigError(f"cp={p.cp}: seq_len ({workload.seq_len}) must divide into 2*cp chunks (load-balanced ring)")
    if p.cp > 1 and device_kind == "cpu":
        raise ConfigError("context parallelism is GPU only: torch's CPU flash attention has no sharding strategy "
                          "(docs/PLATFORM.md)")
    if workload.global_batch % (p.dp * p.micro_batch * (p.microbatches if p.pp > 1 else 1)):
        raise ConfigError(f"global batch {workload.global_batch} is not a multiple of dp ({p.dp}) x micro_batch "
                          f"({p.micro_batch})" + (f" x pipeline micro-batches ({p.microbatches})" if p.pp > 1 else ""))
    if p.zero_stage in (2, 3) and p.dp_shard == 1 and p.dp > 1:
        raise ConfigError(f"zero_stage {p.zero_stage} is FSDP2, which shards over dp_shard; dp_shard is 1")
    if p.zero_stage == 1 and p.dp_shard > 1:
        raise ConfigError("zero_stage 1 (ZeroRedundancyOptimizer over DDP) needs dp_shard = 1; use 2 or 3 with FSDP")
    if p.cpu_offload and p.zero_stage not in (2, 3):
        raise ConfigError("cpu_offload is an FSDP2 policy: it needs zero_stage 2 or 3")
    if workload.seq_len > m.max_seq_len:
        raise ConfigError(f"seq_len ({workload.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
