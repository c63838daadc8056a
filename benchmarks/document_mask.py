"""data.document_attention (the block-causal mask between packed documents, positions restarting per document) on
and off: its effect on the validation bits per byte and its cost, on a folder of books.

    python benchmarks/document_mask.py [--data ../shared/data/gutenberg-shakespeare] [--steps 300] [--out ...]

Two pretraining runs of the same tiny model on the same prepared folder (char tokenizer), the same seed and
steps, one with the mask and one without; each records its own val loss and bpb (evaluation uses the mask when
training did). Also: the fraction of training windows that hold an end-of-text, i.e. where the mask changes
anything at all, and the extra bytes the mask holds (B x T x T bools, plus SDPA's explicit-mask path). Step times
are wall-clock from each run's metrics: noise on a shared machine (rerun quietly for the cost in seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launch import OUT_HELP, ROOT, default_out, write_result  # benchmarks/launch.py (on sys.path)

SHARED = ROOT.parent / "shared" / "data" / "gutenberg-shakespeare"


def train(data: str, run: Path, cache: Path, masked: bool, args) -> dict:
    """One ``scaletrain train`` run; its final val loss / bpb and median step milliseconds from metrics.jsonl."""
    command = [sys.executable, "-m", "scaletrain.cli", "train", f"--data.path={data}", f"--data.cache_dir={cache}",
               f"--data.seq_len={args.seq_len}", f"--model.max_seq_len={args.seq_len}", "--model.dim=64",
               "--model.n_layers=2", "--model.n_heads=4", "--model.ffn_hidden_dim=192",
               f"--train.batch_size={args.batch}", f"--train.steps={args.steps}", "--train.eval_interval=0",
               f"--train.eval_batches={args.eval_batches}", "--train.sample_tokens=0", "--train.precision=fp32",
               "--logging.progress=off", "--logging.tensorboard=false", "--logging.log_interval=10",
               f"--data.document_attention={'true' if masked else 'false'}", f"--train.run_dir={run}"]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "val_bpb" in r][-1]
    step_ms = [r["step_ms"] for r in records if "step_ms" in r]
    return {"document_attention": masked, "val_loss": final["val_loss"], "val_bpb": final["val_bpb"],
            "median_step_ms_noisy": statistics.median(step_ms) if step_ms else None}


def crossing_fraction(cache: Path, seq_len: int) -> float:
    """Fraction of the train split's windows (stride seq_len) that hold a document boundary."""
    import numpy as np

    from scaletrain.data.loader import TokenStream

    folder = next(p.parent for p in cache.rglob("manifest.json"))
    stream = TokenStream(str(folder), "train")
    starts = np.arange(0, stream.total - seq_len - 1, seq_len)
    ids = stream.doc_ids(starts, stream.read_windows(starts, seq_len + 1), seq_len)
    return float((ids[:, -1] > 0).mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(SHARED), help="a folder of text files (one document a file)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--out", default=default_out("document_mask.json"),
                        help=OUT_HELP.format(name="document_mask.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "data"
        rows = [train(args.data, Path(tmp) / f"run{int(masked)}", cache, masked, args) for masked in (False, True)]
        crossing = crossing_fraction(cache, args.seq_len)
    mask_bytes = args.batch * args.seq_len * args.seq_len  # the (B, 1, T, T) bool mask
    print("| document_attention | val loss | val bpb | median step ms (noisy) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {str(r['document_attention']).lower()} | {r['val_loss']:.4f} | {r['val_bpb']:.4f} | "
              f"{r['median_step_ms_noisy']:.1f} |")
    print(f"windows of {args.seq_len} tokens holding a document boundary: {100 * crossing:.2f}%; "
          f"the mask: {mask_bytes / 2**20:.1f} MiB a micro-batch")
    data = Path(args.data).resolve()
    shown = f"../{data.relative_to(ROOT.parent)}" if data.is_relative_to(ROOT.parent) else str(data)
    write_result(args.out, {"data": shown, "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch,
                            "rows": rows, "crossing_fraction": crossing, "mask_bytes": mask_bytes,
                            "bpb_difference": rows[1]["val_bpb"] - rows[0]["val_bpb"]})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
