"""Dense or MoE on this hardware: a scaling fit of each family on the same data, then `plan --target-bpb`'s answer.

1. prepare the Gutenberg folder's characters (`scaletrain prepare ../shared/data/gutenberg-shakespeare
   --tokenizer char`);
2. `scaletrain scale DATA --budget B` and `scaletrain scale DATA --budget B --moe 8x2`, side by side (one torch
   thread each): the same grid shapes, the MoE's feed-forwards routed over 8 experts of which a token runs 2
   (each expert the dense width / 2: the same active parameters), each fitted to its own law;
3. one held-out run per family at about 4x its largest fitted compute: the law's prediction against the
   measured val bpb (the MoE law is checked like the dense one, not trusted);
4. `plan --data DATA --target-bpb X --json` on this machine (`--hardware auto`) and on an H100 node, for a few
   targets: which family each answers, at what cost, and the crossover.

    .venv/bin/python benchmarks/moe_scaling.py --work /tmp/moe_scaling      # resumable in --work

Writes benchmarks/out/moe_scaling.json (``--out benchmarks/results/moe_scaling.json`` replaces the tracked one).
Wall times are measured on 2 cores shared with other work: the bpb does not depend on the load, the times do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import OUT_HELP, default_out, write_result  # noqa: E402  (benchmarks/launch.py)

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SOURCE = SHARED / "gutenberg-shakespeare"
MOE = "8x2"
HARDWARE = ("auto", "h100-sxm:8")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain", *args]


def scale_both(data: Path, work: Path, budget: int, corner: float) -> dict:
    """The two grids at once, one thread each; {family: seconds}."""
    procs, t0 = {}, time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for family, extra in (("dense", []), ("moe" + MOE, ["--moe", MOE])):
        log = open(work / f"scale_{family}.log", "w")  # noqa: SIM115 (closed with the process)
        procs[family] = (subprocess.Popen(cli("scale", str(data), "--out", str(work / f"grid-{family}"), "--budget",
                                              f"{budget}s", "--min-tokens-per-param", str(corner), *extra),
                                          stdout=log, stderr=subprocess.STDOUT, env=env), log)
    seconds = {}
    for family, (proc, log) in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"scale {family} failed: see {log.name}")
        log.close()
        seconds[family] = time.perf_counter() - t0
    return seconds


def heldout(data: Path, work: Path, family: str) -> dict:
    """One run of the next family size at ~4x the largest fitted compute; predicted vs measured."""
    import torch

    from scaletrain.scaling.family import MoEShape
    from scaletrain.scaling.grid import FAMILY, finished_records, make_run, train_run, vocabulary
    from scaletrain.scaling.store import load_fit

    torch.set_num_threads(1)
    moe = MoEShape.parse(family.removeprefix("moe"))
    fit, doc = load_fit(data, family)
    largest = max(doc["runs"], key=lambda r: r["flops"])
    top = FAMILY.index(max(((r["dim"], r["n_layers"]) for r in doc["runs"]), key=lambda s: s[0]))
    dim, layers = FAMILY[top + 1]
    vocab = vocabulary(data)[0]
    probe = make_run(dim, layers, vocab, 1, moe=moe)
    steps = max(1, round(4 * largest["flops"] / (6 * probe.params) / probe.tokens))
    run = make_run(dim, layers, vocab, steps, moe=moe)
    out = work / f"heldout-{family}"
    done = finished_records(out, data, run.moe)
    record = done[0] if done else train_run(run, data, out, threads=1)
    mid, lo, hi = fit.predict(run.params, run.tokens)
    return {"run": run.name, "params": run.params, "tokens": run.tokens, "compute_multiple": run.flops /
            largest["flops"], "predicted_bpb": mid, "interval": [lo, hi], "measured_bpb": record["val_bpb"],
            "error_pct": 100 * (mid - record["val_bpb"]) / record["val_bpb"], "covered": lo <= record["val_bpb"] <= hi,
            "seconds": record["seconds"], "predicted_seconds": run.predicted_seconds}


def compute_frontier(fits: dict, largest: float) -> list[dict]:
    """Each law's compute-optimal val bpb at 1x, 4x and 16x the grids' largest compute: bpb per FLOP."""
    rows = []
    for multiple in (1, 4, 16):
        flops = largest * multiple
        row = {"compute_multiple": multiple, "flops": flops}
        for family, fit in fits.items():
            n, d = fit.params.compute_optimal(flops)
            row[family] = {"val_bpb": float(fit.params.loss(n, d)), "params": n, "tokens": d}
        rows.append(row)
    return rows


def plans(data: Path, work: Path, targets: list[float]) -> list[dict]:
    """`plan --target-bpb` for each target and hardware: the family chosen, both costs, the crossover."""
    rows = []
    for hardware in HARDWARE:
        for target in targets:
            path = work / f"plan_{hardware.replace(':', '_')}_{target:.3f}.json"
            proc = subprocess.run(cli("plan", "--data", str(data), "--target-bpb", f"{target:.4f}", "--hardware",
                                      hardware, "--max-nodes", "1", "--json", str(path)),
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                rows.append({"hardware": hardware, "target_bpb": target, "error": proc.stderr.strip()})
                continue
            doc = json.loads(path.read_text())
            fams = doc.get("families", {doc.get("family", "dense"): doc})
            rows.append({"hardware": hardware, "target_bpb": target, "family": doc.get("family"),
                         "choices": {k: {f: v["choice"][f] for f in ("params_non_embedding", "parameters",
                                                                     "active_parameters", "tokens", "hours",
                                                                     "on_demand_usd", "plan", "model")}
                                     for k, v in fams.items()},
                         "crossover": doc.get("crossover"), "printed": proc.stdout.strip().splitlines()[-3:]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=210, help="each grid's planner-predicted seconds")
    parser.add_argument("--min-tokens-per-param", type=float, default=1.0, help="the grids' corner ratio")
    parser.add_argument("--work", default="", help="folder for data and runs (resumable)")
    parser.add_argument("--out", default=default_out("moe_scaling.json"), help=OUT_HELP.format(name="moe_scaling.json"))
    parser.add_argument("--heldout", default="", help=argparse.SUPPRESS)  # one family's held-out run (a child)
    parser.add_argument("--plans-only", action="store_true",
                        help="reuse --work's grids, fits and held-out runs (and --out's grid times); plan again")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="moe_scaling_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if args.heldout:
        (work / f"heldout-{args.heldout}.json").write_text(json.dumps(heldout(data, work, args.heldout)))
        return 0
    t0, load0 = time.perf_counter(), os.getloadavg()
    if not (data / "manifest.json").is_file():
        subprocess.run(cli("prepare", str(SOURCE), "--out", str(data), "--tokenizer", "char"), check=True)
    from scaletrain.scaling.store import load_fit

    families = ("dense", "moe" + MOE)
    previous = json.loads(Path(args.out).read_text()) if args.plans_only else {}
    if args.plans_only:  # the grids, fits and held-out runs of an earlier invocation in --work
        grid_seconds = previous["grid_seconds"]
    else:
        grid_seconds = scale_both(data, work, args.budget, args.min_tokens_per_param)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, "--work", str(work), "--heldout", family], env=env)
                 for family in families]  # side by side, one thread each
        if any(p.wait() for p in procs):
            raise SystemExit("a held-out run failed")
    fits = {}
    for family in families:
        fit, doc = load_fit(data, family)
        fits[family] = {"params": doc["params"], "intervals": doc.get("intervals"), "runs": doc["runs"],
                        "residual_std_log": doc.get("residual_std_log"),
                        "heldout": json.loads((work / f"heldout-{family}.json").read_text())}
    frontier = compute_frontier({f: load_fit(data, f)[0] for f in families},
                                max(r["flops"] for f in fits.values() for r in f["runs"]))
    every = [r["val_bpb"] for f in fits.values() for r in f["runs"]]
    targets = sorted({round(min(every) * 0.97, 3), round(min(every), 3), round((min(every) + max(every)) / 2, 3)})
    doc = {"benchmark": "moe_scaling", "data": "gutenberg-shakespeare, characters", "moe": MOE,
           "grid_budget_seconds": args.budget, "grid_seconds": grid_seconds, "fits": fits, "frontier": frontier,
           "plans": plans(data, work, targets), "seconds": time.perf_counter() - t0,
           "load_average_start": load0, "load_average_end": os.getloadavg(),
           "note": "wall times measured on 2 cores shared with other work (see the load averages)", "work": str(work)}
    for family, f in fits.items():
        h = f["heldout"]
        print(f"{family}: law {f['params']}; held-out {h['run']}: predicted {h['predicted_bpb']:.4f} "
              f"[{h['interval'][0]:.4f}, {h['interval'][1]:.4f}] vs measured {h['measured_bpb']:.4f} "
              f"({h['error_pct']:+.2f}%)")
    for row in doc["plans"]:
        print(f"{row['hardware']} target {row['target_bpb']}: {row.get('family') or row.get('error')}")
    print(f"wrote {write_result(Path(args.out), doc)} in {doc['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
