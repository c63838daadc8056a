"""Auxiliary loss terms under every engine, run by tests/train/test_loss.py under torchrun (gloo, 2 CPU ranks).

A test-only term, as an MoE router leaves one (train/loss.py's ``auxiliary_loss`` channel): WEIGHT x the mean
square of a block's output, left by blocks 0 and 3 under one name and by block 1 under another. Each strategy
trains a tiny Llama for a few AdamW steps and is compared, step by step, with the plain path (one process,
``build_parallel_training`` + ``training_step``) on the same global batches with the same terms:

- ``pp_*``: 2 pipeline stages (4 with interleaving), so terms are left on a stage before the last (which torch's
  schedule backpropagates from its output's gradient only) and on the last one. Compared: the step's loss, the
  logged terms (summed over the pipeline), every parameter's gradient on the rank that holds it, and the
  evaluation loss (terms dropped).
- ``ds<stage>``: DeepSpeed ZeRO-<stage> over 2 data-parallel ranks against the native engine's DDP on the same
  rows: the step's loss, gradient norm and (this rank's) logged terms.

Rank 0 writes one JSON record per strategy.

    torchrun --standalone --nproc-per-node 2 tests/helpers/auxiliary_parity.py --out r.json \\
        --strategies pp_1f1b,pp_gpipe,pp_interleaved,pp_1f1b_accum2,ds2,ds3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from scaletrain.config import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.distributed import destroy_distributed, init_distributed
from scaletrain.train.loss import AUXILIARY, forward_loss
from scaletrain.train.step import StepOptions, build_parallel_training, training_step

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_hidden_dim=64, max_seq_len=16)
OPTIM = OptimConfig(lr=1e-2, grad_clip=0.0)  # no clipping: the gradient norm is compared as it is
SEQ, GLOBAL_BATCH, STEPS, SEED = 16, 8, 3, 7
WEIGHT = 10.0
TERMS = {"0": "balance", "3": "balance", "1": "router_z"}  # block -> the name of the term it leaves
PIPELINES = {"pp_1f1b": (dict(pp=2, pp_schedule="1f1b", pp_microbatches=4), 1),
             "pp_gpipe": (dict(pp=2, pp_schedule="gpipe", pp_microbatches=2), 1),
             "pp_interleaved": (dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
                                     pp_microbatches=4), 1),
             "pp_1f1b_accum2": (dict(pp=2, pp_schedule="1f1b", pp_microbatches=2), 2)}


def leave_terms(modules: list[torch.nn.Module], weight: float = WEIGHT) -> None:
    """Forward hooks that leave TERMS on the blocks these modules (one rank's stages, or the whole model) hold."""
    for module in modules:
        for block, name in TERMS.items():
            if block in module.layers:
                def leave(mod, _inputs, output, name=name):
                    mod.__dict__[AUXILIARY] = {name: weight * output.float().pow(2).mean()}

                module.layers[block].register_forward_hook(leave)


def batches(step: int, accum: int, rows: slice = slice(None)):
    """The global batch of ``step`` cut into ``accum`` micro-batches (``rows``: a data-parallel rank's share)."""
    gen = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    return [(chunk[rows, :-1], chunk[rows, 1:], None) for chunk in tokens.chunk(accum)]


def job(fields: dict, accum: int) -> JobConfig:
    cfg = JobConfig(model=MODEL, optim=OPTIM, parallel=ParallelConfig(**fields),
                    train=TrainConfig(seed=SEED, precision="fp32", grad_accum_steps=accum))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=SEQ))


def train(pm, optimizer, step_fn, modules, accum: int, rows: slice = slice(None)) -> tuple[list[dict], float | None]:
    """STEPS steps; per step the loss, gradient norm, logged terms and the gradients (by parameter name) the
    update used. After the first step, an evaluation of the next batch (its loss: None on pipeline ranks without
    the last stage): with the pipeline, the switch makes torch's schedule infer its stages' shapes again."""
    records, evaluated = [], None
    for step in range(STEPS):
        if step == 1:
            inputs, targets, _ = batches(STEPS, 1, rows)[0]
            with torch.no_grad():
                loss = forward_loss(pm, inputs, targets)
            evaluated = None if loss is None else float(loss)
        grads: dict[str, torch.Tensor] = {}

        def keep_grads(loss: float, grad_norm: float) -> bool:
            grads.update({name: p.grad.clone() for m in modules for name, p in m.named_parameters()
                          if p.grad is not None})
            return True

        result = step_fn(pm, optimizer, iter(batches(step, accum, rows)), accum,
                         StepOptions(grad_clip=OPTIM.grad_clip, before_update=keep_grads))
        records.append({"loss": result.loss, "grad_norm": result.grad_norm, "auxiliary": result.auxiliary,
                        "grads": grads})
    return records, evaluated


def plain(accum: int, weight: float = WEIGHT) -> tuple[list[dict], float]:
    """The plain path in one process: ``train``'s steps and evaluation."""
    cfg = job({}, accum)
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(cfg.parallel, 1), torch.device("cpu"))
    leave_terms(pm.modules, weight)
    return train(pm, optimizer, training_step, pm.modules, accum)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(got: list[dict], want: list[dict], grads: bool) -> dict:
    """Maximum relative differences over the steps (gradients: over this rank's parameters)."""
    out = {"loss": max(rel(g["loss"], w["loss"]) for g, w in zip(got, want)),
           "grad_norm": max(rel(g["grad_norm"], w["grad_norm"]) for g, w in zip(got, want)),
           "auxiliary": max(rel(g["auxiliary"].get(k, 0.0), w["auxiliary"][k]) for g, w in zip(got, want)
                            for k in w["auxiliary"]),
           "auxiliary_names": sorted(got[0]["auxiliary"]), "losses": [g["loss"] for g in got]}
    if grads:
        out["grad_params"] = sorted(got[0]["grads"])
        out["grads"] = max(float((g["grads"][n] - w["grads"][n]).abs().max() / w["grads"][n].abs().max())
                           for g, w in zip(got, want) for n in g["grads"])
    return out


def pipeline(name: str) -> dict:
    fields, accum = PIPELINES[name]
    cfg = job(fields, accum)
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    pm, optimizer = build_parallel_training(cfg, dims, torch.device("cpu"))
    leave_terms(pm.modules)
    got, evaluated = train(pm, optimizer, training_step, pm.modules, accum)
    want, want_eval = plain(accum)
    without, _ = plain(accum, weight=0.0)
    record = compare(got, want, grads=True)
    # How much the terms move the gradients: a parity that ignored them would miss by this much.
    record["terms_move_grads"] = max(float((w["grads"][n] - o["grads"][n]).abs().max() / o["grads"][n].abs().max())
                                     for w, o in zip(want, without) for n in w["grads"])
    record["reference_auxiliary"] = want[0]["auxiliary"]
    if evaluated is not None:  # the rank holding the last stage
        record["eval"] = rel(evaluated, want_eval)
    return record


def deepspeed(name: str) -> dict:
    """ZeRO-<stage> over 2 data-parallel ranks vs the native engine's DDP, each rank on its own rows."""
    from scaletrain.train.deepspeed_engine.engine import build_deepspeed_training, deepspeed_training_step
    from scaletrain.train.validate import check_runnable

    rank, world, accum = dist.get_rank(), dist.get_world_size(), 2
    per_rank = GLOBAL_BATCH // accum // world  # rows of each micro-batch
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    results = {}
    for engine in ("native", "deepspeed"):
        fields = dict(dp_replicate=-1) if engine == "native" else dict(engine="deepspeed", zero_stage=int(name[2:]))
        cfg = job(fields, accum)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=per_rank))
        dims = check_runnable(cfg, world, "cpu", "fp32")
        if engine == "native":
            pm, optimizer = build_parallel_training(cfg, dims, torch.device("cpu"))
            modules, step_fn = pm.modules, training_step
        else:
            pm, optimizer, _ = build_deepspeed_training(cfg, dims, torch.device("cpu"), "fp32")
            modules, step_fn = [pm.parts[0].module], deepspeed_training_step
        leave_terms(modules)
        results[engine] = train(pm, optimizer, step_fn, modules, accum, rows)
    (got, got_eval), (want, want_eval) = results["deepspeed"], results["native"]
    return {**compare(got, want, grads=False), "eval": rel(got_eval, want_eval)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", default=",".join(PIPELINES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    records = []
    for name in filter(None, args.strategies.split(",")):
        record = pipeline(name) if name in PIPELINES else deepspeed(name)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, record)
        records.append({"strategy": name, "ranks": every})
        if env.rank == 0:
            print(f"{name}: {every}", flush=True)
    if env.rank == 0:
        with open(args.out, "w") as fh:
            json.dump(records, fh, indent=1)
    destroy_distributed(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
