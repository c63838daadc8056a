"""Fine-tuning on this machine: pretrain a base on general books, adapt it to Tiny Shakespeare with every
method for the same number of steps, and compare.

    python benchmarks/finetune.py [--base-steps 2000] [--steps 200] [--out benchmarks/results/finetune.json]

The base: six Project Gutenberg books (``../shared/data/gutenberg-raw-sample``: Alice, Metamorphosis,
Candide, ...; headers stripped by ``scaletrain prepare``'s cleaning), character level (123 characters, so
the embedding and head are a small share), dim 320, 2 blocks (2.6M parameters), pretrained for
``--base-steps`` and cached under ``benchmarks/out/finetune/`` (a rerun with the same settings reuses it).

Learning rates: full fine-tuning and LoRA each take the best of a small sweep (``SWEEP``), judged on a
held-out split that is not the reported one: the sweep trains on the first 80% of Tiny Shakespeare and
is scored on the next 10%; the reported runs train on the first 90% and are scored on the last 10%.
QLoRA takes LoRA's rate (the same adapter); prompt and prefix tuning keep the usual 3e-2 (not swept).
Each schedule decays to a tenth of its own peak rate.

Then each method (full, LoRA, QLoRA, prompt, prefix) fine-tunes the base on bundled Tiny Shakespeare - a
different style - in its own fresh process, so each peak resident memory is its own. Recorded per method:
trainable parameters, peak memory (the process's peak RSS minus its RSS before the model was built: what
training added), the bytes of the frozen base, median step time, and the validation loss before (step 0:
the base) and after.

Without ``../shared`` (a fresh clone) the script stops with a message; the tests do not need it.
"""

from __future__ import annotations

import argparse
import hashlib
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
SHAKESPEARE = ROOT / "src" / "scaletrain" / "assets" / "tinyshakespeare" / "input.txt"
LORA = {"finetune.lora_rank": "8", "finetune.lora_alpha": "16", "finetune.lora_targets": "q,k,v,o"}
METHODS = {  # method -> its overrides; learning rates of full and lora come from the sweep
    "full": {"finetune.method": "full"},
    "lora": {"finetune.method": "lora", **LORA},
    "qlora": {"finetune.method": "qlora", **LORA},
    "prompt": {"finetune.method": "prompt", "finetune.virtual_tokens": "16", "optim.lr": "3e-2"},
    "prefix": {"finetune.method": "prefix", "finetune.virtual_tokens": "16", "optim.lr": "3e-2"},
}
SWEEP = {"full": ["3e-4", "1e-3", "3e-3"], "lora": ["3e-3", "1e-2", "3e-2"]}
LR_FROM = {"full": "full", "lora": "lora", "qlora": "lora"}  # method -> whose swept rate it takes
COMMON = {"data.seq_len": "64", "train.batch_size": "4", "train.eval_batches": "20", "train.sample_tokens": "0",
          "logging.progress": "off", "logging.tensorboard": "false", "logging.log_interval": "10",
          "train.precision": "fp32", "checkpoint.interval": "0", "schedule.warmup_steps": "10",
          "optim.weight_decay": "0.0", "train.threads": "1"}
# 2.6M parameters at dim 320, so that rank-8 LoRA on q, k, v, o is under 2% of them (2r / (3 dim) of a
# block), in 2 blocks and 4 x 64 tokens a step, so that pretraining and eleven fine-tunes fit in ~30 minutes
# on 2 cores shared by five people (one thread each: at a load of 10, a second thread only waits).
# Character level: the embedding and head are 128 x 320 each (123 characters, padded).
BASE = {"data.path": str(BOOKS), "data.tokenizer": "char", "model.dim": "320", "model.n_layers": "2",
        "model.n_heads": "5", "model.ffn_hidden_dim": "864", "model.max_seq_len": "64",
        "optim.lr": "3e-3", "optim.weight_decay": "0.1", "schedule.warmup_steps": "50", "schedule.min_lr": "3e-4"}


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """The resident set now (not the peak): /proc/self/statm's second field, in pages."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_method(method: str, base: Path, steps: int, lr: str, tag: str, data: str) -> dict:
    """Fine-tune ``base`` with ``method`` at peak rate ``lr`` on ``data`` in this process (run folder
    ``WORK/tag``); the numbers for one row."""
    import torch

    from scaletrain.adapt.lora import is_nf4, nf4_bytes
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    overrides = {**COMMON, **METHODS[method], "optim.lr": lr, "schedule.min_lr": str(float(lr) / 10),
                 "finetune.source": str(base), "train.steps": str(steps), "train.eval_interval": str(steps),
                 "train.run_dir": str(WORK / tag), "data.path": data, "train.overwrite": "true",  # reruns start afresh
                 "data.cache_dir": str(WORK / f"data-{Path(data).parent.name}")}
    if Path(data).parent == WORK / "sweep":  # the first 90% of the text: its last ninth is the sweep's val
        overrides["data.val_fraction"] = str(1 / 9)
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
            "improvement": evals[0]["val_loss"] - evals[-1]["val_loss"], "lr": float(lr)}


def run(cmd: list[str]) -> str:
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def child(method: str, steps: int, lr: str, tag: str, data: Path) -> dict:
    """One fine-tune in a fresh process (its own peak memory); its row."""
    out = run([__file__, "--one", method, "--steps", str(steps), "--lr", lr, "--tag", tag, "--data", str(data)])
    return json.loads(out.strip().splitlines()[-1])


def shakespeare_text(base: Path) -> tuple[Path, dict]:
    """Tiny Shakespeare less the characters the base's character vocabulary lacks (the books have no '$';
    Tiny Shakespeare has one), so that the base's tokenizer encodes it; and what was left out."""
    chars = set(json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))["chars"])
    text = SHAKESPEARE.read_text(encoding="utf-8")
    dropped = {c: text.count(c) for c in sorted(set(text) - chars)}
    out = WORK / "shakespeare" / "input.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(c for c in text if c in chars), encoding="utf-8")
    return out, dropped


def sweep(base: Path, steps: int, key: str, data: Path) -> dict:
    """Each swept method's validation loss per learning rate on the sweep's own split (cached by ``key``)."""
    cache = WORK / "sweep.json"
    done = json.loads(cache.read_text()) if cache.is_file() else {}
    if done.get("key") != key:
        done = {"key": key, "losses": {}}
    text = WORK / "sweep" / "input.txt"  # the first 90% of Tiny Shakespeare; the reported val is the rest
    full_text = data.read_text(encoding="utf-8")
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text(full_text[: int(0.9 * len(full_text))], encoding="utf-8")
    for method, lrs in SWEEP.items():
        for lr in lrs:
            losses = done["losses"].setdefault(method, {})
            if lr not in losses:
                losses[lr] = child(method, steps, lr, f"sweep-{method}-{lr}", text)["val_loss_after"]
                cache.write_text(json.dumps(done, indent=1))
            print(f"sweep {method:5s} lr {lr:>5s}: val {losses[lr]:.4f}", flush=True)
    return done["losses"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps, the same for every method")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one method, JSON on stdout
    parser.add_argument("--lr", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=default_out("finetune.json"), help=OUT_HELP.format(name="finetune.json"))
    args = parser.parse_args()
    key = hashlib.sha256(json.dumps([BASE, COMMON, args.base_steps]).encode()).hexdigest()[:12]
    base = WORK / f"base-{key}"  # reused by reruns with the same base settings
    if args.one:
        print(json.dumps(one_method(args.one, base, args.steps, args.lr, args.tag, args.data)))
        return 0
    if not BOOKS.is_dir():
        raise SystemExit(f"{BOOKS} not found: this benchmark needs ../shared/data (see its README)")
    if not (base / "checkpoints").is_dir():
        over = {**COMMON, **BASE, "train.steps": str(args.base_steps), "train.eval_interval": "0",
                "train.run_dir": str(base), "data.cache_dir": str(WORK / "books-data")}
        print(run(["-m", "scaletrain.cli", "train", *[f"--{k}={v}" for k, v in over.items()]]).strip().splitlines()[-1])
    data, dropped = shakespeare_text(base)
    swept = sweep(base, args.steps, f"{key}-{args.steps}-{json.dumps(SWEEP)}", data)
    best = {m: min(losses, key=losses.get) for m, losses in swept.items()}
    rows = []
    for method in args.methods.split(","):
        lr = best[LR_FROM[method]] if method in LR_FROM else METHODS[method]["optim.lr"]
        rows.append(child(method, args.steps, lr, method, data))
        r = rows[-1]
        print(f"{method:7s} lr {lr:>5s} trainable {r['trainable_parameters']:>9,} ({r['trainable_percent']:5.2f}%)  "
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
              "steps": args.steps, "dropped_characters": dropped, "base": BASE, "common": COMMON,
              "sweep": {"rates": SWEEP, "val_loss": swept, "chosen": best}, "methods": by, "checks": checks,
              "median_step_ms_all": statistics.median(r["median_step_ms"] for r in rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(checks, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
