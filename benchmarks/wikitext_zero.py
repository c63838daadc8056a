"""The WikiText-2 DDP + ZeRO recipe (configs/wikitext_zero.toml), timed and scored.

Trains the recipe under ``torchrun --nproc-per-node 2`` (DDP + ZeRO-1), then the same recipe in one process
(batch 32 = the same global batch, ZeRO off: nothing to shard), and scores each run's final checkpoint on the
whole WikiText-2 test split (``scaletrain eval --text builtin:wikitext2-test``). Records wall times, the test
perplexities, both training-loss curves and their largest relative difference.

    python benchmarks/wikitext_zero.py [--steps N] [--out benchmarks/results/wikitext_zero.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from launch import OUT_HELP, ROOT, default_out, run_ranks, write_result  # benchmarks/launch.py

RECIPE = ROOT / "configs" / "wikitext_zero.toml"


def train(ranks: int, run_dir: Path, steps: int, extra: list[str]) -> dict:
    t0 = time.perf_counter()
    run_ranks(["-m", "scaletrain.cli", "train", "--config", str(RECIPE), f"--train.run_dir={run_dir}",
               f"--train.steps={steps}", "--logging.progress=plain", *extra], ranks, f"{ranks}-rank training",
              timeout=3600)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    # Disjoint windows of the trained context (--stride 128), as the recorded result was scored; the default
    # sliding windows (stride 64) give each token more context (docs/evaluation.md).
    scored = run_dir / "test.json"
    run_ranks(["-m", "scaletrain.cli", "eval", "--run", str(run_dir), "--text", "builtin:wikitext2-test", "--stride",
               "128", "--json", str(scored)], 1, "test-split evaluation")
    test = json.loads(scored.read_text())
    return {"ranks": ranks, "wall_s": round(wall, 1), "train_loss": losses, "val_loss": vals,
            "test_loss": test["loss"], "test_perplexity": test["perplexity"], "test_tokens": test["tokens"],
            "test_word_perplexity": test["word_perplexity"], "test_bpb": test["bpb"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=default_out("wikitext_zero.json"), help=OUT_HELP.format(name="wikitext_zero.json"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wikitext_zero-"))
    try:
        two = train(2, work / "two", args.steps, [])
        one = train(1, work / "one", args.steps, ["--train.batch_size=32", "--parallel.zero_stage=0"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rel = max(abs(two["train_loss"][s] - one["train_loss"][s]) / abs(one["train_loss"][s]) for s in one["train_loss"])
    result = {"recipe": "configs/wikitext_zero.toml", "steps": args.steps, "two_ranks": two, "one_process": one,
              "max_rel_loss_diff": rel, "test_perplexity_diff": abs(two["test_perplexity"] - one["test_perplexity"])}
    write_result(args.out, result, indent=1)
    print(f"2 ranks: test perplexity {two['test_perplexity']:.2f} ({two['test_tokens']:,} tokens), "
          f"wall {two['wall_s']} s")
    print(f"1 process: test perplexity {one['test_perplexity']:.2f}, wall {one['wall_s']} s; "
          f"loss curves differ by at most {rel:.2e} (relative)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
