"""Where the baby recipe's whole-process wall time goes, against nanoGPT's run of the same steps.

Issue 28 asks for the baby char recipe's whole 2000-step run in <= 1.0x of nanoGPT's wall time. This splits the
difference into its parts, measured in the same minutes:

1. Whole processes, rounds of three runs in an order that alternates round by round: nanoGPT
   (benchmarks/nanogpt_reference.py), `scaletrain train --config configs/shakespeare_char_baby_adamw.toml` as a user
   runs it (AdamW, a 200-character sample at each of its 9 evaluations), and the same run without samples
   (`--train.sample_tokens=0`). From our done line: the median step, and the seconds spent evaluating,
   sampling and checkpointing; start-up is the process's wall minus the training loop's.
2. The step alone, in one process at the runs' 2 threads, alternating in blocks of steps (load on the machine
   slows all three alike): nanoGPT's step (its GPT-2 model, its AdamW, its loop), the same loop training our
   Llama-style model (RMSNorm, rotary, SwiGLU: the architecture's cost), and our trainer's ``step`` (data
   loader, fused AdamW, NaN guard, bookkeeping: the trainer's cost).
3. Where the architecture's cost is, in one block (forward + backward of a (12, 64, 128) input, 2 threads,
   alternating): nanoGPT's GPT-2 block against ours, and their attention, MLP and norm; ours' attention also
   without the rotary embedding.

    python benchmarks/baby_wall.py [--rounds 2] [--steps 2000] [--step-blocks 12]
    python benchmarks/baby_wall.py --parts-only --out FILE   # part 3 alone, added to FILE's result

Writes benchmarks/out/baby_wall.json unless --out names another file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import nanogpt_reference as ng  # benchmarks/ (the script's folder is on sys.path)
from launch import OUT_HELP, default_out, write_result
from scaletrain.config import load_config
from scaletrain.data.run_data import prepare_data
from scaletrain.model import build_model
from scaletrain.train.trainer import Trainer
from time_to_loss import ROOT, run_nanogpt, run_ours

CONFIG = "configs/shakespeare_char_baby_adamw.toml"
VARIANTS = {"ours": [], "ours_no_samples": ["--train.sample_tokens=0"]}
STALL = re.compile(r"\b(eval|sample|checkpoint) ([\d.]+) s\b")


def parse_stalls(line: str) -> dict:
    """Seconds spent evaluating, sampling and checkpointing, from a `done:` line (no sample part when the run
    took none)."""
    stalls = {f"{cause}_s": float(seconds) for cause, seconds in STALL.findall(line)}
    if "eval_s" not in stalls:
        raise RuntimeError(f"unexpected done line: {line!r}")
    return {"sample_s": 0.0, **stalls}


def one_round(index: int, data_dir: Path, steps: int, eval_interval: int, scratch: Path) -> dict:
    names = ["nanogpt", *VARIANTS]
    order = names if index % 2 == 0 else names[::-1]
    out = {"round": index, "order": order}
    for name in order:
        if name == "nanogpt":
            out[name] = run_nanogpt("char", data_dir, steps, eval_interval, 0)
        else:
            run_dir = scratch / f"r{index}-{name}"
            cache = Path(tempfile.mkdtemp(prefix="cache-", dir=scratch))
            result = run_ours(CONFIG, "adamw", cache, run_dir, data_dir,
                              [f"--train.steps={steps}", f"--train.eval_interval={eval_interval}", *VARIANTS[name]])
            result.update(parse_stalls(result["done_line"]))
            # The loop's seconds and the median step, unrounded (the done line rounds them).
            summary = json.loads((run_dir / "run_info.json").read_text())["segments"][-1]["summary"]
            result["loop_s"], result["step_ms"] = summary["loop_seconds"], summary["median_step_ms"]
            result["startup_s"] = result["wall_s"] - result["loop_s"]
            out[name] = result
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"round {index} {name:16s}: whole run {out[name]['wall_s']:.1f} s, final val "
              f"{out[name]['final_val_loss']:.4f}", flush=True)
    for name in VARIANTS:
        out[name]["wall_over_nanogpt"] = out[name]["wall_s"] / out["nanogpt"]["wall_s"]
    return out


def step_side_by_side(data_dir: Path, blocks: int, block: int = 20) -> dict:
    """Median wall ms of a step: nanoGPT's, nanoGPT's loop on our model, our trainer's; blocks of ``block``
    steps each, the order reversed every other block, the first block of each discarded (warm-up)."""
    torch.set_num_threads(2)  # as the runs (both default to the machine's 2 cores)
    rc = ng.CONFIGS["char"]
    splits = ng.load_splits(data_dir)
    scratch = Path(tempfile.mkdtemp(prefix="baby-wall-"))
    try:
        cfg = load_config(str(ROOT / CONFIG), {"train.run_dir": str(scratch / "run"), "data.cache_dir": str(data_dir),
                                               "checkpoint.enabled": "false", "logging.tensorboard": "false"})
        trainer = Trainer(cfg, log=False)
        torch.manual_seed(rc.seed)
        gpt = ng.GPT(rc, 65)
        llama = copy.deepcopy(trainer.model)  # the recipe's model (same config and init), for nanoGPT's loop
        loops = {"nanogpt": _nanogpt_loop(gpt, gpt.configure_optimizers(rc), splits, rc),
                 "nanogpt_loop_our_model": _nanogpt_loop(llama, ng.configure_adamw(llama, rc), splits, rc),
                 "our_trainer": trainer.step}
        times: dict[str, list[float]] = {name: [] for name in loops}
        for b in range(blocks):
            for name, step in (list(loops.items()) if b % 2 == 0 else list(loops.items())[::-1]):
                for _ in range(block):
                    t0 = time.perf_counter()
                    step()
                    if b > 0:
                        times[name].append(time.perf_counter() - t0)
        trainer.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {name: 1000 * statistics.median(t) for name, t in times.items()}
    return {"median_ms": med, "steps_each": len(times["nanogpt"]),
            "architecture": med["nanogpt_loop_our_model"] / med["nanogpt"],
            "trainer": med["our_trainer"] / med["nanogpt_loop_our_model"],
            "ours_over_nanogpt": med["our_trainer"] / med["nanogpt"]}


def block_parts(repeats: int = 30) -> dict:
    """Median ms of forward + backward of one block and its parts, nanoGPT's against ours (see the docstring)."""
    torch.set_num_threads(2)
    cfg = load_config(str(ROOT / CONFIG), {})
    ours = build_model(dataclasses.replace(cfg.model, vocab_size=65), torch.device("cpu"))  # the char vocabulary
    torch.manual_seed(0)
    theirs = ng.GPT(ng.CONFIGS["char"], 65).transformer.h[0]
    block, seq = ours.layers["0"], cfg.data.seq_len
    cos, sin = ours.rope_cos[:seq], ours.rope_sin[:seq]
    attention, head_dim = block.attention, block.attention.head_dim
    x0, grad = torch.randn(12, seq, cfg.model.dim), torch.randn(12, seq, cfg.model.dim)

    def attention_without_rope(x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, head_dim).transpose(1, 2) for w in (attention.wq, attention.wk, attention.wv))
        return attention.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))

    parts = {"nanogpt_block": theirs, "our_block": lambda x: block(x, cos, sin),
             "nanogpt_attention": lambda x: theirs.attn(theirs.ln_1(x)),
             "our_attention": lambda x: attention(block.attention_norm(x), cos, sin),
             "our_attention_without_rope": lambda x: attention_without_rope(block.attention_norm(x)),
             "nanogpt_mlp": lambda x: theirs.mlp(theirs.ln_2(x)),
             "our_mlp": lambda x: block.feed_forward(block.ffn_norm(x)),
             "nanogpt_layernorm": theirs.ln_1, "our_rmsnorm": block.attention_norm}
    times: dict[str, list[float]] = {name: [] for name in parts}
    for r in range(repeats):
        for name, part in (list(parts.items()) if r % 2 == 0 else list(parts.items())[::-1]):
            t0 = time.perf_counter()
            for _ in range(10):
                x = x0.clone().requires_grad_()
                part(x).backward(grad)
            times[name].append((time.perf_counter() - t0) / 10 * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def _nanogpt_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, splits: dict, rc: ng.RunConfig):
    """One iteration of nanoGPT's train.py loop (forward, next batch, backward, clip, step, zero_grad) on
    ``model``: nanoGPT's GPT returns (logits, loss); ours returns logits, scored here as nanoGPT scores."""
    batch = list(ng.get_batch(splits["train"], rc))

    def step() -> None:
        x, y = batch
        out = model(x, y) if isinstance(model, ng.GPT) else model(x)
        loss = out[1] if isinstance(out, tuple) else torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
        batch[:] = ng.get_batch(splits["train"], rc)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), rc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return step


def summarize(rounds: list[dict]) -> dict:
    rows = {"nanogpt": {"wall_s": statistics.median(r["nanogpt"]["wall_s"] for r in rounds),
                        "median_step_ms": statistics.median(r["nanogpt"]["median_step_ms"] for r in rounds),
                        "final_val_loss": statistics.median(r["nanogpt"]["final_val_loss"] for r in rounds)}}
    for name in VARIANTS:
        runs = [r[name] for r in rounds]
        rows[name] = {key: statistics.median(x[key] for x in runs)
                      for key in ("wall_s", "wall_over_nanogpt", "step_ms", "loop_s", "startup_s", "eval_s",
                                  "sample_s", "checkpoint_s", "final_val_loss")}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="steps of every run (0 = the recipe's 2000)")
    parser.add_argument("--step-blocks", type=int, default=12, help="blocks of 20 steps of each in part 2")
    parser.add_argument("--out", default=default_out("baby_wall.json"), help=OUT_HELP.format(name="baby_wall.json"))
    parser.add_argument("--parts-only", action="store_true", help="only part 3, added to the result in --out")
    args = parser.parse_args()
    if args.parts_only:
        result = json.loads(Path(args.out).read_text())
        result["block_parts_ms"] = block_parts()
        print_parts(result["block_parts_ms"])
        print(f"wrote {write_result(args.out, result)}")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="baby-wall-"))
    try:
        data_dir = scratch / "data"
        cfg = load_config(str(ROOT / CONFIG), {"data.cache_dir": str(data_dir)})
        prepare_data(cfg)
        steps = args.steps or cfg.train.steps
        rounds = [one_round(i, data_dir, steps, cfg.train.eval_interval, scratch)
                  for i in range(args.rounds)]
        side = step_side_by_side(data_dir, args.step_blocks)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = summarize(rounds)
    result = {"benchmark": "baby_wall", "config": CONFIG, "steps": steps, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows, "step_side_by_side": side, "rounds": rounds,
              "block_parts_ms": block_parts()}
    n = rows["nanogpt"]
    print(f"\nwhole processes, medians of {args.rounds} rounds ({steps} steps): nanoGPT {n['wall_s']:.1f} s, "
          f"{n['median_step_ms']:.1f} ms/step, final val {n['final_val_loss']:.4f}")
    print(f"{'':16s} {'whole s':>8s} {'x nanoGPT':>9s} {'ms/step':>8s} {'start-up s':>10s} {'eval s':>7s} "
          f"{'sample s':>8s} {'ckpt s':>7s} {'final val':>9s}")
    for name in VARIANTS:
        r = rows[name]
        print(f"{name:16s} {r['wall_s']:8.1f} {r['wall_over_nanogpt']:9.2f} {r['step_ms']:8.1f} {r['startup_s']:10.1f} "
              f"{r['eval_s']:7.1f} {r['sample_s']:8.1f} {r['checkpoint_s']:7.2f} {r['final_val_loss']:9.4f}")
    med = side["median_ms"]
    print(f"\none process, 2 threads, {side['steps_each']} steps each alternating: nanoGPT {med['nanogpt']:.1f} ms, "
          f"nanoGPT's loop on our model {med['nanogpt_loop_our_model']:.1f} ms (architecture "
          f"{side['architecture']:.3f}x), our trainer's step {med['our_trainer']:.1f} ms (trainer "
          f"{side['trainer']:.3f}x); ours / nanoGPT {side['ours_over_nanogpt']:.3f}")
    print_parts(result["block_parts_ms"])
    print(f"wrote {write_result(args.out, result)}")
    return 0


def print_parts(parts: dict) -> None:
    print("\none block, forward + backward, 2 threads, medians (ms): "
          + ", ".join(f"{name} {ms:.3f}" for name, ms in parts.items()))


if __name__ == "__main__":
    sys.exit(main())
