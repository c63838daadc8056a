"""Peak memory of a fine-tuning step with the whole logits (train.loss_chunk_rows = 0, before issue 38) and with
the chunked loss (-1, the default now), on the Qwen2.5-0.5B shape (dim 896, 14/2 heads, FFN 4864, a tied
151,936-token vocabulary), LoRA and full fine-tuning, batch 4 x 1024; and the planner's prediction for each
(scaletrain.plan.finetune.finetune_memory, the tensor bytes it plans; target within 10% of the measured peak).

    python benchmarks/chunked_loss.py [--layers 2] [--out benchmarks/results/chunked_loss.json]
    python benchmarks/chunked_loss.py --host --out benchmarks/results/chunked_loss_host.json

``--host``: what one chunk costs the host, whatever its size (the Python loop and the operators it dispatches,
each a kernel launch on a GPU): the loss's forward and backward on tiny tensors (d 16, vocabulary 32) by chunks
of one position against one chunk, the difference per chunk (median of 7), and the operators a chunk dispatches
(counted with a dispatch mode). Why the auto chunk is larger on an accelerator (``model.loss.chunk_bytes``).

The measured peak is the exact peak of live tensor bytes (scaletrain.plan.measure.LiveTensorBytes, what
benchmarks/finetune_plan.py checks the planner with) of the trainer's own step (build_parallel_training +
training_step, fp32), in the step after one warm-up step (AdamW's states exist). The weights are random
(a random model of the shape exported to a temporary Hugging Face folder), each case in a fresh process.
``--layers``: the blocks kept (the published 24 by default would need ~25 GB for full fine-tuning with the whole
logits; the head's and the loss's bytes do not depend on the depth, and the planner is checked on the same
shape it is given). Memory is safe to measure on a loaded machine; the step's seconds are recorded but are noise
there.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

BATCH, SEQ = 4, 1024
METHODS = {"lora": {"method": "lora", "lora_rank": 8, "lora_targets": ["q", "k", "v", "o"]}, "full": {"method": "full"}}


def model_fields(layers: int) -> dict:
    """The Qwen2.5-0.5B preset with ``layers`` blocks and a context of SEQ."""
    from scaletrain.model.presets import PRESETS

    return {**PRESETS["qwen2.5-0.5b"], "n_layers": layers, "max_seq_len": SEQ}


def measure(method: str, loss_rows: int, base: str, layers: int) -> dict:
    """One step's peak live tensor bytes and the planner's prediction for ``method`` with ``loss_rows``."""
    import torch

    from scaletrain.config import FinetuneConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
    from scaletrain.parallel import ParallelDims
    from scaletrain.plan.finetune import finetune_memory
    from scaletrain.plan.measure import LiveTensorBytes, resident_extras
    from scaletrain.plan.workload import Plan, Workload
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    model = ModelConfig(**model_fields(layers))
    ft = FinetuneConfig(source=base, **METHODS[method])
    cfg = JobConfig(model=model, finetune=ft, train=TrainConfig(seed=0, precision="fp32", loss_chunk_rows=loss_rows))
    tracker = LiveTensorBytes().__enter__()
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    micro = [(torch.randint(0, model.vocab_size, (BATCH, SEQ), generator=gen),
              torch.randint(0, model.vocab_size, (BATCH, SEQ), generator=gen), None)]
    losses = [training_step(pm, optimizer, iter(micro), 1, StepOptions(grad_clip=1.0)).loss]  # warm-up: AdamW's states
    tracker.peak = tracker.live
    started = time.perf_counter()
    losses.append(training_step(pm, optimizer, iter(micro), 1, StepOptions(grad_clip=1.0)).loss)
    seconds = time.perf_counter() - started
    tracker.__exit__(None, None, None)
    workload = Workload(model=model, seq_len=SEQ, global_batch=BATCH, train_tokens=BATCH * SEQ,
                        loss_chunk_rows=loss_rows)
    predicted = finetune_memory(workload, Plan(micro_batch=BATCH), ft, "cpu")
    predicted_bytes = predicted["tensor_total"] + resident_extras(model, BATCH, SEQ)
    return {"method": method, "loss_chunk_rows": loss_rows, "losses": losses, "measured_peak_bytes": tracker.peak,
            "predicted_bytes": predicted_bytes, "memory_error": predicted_bytes / tracker.peak - 1,
            "peak_phase": predicted["peak_phase"], "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            * 1024, "step_seconds_noisy": seconds}


def host_cost(positions: int = 2048, repeats: int = 7) -> dict:
    """Host seconds and dispatched operators a chunk of the chunked loss costs, forward and backward."""
    import statistics

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from scaletrain.model.loss import chunked_cross_entropy

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    hidden = torch.randn(positions, 16, requires_grad=True)
    weight = torch.randn(32, 16, requires_grad=True)
    targets = torch.randint(0, 32, (positions,))

    def step(rows: int) -> float:
        start = time.perf_counter()
        chunked_cross_entropy(hidden, weight, targets, rows=rows).backward()
        return time.perf_counter() - start

    def ops(rows: int) -> int:
        Count.ops = 0
        with Count():
            chunked_cross_entropy(hidden, weight, targets, rows=rows).backward()
        return Count.ops

    step(1), step(positions)  # warm-up
    one = statistics.median(step(1) for _ in range(repeats))
    whole = statistics.median(step(positions) for _ in range(repeats))
    per_chunk_ops = (ops(1) - ops(positions)) / (positions - 1)
    return {"positions": positions, "dim": 16, "vocab": 32, "threads": torch.get_num_threads(),
            "seconds_one_position_chunks": one, "seconds_one_chunk": whole,
            "host_seconds_per_chunk": (one - whole) / (positions - 1), "operators_per_chunk": per_chunk_ops,
            "torch": torch.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # child: METHOD LOSS_ROWS BASE LAYERS
    parser.add_argument("--layers", type=int, default=2, help="blocks of the Qwen2.5-0.5B shape kept (24 published)")
    parser.add_argument("--methods", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--out", default=default_out("chunked_loss.json"),
                        help=OUT_HELP.format(name="chunked_loss.json"))
    parser.add_argument("--host", action="store_true", help="only the host's cost of one chunk (tiny tensors)")
    args = parser.parse_args()
    if args.host:
        result = host_cost()
        print(f"{result['host_seconds_per_chunk'] * 1e3:.3f} ms and {result['operators_per_chunk']:.0f} operators "
              f"a chunk (forward + backward) on the host")
        write_result(args.out, result)
        return 0
    if args.one:
        method, rows, base, layers = args.one
        print(json.dumps(measure(method, int(rows), base, int(layers))))
        return 0
    from tokenizers import Tokenizer, models

    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import BPETokenizer
    from scaletrain.model import build_model

    fields = model_fields(args.layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = BPETokenizer(Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(fields["vocab_size"])},
                                                           unk_token="t0")))
        export_hf(build_model(ModelConfig(**fields), seed=0), ModelConfig(**fields), tokenizer, tmp)
        for method in args.methods.split(","):
            for loss_rows in (0, -1):  # before (the whole logits), after (the chunked loss, auto)
                proc = subprocess.run([sys.executable, __file__, "--one", method, str(loss_rows), tmp,
                                       str(args.layers)], capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-3000:])
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                kind = "chunked" if loss_rows else "whole  "
                print(f"{method:5s} {kind}: measured {r['measured_peak_bytes'] / 2**30:6.2f} GiB, planned "
                      f"{r['predicted_bytes'] / 2**30:6.2f} GiB ({100 * r['memory_error']:+5.1f}%, "
                      f"{r['peak_phase']}), losses {r['losses'][0]:.6f} {r['losses'][1]:.6f}", flush=True)
    result = {"model": fields, "batch": BATCH, "seq_len": SEQ, "precision": "fp32", "rows": rows,
              "max_abs_memory_error_chunked": max(abs(r["memory_error"]) for r in rows if r["loss_chunk_rows"])}
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
