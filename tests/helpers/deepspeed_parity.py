"""DeepSpeed vs native parity harness, run by tests/train/test_deepspeed.py under torchrun (gloo, 2 CPU ranks).

For each strategy it trains a tiny Llama for a few AdamW steps (2 micro-batches accumulated per step, gradient
clipping on) on the same global batches from the same seed: the native engine's ZeRO-1
(ZeroRedundancyOptimizer over DDP, through ``build_parallel_training`` / ``training_step``) and DeepSpeed's
ZeRO-1/2/3 (through ``build_deepspeed_training`` / ``deepspeed_training_step``, the DeepSpeed engine's own
path). Rank 0 writes one JSON record: the loss curves, and per rank the model-state bytes each DeepSpeed stage
holds next to the planner's prediction (``plan/memory.py:model_states``).

    torchrun --standalone --nproc-per-node 2 tests/helpers/deepspeed_parity.py --out r.json \\
        --strategies native,ds1,ds2,ds3,ds2_cpu,ds2_bf16,ds3_bf16,ds3_nvme --nvme /tmp/swap
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist

from scaletrain.config import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from scaletrain.model.presets import num_params
from scaletrain.parallel.distributed import destroy_distributed, init_distributed
from scaletrain.plan.memory import RECIPES, model_states
from scaletrain.train.deepspeed_engine.engine import build_deepspeed_training, deepspeed_training_step
from scaletrain.train.step import StepOptions, build_parallel_training, training_step
from scaletrain.train.validate import check_runnable

MODEL = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=128, max_seq_len=32)
SEQ, ROWS, ACCUM = 32, 2, 2  # rows per rank per micro-batch


def job(strategy: str, nvme: str = "") -> JobConfig:
    cfg = JobConfig(model=MODEL, optim=OptimConfig(lr=3e-3, grad_clip=0.5),
                    train=TrainConfig(batch_size=ROWS, grad_accum_steps=ACCUM, precision="fp32", seed=11),
                    parallel=ParallelConfig(dp_replicate=-1, zero_stage=1))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=SEQ))
    if strategy.startswith("ds"):  # ds<stage>[_cpu|_bf16]: DeepSpeed ZeRO-<stage>, optimizer state offloaded to the
        # CPU, or DeepSpeed's bf16 (module in bf16, fp32 master partitions)
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(engine="deepspeed", zero_stage=stage_of(strategy)))
        if strategy.endswith("_cpu"):
            cfg = dataclasses.replace(cfg, deepspeed=dataclasses.replace(cfg.deepspeed, offload_optimizer="cpu"))
        if strategy.endswith("_nvme"):  # ZeRO-Infinity: optimizer state and parameters swapped to a folder
            cfg = dataclasses.replace(cfg, deepspeed=dataclasses.replace(
                cfg.deepspeed, offload_optimizer="nvme", offload_param="nvme", nvme_path=nvme))
    return cfg


def stage_of(strategy: str) -> int:
    return int(strategy[2:].split("_")[0])


def batches(step: int, rank: int, world: int):
    """The global batch of ``step`` (world x ROWS rows per micro-batch), this rank's rows, as the loader does.
    Two batches alternate, so the loss falls visibly when the updates happen."""
    gen = torch.Generator().manual_seed(1000 + step % 2)
    for _ in range(ACCUM):
        tokens = torch.randint(0, MODEL.vocab_size, (world * ROWS, SEQ + 1), generator=gen)
        mine = tokens[rank * ROWS:(rank + 1) * ROWS]
        yield mine[:, :-1], mine[:, 1:], None


def model_state_bytes(pm, optimizer, stage: int) -> dict[str, int]:
    """This rank's bytes of params, fp32 master copies and Adam moments under DeepSpeed."""
    module = pm.parts[0].module
    params = sum((p.ds_tensor if stage == 3 else p).numel() * 4 for p in module.parameters())
    base = getattr(optimizer, "optimizer", optimizer)
    moments = sum(t.numel() * t.element_size() for s in base.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None) or \
        getattr(optimizer, "fp32_partitioned_groups_flat", None) or []
    return {"params": params, "master": sum(t.numel() * 4 for t in masters), "optimizer": moments}


def run(strategy: str, steps: int, env, nvme: str = "") -> dict:
    cfg = job(strategy, f"{nvme}/rank{env.rank}")
    precision = "bf16" if strategy.endswith("_bf16") else "fp32"
    dims = check_runnable(cfg, env.world_size, "cpu", precision)
    if strategy == "native":
        pm, optimizer = build_parallel_training(cfg, dims, env.device)
        step_fn = training_step
    else:
        pm, optimizer, _ = build_deepspeed_training(cfg, dims, env.device, precision)
        step_fn = deepspeed_training_step
    losses = []
    for step in range(steps):
        result = step_fn(pm, optimizer, batches(step, env.rank, env.world_size), ACCUM,
                         StepOptions(grad_clip=cfg.optim.grad_clip))
        losses.append(result.loss)
    weights = pm.parts[0].module if strategy != "native" else pm.modules[0]
    with torch.no_grad():  # ZeRO-3 holds partitions: the plain sum of one rank's view is not comparable
        first = next(iter(weights.parameters()))
        checksum = float(first.ds_tensor.double().sum()) if hasattr(first, "ds_tensor") else float(first.double().sum())
    record = {"strategy": strategy, "losses": losses, "first_param_sum": checksum,
              "param_dtypes": sorted({str(p.dtype) for p in weights.parameters()})}
    # Offloaded moments live in DeepSpeedCPUAdam or on disk; bf16 is another recipe.
    if strategy != "native" and not strategy.endswith(("_cpu", "_bf16", "_nvme")):
        stage = stage_of(strategy)
        measured = model_state_bytes(pm, optimizer, stage)
        predicted = model_states(num_params(MODEL), stage, env.world_size, RECIPES["deepspeed-fp32"])
        every = [None] * env.world_size
        dist.all_gather_object(every, measured)
        record |= {"measured_bytes_per_rank": every, "planner_bytes_per_rank": predicted}
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategies", default="native,ds1,ds2,ds3,ds2_cpu,ds2_bf16,ds3_bf16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--nvme", default="", help="the folder ds3_nvme swaps to")
    args = p.parse_args()
    env = init_distributed("cpu")
    records = []
    for strategy in args.strategies.split(","):
        # One line per strategy on stderr, flushed: a run the test stops at its ceiling then says which strategy
        # it was in and how long each before it took (the first DeepSpeedCPUAdam use compiles its op, ~1 min).
        started = time.perf_counter()
        print(f"parity: rank {env.rank} {strategy} started", file=sys.stderr, flush=True)
        records.append(run(strategy, args.steps, env, args.nvme) | {"seconds": time.perf_counter() - started})
        print(f"parity: rank {env.rank} {strategy} done in {records[-1]['seconds']:.1f} s", file=sys.stderr,
              flush=True)
    if env.rank == 0:
        with open(args.out, "w") as fh:
            json.dump(records, fh, indent=1)
    destroy_distributed(env)


if __name__ == "__main__":
    main()
