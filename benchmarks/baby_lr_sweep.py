"""Steps to nanoGPT's final val loss (1.886) on the baby char recipe: AdamW and Muon over peak lr and warmup.

Each row is one `scaletrain train` of configs/shakespeare_char_baby_adamw.toml stopped at step 600 (the schedule is
still the recipe's 2000-step cosine), evaluated every 100 steps on the recipe's 20 validation batches, eager,
one thread (the losses do not depend on the machine's load, so the sweep can run beside other work; the
time-to-target race is benchmarks/time_to_loss.py). It answers which settings reach 1.886 by step 500, the
eval the recipe runs at its interval of 250 (the recipe: AdamW lr 1e-3, warmup 100, reaches it at ~850).

    python benchmarks/baby_lr_sweep.py [--rows adamw:1e-3:100,muon:3e-3:20] [--out ...]

Writes benchmarks/out/baby_lr_sweep.json unless --out names another file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("adamw:1e-3:100,adamw:1.5e-3:100,adamw:3e-3:100,adamw:1e-3:20,"
        "muon:1e-3:100,muon:2e-3:100,muon:3e-3:100,muon:4e-3:100,muon:2e-3:20,muon:3e-3:20")
TARGET = 1.886


# Keller Jordan's Muon recipe (https://kellerjordan.github.io/posts/muon/): the Muon matrices at lr 0.02 with the
# "original" shape adjustment sqrt(max(1, rows/cols)); the row's lr is then the AdamW part's (embedding, head, norms).
KELLER_JORDAN = ["--optim.name=muon", "--optim.muon_lr=0.02", "--optim.muon_adjust_lr=original"]


def run_row(optimizer: str, lr: str, warmup: str, scratch: Path) -> dict:
    run_dir = scratch / f"{optimizer}-{lr}-{warmup}"
    flags = KELLER_JORDAN if optimizer == "muon_kj" else [f"--optim.name={optimizer}"]
    cmd = [sys.executable, "-m", "scaletrain", "train",
           "--config", str(ROOT / "configs/shakespeare_char_baby_adamw.toml"),
           "--train.compile=false", "--train.stop_at_step=600", "--train.eval_interval=100",
           "--train.sample_tokens=0", "--checkpoint.enabled=false", *flags,
           f"--optim.lr={lr}", f"--schedule.warmup_steps={warmup}", f"--train.run_dir={run_dir}",
           "--logging.progress=off", "--logging.tensorboard=false"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {str(r["step"]): round(r["val_loss"], 4) for r in evals if "val_loss" in r}
    hit = next((int(step) for step, loss in curve.items() if loss <= TARGET), None)
    return {"optimizer": optimizer, "lr": float(lr), "warmup": int(warmup), "val_loss": curve,
            "first_eval_at_or_below_target": hit}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=ROWS, help="optimizer:lr:warmup, comma-separated; optimizer adamw, muon or "
                        "muon_kj (Keller Jordan's: Muon at 0.02, original scaling; lr is then AdamW's part)")
    parser.add_argument("--out", default=default_out("baby_lr_sweep.json"),
                        help=OUT_HELP.format(name="baby_lr_sweep.json"))
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="lr-sweep-"))
    rows = []
    for spec in args.rows.split(","):
        rows.append(run_row(*spec.split(":"), scratch))
        r = rows[-1]
        curve = " ".join(f"{s}:{v}" for s, v in r["val_loss"].items())
        print(f"{r['optimizer']:5s} lr {r['lr']:<7g} warmup {r['warmup']:3d}: {curve}  -> {TARGET} at "
              f"{r['first_eval_at_or_below_target']}", flush=True)
    write_result(args.out, {"benchmark": "baby_lr_sweep", "target": TARGET, "rows": rows}, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
