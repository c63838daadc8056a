"""Does a mixture of experts pay on this machine? A dense model and the MoE with its active parameters, trained
side by side on the same data for the same steps and tokens (equal compute: the same model FLOPs a token, the
router's aside), compared in val bits per byte per FLOP and per second of training wall.

- ``dense``: the ``nano`` shape (4 x 128, SwiGLU 344);
- ``moe``: ``nano-moe`` (8 experts x 176, top-2: 352 active, the dense width), the Switch/GShard balance loss
  (the default ``moe_balance_coef``), every block sparse.

Both runs: the Gutenberg Shakespeare folder (``../shared/data/gutenberg-shakespeare``, 77 plays and poems,
9.6 MB; the bundled Tiny Shakespeare where that folder is absent), prepared once at character level, seq 128,
batch 16, fp32, eager, one thread each, the same seed and data order, evaluated every ``steps / 8`` steps on
the same validation windows. A curve point is (step, tokens, model FLOPs, training seconds so far, val bpb);
the training seconds are the logged step times (evaluation excluded), so two runs on two cores compare like
with like.

Reported: the val bpb of each at equal FLOPs (the last point) and at equal training seconds (the MoE's curve
interpolated at the dense model's wall), and the crossover: the wall the dense model needs to reach the MoE's
final bpb (its curve interpolated; none when it never gets there), against the MoE's wall; MoE pays here when
that ratio is above 1.

    .venv/bin/python benchmarks/moe_vs_dense.py      # ~5-10 minutes on 2 cores (two processes)

Writes benchmarks/out/moe_vs_dense.json (``--out benchmarks/results/moe_vs_dense.json`` replaces the tracked
result).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import OUT_HELP, default_out, write_result  # noqa: E402  (benchmarks/launch.py)

ROOT = Path(__file__).resolve().parents[1]
GUTENBERG = ROOT.parent / "shared" / "data" / "gutenberg-shakespeare"
RUNS = {
    "dense": {"model.preset": "nano"},
    "moe": {"model.preset": "nano-moe"},
}
LOG_EVERY = 10  # steps a logged step time covers (its window's mean x this = the window's training seconds)


def prepare(tmp: str, source: Path = GUTENBERG) -> tuple[str, str]:
    """The data folder every run reads: the folder of .txt ``source`` prepared once at character level into
    ``tmp/data`` (so no run's wall holds the preparation), and its description; the bundled Tiny Shakespeare where
    ``source`` is absent. benchmarks/moe_balance.py's ``--data`` prepares its folder here too."""
    from scaletrain.data.prepare import prepare_text

    out = Path(tmp) / "data"
    if not source.is_dir():
        return "builtin:tinyshakespeare", f"Tiny Shakespeare (bundled; {source} absent)"
    prepare_text(str(source), out, tokenizer="char", val_fraction=0.02)
    return str(out), f"{source.name} ({sum(p.stat().st_size for p in source.glob('*.txt')):,} bytes)"


def run(args: tuple[str, int, str, str]) -> tuple[str, dict]:
    """One model's curve: (step, tokens, model FLOPs, training seconds, val bpb) at each evaluation."""
    name, steps, data, tmp = args
    import torch

    from scaletrain.config import load_config
    from scaletrain.model import flops_per_token
    from scaletrain.model.presets import matmul_params, num_params
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    run_dir = Path(tmp) / name
    over = {**RUNS[name], "data.path": data, "data.seq_len": 128, "train.batch_size": 16, "train.steps": steps,
            "train.eval_interval": max(1, steps // 8), "logging.log_interval": LOG_EVERY, "train.sample_tokens": 0,
            "train.precision": "fp32", "train.compile": "false", "train.threads": 1, "checkpoint.enabled": "false",
            "logging.progress": "off", "logging.tensorboard": "false", "monitor.enabled": "false",
            "train.run_dir": str(run_dir), "data.cache_dir": f"{tmp}/cache-{name}"}
    trainer = Trainer(load_config(None, {k: str(v) for k, v in over.items()}))
    cfg = trainer.cfg
    summary = trainer.train()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    per_token = flops_per_token(cfg.model, cfg.data.seq_len)
    seconds, curve, done = 0.0, [], 0
    for line in lines:
        if "step_ms" in line:
            seconds += line["step_ms"] / 1e3 * (line["step"] - done)
            done = line["step"]
        if "val_bpb" in line:
            curve.append({"step": line["step"], "tokens": line["step"] * tokens_per_step,
                          "flops": line["step"] * tokens_per_step * per_token, "train_seconds": round(seconds, 2),
                          "val_bpb": line["val_bpb"]})
    result = {"parameters": num_params(cfg.model), "active_matmul_parameters": matmul_params(cfg.model),
              "flops_per_token": per_token, "median_step_ms": summary["median_step_ms"],
              "final_val_bpb": summary["final_val_bpb"], "curve": curve}
    print(f"{name}: bpb {result['final_val_bpb']:.4f}, {result['median_step_ms']:.1f} ms/step, "
          f"{result['parameters']:,} parameters ({result['active_matmul_parameters']:,} active in matmuls)",
          flush=True)
    return name, result


def interpolate(curve: list[dict], key: str, value: float, want: str) -> float | None:
    """``want`` at ``key`` = ``value`` along a curve monotone in ``key`` (linear between points); None outside."""
    for a, b in zip(curve, curve[1:]):
        lo, hi = sorted((a[key], b[key]))
        if lo <= value <= hi and a[key] != b[key]:
            t = (value - a[key]) / (b[key] - a[key])
            return a[want] + t * (b[want] - a[want])
    return None


def compare(dense: dict, moe: dict) -> dict:
    """Equal FLOPs, equal wall and the crossover (module docstring)."""
    last_moe = moe["curve"][-1]
    dense_at_moe_wall = interpolate(dense["curve"], "train_seconds", last_moe["train_seconds"], "val_bpb")
    # the dense curve after its first point falls monotonically in bpb: the seconds it takes to reach MoE's bpb
    falling = [p for p in dense["curve"] if p["step"] > 0]
    dense_wall_to_moe_bpb = interpolate(falling, "val_bpb", last_moe["val_bpb"], "train_seconds")
    last_dense = dense["curve"][-1]
    moe_at_dense_wall = interpolate(moe["curve"], "train_seconds", last_dense["train_seconds"], "val_bpb")
    return {"flops_ratio_moe_over_dense": moe["flops_per_token"] / dense["flops_per_token"],
            "wall_ratio_moe_over_dense": last_moe["train_seconds"] / last_dense["train_seconds"],
            "bpb_at_equal_wall": {"seconds": last_dense["train_seconds"], "dense": last_dense["val_bpb"],
                                  "moe": moe_at_dense_wall},
            "bpb_at_equal_flops": {"dense": dense["curve"][-1]["val_bpb"], "moe": last_moe["val_bpb"]},
            "step_time_ratio_moe_over_dense": moe["median_step_ms"] / dense["median_step_ms"],
            "dense_bpb_at_moe_wall": dense_at_moe_wall,
            "dense_seconds_to_moe_final_bpb": dense_wall_to_moe_bpb,
            "moe_seconds": last_moe["train_seconds"],
            "moe_pays_on_wall": None if dense_wall_to_moe_bpb is None else dense_wall_to_moe_bpb > last_moe[
                "train_seconds"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--compare", metavar="JSON", help="recompute the comparison of an earlier result (no runs)")
    parser.add_argument("--out", default=default_out("moe_vs_dense.json"),
                        help=OUT_HELP.format(name="moe_vs_dense.json"))
    args = parser.parse_args()
    if args.compare:  # the comparison is a function of the curves: recomputed without training again
        result = json.loads(Path(args.compare).read_text())
        result["comparison"] = compare(result["results"]["dense"], result["results"]["moe"])
        write_result(args.out, result, indent=1)
        print(json.dumps(result["comparison"], indent=1))
        return 0
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        data, described = prepare(tmp)
        with mp.get_context("spawn").Pool(2) as pool:
            results = dict(pool.map(run, [(name, args.steps, data, tmp) for name in RUNS]))
    verdict = compare(results["dense"], results["moe"])
    result = {"benchmark": "moe_vs_dense", "data": described, "steps": args.steps, "runs": RUNS,
              "results": results, "comparison": verdict, "seconds": round(time.time() - t0, 1)}
    print("| model | parameters | active in matmuls | FLOPs/token | ms/step | val bpb (equal FLOPs) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['parameters']:,} | {r['active_matmul_parameters']:,} | {r['flops_per_token']:,} | "
              f"{r['median_step_ms']:.1f} | {r['final_val_bpb']:.4f} |")
    equal = verdict["bpb_at_equal_wall"]
    if equal["moe"] is not None:
        print(f"at equal training seconds ({equal['seconds']:.0f} s): dense {equal['dense']:.4f} bpb, MoE "
              f"{equal['moe']:.4f}")
    wall = verdict["dense_seconds_to_moe_final_bpb"]
    print(f"crossover: dense reaches the MoE's {verdict['bpb_at_equal_flops']['moe']:.4f} bpb in "
          + (f"{wall:.0f} s of training against the MoE's {verdict['moe_seconds']:.0f} s" if wall is not None
             else "none of its curve (it never gets there in these steps)"))
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
