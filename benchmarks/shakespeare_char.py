"""The nanoGPT "baby GPT" comparison: configs/shakespeare_char_baby_adamw.toml, timed and scored.

Runs the full recipe (2000 steps, evals every 250) and records median ms/iteration, tokens/s, the val
loss at every eval, peak RSS and wall time. Because absolute times drift with machine load, it also
times our training step (compiled and eager) and a nanoGPT-layout step (GPT-2
blocks: LayerNorm, fused QKV, GELU MLP, learned positions, same width/depth/heads, 12x64 tokens; eager
and compiled) *interleaved in one process*, and reports their ratios, which load affects equally.

    python benchmarks/shakespeare_char.py [--steps N] [--eager] [--out benchmarks/results/shakespeare_char.json]

Writes benchmarks/out/shakespeare_char.json unless --out names another file (the tracked result the docs quote is
benchmarks/results/shakespeare_char.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)
from scaletrain.config import load_config
from scaletrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
NANOGPT = {"median_ms": 41.4, "tokens_per_second": 18551, "wall_s": 91, "peak_rss_mb": 373,
           "val_loss": {0: 4.165, 250: 2.445, 500: 2.314, 750: 2.191, 1000: 2.053, 1250: 2.009, 1500: 1.923,
                        1750: 1.892, 2000: 1.886}}


class NanoGPTLayout(nn.Module):
    """GPT-2 block layout at the baby size, only to time a step side by side (not a training recipe)."""

    def __init__(self, vocab: int = 65, dim: int = 128, layers: int = 4, heads: int = 4, seq: int = 64):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim),
            "ln2": nn.LayerNorm(dim), "fc": nn.Linear(dim, 4 * dim), "out": nn.Linear(4 * dim, dim)})
            for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        bsz, seq = idx.shape
        h = self.wte(idx) + self.wpe(torch.arange(seq))
        for b in self.blocks:
            q, k, v = (t.view(bsz, seq, self.heads, -1).transpose(1, 2) for t in b["qkv"](b["ln1"](h)).chunk(3, -1))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, seq, -1)
            h = h + b["proj"](att)
            h = h + b["out"](F.gelu(b["fc"](b["ln2"](h))))
        return self.head(self.ln_f(h))


def side_by_side(cfg, steps: int = 120, warmup: int = 10) -> dict:
    """Median step times, alternating step by step in this process: our Trainer.step compiled
    and eager, and the nanoGPT-layout step eager (the reference measured 41.4 ms on these machines) and
    compiled (40.0 ms there). Load slows every contender alike, so the ratios hold where absolute times drift."""
    from dataclasses import replace

    ours = {name: Trainer(replace(cfg, train=replace(cfg.train, compile=flag)), log=False)
            for name, flag in (("ours_compiled", "true"), ("ours_eager", "false"))}
    batches = [next(ours["ours_eager"].train_loader) for _ in range(8)]

    def ref_step_fn(compiled: bool):
        ref = NanoGPTLayout(seq=cfg.data.seq_len)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        forward = torch.compile(ref) if compiled else ref

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            F.cross_entropy(forward(x).flatten(0, 1), y.flatten()).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    contenders = {**{name: (lambda i, t=t: t.step()) for name, t in ours.items()},
                  "nanogpt_layout_eager": ref_step_fn(False), "nanogpt_layout_compiled": ref_step_fn(True)}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(steps + warmup):  # the warmup steps include the compilations
        for name, step in contenders.items():
            t0 = time.perf_counter()
            step(i)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {name: 1000 * statistics.median(t) for name, t in times.items()}
    ref = med["nanogpt_layout_eager"]
    return {"median_ms": med, "ratio_over_nanogpt_layout_eager": {k: v / ref for k, v in med.items()},
            "ratio_compiled_over_compiled": med["ours_compiled"] / med["nanogpt_layout_compiled"],
            "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "shakespeare_char_baby_adamw.toml"))
    parser.add_argument("--steps", type=int, default=0, help="override train.steps (0 = the recipe's)")
    parser.add_argument("--eager", action="store_true", help="train without torch.compile (the recipe: compile = auto)")
    parser.add_argument("--ratio-steps", type=int, default=120, help="interleaved steps for the side-by-side ratio")
    parser.add_argument("--out", default=default_out("shakespeare_char.json"),
                        help=OUT_HELP.format(name="shakespeare_char.json"))
    args = parser.parse_args()

    overrides = {"train.run_dir": str(ROOT / "runs" / "bench_shakespeare_char"), "logging.progress": "plain",
                 "logging.tensorboard": "false", "checkpoint.enabled": "false", "train.sample_tokens": "0"}
    if args.steps:
        overrides["train.steps"] = str(args.steps)
    if args.eager:
        overrides["train.compile"] = "false"
    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg)
    load_before = os.getloadavg()  # other work on the machine inflates the times, and the ratio too
    t0 = time.perf_counter()
    summary = trainer.train()
    wall = time.perf_counter() - t0

    sbs = side_by_side(cfg, args.ratio_steps) if args.ratio_steps else None
    result = {
        "benchmark": "shakespeare_char_baby", "config": args.config, "compile": cfg.train.compile,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": sys.version.split()[0],
                    "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "median_ms_per_iter": summary["median_step_ms"], "tokens_per_second": summary["tokens_per_second"],
        "mfu": summary["mfu"], "wall_seconds": wall, "peak_rss_mb": summary["peak_memory_mb"],
        "val_loss": {str(e["step"]): round(e["val_loss"], 4) for e in summary["evals"]},
        "final_val_loss": summary["final_val_loss"], "side_by_side": sbs, "nanogpt_reference": NANOGPT,
    }
    write_result(args.out, result, indent=2)

    print(f"\n{'':28s} {'scaletrain':>12s} {'nanoGPT reference':>24s}")
    print(f"{'median ms/iter':28s} {result['median_ms_per_iter']:12.1f} {NANOGPT['median_ms']:24.1f}")
    print(f"{'tokens/s':28s} {result['tokens_per_second']:12,.0f} {NANOGPT['tokens_per_second']:24,}")
    print(f"{'wall s (incl. evals)':28s} {wall:12.0f} {NANOGPT['wall_s']:24}")
    print(f"{'peak RSS MB':28s} {result['peak_rss_mb']:12.0f} {NANOGPT['peak_rss_mb']:24}")
    for step, loss in result["val_loss"].items():
        ref = NANOGPT["val_loss"].get(int(step))
        print(f"{'val loss @ ' + step:28s} {loss:12.4f} {ref if ref is not None else '':>24}")
    if sbs:
        print(f"\nside by side, one process, {sbs['steps']} interleaved steps (median ms, ratio to the eager "
              "nanoGPT layout):")
        for name, ms in sbs["median_ms"].items():
            print(f"  {name:28s} {ms:8.1f} {sbs['ratio_over_nanogpt_layout_eager'][name]:8.3f}")
        print(f"  compiled over compiled: {sbs['ratio_compiled_over_compiled']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
