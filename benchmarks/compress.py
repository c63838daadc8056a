"""Compression on this CPU: pretrain a few-million-parameter model on Gutenberg books, then quantize and prune
it and measure what each variant costs in quality, size and speed, side by side in one process.

    python benchmarks/compress.py [--base-steps 600] [--reuse] [--out benchmarks/results/compress.json]

The base: Shakespeare's works from Project Gutenberg (``../shared/data/gutenberg-shakespeare``, 9.6 MB, 77
texts), byte-level BPE 2048, dim 256, 4 blocks, 8 heads, SwiGLU 704 (4.2M parameters), 1 thread, cached in
``benchmarks/out/compress/base`` (a rerun reuses it). Every variant is written by ``scaletrain compress`` (a
subprocess, as a user runs it) and then read back here with ``compress.run.load_run``, so the numbers are
those of the saved run folders:

- quantization (torchao): int8 weight-only, int8 dynamic activation + int8 weight, int4 weight-only (group 32);
- pruning at 50%: magnitude and Wanda, unstructured (per layer) and 2:4;
- structured: 25% of the SwiGLU neurons and 25% of the attention heads (2 of 8 in every block) removed, then
  recovered by a full fine-tune of at most 10% of the pretraining tokens (``scaletrain finetune --from``).

Measured per variant in this process, with the variants interleaved round by round, the order reversed
every other round (so load from other users hits all alike; medians reported): validation perplexity
(the same 16 batches of the held-out split), the weights' bytes as one ``torch.save`` file, greedy decode
tokens/s at batch 1 (``generate``), and for the structured model also training tokens/s
(``build_parallel_training`` + ``training_step``).

Without ``../shared`` (a fresh clone) the script stops with a message; the tests do not need it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from launch import OUT_HELP, default_out  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
BOOKS = ROOT.parent / "shared" / "data" / "gutenberg-shakespeare"
WORK = ROOT / "benchmarks" / "out" / "compress"
BATCH, SEQ = 8, 128
BASE = {"data.path": str(BOOKS), "data.tokenizer": "bpe", "data.vocab_size": "2048", "model.dim": "256",
        "model.n_layers": "4", "model.n_heads": "8", "model.ffn_hidden_dim": "704", "model.max_seq_len": str(SEQ),
        "data.seq_len": str(SEQ), "train.batch_size": str(BATCH), "optim.lr": "2e-3", "optim.weight_decay": "0.1",
        "schedule.warmup_steps": "30", "train.eval_batches": "16", "train.sample_tokens": "0",
        "logging.progress": "off", "logging.tensorboard": "false", "logging.log_interval": "50",
        "train.precision": "fp32", "checkpoint.interval": "0", "train.threads": "1",
        "data.cache_dir": str(WORK / "data")}
VARIANTS = {  # name -> `scaletrain compress` flags
    "int8-weight": ["--quantize", "int8-weight"],
    "int8-dynamic": ["--quantize", "int8-dynamic"],
    "int4-weight-g32": ["--quantize", "int4-weight", "--group-size", "32"],
    "magnitude-50": ["--prune", "magnitude", "--sparsity", "0.5"],
    "wanda-50": ["--prune", "wanda", "--sparsity", "0.5"],
    "magnitude-2:4": ["--prune", "magnitude", "--pattern", "2:4"],
    "wanda-2:4": ["--prune", "wanda", "--pattern", "2:4"],
    "structured": ["--mlp-fraction", "0.25", "--head-fraction", "0.25"],
}


def scaletrain(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"scaletrain {' '.join(args[:3])} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def flags(overrides: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in overrides.items()]


def pretrain(steps: int) -> Path:
    base = WORK / "base"
    if (base / "checkpoints").is_dir() and any((base / "checkpoints").glob("step-*")):
        print(f"reusing {base}")
        return base
    t0 = time.perf_counter()
    print(scaletrain("train", *flags({**BASE, "train.steps": str(steps), "train.eval_interval": str(steps),
                                      "train.run_dir": str(base), "train.overwrite": "true"}))[-400:])
    (WORK / "base-seconds.txt").write_text(f"{time.perf_counter() - t0:.0f}\n")
    return base


def build_variants(base: Path, base_steps: int, recovery_fraction: float, reuse: bool) -> dict[str, Path]:
    """Write every variant with `scaletrain compress`, and the two recoveries of the structured one
    (``reuse``: keep the folders an earlier run wrote, to measure again)."""
    import shutil

    runs = {"fp32 (original)": base}
    for name, extra in VARIANTS.items():
        out = WORK / name.replace(":", "_")
        runs[name] = out
        if reuse and (out / "compress.json").is_file():
            continue
        shutil.rmtree(out, ignore_errors=True)
        print(scaletrain("compress", "--run", str(base), "--out", str(out), "--calibration-sequences", "64",
                         *extra).strip().splitlines()[-2])
    steps = max(1, int(base_steps * recovery_fraction))  # the same batch: steps are tokens
    for name, extra in (("structured + fine-tune", {}),
                        ("structured + distill", {"finetune.teacher": str(base), "finetune.distill_weight": "0.5",
                                                  "finetune.distill_temperature": "2.0"})):
        out = WORK / name.replace(" + ", "-").replace(" ", "-")
        runs[name] = out
        if reuse and (out / "checkpoints").is_dir():
            continue
        over = {k: v for k, v in BASE.items() if not k.startswith("model.")}
        over.update({"finetune.method": "full", "optim.lr": "1e-3", "schedule.warmup_steps": "5",
                     "train.steps": str(steps), "train.eval_interval": str(steps), "train.run_dir": str(out),
                     "train.overwrite": "true", **extra})
        print(scaletrain("finetune", "--from", str(runs["structured"]), *flags(over)).strip().splitlines()[-1])
    return runs


def measure_all(args, base: Path) -> int:
    import torch

    from scaletrain.compress.cli import decode_tokens_per_second
    from scaletrain.compress.run import load_run, state_bytes
    from scaletrain.compress.structured import count
    from scaletrain.config import JobConfig, OptimConfig, TrainConfig
    from scaletrain.data.loader import TokenStream
    from scaletrain.model.presets import matmul_params
    from scaletrain.parallel import ParallelDims
    from scaletrain.train.evaluate import perplexity, token_loss
    from scaletrain.train.step import build_parallel_training, training_step
    from scaletrain.train.trainer import prepare_data

    torch.set_num_threads(1)
    runs = build_variants(base, args.base_steps, args.recovery_fraction, args.reuse)
    loaded = {name: load_run(path) for name, path in runs.items()}
    cfg0, _, tok, _ = loaded["fp32 (original)"]
    stream = TokenStream(str(prepare_data(cfg0)), "val")
    val = torch.from_numpy(stream.read(0, 16 * BATCH * SEQ + 1).astype("int64"))
    prompt = val[:16].tolist()
    rows = {}
    for name, (cfg, model, tokenizer, _) in loaded.items():
        loss, n = token_loss(model, val, SEQ, BATCH, vocab_limit=tokenizer.vocab_size)
        record = json.loads((runs[name] / "compress.json").read_text()) if (runs[name] / "compress.json").is_file() \
            else {}
        rows[name] = {"run": str(runs[name].relative_to(ROOT)), "val_loss": round(loss, 4),
                      "val_perplexity": round(perplexity(loss), 3), "tokens_scored": n,
                      "weight_bytes": state_bytes(model), "parameters": count(model),
                      "n_layers": cfg.model.n_layers, "ffn_hidden_dim": cfg.model.ffn_hidden_dim,
                      "note": record.get("quantize", {}).get("note", ""),
                      "sparsity": record.get("prune", {}).get("sparsity", 0.0)}
    # Decode speed: the variants interleaved round by round (noise from other users hits all alike).
    speeds = {name: [] for name in loaded}
    for r in range(args.rounds):  # the order reversed every other round: no variant is always first or last
        for name, (cfg, model, tokenizer, _) in (list(loaded.items()) if r % 2 == 0 else list(loaded.items())[::-1]):
            speeds[name].append(decode_tokens_per_second(model, cfg, tokenizer, 64, prompt))
    for name in loaded:
        rows[name]["decode_tokens_per_s"] = round(statistics.median(speeds[name]), 1)
    dense = rows["fp32 (original)"]
    for row in rows.values():
        row["perplexity_change"] = round(row["val_perplexity"] / dense["val_perplexity"] - 1, 4)
        row["size_ratio"] = round(row["weight_bytes"] / dense["weight_bytes"], 3)
        row["decode_speed_ratio"] = round(row["decode_tokens_per_s"] / dense["decode_tokens_per_s"], 3)
    # Training speed, dense vs structured: the trainer's own build and step, interleaved.
    train_ms = {"fp32 (original)": [], "structured": []}
    steppers = {}
    for name in train_ms:
        mcfg = loaded[name][0].model
        job = JobConfig(model=mcfg, optim=OptimConfig(), train=TrainConfig(seed=0))
        pm, opt = build_parallel_training(job, ParallelDims.from_config(job.parallel, 1), torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        batch = [(torch.randint(0, 2048, (BATCH, SEQ), generator=gen), torch.randint(0, 2048, (BATCH, SEQ),
                                                                                      generator=gen), None)]
        steppers[name] = (pm, opt, batch)
    for r in range(args.rounds + 1):
        for name, (pm, opt, batch) in (list(steppers.items()) if r % 2 == 0 else list(steppers.items())[::-1]):
            t0 = time.perf_counter()
            for _ in range(2):
                training_step(pm, opt, iter(batch), 1, grad_clip=1.0)
            train_ms[name].append((time.perf_counter() - t0) / 2 * 1000)
    train_tps = {name: BATCH * SEQ / (statistics.median(ms[1:]) / 1000) for name, ms in train_ms.items()}
    best = min(("structured + fine-tune", "structured + distill"), key=lambda n: rows[n]["val_loss"])
    structured = {
        "recovery_steps": max(1, int(args.base_steps * args.recovery_fraction)), "recovery_token_fraction":
            args.recovery_fraction, "best_recovery": best,
        "val_loss_ratio": round(rows[best]["val_loss"] / dense["val_loss"], 4),
        "train_tokens_per_s": {k: round(v, 1) for k, v in train_tps.items()},
        "train_speed_ratio": round(train_tps["structured"] / train_tps["fp32 (original)"], 3),
        # What the FLOPs alone predict (weights in a matmul per token, blocks + head): the measured ratios are
        # compared with it in the docs.
        "matmul_params_ratio": round(matmul_params(loaded["fp32 (original)"][0].model)
                                     / matmul_params(loaded["structured"][0].model), 3),
        "decode_speed_ratio": rows[best]["decode_speed_ratio"]}
    targets = {
        "int8_weight_within_1pct_perplexity": rows["int8-weight"]["perplexity_change"] <= 0.01,
        "wanda_below_magnitude_50pct": rows["wanda-50"]["val_perplexity"] < rows["magnitude-50"]["val_perplexity"],
        "wanda_below_magnitude_2_4": rows["wanda-2:4"]["val_perplexity"] < rows["magnitude-2:4"]["val_perplexity"],
        "structured_val_loss_within_5pct": structured["val_loss_ratio"] <= 1.05,
        "structured_train_speed_1_25x": structured["train_speed_ratio"] >= 1.25,
        "structured_decode_speed_1_25x": structured["decode_speed_ratio"] >= 1.25}
    base_cfg = cfg0
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": 1,
                          "torch": torch.__version__},
              "base": {"data": "gutenberg-shakespeare (BPE 2048)", "steps": args.base_steps,
                       "tokens": args.base_steps * BATCH * SEQ, "parameters": dense["parameters"],
                       "dim": base_cfg.model.dim, "n_layers": base_cfg.model.n_layers,
                       "n_heads": base_cfg.model.n_heads, "ffn_hidden_dim": base_cfg.model.ffn_hidden_dim},
              "variants": rows, "structured": structured, "targets": targets}
    print(f"{'variant':<24} {'val ppl':>8} {'d ppl':>8} {'MB':>6} {'size':>6} {'decode tok/s':>12} {'speed':>6}")
    for name, r in rows.items():
        print(f"{name:<24} {r['val_perplexity']:>8.2f} {100 * r['perplexity_change']:>+7.1f}% "
              f"{r['weight_bytes'] / 1e6:>6.2f} {r['size_ratio']:>5.2f}x {r['decode_tokens_per_s']:>12.1f} "
              f"{r['decode_speed_ratio']:>5.2f}x")
    print(json.dumps({"structured": structured, "targets": targets}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=600, help="pretraining steps (cached)")
    parser.add_argument("--base-only", action="store_true", help="only pretrain (or reuse) the base")
    parser.add_argument("--recovery-fraction", type=float, default=0.1,
                        help="structured recovery: fine-tuning tokens as a share of the pretraining tokens")
    parser.add_argument("--reuse", action="store_true", help="measure the variants an earlier run wrote again")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (medians reported)")
    parser.add_argument("--out", default=default_out("compress.json"), help=OUT_HELP.format(name="compress.json"))
    args = parser.parse_args()
    if not BOOKS.is_dir():
        print(f"needs {BOOKS} (the shared corpora); not in a fresh clone", file=sys.stderr)
        return 1
    WORK.mkdir(parents=True, exist_ok=True)
    base = pretrain(args.base_steps)
    if args.base_only:
        return 0
    return measure_all(args, base)


if __name__ == "__main__":
    sys.exit(main())
