"""The nanoGPT "baby GPT" comparison: configs/shakespeare_char_baby.toml, timed and scored.

Runs the full recipe (2000 steps, evals every 250) and records median ms/iteration, tokens/s, the val
loss at every eval, peak RSS and wall time. Because absolute times drift with machine load, it also
times our training step and a nanoGPT-layout step (GPT-2 blocks: LayerNorm, fused QKV, GELU MLP,
learned positions, same width/depth/heads, 12x64 tokens) *interleaved in one process*, and reports
their ratio, which load affects equally.

    python benchmarks/shakespeare_char.py [--steps N] [--out benchmarks/results/shakespeare_char.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

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


def interleaved_ratio(trainer: Trainer, steps: int = 120, warmup: int = 10) -> dict:
    """Median step time of our train_step and of the nanoGPT-layout step, alternating step by step."""
    ref = NanoGPTLayout(seq=trainer.cfg.data.seq_len)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    batches = [next(trainer.train_loader) for _ in range(8)]

    def ref_step(i: int) -> None:
        x, y = batches[i % len(batches)]
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    ours_t, ref_t = [], []
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        trainer.train_step()
        t1 = time.perf_counter()
        ref_step(i)
        t2 = time.perf_counter()
        if i >= warmup:
            ours_t.append(t1 - t0)
            ref_t.append(t2 - t1)
    ours, ref_ms = 1000 * statistics.median(ours_t), 1000 * statistics.median(ref_t)
    return {"ours_median_ms": ours, "nanogpt_layout_median_ms": ref_ms, "ratio_ours_over_ref": ours / ref_ms,
            "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "shakespeare_char_baby.toml"))
    parser.add_argument("--steps", type=int, default=0, help="override train.steps (0 = the recipe's)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--ratio-steps", type=int, default=120, help="interleaved steps for the side-by-side ratio")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "shakespeare_char.json"))
    args = parser.parse_args()

    overrides = {"train.run_dir": str(ROOT / "runs" / "bench_shakespeare_char"), "logging.progress": "plain",
                 "logging.tensorboard": "false", "checkpoint.enabled": "false", "train.sample_tokens": "0"}
    if args.steps:
        overrides["train.steps"] = str(args.steps)
    if args.compile:
        overrides["train.compile"] = "true"
    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg)
    t0 = time.perf_counter()
    summary = trainer.train()
    wall = time.perf_counter() - t0

    side_by_side = interleaved_ratio(Trainer(cfg, log=False), args.ratio_steps) if args.ratio_steps else None
    result = {
        "benchmark": "shakespeare_char_baby", "config": args.config, "compile": args.compile,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": sys.version.split()[0]},
        "median_ms_per_iter": summary["median_step_ms"], "tokens_per_second": summary["tokens_per_second"],
        "mfu": summary["mfu"], "wall_seconds": wall, "peak_rss_mb": summary["peak_memory_mb"],
        "val_loss": {str(e["step"]): round(e["val_loss"], 4) for e in summary["evals"]},
        "final_val_loss": summary["final_val_loss"], "side_by_side": side_by_side, "nanogpt_reference": NANOGPT,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))

    print(f"\n{'':28s} {'scaletrain':>12s} {'nanoGPT (BASELINES.md)':>24s}")
    print(f"{'median ms/iter':28s} {result['median_ms_per_iter']:12.1f} {NANOGPT['median_ms']:24.1f}")
    print(f"{'tokens/s':28s} {result['tokens_per_second']:12,.0f} {NANOGPT['tokens_per_second']:24,}")
    print(f"{'wall s (incl. evals)':28s} {wall:12.0f} {NANOGPT['wall_s']:24}")
    print(f"{'peak RSS MB':28s} {result['peak_rss_mb']:12.0f} {NANOGPT['peak_rss_mb']:24}")
    for step, loss in result["val_loss"].items():
        ref = NANOGPT["val_loss"].get(int(step))
        print(f"{'val loss @ ' + step:28s} {loss:12.4f} {ref if ref is not None else '':>24}")
    if side_by_side:
        print(f"side by side, same process: ours {side_by_side['ours_median_ms']:.1f} ms vs nanoGPT layout "
              f"{side_by_side['nanogpt_layout_median_ms']:.1f} ms -> ratio {side_by_side['ratio_ours_over_ref']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
