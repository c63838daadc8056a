"""The fine-tuning planner at full size: `scaletrain finetune --from FOLDER` with QLoRA and LoRA on a
full-size Qwen2.5-0.5B-shaped model (random weights, built in transformers from the published config.json),
its peak memory against `scaletrain plan --finetune.method=... --hardware auto`'s prediction for the same shape, batch
and sequence. Target: within 15%.

    python benchmarks/family_scale.py [--out benchmarks/results/family_scale.json] [--steps 5] [--seq-len 256]

The base folder holds `Qwen2ForCausalLM` with the published shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocabulary 151936, tied embeddings, q/k/v bias, rope base 1e6) in the published dtype
(bfloat16) as `model.safetensors`, with the real Qwen3 tokenizer from ../shared/data/tokenizers (the same
byte-level BPE family; its 151,669 ids fit the 151,936 rows). Without ../shared it says so and exits 2.

Each method runs `scaletrain finetune` in its own process (`builtin:tinyshakespeare`, micro-batch 1); its peak
resident set size (``ru_maxrss`` of the child, read by this process after it exits) and the trainer's own
peak memory log (`peak_memory_mb` in metrics.jsonl, the same RSS seen from inside) are compared with the
planner's per-device total, which includes the runtime (Python + torch) and allocator margins. The machine is
shared: memory is what this checks; the step times are printed for reference only. The planner runs with one
torch thread, whose calibration `scaletrain doctor --clock cpu` caches on a shared machine (run it first); the
memory answer is the same at any thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch import (  # benchmarks/launch.py (the script's folder is on sys.path)
    OUT_HELP,
    ROOT,
    default_out,
    write_result,
)

TOKENIZER = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3"
# Qwen/Qwen2.5-0.5B config.json as published (transformers 4.40.1).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
METHODS = ("qlora", "lora")
PUBLISHED_PARAMETERS = 494_032_768  # Qwen2.5-0.5B's model card: 0.49B (494,032,768 counted on the checkpoint)


def build_base(folder: Path) -> int:
    """Write the random full-size model and the Qwen tokenizer to ``folder``; returns its parameter count."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in QWEN25_05B.items() if k != "architectures"})
    config.architectures = QWEN25_05B["architectures"]
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return count


def saved_parameters(folder: Path) -> int | None:
    """Parameters in ``folder``'s model.safetensors, from its header (None without the file)."""
    if not (folder / "model.safetensors").is_file():
        return None
    import math

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def run_finetune(base: Path, run: Path, method: str, steps: int, seq: int, batch: int) -> dict:
    """``scaletrain finetune`` in a child process: its peak RSS, the trainer's logged peak, seconds."""
    args = [sys.executable, "-m", "scaletrain", "finetune", "--from", str(base), f"--finetune.method={method}",
            "--data.path=builtin:tinyshakespeare", f"--data.seq_len={seq}", f"--train.batch_size={batch}",
            f"--train.steps={steps}", f"--train.run_dir={run}", "--train.eval_interval=0",
            "--logging.log_interval=1", "--checkpoint.interval=0", "--train.eval_batches=1",
            "--train.sample_tokens=0"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"finetune --finetune.method={method} failed:\n{proc.stderr[-3000:]}")
    # RUSAGE_CHILDREN's maxrss is the largest of the waited-for children: run the biggest first, or compare
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    tokens_per_second = [r["tokens_per_second"] for r in logged if "tokens_per_second" in r]
    return {"peak_rss_bytes": after * 1024 if after > before else None,
            "trainer_peak_memory_bytes": max(r["peak_memory_mb"] for r in logged) * 2**20,
            "steps_logged": len(logged), "wall_seconds": seconds, "tokens_per_second": tokens_per_second,
            "precision": _logged_precision(proc.stdout + proc.stderr)}


MEASURED = ("peak_rss_bytes", "trainer_peak_memory_bytes", "steps_logged", "wall_seconds", "tokens_per_second",
            "precision")


def _logged_precision(log: str) -> str:
    m = re.search(r"precision auto -> (\w+)", log)
    return m.group(1) if m else "fp32"


def plan(method: str, seq: int, batch: int, precision: str) -> dict:
    """`scaletrain plan --finetune.method=METHOD --hardware auto` for the preset of the same shape, as JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = [sys.executable, "-m", "scaletrain", "plan", "--model.preset=qwen2.5-0.5b",
                f"--finetune.method={method}", "--hardware", "auto", f"--data.seq_len={seq}", "--global-batch",
                str(batch), "--micro-batch", str(batch), f"--train.precision={precision}", "--json", out.name]
        # One torch thread: the calibration `scaletrain doctor --clock cpu` caches on a shared machine (a busy
        # machine cannot calibrate all threads by wall time); the memory answer does not depend on it.
        proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode not in (0, 2) or not Path(out.name).stat().st_size:
            raise SystemExit(f"plan --method {method} failed:\n{proc.stderr[-3000:]}")
        return {"plan_output": proc.stdout.strip(), **json.loads(Path(out.name).read_text())["finetune"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out("family_scale.json"),
                        help=OUT_HELP.format(name="family_scale.json"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="micro-batch = global batch")
    parser.add_argument("--base", default="", help="reuse this base folder (written there when missing)")
    parser.add_argument("--predict-from", default="",
                        help="a previous result JSON: keep its measurements, ask the planner again (after a change to "
                             "plan/ that cannot change what the trainer does)")
    args = parser.parse_args()
    if not (TOKENIZER / "tokenizer.json").is_file():
        print(f"error: the Qwen tokenizer is not at {TOKENIZER} (../shared/data/tokenizers, absent on a fresh "
              "clone): this benchmark needs it", file=sys.stderr)
        return 2
    rows = []
    previous = json.loads(Path(args.predict_from).read_text()) if args.predict_from else None
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.base) if args.base else Path(tmp) / "qwen2.5-0.5b"
        if not (base / "config.json").is_file() and previous is None:
            base.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            parameters = build_base(base)
            print(f"built {parameters:,} parameters (published {PUBLISHED_PARAMETERS:,}) in "
                  f"{time.perf_counter() - t0:.0f} s at {base}", flush=True)
        else:
            parameters = (previous or {}).get("parameters_built") or saved_parameters(base)
        # The largest expected peak first: RUSAGE_CHILDREN keeps the maximum over the children so far.
        for method in ("lora", "qlora"):
            if previous is not None:
                measured = {k: v for k, v in next(r for r in previous["rows"] if r["method"] == method).items()
                            if k in MEASURED}
            else:
                measured = run_finetune(base, Path(tmp) / f"run-{method}", method, args.steps, args.seq_len,
                                        args.batch)
            predicted = plan(method, args.seq_len, args.batch, measured["precision"])
            row = {"method": method, **measured, "predicted_bytes": predicted["per_device_bytes"],
                   "predicted_tensor_bytes": predicted["tensor_total"], "peak_phase": predicted["peak_phase"],
                   "frozen_bytes": predicted["frozen_bytes"], "activations": predicted["activations"],
                   "weight_casts": predicted["weight_casts"],
                   "trainable_parameters": predicted["trainable_parameters"],
                   "total_parameters": predicted["total_parameters"], "plan_output": predicted["plan_output"]}
            reference = row["peak_rss_bytes"] or row["trainer_peak_memory_bytes"]
            row["error"] = row["predicted_bytes"] / reference - 1
            row["error_vs_trainer_log"] = row["predicted_bytes"] / row["trainer_peak_memory_bytes"] - 1
            rows.append(row)
            print(f"{method:6s} predicted {row['predicted_bytes'] / 2**30:.2f} GiB, peak RSS "
                  f"{(row['peak_rss_bytes'] or 0) / 2**30:.2f} GiB (trainer's log "
                  f"{row['trainer_peak_memory_bytes'] / 2**30:.2f} GiB): error {100 * row['error']:+.1f}%; "
                  f"{row['steps_logged']} steps, precision {row['precision']}, {row['wall_seconds']:.0f} s",
                  flush=True)
    result = {"model": "Qwen2.5-0.5B shape (random weights, bf16 safetensors)", "config": QWEN25_05B,
              "parameters_built": parameters, "published_parameters": PUBLISHED_PARAMETERS,
              "seq_len": args.seq_len, "micro_batch": args.batch, "steps": args.steps, "rows": rows,
              "measurements_from": "this run" if previous is None else previous["measurements_from"]
              if previous["measurements_from"] != "this run" else "an earlier run of this script (--predict-from)",
              "max_abs_error": max(abs(r["error"]) for r in rows)}
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
