"""QLoRA's step with torchao's eager NF4 dequantization against the compiled one (finetune.qlora_compile), beside
LoRA's, on a small Llama: tokens/s, the first step (the compiles), and the dequantization's rate alone.

    python benchmarks/qlora_speed.py [--dim 512 --layers 4 --heads 8 --kv-heads 2 --ffn 1408] [--seq 256 --batch 4]
                                     [--steps 12] [--threads 1] [--out benchmarks/results/qlora_speed.json]

A random base of that shape is exported as a Hugging Face folder (what ``finetune --from`` reads; Tiny Shakespeare's
characters as its vocabulary), then three fine-tunes of it are built by the trainer's own builder
(``build_parallel_training``: LoRA; QLoRA with ``finetune.qlora_compile=false``; QLoRA with ``true``), all with
LoRA on the default targets, fp32, one process. Their steps (``training_step``, random tokens) run round-robin in
one process, so a change in the machine's load falls on all three alike; the medians are reported. The first step
of each is timed apart: the compiled one's includes inductor's cold compiles (a fresh cache folder). Wall clock:
run it on quiet cores (``flock /tmp/quiet.lock``), and with one thread when other jobs run.

The dequantization alone (a 1024 x 1024 NF4 weight to fp32, eager and compiled, best of 7 in process CPU time) is
the planner's CPU rate (``plan/finetune.py``: ``nf4_dequant_s_per_element``, ``nf4_compiled_dequant_s_per_element``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from launch import OUT_HELP, ROOT, default_out, write_result  # benchmarks/launch.py (on sys.path)

VARIANTS = {"lora": {"method": "lora"},
            "qlora_eager": {"method": "qlora", "qlora_compile": "false"},
            "qlora_compiled": {"method": "qlora", "qlora_compile": "true"}}


def make_base(folder: Path, args) -> dict:
    """A random Llama of the chosen shape as a Hugging Face folder; its ModelConfig's numbers."""
    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import CharTokenizer
    from scaletrain.model import build_model, num_params

    text = (ROOT / "src/scaletrain/assets/tinyshakespeare/input.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    cfg = ModelConfig(vocab_size=len(chars), dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_hidden_dim=args.ffn, max_seq_len=args.seq)
    export_hf(build_model(cfg, seed=0), cfg, CharTokenizer(chars), folder)
    return {"dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
            "ffn_hidden_dim": cfg.ffn_hidden_dim, "vocab_size": cfg.vocab_size, "parameters": num_params(cfg)}


def build(base: Path, variant: dict, args):
    """The trainer's model + optimizer for one variant, and a step function over random tokens."""
    import dataclasses

    import torch

    from scaletrain.config import JobConfig, ParallelConfig
    from scaletrain.finetune import resolve_finetune
    from scaletrain.parallel import ParallelDims
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=args.seq),
                              train=dataclasses.replace(cfg.train, seed=0, precision="fp32", batch_size=args.batch),
                              finetune=dataclasses.replace(cfg.finetune, source=str(base), **variant))
    cfg = resolve_finetune(cfg)
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq + 1), generator=gen)

    def step() -> float:
        started = time.perf_counter()
        training_step(pm, optimizer, iter([(batch[:, :-1], batch[:, 1:], None)]), 1, StepOptions(grad_clip=1.0))
        return time.perf_counter() - started

    return step


def dequant_rates(reps: int = 7, n: int = 1024) -> dict:
    """Seconds per element of one NF4 -> fp32 dequantization, torchao eager and compiled (the planner's own probe,
    ``plan.finetune.measure_nf4_dequant``: process CPU time, best of ``reps``), and the compiled one's first call
    (its cold compile, on a shape no earlier call compiled)."""
    import torch

    from scaletrain.finetune.lora import compiled_dequantize_nf4, to_nf4
    from scaletrain.plan.finetune import measure_nf4_dequant

    weight = to_nf4(torch.randn(n, n, generator=torch.Generator().manual_seed(0)), 64, 256)
    started = time.perf_counter()
    compiled_dequantize_nf4(weight, torch.float32)
    out = {"cold_compile_seconds": time.perf_counter() - started}
    assert torch.equal(weight.get_original_weight(), compiled_dequantize_nf4(weight, torch.float32))
    for name, compiled in (("eager", False), ("compiled", True)):
        seconds = measure_nf4_dequant(n, reps, compiled)
        out[f"{name}_s_per_element"] = seconds
        out[f"{name}_ns_per_element"] = 1e9 * seconds  # as the docs quote it
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="timed steps a variant, after its first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=default_out("qlora_speed.json"), help=OUT_HELP.format(name="qlora_speed.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qlora-speed-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")  # cold compiles, as a first run meets them
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    base = make_base(work / "base", args)
    steps, first = {}, {}
    for name, variant in VARIANTS.items():
        steps[name] = build(work / "base", variant, args)
        first[name] = steps[name]()
    times = {name: [] for name in VARIANTS}
    for _ in range(args.steps):  # round-robin: the machine's load falls on every variant alike
        for name, step in steps.items():
            times[name].append(step())
    tokens = args.batch * args.seq
    rows = {name: {"median_step_seconds": statistics.median(t), "tokens_per_second": tokens / statistics.median(t),
                   "first_step_seconds": first[name], "step_seconds": t} for name, t in times.items()}
    rates = dequant_rates()
    tps = {name: row["tokens_per_second"] for name, row in rows.items()}
    saved = rows["qlora_eager"]["median_step_seconds"] - rows["qlora_compiled"]["median_step_seconds"]
    compile_cost = first["qlora_compiled"] - first["qlora_eager"]
    checks = {"qlora_eager_over_lora": tps["qlora_eager"] / tps["lora"],
              "qlora_compiled_over_lora": tps["qlora_compiled"] / tps["lora"],
              "compiled_over_eager": tps["qlora_compiled"] / tps["qlora_eager"],
              "compile_seconds_first_step": compile_cost,
              "break_even_steps": compile_cost / saved if saved > 0 else None,
              "dequant_compiled_speedup": rates["eager_s_per_element"] / rates["compiled_s_per_element"]}
    print(f"base {base['parameters']:,} parameters ({args.dim} x {args.layers}), {args.batch} x {args.seq} tokens, "
          f"fp32, {torch.get_num_threads()} thread(s), {args.steps} steps a variant, round-robin")
    print("| variant | tokens/s | median step ms | first step s |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tokens_per_second']:.0f} | {1000 * row['median_step_seconds']:.1f} | "
              f"{row['first_step_seconds']:.2f} |")
    print(f"QLoRA / LoRA tokens/s: eager {checks['qlora_eager_over_lora']:.2f}x, compiled "
          f"{checks['qlora_compiled_over_lora']:.2f}x; compiled / eager {checks['compiled_over_eager']:.2f}x; "
          f"compiles {compile_cost:.1f} s, paid back after {checks['break_even_steps'] or float('inf'):.0f} steps")
    print(f"dequantization alone: eager {1e9 * rates['eager_s_per_element']:.2f} ns/element, compiled "
          f"{1e9 * rates['compiled_s_per_element']:.2f} ({checks['dequant_compiled_speedup']:.1f}x)")
    result = {"model": base, "seq_len": args.seq, "batch": args.batch, "steps": args.steps, "precision": "fp32",
              "threads": torch.get_num_threads(), "lora_targets": "q,k,v,o (the default)", "rows": rows,
              "dequant": rates, "checks": checks}
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
