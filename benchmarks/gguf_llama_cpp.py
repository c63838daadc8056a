"""The GGUF export run by a real llama.cpp (through llama-cpp-python): same greedy tokens as ours, sizes and speed.

    pip install llama-cpp-python   # builds llama.cpp from source with the system compiler (minutes)
    python benchmarks/gguf_llama_cpp.py [--out benchmarks/results/gguf.json]

Trains a small run on the bundled Tiny Shakespeare (character vocabulary; 4 x 128, 4 heads / 2 KV heads, so the
q/k permutation is exercised with grouped-query attention), exports it with ``scaletrain export --format gguf``
at f32, f16 and q8_0, loads each file with ``llama_cpp.Llama`` and generates 32 tokens greedily after the same
prompt ids as ours (``model.generate``, with the KV cache). Reported per dtype: file size, the number of leading
greedy tokens equal to ours (f32 must match all 32), llama.cpp's decode tokens/s (one thread) beside ours; and
whether llama.cpp's own tokenizer encodes the prompt text to our ids and finds the chat template.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "out" / "gguf"
PROMPT, NEW = "ROMEO:\nWhat light through yonder window breaks?", 32
TRAIN = {"model.dim": "128", "model.n_layers": "4", "model.n_heads": "4", "model.n_kv_heads": "2",
         "model.ffn_hidden_dim": "344", "model.max_seq_len": "128", "data.seq_len": "128", "train.batch_size": "8",
         "train.steps": "300", "train.eval_interval": "0", "train.sample_tokens": "0", "logging.progress": "off",
         "logging.tensorboard": "false", "train.precision": "fp32"}


def scaletrain(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "scaletrain", *args], check=True, cwd=ROOT,
                   env={"OMP_NUM_THREADS": "1", **os.environ})


def llama_tokens(path: Path, prompt: list[int], text: str) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=128, n_threads=1, n_batch=128, verbose=False)
    start = time.perf_counter()
    tokens = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == 1:
            first = time.perf_counter()
        if len(tokens) == NEW:
            break
    end = time.perf_counter()
    return {"tokens": tokens, "decode_tokens_per_second": (NEW - 1) / (end - first),
            "prefill_seconds": first - start,
            "tokenizer_matches": llm.tokenize(text.encode(), add_bos=False, special=False) == prompt,
            "chat_template": "Assistant:" in llm.metadata.get("tokenizer.chat_template", "")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out("gguf.json"), help=OUT_HELP.format(name="gguf.json"))
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("needs llama-cpp-python: pip install llama-cpp-python (builds llama.cpp from source)", file=sys.stderr)
        return 1
    import torch

    from scaletrain.infer.load import load_run
    from scaletrain.model.generate import decode_speed, generate

    torch.set_num_threads(1)
    run = WORK / "run"
    if not (run / "checkpoints").is_dir():
        scaletrain("train", *[f"--{k}={v}" for k, v in {**TRAIN, "train.run_dir": str(run)}.items()])
    cfg, model, tokenizer, _ = load_run(run)
    prompt = tokenizer.encode(PROMPT)
    ours = generate(model, prompt, NEW, max_seq_len=cfg.data.seq_len, temperature=0.0,
                    vocab_limit=tokenizer.vocab_size)
    ours_speed = decode_speed(model, tokenizer.vocab_size, len(prompt), NEW)["decode_tokens_per_second"]
    rows = {}
    for dtype in ("f32", "f16", "q8_0"):
        path = WORK / f"model-{dtype}.gguf"
        scaletrain("export", "--run", str(run), "--format", "gguf", "--dtype", dtype, "--out", str(path))
        got = llama_tokens(path, prompt, PROMPT)
        same = next((i for i, (a, b) in enumerate(zip(ours, got["tokens"])) if a != b), min(len(ours), NEW))
        rows[dtype] = {"bytes": path.stat().st_size, "greedy_tokens_equal": same,
                       "llama_cpp_decode_tokens_per_second": round(got["decode_tokens_per_second"], 1),
                       "llama_cpp_text": tokenizer.decode(got["tokens"]),
                       "tokenizer_matches": got["tokenizer_matches"], "chat_template": got["chat_template"]}
        print(f"{dtype}: {path.stat().st_size / 1e6:.2f} MB, {same}/{NEW} greedy tokens equal to ours, llama.cpp "
              f"{got['decode_tokens_per_second']:.0f} tok/s", flush=True)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": 1,
                          "llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
                          "note": "2 cores shared with other users' jobs: speeds are indicative"},
              "run": {**TRAIN, "parameters": sum(p.numel() for p in model.parameters()),
                      "vocab": tokenizer.vocab_size},
              "prompt": PROMPT, "new_tokens": NEW, "ours_text": tokenizer.decode(ours),
              "ours_decode_tokens_per_second": round(ours_speed, 1), "gguf": rows}
    print(f"{'dtype':<6} {'MB':>7} {'equal':>6} {'llama.cpp tok/s':>16} (ours: {ours_speed:.0f} tok/s)")
    for dtype, r in rows.items():
        print(f"{dtype:<6} {r['bytes'] / 1e6:>7.2f} {r['greedy_tokens_equal']:>3}/{NEW} "
              f"{r['llama_cpp_decode_tokens_per_second']:>16.1f}")
    write_result(args.out, result, indent=2)
    print(f"wrote {args.out}")
    return 0 if rows["f32"]["greedy_tokens_equal"] == NEW else 1


if __name__ == "__main__":
    sys.exit(main())
