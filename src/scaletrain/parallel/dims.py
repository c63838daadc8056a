"""Parallel degrees -> one DeviceMesh.

``ParallelDims`` turns the ``[parallel]`` section into resolved degrees, checks them against the world
size and the model *before* any process-group work (so a bad config fails with one line, on every rank,
without hanging), and builds the single DeviceMesh every technique takes its sub-mesh from.

Mesh dimension order (outermost first): ``pp, dp_replicate, dp_shard, cp, tp``. TP is innermost because it
communicates on every matmul and wants the fastest links (ranks on the same node); PP is outermost because
it only sends activations between neighbours. Only dimensions of size > 1 are put in the mesh.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scaletrain.config import ConfigError, ModelConfig, ParallelConfig
from scaletrain.model.config import is_sliding
from scaletrain.model.presets import ffn_hidden_dim, kv_heads

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
VOCAB_MULTIPLE = 64  # GPU-friendly vocabulary rows (nanoGPT's 50257 -> 50304, Megatron's make-vocab-size-divisible-by)
VOCAB_MAX_PADDING = 0.01  # the round-up to VOCAB_MULTIPLE may add at most this fraction of rows


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The model vocabulary for a data-derived ``vocab_size`` under tensor-parallel degree ``tp``.

    Always a multiple of ``tp`` (the embedding and the output head are split by vocabulary rows). Rounded
    further up to a multiple of lcm(64, tp) when that adds at most 1% rows: BPE vocabularies get the
    GPU-friendly size (50257 -> 50304) while a 65-character vocabulary is not doubled (65 -> 65, or 66
    at tp=2), so a small model's step time does not change. The extra rows are padding: the loss and
    sampling mask them out (``cross_entropy``'s and ``generate``'s ``vocab_limit``).
    """
    for_tp = -(-vocab_size // tp) * tp
    multiple = math.lcm(VOCAB_MULTIPLE, tp)
    rounded = -(-vocab_size // multiple) * multiple
    return rounded if rounded - vocab_size <= VOCAB_MAX_PADDING * vocab_size else for_tp


def check_expert_model(cfg: ParallelConfig, model: ModelConfig) -> None:
    """What parallel.ep asks of the model: experts to split, as many on each rank."""
    if cfg.ep > 1 and not model.moe_experts:
        raise ConfigError(f"parallel.ep={cfg.ep} splits a mixture of experts, but the model is dense "
                          f"(model.moe_experts = 0); set parallel.ep=1, or model.moe_experts")
    if cfg.ep > 1 and model.moe_experts % cfg.ep:
        raise ConfigError(f"model.moe_experts ({model.moe_experts}) must be divisible by parallel.ep ({cfg.ep}): "
                          f"each expert-parallel rank holds as many experts")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees (no -1 left) whose product is the world size, plus the resolved ZeRO stage."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    zero_stage: int
    ep: int = 1  # expert parallel: borrowed from the data-parallel degree, no mesh dimension (parallel/expert.py)

    # -- construction and validation --------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Fill a -1 degree with the ranks left over and check that the degrees multiply to ``world_size``."""
        degrees = {"dp_replicate": cfg.dp_replicate, "dp_shard": cfg.dp_shard, "cp": cfg.cp, "tp": cfg.tp,
                   "pp": cfg.pp}
        fill = [name for name, d in degrees.items() if d == -1]
        if len(fill) > 1:
            raise ConfigError("only one of parallel.dp_replicate / parallel.dp_shard may be -1 (got both)")
        for name, d in degrees.items():
            if d == 0 or d < -1:
                raise ConfigError(f"parallel.{name} must be >= 1 or -1 (got {d})")
        known = 1
        for name, d in degrees.items():
            if d != -1:
                known *= d
        if fill:
            if world_size % known:
                raise ConfigError(f"parallel.{fill[0]}=-1: the other degrees multiply to {known}, which does not "
                                  f"divide the world size {world_size}")
            degrees[fill[0]] = world_size // known
        product = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["cp"] * degrees["tp"] * degrees["pp"]
        if product != world_size:
            raise ConfigError(
                f"parallel degrees dp_replicate={degrees['dp_replicate']} x dp_shard={degrees['dp_shard']} x "
                f"cp={degrees['cp']} x tp={degrees['tp']} x pp={degrees['pp']} = {product}, but the world size is "
                f"{world_size}; set them to multiply to {world_size} (e.g. --parallel.dp_shard=-1)")
        zero = cfg.zero_stage if cfg.zero_stage != -1 else (3 if degrees["dp_shard"] > 1 else 0)
        dims = cls(world_size=world_size, zero_stage=zero, ep=cfg.ep, **degrees)
        dims._check_combination(cfg)
        return dims

    def _check_combination(self, cfg: ParallelConfig) -> None:
        """Combinations this project supports, each refusal with the reason and the alternative."""
        if self.zero_stage in (2, 3) and self.dp_shard == 1 and self.world_size > 1:
            raise ConfigError(f"parallel.zero_stage={self.zero_stage} shards with FSDP2 over parallel.dp_shard, "
                              f"which is 1; set parallel.dp_shard > 1")
        if self.zero_stage in (0, 1) and self.dp_shard > 1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard} uses FSDP2 (ZeRO-2/3); parallel.zero_stage="
                              f"{self.zero_stage} asks for DDP: set zero_stage to -1, 2 or 3, or use dp_replicate")
        if self.zero_stage == 1 and (self.tp > 1 or self.pp > 1 or self.cp > 1):
            raise ConfigError("parallel.zero_stage=1 (ZeroRedundancyOptimizer over DDP) is data parallel only; "
                              "combine tp/pp/cp with FSDP2 (dp_shard > 1, zero_stage 2 or 3) instead")
        if self.dp_replicate > 1 and self.dp_shard == 1 and (self.tp > 1 or self.cp > 1):
            raise ConfigError("DDP (dp_replicate without dp_shard) cannot wrap tensor/context-parallel DTensor "
                              "parameters; use parallel.dp_shard for the data-parallel degree")
        if self.dp_replicate > 1 and self.dp_shard == 1 and self.pp > 1:
            raise ConfigError("DDP (dp_replicate without dp_shard) is not supported with parallel.pp > 1 (it hangs "
                              "in the pipeline schedule); use parallel.dp_shard for the data-parallel degree")
        if cfg.low_comm != "none":
            if self.dp_replicate < 2 or self.dp_shard > 1 or self.tp > 1 or self.pp > 1 or self.cp > 1:
                raise ConfigError(f"parallel.low_comm={cfg.low_comm} averages whole replicas over dp_replicate > 1 "
                                  f"ranks and cannot be combined with dp_shard, tp, pp or cp")
            if cfg.zero_stage not in (-1, 0):
                raise ConfigError(f"parallel.low_comm={cfg.low_comm} keeps full optimizer states per replica; "
                                  f"leave parallel.zero_stage at -1 or 0")
        if self.ep > 1:
            self._check_expert_parallel(cfg)
        if cfg.pp_schedule == "interleaved_1f1b" and self.pp > 1 and cfg.pp_virtual_stages < 2:
            raise ConfigError("parallel.pp_schedule=interleaved_1f1b needs parallel.pp_virtual_stages >= 2")
        if cfg.pp_schedule != "interleaved_1f1b" and cfg.pp_virtual_stages != 1:
            raise ConfigError(f"parallel.pp_virtual_stages={cfg.pp_virtual_stages} needs "
                              f"parallel.pp_schedule=interleaved_1f1b (gpipe and 1f1b run one stage per rank)")

    def _check_expert_parallel(self, cfg: ParallelConfig) -> None:
        """parallel.ep > 1: the layouts written and tested (parallel/expert.py), each refusal saying what runs."""
        if self.cp > 1:
            raise ConfigError(f"parallel.ep={self.ep} runs with data, tensor and pipeline parallelism (FSDP2, HSDP, "
                              f"DDP; parallel.tp, parallel.pp); context parallelism with experts is not written yet: "
                              f"set parallel.cp to 1")
        if self.dp_size == 1:
            raise ConfigError(f"parallel.ep={self.ep} splits the experts over data-parallel ranks, and there are none "
                              f"here; launch ep ranks or more under torchrun with parallel.dp_shard (or "
                              f"dp_replicate), or set parallel.ep=1")
        if self.dp_shard > 1 and self.dp_shard % self.ep:
            raise ConfigError(f"parallel.ep ({self.ep}) must divide parallel.dp_shard ({self.dp_shard}): the experts "
                              f"are split over ep of the FSDP2 ranks and sharded over the dp_shard / ep others")
        if self.dp_shard == 1 and self.ep != self.dp_replicate:
            raise ConfigError(f"parallel.ep ({self.ep}) must equal parallel.dp_replicate ({self.dp_replicate}) under "
                              f"DDP (experts replicated over DDP ranks are not reduced apart from the dense part); "
                              f"set parallel.ep={self.dp_replicate}, or shard with parallel.dp_shard")
        if self.zero_stage == 1 or cfg.low_comm != "none":
            raise ConfigError(f"parallel.ep={self.ep}: ZeroRedundancyOptimizer (zero_stage=1) and low_comm would "
                              f"broadcast or average experts that are not replicas; use FSDP2 (dp_shard) or plain "
                              f"DDP (dp_replicate, zero_stage 0)")
        if cfg.balance != "none":
            raise ConfigError(f"parallel.ep={self.ep}: parallel.balance={cfg.balance} gives ranks different numbers "
                              f"of micro-batches, and every forward's all-to-all needs every rank; set "
                              f"parallel.balance=none")

    def check_model(self, cfg: ParallelConfig, model: ModelConfig, seq_len: int, batch_size: int) -> None:
        """Divisibility the model and batch must satisfy for these degrees (vocab checked when known)."""
        check_expert_model(cfg, model)
        if self.tp > 1:
            for name, value in (("model.n_heads", model.n_heads), ("model.n_kv_heads", kv_heads(model)),
                                ("the SwiGLU hidden size", ffn_hidden_dim(model))):
                if value % self.tp:
                    raise ConfigError(f"{name} ({value}) must be divisible by parallel.tp ({self.tp})")
            if model.vocab_size and model.vocab_size % self.tp:
                raise ConfigError(f"model.vocab_size ({model.vocab_size}) must be divisible by parallel.tp "
                                  f"({self.tp}) for the vocabulary-parallel output; leave model.vocab_size = 0 "
                                  f"to pad the data's vocabulary automatically, or set it to a multiple of "
                                  f"{self.tp} that covers the tokenizer")
            if model.tie_embeddings:
                raise ConfigError("model.tie_embeddings is not supported with parallel.tp > 1 (the embedding is "
                                  "row-split and the output column-split)")
            if cfg.sequence_parallel and seq_len % self.tp:
                raise ConfigError(f"data.seq_len ({seq_len}) must be divisible by parallel.tp ({self.tp}) with "
                                  f"parallel.sequence_parallel")
        if self.pp > 1:
            stages = self.pp * cfg.pp_virtual_stages
            if model.n_layers % stages:
                raise ConfigError(f"model.n_layers ({model.n_layers}) must be divisible by the pipeline stages "
                                  f"parallel.pp x parallel.pp_virtual_stages = {stages}")
            if model.tie_embeddings:
                raise ConfigError("model.tie_embeddings is not supported with parallel.pp > 1 (the embedding and "
                                  "the output head live on different stages)")
            micro = self.pp_microbatches(cfg)
            if batch_size % micro:
                raise ConfigError(f"train.batch_size ({batch_size}) must be divisible by the pipeline "
                                  f"micro-batches ({micro}; parallel.pp_microbatches, 0 = 2 x pp)")
            if cfg.pp_schedule == "interleaved_1f1b" and micro % self.pp:
                raise ConfigError(f"interleaved_1f1b needs pipeline micro-batches ({micro}) divisible by "
                                  f"parallel.pp ({self.pp})")
            if micro < self.pp and cfg.pp_schedule != "gpipe":
                raise ConfigError(f"parallel.pp_schedule={cfg.pp_schedule} needs at least parallel.pp ({self.pp}) "
                                  f"micro-batches (got {micro})")
        if self.cp > 1:
            if seq_len % (2 * self.cp):
                raise ConfigError(f"data.seq_len ({seq_len}) must be divisible by 2 x parallel.cp ({2 * self.cp}) "
                                  f"for load-balanced context parallelism")
            if seq_len != model.max_seq_len:
                raise ConfigError(f"parallel.cp > 1 shards the rotary tables with the sequence: set model.max_seq_len "
                                  f"({model.max_seq_len}) equal to data.seq_len ({seq_len})")
            if any(is_sliding(model, i) for i in range(model.n_layers)) and model.sliding_window < seq_len:
                raise ConfigError(f"model.sliding_window ({model.sliding_window}) is shorter than data.seq_len "
                                  f"({seq_len}): context parallelism's ring attention takes no window mask; use "
                                  f"parallel.cp=1, or data.seq_len <= the window")

    # -- derived quantities -------------------------------------------------------------------------
    def pp_microbatches(self, cfg: ParallelConfig) -> int:
        return cfg.pp_microbatches or 2 * self.pp

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (the loader's world size)."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh's named dimensions (size > 1 only), outermost first."""
        sizes = dataclasses.asdict(self)
        return {name: sizes[name] for name in MESH_ORDER if sizes[name] > 1}

    def build_mesh(self, device_type: str):
        """The one DeviceMesh of the job (None for a single process). Needs the process group."""
        shape = self.mesh_shape
        if not shape:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
