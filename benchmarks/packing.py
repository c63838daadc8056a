"""Padded vs packed fine-tuning rows (finetune.packing) at sequence 1024 on a chat set with a skewed length
distribution: target tokens per second, the step's peak live tensor bytes, and the loss equality (the packed
loss over a set of examples against the padded loss over the same examples).

    python benchmarks/packing.py [--examples 256] [--steps 4] [--dim 256 --layers 4] [--out ...]

The chat set is built from the bundled Tiny Shakespeare (so it needs no ../shared): the play's speeches in
order; each example is a user turn (one speech) and an assistant turn (the following 1 + G speeches, G geometric
with p = 0.35), rendered in the plain chat template with the character tokenizer, the assistant's words the
targets. Speech lengths are themselves skewed (a median of ~80 characters, a tail past 1,000), so example
lengths vary more than tenfold, as chat data does; examples longer than 1,025 tokens are cut, as the trainer cuts
them. ``--source FILE`` builds the same from another text (e.g. a Gutenberg book of ../shared/data; blank
lines separate its "speeches").

Three modes run the trainer's own step (``build_parallel_training`` + ``training_step``, fp32, one process) on
the rows ``InstructionLoader`` gives them (packed: the block-causal mask from its document ids): padded; packed,
whose attention runs a document at a time on a CPU; and packed through SDPA's explicit-mask kernel over the whole
row (the accelerator's path), side by side. The step times
are wall-clock: on a machine shared with other jobs they are noise, so rerun it quietly for the throughput
(``--threads`` pins torch's threads); the memory and equality numbers do not depend on the load.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

from launch import OUT_HELP, ROOT, default_out, write_result  # benchmarks/launch.py (on sys.path)

SEQ = 1024


def chat_examples(text: str, count: int, seed: int) -> tuple[list, object]:
    """``count`` (ids, is_target) chat examples from ``text``'s speeches (blank-line separated), and the tokenizer."""
    from scaletrain.data.instructions import encode_example, message_segments
    from scaletrain.data.tokenizer import CharTokenizer

    speeches = [s.strip() for s in re.split(r"\n\s*\n", text) if s.strip()]
    tokenizer = CharTokenizer(sorted(set(text)))
    rng = np.random.default_rng(seed)
    examples, at = [], 0
    while len(examples) < count and at + 2 < len(speeches):
        answer = int(rng.geometric(0.35))  # speeches in the answer: 1, 2, ... (mean 2.9)
        messages = [{"role": "user", "content": speeches[at]},
                    {"role": "assistant", "content": "\n\n".join(speeches[at + 1:at + 1 + answer])}]
        ids, target = encode_example(message_segments(messages), tokenizer)
        examples.append((np.array(ids, dtype=np.int64), np.array(target, dtype=bool)))
        at += 1 + answer
    return examples, tokenizer


def run_mode(examples: list, vocab: int, packed: bool, args, masked: bool = False) -> dict:
    """Target tokens per second, peak live tensor bytes of one step, rows, for one mode. ``masked``: packed rows
    through SDPA's explicit-mask kernel over the whole T x T square (what an accelerator runs) instead of the
    CPU's attention a document at a time (``model/llama.document_spans`` made to find no spans)."""
    import scaletrain.model.decoder as llama

    spans = llama.document_spans
    if masked:
        llama.document_spans = lambda attn_mask: None
    try:
        return _run_mode(examples, vocab, packed, args) | {"masked_kernel": masked}
    finally:
        llama.document_spans = spans


def _run_mode(examples: list, vocab: int, packed: bool, args) -> dict:
    import torch

    from scaletrain.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
    from scaletrain.data.instructions import InstructionLoader
    from scaletrain.data.loader import block_causal_mask
    from scaletrain.parallel import ParallelDims
    from scaletrain.plan.measure import LiveTensorBytes
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    torch.manual_seed(0)
    model = ModelConfig(vocab_size=vocab, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64 or 1,
                        ffn_hidden_dim=args.dim * 8 // 3, max_seq_len=SEQ)
    cfg = JobConfig(model=model, train=TrainConfig(seed=0, precision="fp32", batch_size=args.batch))
    tracker = LiveTensorBytes().__enter__()
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))
    loader = InstructionLoader(examples, SEQ, args.batch, seed=0, packed=packed)

    def micro():
        batch = next(loader)
        mask = block_causal_mask(batch[2]) if packed else None
        micro.targets += int((batch[1] != -100).sum())
        return iter([(batch[0], batch[1], mask)])

    micro.targets = 0
    training_step(pm, optimizer, micro(), 1, StepOptions(grad_clip=1.0))  # warm-up: AdamW's states
    tracker.peak = tracker.live
    training_step(pm, optimizer, micro(), 1, StepOptions(grad_clip=1.0))
    tracker.__exit__(None, None, None)
    micro.targets, started = 0, time.perf_counter()
    for _ in range(args.steps):
        training_step(pm, optimizer, micro(), 1, StepOptions(grad_clip=1.0))
    seconds = time.perf_counter() - started
    real = sum(min(len(ids), SEQ + 1) - 1 for ids, _ in examples)  # positions that are no padding
    return {"packed": packed, "rows": len(loader.inputs), "filled_fraction": real / loader.inputs.numel(),
            "target_tokens_per_row": float((loader.targets != -100).sum() / len(loader.inputs)),
            "peak_bytes": tracker.peak, "target_tokens_per_second": micro.targets / seconds, "seconds": seconds}


def loss_equality(examples: list, vocab: int, args) -> float:
    """|packed - padded| mean loss over the same examples (one fresh model, no gradient)."""
    import torch
    import torch.nn.functional as F

    from scaletrain.config import ModelConfig
    from scaletrain.data.instructions import make_rows, pack_rows
    from scaletrain.data.loader import block_causal_mask
    from scaletrain.model import build_model

    model = build_model(ModelConfig(vocab_size=vocab, dim=args.dim, n_layers=args.layers,
                                    n_heads=args.dim // 64 or 1, ffn_hidden_dim=args.dim * 8 // 3,
                                    max_seq_len=SEQ), seed=0).eval()
    subset = examples[:args.equality_examples]
    with torch.no_grad():
        inputs, targets, doc_ids = pack_rows(subset, SEQ)
        packed = F.cross_entropy(model(inputs, attn_mask=block_causal_mask(doc_ids)).flatten(0, 1), targets.flatten())
        inputs, targets = make_rows(subset, SEQ)
        padded = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    return abs(float(packed) - float(padded))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(ROOT / "src/scaletrain/assets/tinyshakespeare/input.txt"))
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="timed steps a mode")
    parser.add_argument("--batch", type=int, default=4, help="rows a step")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--equality-examples", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=default_out("packing.json"), help=OUT_HELP.format(name="packing.json"))
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    examples, tokenizer = chat_examples(Path(args.source).read_text(encoding="utf-8"), args.examples, seed=0)
    lengths = np.array([len(ids) for ids, _ in examples])
    rows = [run_mode(examples, tokenizer.vocab_size, packed, args, masked)
            for packed, masked in ((False, False), (True, False), (True, True))]
    difference = loss_equality(examples, tokenizer.vocab_size, args)
    print(f"{len(examples)} chat examples from {args.source}: tokens median {int(np.median(lengths))}, "
          f"p10 {int(np.percentile(lengths, 10))}, p90 {int(np.percentile(lengths, 90))}, max {lengths.max()}")
    print("| rows | count | filled | target tokens/s | peak MiB |\n|---|---|---|---|---|")
    for r in rows:
        mode = ("packed, masked kernel" if r["masked_kernel"] else "packed") if r["packed"] else "padded"
        print(f"| {mode} | {r['rows']} | {100 * r['filled_fraction']:.1f}% | "
              f"{r['target_tokens_per_second']:.0f} | {r['peak_bytes'] / 2**20:.1f} |")
    speedup = rows[1]["target_tokens_per_second"] / rows[0]["target_tokens_per_second"]
    masked_speedup = rows[2]["target_tokens_per_second"] / rows[0]["target_tokens_per_second"]
    print(f"packed / padded target tokens/s: {speedup:.2f}x ({masked_speedup:.2f}x through the masked kernel; wall "
          f"clock, side by side: quiet cores only); "
          f"|packed - padded| loss over {args.equality_examples} examples: {difference:.2e}")
    source = Path(args.source).resolve()
    result = {"seq_len": SEQ, "source": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source),
              "examples": len(examples),
              "length_percentiles": {str(p): float(np.percentile(lengths, p)) for p in (10, 50, 90, 100)},
              "model": {"dim": args.dim, "layers": args.layers}, "batch": args.batch, "steps": args.steps,
              "threads": torch.get_num_threads(), "rows": rows, "speedup": speedup,
              "masked_kernel_speedup": masked_speedup,
              "loss_abs_difference": difference, "equality_examples": args.equality_examples}
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
