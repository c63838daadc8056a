"""Expert parallelism parity, run by tests/parallel/test_expert_parallel.py under torchrun (gloo, 2 CPU ranks).

Each strategy trains a tiny mixture of experts (4 experts, top-2, every balancing method on: the Switch balance
loss, the router z-loss and the expert bias) for STEPS AdamW steps through the trainer's own build and step
(``build_parallel_training`` + ``training_step``), each data-parallel rank on its rows of the global batch, and
compares with one process (the same build, world size 1) that takes the same rows as micro-batches: rank r's rows
are its micro-batch r, so the balance loss, computed on each forward's tokens, is the same sum in both, and the
bias counts summed over the ranks are the one process's counts over its micro-batches. Recorded: both loss
curves, the expert bias each rank ends with (every rank must move the same one), the logged tokens per expert
(summed over the ranks) and this rank's share of the expert weights.

    torchrun --standalone --nproc-per-node 2 tests/helpers/ep_parity.py --out r.json --strategies ep2_fsdp,ep2_ddp
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist
from dist_parity import GLOBAL_BATCH, batches  # this folder is the script's sys.path[0] under torchrun
from torch._dynamo.utils import counters as dynamo_counters
from torch.distributed.tensor import DTensor

from scaletrain.config import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from scaletrain.model.moe import expert_load, moe_layers
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.distributed import destroy_distributed, init_distributed
from scaletrain.train.step import StepOptions, build_parallel_training, training_step

MODEL = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=128, max_seq_len=32, moe_experts=4,
                    moe_top_k=2, moe_hidden_dim=64, moe_balance_coef=0.05, moe_z_loss_coef=1e-3, moe_bias_rate=0.01)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
STEPS, SEED = 10, 1234

# name -> (ParallelConfig fields, grad_accum_steps)
STRATEGIES: dict[str, tuple[dict, int]] = {
    "ep2_fsdp": (dict(dp_shard=2, ep=2), 1),
    "ep2_fsdp2": (dict(dp_shard=2, zero_stage=2, ep=2), 1),
    "ep2_fsdp_accum2": (dict(dp_shard=2, ep=2), 2),
    "ep2_ddp": (dict(dp_replicate=2, ep=2), 1),
    "ep2_fsdp_ac": (dict(dp_shard=2, ep=2, activation_checkpointing="full"), 1),  # the forward's all-to-all again
    "ep2_fsdp_compile": (dict(dp_shard=2, ep=2, compile="true"), 1),
    "moe_fsdp": (dict(dp_shard=2), 1),
    # 4 ranks: each expert on one of 2 ranks and sharded by FSDP2 over the 2 others
    "ep2_fsdp4": (dict(dp_shard=4, ep=2), 1),
    "ep4_fsdp4": (dict(dp_shard=4, ep=4), 1),  # data parallel, every expert on every rank (FSDP2 shards them)
    # HSDP: the experts split over the 2 ranks of each dp_shard group, their gradients all-reduced over the 2 replicas
    "ep2_hsdp": (dict(dp_replicate=2, dp_shard=2, ep=2), 1),
    "moe_ddp": (dict(dp_replicate=2), 1),
    # 4 ranks, FSDP2 x TP (2 x 2): each tp pair routes the same rows, the experts split over ep = dp_shard and each
    # expert's hidden units over tp; the dispatch among the ranks of one tp coordinate
    "ep2_tp2": (dict(dp_shard=2, tp=2, ep=2, sequence_parallel=False), 1),
    # 8 ranks (by hand): dp_shard 4 x tp 2, each (ep, tp) expert FSDP2-sharded over the other 2 of its tp coordinate
    "ep2_fsdp4_tp2": (dict(dp_shard=4, tp=2, ep=2, sequence_parallel=False), 1),
    # 4 ranks (by hand): ep2_tp2 with full activation checkpointing (the recomputation's all-to-alls and tp
    # all-reduces again) and with 2 micro-batches
    "ep2_tp2_ac": (dict(dp_shard=2, tp=2, ep=2, sequence_parallel=False, activation_checkpointing="full"), 1),
    "ep2_tp2_accum2": (dict(dp_shard=2, tp=2, ep=2, sequence_parallel=False), 2),
    # 8 ranks (by hand): HSDP x TP (2 x 2 x 2), the counts summed over the 4 data-parallel ranks of a tp coordinate
    "moe_hsdp_tp2": (dict(dp_replicate=2, dp_shard=2, tp=2, sequence_parallel=False), 1),
    "ep2_hsdp_tp2": (dict(dp_replicate=2, dp_shard=2, tp=2, ep=2, sequence_parallel=False), 1),
    "ep2_hsdp_tp2_sp": (dict(dp_replicate=2, dp_shard=2, tp=2, ep=2), 1),  # the same with sequence parallelism
    # 2 ranks, TP with sequence parallelism (the default): the sparse feed-forward all-gathers its sequence shard,
    # routes the replicated tokens, and cuts its output back to the shard; with shared experts, and with full
    # activation checkpointing (the recomputation's all-gather again)
    "moe_tp2_sp": (dict(tp=2), 1),
    "moe_tp2_sp_shared": (dict(tp=2, moe_shared_experts=1), 1),
    "moe_tp2_sp_ac": (dict(tp=2, activation_checkpointing="full"), 1),
    # 4 ranks: ep2_tp2 with sequence parallelism
    "ep2_tp2_sp": (dict(dp_shard=2, tp=2, ep=2), 1),
    # per-block torch.compile with the experts' tensor parallelism: 2 ranks tp=2; 4 ranks (by hand) beside ep=2
    "moe_tp2_compile": (dict(tp=2, sequence_parallel=False, compile="true"), 1),
    "ep2_tp2_compile": (dict(dp_shard=2, tp=2, ep=2, sequence_parallel=False, compile="true"), 1),
    "moe_tp2_sp_compile": (dict(tp=2, compile="true"), 1),  # ... with sequence parallelism (2 ranks)
}
# fields of STRATEGIES that are the model's (ModelConfig), not ParallelConfig's; the one process builds the same model
MODEL_FIELDS = ("moe_shared_experts",)


def job(fields: dict, accum: int) -> JobConfig:
    fields = dict(fields)
    compile = fields.pop("compile", "false")
    model = dataclasses.replace(MODEL, **{k: fields.pop(k) for k in MODEL_FIELDS if k in fields})
    return JobConfig(model=model, optim=OPTIM, parallel=ParallelConfig(**fields),
                     train=TrainConfig(seed=SEED, compile=compile, precision="fp32", grad_accum_steps=accum))


def train(fields: dict, accum: int, world: int, dp_size: int) -> dict:
    """STEPS steps of the job on ``world`` ranks (1: one process), each of the ``dp_size`` data-parallel ranks
    taking its rows of each of the ``accum`` micro-batches (one process: every micro-batch and every rank's rows,
    as ``accum * dp_size`` micro-batches; a tensor-parallel group, the same rows). ``seconds``: the STEPS steps'
    wall time."""
    cfg = job(fields, accum)
    dims = ParallelDims.from_config(cfg.parallel, world)
    pm, optimizer = build_parallel_training(cfg, dims, torch.device("cpu"))
    rank = pm.dp_rank
    micro_per_step = accum if world > 1 else accum * dp_size
    rows = GLOBAL_BATCH // (accum * dp_size)
    frames_before = dynamo_counters["frames"]["ok"]
    losses, start = [], time.perf_counter()
    for step in range(STEPS):
        pieces = batches(step, accum * dp_size)  # micro-batch i of rank r: piece i * dp_size + r
        mine = pieces[rank::dp_size] if world > 1 else pieces
        assert all(len(x) == rows for x, _ in mine)
        micro = ((x, y, None) for x, y in mine)
        losses.append(training_step(pm, optimizer, micro, micro_per_step, StepOptions(grad_clip=OPTIM.grad_clip)).loss)
    seconds = time.perf_counter() - start
    pm.sum_expert_counts("tokens_since_log", "dropped_since_log")  # as the trainer does before logging the load
    load = expert_load(pm.modules)
    biases = {layer: module.expert_bias.tolist() for layer, module in moe_layers(pm.modules[0])}
    expert_weights = [p for _, m in moe_layers(pm.modules[0]) for p in m.experts.parameters()]
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in expert_weights)
    return {"losses": losses, "seconds": seconds, "compiled_frames": dynamo_counters["frames"]["ok"] - frames_before,
            "load": {k: v for k, v in load.items() if k.startswith("moe_tokens_per_expert/")}, "bias": biases,
            "expert_numel_local": local, "expert_numel": sum(p.numel() for p in expert_weights)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    rank, world = env.rank, dist.get_world_size()
    records, references = [], {}
    for name in args.strategies.split(","):
        fields, accum = STRATEGIES[name]
        dp_size = ParallelDims.from_config(job(fields, accum).parallel, world).dp_size
        model = {k: v for k, v in fields.items() if k in MODEL_FIELDS}
        key = (accum, dp_size, tuple(sorted(model.items())))
        if key not in references:
            references[key] = train(model, accum, 1, dp_size)
        ref = references[key]
        got = train(fields, accum, world, dp_size)
        gathered = [None] * world
        dist.all_gather_object(gathered, {"bias": got["bias"], "expert_numel_local": got["expert_numel_local"]})
        rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        records.append({"strategy": name, "reference": ref["losses"], "parallel": got["losses"], "max_rel_diff": rel,
                        "load": got["load"], "reference_load": ref["load"], "reference_bias": ref["bias"],
                        "rank_bias": [g["bias"] for g in gathered],
                        "rank_expert_numel": [g["expert_numel_local"] for g in gathered],
                        "expert_numel": got["expert_numel"], "seconds": got["seconds"],
                        "reference_seconds": ref["seconds"], "compiled_frames": got["compiled_frames"]})
        if rank == 0:
            print(f"{name:>16}: max rel diff {rel:.2e}", flush=True)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(records, fh, indent=1)
    destroy_distributed(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
