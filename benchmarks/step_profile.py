"""Where one training step's time goes, dense vs structured-pruned (the model of benchmarks/compress.py), and
what two per-step costs of our own step used to be: AdamW's foreach kernel and glibc re-faulting freed memory.

    python benchmarks/step_profile.py [--rounds 16] [--out benchmarks/results/step_profile.json]

The models: dim 256, 4 blocks, 8 heads, SwiGLU 704, vocab 2048 (4.26M parameters), and the same with 25% of
the SwiGLU neurons (528) and 25% of the heads (6, width 32) removed, as ``scaletrain compress --mlp-fraction
0.25 --head-fraction 0.25`` writes it; batch 8 x 128 tokens, fp32, 1 thread, random tokens (the time does not
depend on the values). Each step is the trainer's (``build_parallel_training`` and the ops of
``training_step``: forward, cross-entropy, backward, clip 1.0, AdamW, zero_grad) split into phases by this
thread's CPU time (``time.thread_time``: on this shared machine the wall time mostly measures the other users'
processes), the backward split where the gradient reaches the final norm's input and the embedding's output
(tensor hooks). Dense and pruned alternate step by step (the order reversed every other round); medians.

Also measured, in the same way: AdamW ``foreach`` (the CPU default before) vs ``fused`` over the dense model's
parameters, and the page faults and CPU time of a dense step with glibc's default malloc thresholds (a child
process where ``keep_freed_memory`` is not applied) vs the step as built now.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

B, T = 8, 128
PHASES = ("forward: embedding", "forward: blocks", "forward: final norm + head", "forward: cross-entropy",
          "backward: cross-entropy + head + final norm", "backward: blocks", "backward: embedding",
          "clip", "AdamW", "zero_grad")


def models():
    from scaletrain.model.config import ModelConfig

    dense = ModelConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=8, ffn_hidden_dim=704,
                        max_seq_len=T)
    return {"dense": dense, "pruned": dataclasses.replace(dense, n_heads=6, n_kv_heads=6, head_dim=32,
                                                          ffn_hidden_dim=528)}


def build(cfg, implementation: str = "auto"):
    import torch

    from scaletrain.config import JobConfig, OptimConfig, TrainConfig
    from scaletrain.parallel import ParallelDims
    from scaletrain.train.step import build_parallel_training

    job = JobConfig(model=cfg, optim=OptimConfig(implementation=implementation), train=TrainConfig(seed=0))
    pm, opt = build_parallel_training(job, ParallelDims.from_config(job.parallel, 1), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    return pm.modules[0], opt, torch.randint(0, 2048, (B, T), generator=gen), torch.randint(0, 2048, (B, T),
                                                                                               generator=gen)


def step(model, opt, x, y) -> dict[str, float]:
    """One training step (the ops of ``training_step``, single process), CPU ms per phase, plus wall and faults."""
    import torch
    import torch.nn.functional as F
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    clk = time.thread_time
    faults0, wall0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    t = [clk()]
    h0 = model.tok_embeddings(x)
    t.append(clk())
    h = h0
    for layer in model.layers.values():
        h = layer(h, model.rope_cos[:T], model.rope_sin[:T])
    t.append(clk())
    logits = model.output(model.norm(h))
    t.append(clk())
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    t.append(clk())
    reached = {}
    h.register_hook(lambda g: reached.setdefault("h", clk()) and None)
    h0.register_hook(lambda g: reached.setdefault("h0", clk()) and None)
    loss.backward()
    t.append(clk())
    params = list(model.parameters())
    clip_grads_with_norm_(params, 1.0, get_total_norm([p.grad for p in params], 2.0, foreach=True), foreach=True)
    t.append(clk())
    opt.step()
    t.append(clk())
    opt.zero_grad(set_to_none=True)
    t.append(clk())
    ms = [1000 * v for v in (t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3], reached["h"] - t[4],
                             reached["h0"] - reached["h"], t[5] - reached["h0"], t[6] - t[5], t[7] - t[6],
                             t[8] - t[7])]
    out = dict(zip(PHASES, ms))
    out["cpu total"] = 1000 * (t[8] - t[0])
    out["wall total"] = 1000 * (time.perf_counter() - wall0)
    out["page faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    del torch
    return out


def medians(records: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in records), 3) for k in records[0]}


def child(mode: str, rounds: int) -> None:
    """A dense step in a fresh process, with glibc's default malloc thresholds ("default") or as built now."""
    import torch

    import scaletrain.train.step as step_module

    torch.set_num_threads(1)
    if mode == "default":
        step_module.keep_freed_memory = lambda: False
    parts = build(models()["dense"])
    records = [step(*parts) for _ in range(rounds + 2)][2:]
    print(json.dumps(medians(records)))


def optimizer_kernels(rounds: int) -> dict:
    import torch

    from scaletrain.model import build_model
    from scaletrain.train.optimizer import param_groups

    model = build_model(models()["dense"], seed=0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = {kind: torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, **{kind: True}) for kind in ("foreach", "fused")}
    ms = {kind: [] for kind in opts}
    for r in range(rounds + 2):
        for kind, opt in (opts.items() if r % 2 == 0 else list(opts.items())[::-1]):
            c = time.thread_time()
            opt.step()
            ms[kind].append(1000 * (time.thread_time() - c))
    return {kind: round(statistics.median(v[2:]), 3) for kind, v in ms.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16, help="steps per model (medians reported)")
    parser.add_argument("--out", default=default_out("step_profile.json"),
                        help=OUT_HELP.format(name="step_profile.json"))
    parser.add_argument("--child", choices=("default", "kept"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rounds)
        return 0
    import torch

    from scaletrain.model.presets import matmul_params

    torch.set_num_threads(1)
    built = {name: build(cfg) for name, cfg in models().items()}
    records = {name: [] for name in built}
    for r in range(args.rounds + 2):  # the first two steps of each are warm-up
        for name in (("dense", "pruned") if r % 2 == 0 else ("pruned", "dense")):
            records[name].append(step(*built[name]))
    phases = {name: medians(rs[2:]) for name, rs in records.items()}
    fixed = [p for p in PHASES if "head" in p or "embedding" in p or "cross-entropy" in p]
    summary = {
        "cpu_ratio": round(phases["dense"]["cpu total"] / phases["pruned"]["cpu total"], 3),
        "wall_ratio": round(phases["dense"]["wall total"] / phases["pruned"]["wall total"], 3),
        "blocks_cpu_ratio": round(sum(phases["dense"][p] for p in PHASES if "blocks" in p)
                                  / sum(phases["pruned"][p] for p in PHASES if "blocks" in p), 3),
        "fixed_share_dense": round(sum(phases["dense"][p] for p in fixed) / phases["dense"]["cpu total"], 3),
        "matmul_params_ratio": round(matmul_params(models()["dense"]) / matmul_params(models()["pruned"]), 3)}
    adamw = optimizer_kernels(args.rounds)
    malloc = {}
    for mode in ("default", "kept"):
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--rounds", str(args.rounds)],
                              capture_output=True, text=True, check=True)
        malloc[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    result = {"shape": {"batch": B, "seq_len": T, "threads": 1, "torch": torch.__version__}, "phases_ms": phases,
              "summary": summary, "adamw_step_ms": adamw,
              "glibc_malloc": {mode: {"cpu_ms": m["cpu total"], "page_faults": m["page faults"]}
                               for mode, m in malloc.items()}}
    print(f"{'phase (CPU ms, medians)':<46}{'dense':>9}{'pruned':>9}{'ratio':>7}")
    for p in (*PHASES, "cpu total", "wall total", "page faults"):
        d, q = phases["dense"][p], phases["pruned"][p]
        print(f"{p:<46}{d:9.2f}{q:9.2f}{d / q if q else float('nan'):7.3f}")
    print(json.dumps({"summary": summary, "adamw_step_ms": adamw, "glibc_malloc": result["glibc_malloc"]}, indent=1))
    write_result(args.out, result, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
