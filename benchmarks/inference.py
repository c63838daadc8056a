"""Decode speed on this CPU: our generation with the KV cache vs without it, and vs transformers' ``generate`` on
the same model exported as a Hugging Face folder (``scaletrain export``'s ``export_hf``).

    python benchmarks/inference.py [--models small qwen2.5-0.5b-shape] [--rounds 3] [--out FILE]

Batch 1, a 64-token random prompt, 512 tokens generated greedily (no stop token), random weights (speed does not
depend on them), fp32, one thread (``--threads``; on this machine's 2 cores shared with other jobs, 2 threads ran
the ``small`` decode at 1 token/s against 22 with one: oversubscribed OpenMP threads wait on each other). Two
shapes:

- ``small``: our preset (6 x 512, 8 heads / 4 KV heads, SwiGLU 1408) with GPT-2's padded vocabulary 50304;
- ``qwen2.5-0.5b-shape``: Qwen2.5-0.5B's sizes (24 x 896, 14 heads / 2 KV heads of 64, SwiGLU 4864, vocabulary
  151936, tied embeddings, rope theta 1e6) as a Llama layout: our model has no q/k/v bias, which Qwen2 has
  (3 vectors a block, a negligible share of the compute), so it is an approximation of its cost, not Qwen2.

Measured per round, interleaved (ours, then transformers; the order swapped every other round; medians
reported), because the machine is shared and its load moves the numbers of one run by 2x or more:

- ours with the cache: ``model.generate.decode_speed`` (prefill = the first step; decode = the other 511 tokens);
- transformers: ``generate(max_new_tokens=512)`` minus ``generate(max_new_tokens=1)`` for the decode rate, with
  its default dynamic cache, greedy, ``min_new_tokens`` so that both generate all 512;
- ours without the cache: each new token re-runs the whole context, so a step at context L costs one forward
  of L tokens. Running all 512 steps takes minutes per round at these sizes, so the forward is timed at 5
  contexts (64, 192, 320, 447, 575 tokens) and the 511 decode steps are summed by linear interpolation; the
  ``small`` shape also runs it for real once (``no_cache_measured``) to check that estimate.

Greedy tokens of ours (cache) and transformers are compared too (random weights: a near-tie may flip one).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)
from scaletrain.checkpoint.export import export_hf
from scaletrain.config import ModelConfig, build
from scaletrain.data.tokenizer import CharTokenizer
from scaletrain.model import PRESETS, build_model
from scaletrain.model.generate import decode_speed, generate_batch

PROMPT = 64
NEW = 512  # --new-tokens
SHAPES = {
    "small": dict(preset="small", vocab_size=50304, max_seq_len=1024),
    "qwen2.5-0.5b-shape": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, ffn_hidden_dim=4864,
                               vocab_size=151936, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6,
                               max_seq_len=1024),
}


def hf_model(model, cfg: ModelConfig, folder: Path):
    from transformers import LlamaForCausalLM

    export_hf(model, cfg, CharTokenizer([chr(0x10000 + i) for i in range(cfg.vocab_size)]), folder)
    return LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()


@torch.no_grad()
def hf_rates(hf, prompt: list[int]) -> dict:
    ids = torch.tensor([prompt])

    def run(n):
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, out[0, len(prompt):].tolist()

    first, _ = run(1)
    total, tokens = run(NEW)
    return {"prefill_seconds": first, "decode_tokens_per_second": (NEW - 1) / (total - first),
            "end_to_end_tokens_per_second": NEW / total, "tokens": tokens}


@torch.no_grad()
def no_cache_estimate(model, vocab: int) -> dict:
    """Seconds of one no-cache step (a forward of L tokens, the head on all of them, as ``stream`` runs it)
    at 5 contexts from the prompt's to the last step's; the NEW - 1 decode steps' total by linear interpolation."""
    gen = torch.Generator().manual_seed(1)
    times = {}
    xs = [PROMPT + round(i * (NEW - 1) / 4) for i in range(5)]
    for length in xs:
        tokens = torch.randint(0, vocab, (1, length), generator=gen)
        start = time.perf_counter()
        model(tokens)[:, -1].argmax(-1)
        times[length] = time.perf_counter() - start
    total = 0.0
    for length in range(PROMPT + 1, PROMPT + NEW):  # contexts of the decode steps 2..NEW
        i = max(j for j in range(len(xs) - 1) if xs[j] <= length) if length < xs[-1] else len(xs) - 2
        w = (length - xs[i]) / (xs[i + 1] - xs[i])
        total += times[xs[i]] * (1 - w) + times[xs[i + 1]] * w
    return {"step_seconds": {str(k): v for k, v in times.items()}, "decode_tokens_per_second": (NEW - 1) / total}


def measure(name: str, rounds: int, real_no_cache: bool) -> dict:
    cfg = build(ModelConfig, SHAPES[name], presets=PRESETS)
    model = build_model(cfg, seed=0).eval()
    params = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model(model, cfg, Path(tmp) / "hf")
    ours_tokens = generate_batch(model, [prompt], NEW, max_seq_len=PROMPT + NEW)[0]
    runs = {"cache": [], "transformers": [], "no_cache": []}
    for r in range(rounds):
        order = ["cache", "transformers", "no_cache"]
        for what in order if r % 2 == 0 else order[::-1]:
            if what == "cache":
                runs[what].append(decode_speed(model, cfg.vocab_size, PROMPT, NEW, seed=0))
            elif what == "transformers":
                runs[what].append(hf_rates(hf, prompt))
            else:
                runs[what].append(no_cache_estimate(model, cfg.vocab_size))
        print(f"{name} round {r + 1}: cache {runs['cache'][-1]['decode_tokens_per_second']:.1f}, transformers "
              f"{runs['transformers'][-1]['decode_tokens_per_second']:.1f}, no cache (est.) "
              f"{runs['no_cache'][-1]['decode_tokens_per_second']:.2f} tok/s", flush=True)
    med = {k: statistics.median(x["decode_tokens_per_second"] for x in v) for k, v in runs.items()}
    ratio = {k: statistics.median(a["decode_tokens_per_second"] / b["decode_tokens_per_second"]
                                  for a, b in zip(runs["cache"], runs[k])) for k in ("transformers", "no_cache")}
    hf_tokens = runs["transformers"][0]["tokens"]
    same = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), len(ours_tokens))
    row = {"parameters": params, "config": SHAPES[name], "new_tokens": NEW,
           "decode_tokens_per_second": {k: round(v, 2) for k, v in med.items()},
           "prefill_tokens_per_second_cache": round(statistics.median(
               x["prefill_tokens_per_second"] for x in runs["cache"]), 1),
           "cache_speedup_vs_no_cache": round(ratio["no_cache"], 2),
           "cache_vs_transformers": round(ratio["transformers"], 3),
           "greedy_tokens_equal_to_transformers": same, "rounds": rounds,
           "per_round": {k: [round(x["decode_tokens_per_second"], 2) for x in v] for k, v in runs.items()},
           "no_cache_step_seconds": runs["no_cache"][0]["step_seconds"]}
    if real_no_cache:  # the estimate checked against a real run of all 512 steps
        start = time.perf_counter()
        generate_batch(model, [prompt], NEW, max_seq_len=PROMPT + NEW, use_cache=False)
        row["no_cache_measured_end_to_end_tokens_per_second"] = round(NEW / (time.perf_counter() - start), 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    parser.add_argument("--new-tokens", type=int, default=512, help="tokens generated after the prompt")
    parser.add_argument("--merge", action="store_true",
                        help="add these models' rows to the JSON already at --out (models run separately)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on 2 cores shared with other jobs, 2 threads measured 20x slower)")
    parser.add_argument("--out", default=default_out("inference.json"), help=OUT_HELP.format(name="inference.json"))
    args = parser.parse_args()
    import transformers

    global NEW
    NEW = args.new_tokens
    torch.set_num_threads(args.threads)

    rows = {name: measure(name, args.rounds, real_no_cache=name == "small") for name in args.models}
    if args.merge and Path(args.out).is_file():
        rows = {**json.loads(Path(args.out).read_text())["models"], **rows}
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "transformers": transformers.__version__,
                          "note": "2 cores shared with other users' jobs: interleaved rounds, medians"},
              "prompt_tokens": PROMPT, "batch": 1, "models": rows}
    print(f"{'model':<20} {'params':>8} {'cache tok/s':>12} {'no cache':>9} {'speed-up':>9} {'transformers':>13} "
          f"{'ours/HF':>8}")
    for name, r in rows.items():
        d = r["decode_tokens_per_second"]
        print(f"{name:<20} {r['parameters'] / 1e6:>7.1f}M {d['cache']:>12.1f} {d['no_cache']:>9.2f} "
              f"{r['cache_speedup_vs_no_cache']:>8.1f}x {d['transformers']:>13.1f} {r['cache_vs_transformers']:>7.2f}x")
    write_result(args.out, result, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
