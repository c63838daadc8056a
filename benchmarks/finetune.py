"""Fine-tuning on this machine: pretrain a small base on general books, adapt it to Tiny Shakespeare with
every method for the same number of steps, and compare.

    python benchmarks/finetune.py [--base-steps 150] [--steps 60] [--out benchmarks/results/finetune.json]

The base: six Project Gutenberg books (``../shared/data/gutenberg-raw-sample``: Alice, Metamorphosis,
Candide, ...; headers stripped by ``scaletrain prepare``'s cleaning), byte-level BPE 1024, dim 128, 4 layers,
pretrained for ``--base-steps``. Then each method (full, LoRA, QLoRA, prompt, prefix) fine-tunes it on
bundled Tiny Shakespeare - a different style - in its own fresh process, so each peak resident memory is
its own. Recorded per method: trainable parameters, peak memory (the process's peak RSS minus its RSS
before the model was built: what training added), the bytes of the frozen base, median step time, and
the validation loss before (step 0: the base) and after.

Without ``../shared`` (a fresh clone) the script stops with a message; the tests do not need it.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from launch import OUT_HELP, default_out  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
BOOKS = ROOT.parent / "shared" / "data" / "gutenberg-raw-sample"
WORK = ROOT / "benchmarks" / "out" / "finetune"
METHODS = {  # method -> its overrides (learning rates: the usual choice per method, the same steps for all)
    "full": {"finetune.method": "full", "optim.lr": "3e-4"},
    "lora": {"finetune.method": "lora", "finetune.lora_rank": "8", "finetune.lora_alpha": "16",
             "finetune.lora_targets": "q,k,v,o", "optim.lr": "3e-3"},
    "qlora": {"finetune.method": "qlora", "finetune.lora_rank": "8", "finetune.lora_alpha": "16",
              "finetune.lora_targets": "q,k,v,o", "optim.lr": "3e-3"},
    "prompt": {"finetune.method": "prompt", "finetune.virtual_tokens": "16", "optim.lr": "3e-2"},
    "prefix": {"finetune.method": "prefix", "finetune.virtual_tokens": "16", "optim.lr": "3e-2"},
}
COMMON = {"data.seq_len": "128", "train.batch_size": "4", "train.eval_batches": "10", "train.sample_tokens": "0",
          "logging.progress": "off", "logging.tensorboard": "false", "logging.log_interval": "10",
          "train.precision": "fp32", "checkpoint.interval": "0", "schedule.warmup_steps": "10",
          "optim.weight_decay": "0.0", "train.threads": "2"}
# Small enough to pretrain and adapt five times in ~20 minutes on 2 shared cores (1.05M parameters).
BASE = {"data.path": str(BOOKS), "data.tokenizer": "bpe", "data.vocab_size": "1024", "model.dim": "128",
        "model.n_layers": "4", "model.n_heads": "4", "model.ffn_hidden_dim": "344", "model.max_seq_len": "128",
        "optim.lr": "2e-3", "optim.weight_decay": "0.1"}


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """The resident set now (not the peak): /proc/self/statm's second field, in pages."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_method(method: str, base: Path, steps: int) -> dict:
    """Fine-tune ``base`` with ``method`` in this process; the numbers for one row."""
    import torch

    from scaletrain.adapt.lora import is_nf4, nf4_bytes
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    overrides = {**COMMON, **METHODS[method], "finetune.source": str(base), "train.steps": str(steps),
                 "train.eval_interval": str(steps), "train.run_dir": str(WORK / method),
                 "data.cache_dir": str(WORK / "shakespeare-data")}
    cfg = load_config(None, overrides)
    before = current_rss_bytes()
    trainer = Trainer(cfg, log=False)
    params = {id(p): p for m in trainer.pm.modules for p in m.parameters()}.values()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    frozen = [p for p in params if not p.requires_grad]
    frozen_bytes = sum(nf4_bytes(p) if is_nf4(p) else p.numel() * p.element_size() for p in frozen)
    frozen_fp32 = sum(p.numel() * 4 for p in frozen)
    summary = trainer.train()
    optimizer_bytes = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                          for t in s.values() if isinstance(t, torch.Tensor))
    evals = summary["evals"]
    return {"method": method, "trainable_parameters": trainable, "total_parameters": total,
            "trainable_percent": 100 * trainable / total, "frozen_base_bytes": frozen_bytes,
            "frozen_base_fp32_bytes": frozen_fp32, "optimizer_state_bytes": optimizer_bytes,
            "peak_memory_mb": (rss_bytes() - before) / 2**20, "median_step_ms": summary["median_step_ms"],
            "val_loss_before": evals[0]["val_loss"], "val_loss_after": evals[-1]["val_loss"],
            "improvement": evals[0]["val_loss"] - evals[-1]["val_loss"], "lr": float(METHODS[method]["optim.lr"])}


def run(cmd: list[str]) -> str:
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps, the same for every method")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one method, JSON on stdout
    parser.add_argument("--out", default=default_out("finetune.json"), help=OUT_HELP.format(name="finetune.json"))
    args = parser.parse_args()
    base = WORK / "base"
    if args.one:
        print(json.dumps(one_method(args.one, base, args.steps)))
        return 0
    if not BOOKS.is_dir():
        raise SystemExit(f"{BOOKS} not found: this benchmark needs ../shared/data (see its README)")
    if not (base / "checkpoints").is_dir():
        over = {**COMMON, **BASE, "train.steps": str(args.base_steps), "train.eval_interval": "0",
                "train.run_dir": str(base), "data.cache_dir": str(WORK / "books-data")}
        print(run(["-m", "scaletrain.cli", "train", *[f"--{k}={v}" for k, v in over.items()]]).strip().splitlines()[-1])
    rows = []
    for method in args.methods.split(","):
        rows.append(json.loads(run([__file__, "--one", method, "--steps", str(args.steps)]).strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{method:7s} trainable {r['trainable_parameters']:>9,} ({r['trainable_percent']:5.2f}%)  "
              f"peak +{r['peak_memory_mb']:6.1f} MB  frozen base {r['frozen_base_bytes'] / 2**20:6.2f} MB  "
              f"{r['median_step_ms']:7.1f} ms/step  val {r['val_loss_before']:.4f} -> {r['val_loss_after']:.4f}",
              flush=True)
    by = {r["method"]: r for r in rows}
    checks = {}
    if "full" in by and "lora" in by:
        full, lora = by["full"], by["lora"]
        checks["lora_improvement_vs_full"] = lora["improvement"] / full["improvement"]
        checks["lora_trainable_percent"] = lora["trainable_percent"]
        checks["lora_peak_memory_vs_full"] = lora["peak_memory_mb"] / full["peak_memory_mb"]
    if "qlora" in by:
        checks["qlora_frozen_base_vs_fp32"] = by["qlora"]["frozen_base_bytes"] / by["qlora"]["frozen_base_fp32_bytes"]
    result = {"machine": platform.processor() or platform.machine(), "base_steps": args.base_steps,
              "steps": args.steps, "base": BASE, "common": COMMON, "methods": by, "checks": checks,
              "median_step_ms_all": statistics.median(r["median_step_ms"] for r in rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(checks, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
