"""The md5 of every logged loss of five short runs, to show a refactor left training bit for bit unchanged.

Runs, each in a fresh process with one thread (so the reductions' order is fixed) and the loss logged every step:

- ``default``: ``scaletrain train`` with the embedded default config, 30 steps;
- ``baby``: ``configs/shakespeare_char_baby.toml`` (Muon), 30 steps;
- ``lora``: ``scaletrain finetune --from`` a tiny Llama-family base (tests/fixtures/families/llama.json built in
  transformers with seeded random weights, as tests/finetune/test_families_finetune.py builds it), LoRA, 20 steps;
- ``dpo``: ``scaletrain finetune --from`` the same base, DPO (``finetune.objective=dpo``, LoRA, its reference the
  base through disabled adapters) on a tiny preference JSONL written by this script, 10 steps;
- ``zero2``: the DeepSpeed engine, ZeRO-2 on 2 gloo ranks, 20 steps (skipped when DeepSpeed is not importable).

The md5 is of the JSON list ``[[step, loss], ...]`` read from the run's metrics.jsonl (Python's float repr is exact).
Run it before and after a change and compare the table::

    nice -n 19 .venv/bin/python scripts/loss_md5.py [--only default,baby] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TEXT = ROOT / "src/scaletrain/assets/tinyshakespeare/input.txt"
QUIET = ["--train.sample_tokens=0", "--logging.log_interval=1", "--logging.progress=off",
         "--logging.tensorboard=false"]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain.cli", *args]


def losses(run: Path) -> list[list]:
    """[[step, loss], ...] in step order from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted([r["step"], r["loss"]] for r in records if "loss" in r)


def _base(work: Path) -> Path:
    """The fixture Llama base as a user downloads it (config, safetensors, a ChatML tokenizer)."""
    import torch
    import transformers

    folder = work / "base-llama"
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**json.loads((FIXTURES / "families/llama.json").read_text()))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    for file in (FIXTURES / "chatml_tokenizer").iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def run_default(work: Path) -> Path:
    run = work / "default"
    _run(_cli("train", "--train.steps=30", "--train.eval_interval=0", f"--train.run_dir={run}",
              f"--data.cache_dir={work / 'data-default'}", *QUIET))
    return run


def run_baby(work: Path) -> Path:
    run = work / "baby"
    _run(_cli("train", "--config", str(ROOT / "configs/shakespeare_char_baby.toml"), "--train.steps=30",
              "--train.eval_interval=0", f"--train.run_dir={run}", f"--data.cache_dir={work / 'data-baby'}", *QUIET))
    return run


def run_lora(work: Path) -> Path:
    run, text = work / "lora", work / "text.txt"
    text.write_text(TEXT.read_text(encoding="utf-8")[:12000], encoding="utf-8")
    _run(_cli("finetune", "--from", str(_base(work)), "--finetune.method=lora", "--finetune.lora_targets=q,k,v,o",
              f"--data.path={text}", f"--data.cache_dir={work / 'data-lora'}", "--data.seq_len=32",
              "--train.batch_size=2", "--train.steps=20", "--train.eval_interval=0", "--train.precision=fp32",
              "--schedule.warmup_steps=2", "--optim.lr=0.01", "--checkpoint.interval=0",
              f"--train.run_dir={run}", *QUIET))
    return run


# One pair a line, as docs/finetuning.md describes ``finetune.preferences``: a prompt, a chosen and a rejected answer.
PAIRS = [("Who speaks first?", "The king speaks first.", "A dog barks first."),
         ("What is the hour?", "It is near midnight.", "Fish are in the sea."),
         ("Where is the duke?", "The duke is at court.", "Bread is made of flour."),
         ("Who loves Juliet?", "Romeo loves her.", "The moon is cheese."),
         ("What does the fool sing?", "A song of rain.", "Numbers and sums."),
         ("Who rules Denmark?", "Claudius rules now.", "A cat rules it.")]


def run_dpo(work: Path) -> Path:
    run, pairs = work / "dpo", work / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS),
                     encoding="utf-8")
    base = work / "base-llama"
    _run(_cli("finetune", "--from", str(base if base.exists() else _base(work)), "--finetune.objective=dpo",
              "--finetune.method=lora", "--finetune.lora_targets=q,k,v,o", f"--finetune.preferences={pairs}",
              "--data.seq_len=48", "--train.batch_size=2", "--train.steps=10", "--train.eval_interval=0",
              "--train.precision=fp32", "--schedule.warmup_steps=2", "--optim.lr=0.01", "--checkpoint.interval=0",
              f"--train.run_dir={run}", *QUIET))
    return run


def run_zero2(work: Path) -> Path:
    run = work / "zero2"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
          "scaletrain.cli", "train", "--config", str(ROOT / "docs/examples/tiny.toml"),
          "--parallel.engine=deepspeed", "--parallel.zero_stage=2", "--train.precision=fp32", "--train.steps=20",
          "--train.eval_interval=0", "--checkpoint.interval=0", f"--train.run_dir={run}",
          f"--data.cache_dir={work / 'data-zero2'}", *QUIET])
    return run


RUNS = {"default": run_default, "baby": run_baby, "lora": run_lora, "dpo": run_dpo, "zero2": run_zero2}


def _deepspeed_missing() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the run is skipped
        return True
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(RUNS), help="comma-separated runs: " + ", ".join(RUNS))
    parser.add_argument("--keep", type=Path, help="write the runs here (default: a temporary folder, removed)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="loss_md5-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"{'run':8} {'steps':>5} {'md5 of [[step, loss], ...]':32}  last loss")
        for name in args.only.split(","):
            if name == "zero2" and _deepspeed_missing():
                print(f"{name:8} skipped: deepspeed is not importable")
                continue
            logged = losses(RUNS[name](work))
            digest = hashlib.md5(json.dumps(logged).encode()).hexdigest()
            print(f"{name:8} {len(logged):>5} {digest}  {logged[-1][1]!r}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
