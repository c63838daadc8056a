"""Distributed parity harness, run by tests/parallel/test_parallel_dist.py under torchrun (gloo on CPU; nccl with
--device cuda).

For each requested strategy it trains a tiny Llama for a few AdamW steps through ``parallelize`` and
``forward_backward`` (the trainer's own path), and on every rank also trains the single-process reference
on the same global batches from the same seed. Rank 0 writes one JSON record per strategy: the two loss
curves and their maximum relative difference. Several strategies share one process group so the whole
matrix costs one launch per world size. Any strategy name with the suffix ``_compile`` runs that strategy
with per-block ``torch.compile`` (``parallelize(..., compile=True)``, as ``train.compile`` does); with the
suffix ``_padded`` (before any ``_compile``) the data has 60 tokens in the model's 64 rows, as with a
vocabulary padded for the plan: the parallel loss masks the 4 padding columns (``vocab_limit``; under TP on
the vocabulary-sharded logits, where they lie in the last rank's shard) and the reference slices them off.

    torchrun --standalone --nproc-per-node 2 tests/helpers/dist_parity.py --out r.json --strategies ddp,fsdp3

On GPUs (one per rank, nccl; each rank takes GPU ``LOCAL_RANK``) add ``--device cuda``:

    torchrun --standalone --nproc-per-node 2 tests/helpers/dist_parity.py --device cuda --out r.json \\
        --strategies fsdp3,fsdp3_bf16,ddp_compile,fsdp3_compile,fsdp3_bf16_compile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters as dynamo_counters

from scaletrain.config import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from scaletrain.model import build_model
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.distributed import destroy_distributed, init_distributed
from scaletrain.train.optimizer import build_optimizer
from scaletrain.train.step import StepOptions, build_parallel_training, training_step

MODEL = ModelConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, ffn_hidden_dim=128, max_seq_len=32)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
SEQ, GLOBAL_BATCH, STEPS, SEED = 32, 8, 5, 1234

# name -> (ParallelConfig fields, grad_accum_steps)
STRATEGIES: dict[str, tuple[dict, int]] = {
    "ddp": (dict(dp_replicate=-1), 1),
    "ddp_accum2": (dict(dp_replicate=-1), 2),
    "zero1": (dict(dp_replicate=-1, zero_stage=1), 1),
    "fsdp2": (dict(dp_shard=-1, zero_stage=2), 1),
    "fsdp3": (dict(dp_shard=-1, zero_stage=3), 1),
    "fsdp3_accum2": (dict(dp_shard=-1, zero_stage=3), 2),
    "fsdp3_ac": (dict(dp_shard=-1, activation_checkpointing="selective", ac_every=2), 1),
    "tp": (dict(tp=2, sequence_parallel=False), 1),
    "tp_sp": (dict(tp=2, sequence_parallel=True), 1),
    "pp_gpipe": (dict(pp=2, pp_schedule="gpipe", pp_microbatches=4), 1),
    "pp_1f1b": (dict(pp=2, pp_schedule="1f1b", pp_microbatches=4), 1),
    "pp_interleaved": (dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_microbatches=4), 1),
    "pp_1f1b_accum2": (dict(pp=2, pp_schedule="1f1b", pp_microbatches=2), 2),
    "fsdp3_offload": (dict(dp_shard=-1, cpu_offload=True), 1),
    "fsdp3_bf16": (dict(dp_shard=-1, param_dtype="bf16"), 1),  # mixed precision: looser tolerance
    # 4 ranks
    "pp_tp": (dict(pp=2, tp=2, pp_schedule="1f1b", pp_microbatches=4), 1),
    "hsdp": (dict(dp_replicate=2, dp_shard=2), 1),
    "fsdp_tp": (dict(dp_shard=2, tp=2, sequence_parallel=True), 1),
    "fsdp_tp_nosp": (dict(dp_shard=2, tp=2, sequence_parallel=False), 1),
    "pp_fsdp": (dict(pp=2, dp_shard=2, pp_schedule="1f1b", pp_microbatches=2), 1),
    # 8 ranks: 3-D
    "pp_tp_fsdp": (dict(pp=2, tp=2, dp_shard=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
                        pp_microbatches=2), 1),
}

COMPILE_SUFFIX = "_compile"
# "X_chunked": X with the chunked loss (model/loss.py) at 24 positions a chunk (the tiny logits would not pass
# the automatic threshold): the model returns the loss, the head's weight gathered by FSDP2 inside its forward.
CHUNKED_SUFFIX = "_chunked"
CHUNK_ROWS = 24


def loss_rows_of(name: str) -> int:
    """train.loss_chunk_rows of a strategy name (the suffix is taken off before ``resolve``)."""
    return CHUNK_ROWS if name.endswith(CHUNKED_SUFFIX) else -1
PADDED_SUFFIX = "_padded"
MUON_SUFFIX = "_muon"  # optim.name = muon (train/muon.py), the reference too; before any _padded / _compile
MUON = dataclasses.replace(OPTIM, name="muon")
# The "tokenizer" of the _padded strategies: 60 tokens in 64 rows (with 63 the 5 x + 3 stream learns too
# little in 5 steps for the parity check's "it learns" condition).
PADDED_VOCAB = MODEL.vocab_size - 4


def resolve(name: str) -> tuple[dict, int, bool, int | None, OptimConfig]:
    """(ParallelConfig fields, grad_accum_steps, compile, vocab_limit, optimizer) of a strategy name; ``X_compile``
    is X compiled, ``X_padded`` is X on data with fewer tokens than the model's vocabulary (None: as many),
    ``X_muon`` is X with Muon + AdamW instead of AdamW."""
    compiled = name.endswith(COMPILE_SUFFIX)
    name = name.removesuffix(COMPILE_SUFFIX)
    vocab_limit = PADDED_VOCAB if name.endswith(PADDED_SUFFIX) else None
    name = name.removesuffix(PADDED_SUFFIX)
    optim = MUON if name.endswith(MUON_SUFFIX) else OPTIM
    fields, accum = STRATEGIES[name.removesuffix(MUON_SUFFIX)]
    return fields, accum, compiled, vocab_limit, optim


def batches(step: int, accum: int, vocab: int = MODEL.vocab_size) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of one optimizer step cut into ``accum`` micro-batches (identical on every rank).

    The batch is the same whatever ``accum`` is, so k micro-batches of b rows can be compared with one
    batch of k * b rows. The stream is learnable (next = 5 x + 3 mod V, with 10% noise) so the loss moves
    a lot in 5 steps and any difference in the updates shows in the losses. Tokens are below ``vocab``.
    """
    g = torch.Generator().manual_seed(SEED + step)
    tokens = torch.empty(GLOBAL_BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (GLOBAL_BATCH,), generator=g)
    for t in range(SEQ):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % vocab
    noise = torch.rand(GLOBAL_BATCH, SEQ + 1, generator=g) < 0.1
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.chunk(accum)]


def reference_losses(accum: int, device: torch.device | None = None, vocab_limit: int | None = None,
                     optim: OptimConfig = OPTIM) -> list[float]:
    """One process, the whole global batch per step (accumulated over the same micro-batches), eager.
    With ``vocab_limit`` the logits are sliced to it: what the parallel loss's -inf mask must equal."""
    device = device or torch.device("cpu")
    model = build_model(MODEL, device, seed=SEED)
    opt = build_optimizer(model, optim, device)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for inputs, targets in batches(step, accum, vocab_limit or MODEL.vocab_size):
            inputs, targets = inputs.to(device), targets.to(device)
            logits = model(inputs)[..., :vocab_limit]  # [..., :None] keeps every column
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) / accum
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def job(fields: dict, accum: int = 1, compile: bool = False, optim: OptimConfig = OPTIM,
        loss_rows: int = -1) -> JobConfig:
    """The tiny job of every strategy: only the [parallel] section, accumulation, compile, optimizer and the
    chunked loss differ."""
    return JobConfig(model=MODEL, optim=optim, parallel=ParallelConfig(**fields),
                     train=TrainConfig(seed=SEED, compile="true" if compile else "false", grad_accum_steps=accum,
                                       loss_chunk_rows=loss_rows))


def parallel_losses(fields: dict, accum: int, compile: bool, device: torch.device,
                    vocab_limit: int | None = None, optim: OptimConfig = OPTIM,
                    loss_rows: int = -1) -> tuple[list[float], dict]:
    """The trainer's own build and step (``build_parallel_training`` + ``training_step``) for one strategy."""
    cfg = job(fields, accum, compile, optim, loss_rows)
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    local_batch = GLOBAL_BATCH // accum // dims.dp_size
    dims.check_model(cfg.parallel, MODEL, SEQ, local_batch)
    pm, opt = build_parallel_training(cfg, dims, device, vocab_limit=vocab_limit)
    lo = pm.dp_rank * local_batch  # this data-parallel rank's slice of each global micro-batch
    frames_before = dynamo_counters["frames"]["ok"]
    losses, t0 = [], time.perf_counter()
    for step in range(STEPS):
        micro = ((x[lo:lo + local_batch].to(device), y[lo:lo + local_batch].to(device), None)
                 for x, y in batches(step, accum, vocab_limit or MODEL.vocab_size))
        losses.append(training_step(pm, opt, micro, accum, StepOptions(grad_clip=OPTIM.grad_clip)).loss)
    return losses, {"dims": dataclasses.asdict(dims), "seconds": time.perf_counter() - t0,
                    "all_reduce_calls": pm.comm.all_reduce_calls,
                    "muon_gathered_bytes": getattr(opt, "gathered_bytes", 0),  # FSDP2 + Muon's all-gathers
                    # frames torch.compile compiled during this run: 0 would mean the eager path ran
                    "compiled_frames": dynamo_counters["frames"]["ok"] - frames_before}


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def memory_record(name: str, device: torch.device) -> dict:
    """Per-rank bytes of parameters (at rest and held between forward and backward), gradients and AdamW
    moments (exp_avg + exp_avg_sq) for one strategy, after one training step."""
    fields, _ = STRATEGIES[name]
    cfg = job(fields)
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    pm, opt = build_parallel_training(cfg, dims, device)
    module, wrapper = pm.modules[0], pm.parts[0]
    local = GLOBAL_BATCH // dims.dp_size
    inputs, targets = batches(0, 1)[0]
    inputs, targets = inputs[pm.dp_rank * local:][:local].to(device), targets[pm.dp_rank * local:][:local].to(device)
    params_at_rest = _local_bytes(module.parameters())
    loss = torch.nn.functional.cross_entropy(wrapper(inputs).flatten(0, 1), targets.flatten())
    # FSDP2 swaps the registered parameters to the gathered (unsharded) ones while they are held.
    params_in_step = _local_bytes(module.parameters())
    loss.backward()
    grads = _local_bytes(p.grad for p in module.parameters() if p.grad is not None)
    opt.step()
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's AdamW in .optim
    states = _local_bytes(v for st in inner.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq"))
    full_params = sum(p.numel() for p in build_model(MODEL, "cpu", seed=SEED).parameters())
    largest = max(p.numel() for p in build_model(MODEL, "cpu", seed=SEED).parameters())
    return {"strategy": name, "zero_stage": dims.zero_stage, "rank": dist.get_rank(), "world_size": dims.world_size,
            "num_params": full_params, "largest_param": largest, "params_at_rest": params_at_rest,
            "params_in_step": params_in_step, "grads": grads, "optimizer_states": states}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", default="")
    parser.add_argument("--memory", default="", help="strategies to measure per-rank bytes for")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: gloo; cuda: nccl, one GPU per rank (GPU LOCAL_RANK)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = init_distributed(args.device)  # the trainer's own set-up: gloo on CPU, nccl + set_device on CUDA
    device, rank = env.device, env.rank
    records, ref_cache = [], {}
    for name in filter(None, args.memory.split(",")):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, memory_record(name, device))
        records.extend({"kind": "memory", **r} for r in gathered)
        if rank == 0:
            print(f"{name:>16}: memory " + " | ".join(f"rank {r['rank']}: P {r['params_at_rest']}/"
                  f"{r['params_in_step']} G {r['grads']} O {r['optimizer_states']}" for r in gathered), flush=True)
    for name in filter(None, args.strategies.split(",")):
        fields, accum, compiled, vocab_limit, optim = resolve(name.removesuffix(CHUNKED_SUFFIX))
        key = (vocab_limit, optim.name)
        if key not in ref_cache:  # always one eager process and one batch of k * b rows, whatever k is
            ref_cache[key] = reference_losses(1, device, vocab_limit, optim)
        ref = ref_cache[key]
        losses, info = parallel_losses(fields, accum, compiled, device, vocab_limit, optim, loss_rows_of(name))
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        records.append({"kind": "parity", "strategy": name, "world_size": dist.get_world_size(),
                        "grad_accum_steps": accum, "vocab_limit": vocab_limit,
                        "compile": compiled, "optimizer": optim.name, "device": device.type, "reference": ref,
                        "parallel": losses,
                        "max_rel_diff": rel, **info})
        if rank == 0:
            print(f"{name:>16}: max rel diff {rel:.2e}  ({info['seconds']:.1f} s)", flush=True)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(records, fh, indent=1)
    destroy_distributed(env)  # barrier, then destroy
    return 0


if __name__ == "__main__":
    sys.exit(main())
