"""``scaletrain scale DATA --out DIR --budget 30min``: the grid, printed with its predicted times, trained
(resumably), then the fit written to ``DATA/scaling_fit.json``.

Bad input (a budget too small, too few finished runs, a fit that does not converge) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from scaletrain.config import ConfigError
from scaletrain.core.options import UserError

_UNITS = {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "hour": 3600}


def parse_duration(text: str, what: str = "--budget") -> float:
    """'30min', '90s', '1.5h', '600' (seconds) -> seconds; ConfigError otherwise."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|sec|min|m|h|hour)?s?\s*", text.lower())
    try:
        seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"] if m else -1.0
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ConfigError(f"{what} must be a duration like 30min, 90s or 1.5h (got {text!r})")
    return seconds


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``scaletrain scale``."""
    parser.add_argument("data", help="a prepared data folder (`scaletrain prepare`); the fit is written into it")
    parser.add_argument("--out", required=True, help="the grid's folder: one run folder per grid point")
    parser.add_argument("--budget", default="30min",
                        help="wall time the grid may take on this machine, by the planner's prediction (30min, 2h)")
    parser.add_argument("--hardware", default="auto",
                        help="what the planner predicts the runs' times for: auto (this machine, calibrated by "
                             "`scaletrain doctor`) or a catalog name (cpu: the reference CPU, no calibration)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (1: the planner's per-core calibration, `doctor --clock cpu`)")
    parser.add_argument("--min-tokens-per-param", type=float, default=1.0,
                        help="the fewest tokens per parameter of the grid's corner (largest model, fewest tokens): "
                             "lower lets a small budget reach larger models, with runs further from convergence")
    parser.add_argument("--moe", default="",
                        help="fit a mixture of experts instead of the dense decoder: EXPERTSxTOPK, e.g. 8x2 (the "
                             "grid's shapes with every feed-forward routed, each expert the dense width / TOPK; the "
                             "fit is written beside the dense one: scaling_fit.moe8x2.json)")
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals")
    parser.add_argument("--dry-run", action="store_true", help="print the grid and its predicted times; train nothing")
    parser.add_argument("--fit-only", action="store_true",
                        help="fit the runs already finished under --out; train nothing")


def run_scale(args: argparse.Namespace) -> int:
    """Plan, print, train, fit; 0 with a fit written, 2 on bad input."""
    try:
        return _scale(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _scale(args: argparse.Namespace) -> int:
    import torch

    from scaletrain.scaling.family import MoEShape
    from scaletrain.scaling.grid import finished_records, plan_grid, run_grid
    from scaletrain.scaling.store import data_fingerprint

    if args.threads < 1 or args.bootstrap < 0 or args.min_tokens_per_param <= 0:
        raise ConfigError("--threads must be >= 1, --bootstrap >= 0 and --min-tokens-per-param > 0")
    data, out = Path(args.data), Path(args.out)
    moe = MoEShape.parse(args.moe)
    data_fingerprint(data)  # a folder that is not prepared data: DataError naming its manifest, before any run
    torch.set_num_threads(args.threads)  # the planner below predicts for this thread count
    if args.fit_only:
        # every run of this family trained on this data, or one line naming the one not
        records = finished_records(out, data, moe.spec if moe else "")
    else:
        runs = plan_grid(data, parse_duration(args.budget), args.hardware, args.min_tokens_per_param, say=print,
                         moe=moe)
        print_grid(runs, args.budget)
        if args.dry_run:
            return 0
        records = run_grid(runs, data, out, say=print, threads=args.threads)
    return fit_and_write(data, records, args.bootstrap, moe)


def print_grid(runs, budget: str) -> None:
    """The grid before it starts: size, tokens, steps, predicted time, and the total against the budget."""
    print(f"{'run':<28} {'N (non-emb)':>11} {'tokens':>10} {'tok/param':>9} {'steps':>6} {'predicted':>9}")
    for r in runs:
        print(f"{r.name:<28} {r.params:>11,} {r.tokens:>10,} {r.tokens / r.params:>9.1f} {r.steps:>6} "
              f"{r.predicted_seconds:>8.0f}s")
    total = sum(r.predicted_seconds for r in runs)
    print(f"{len(runs)} runs, predicted {total / 60:.1f} min on this machine (budget {budget}); largest compute "
          f"{max(r.flops for r in runs):.3g} FLOPs (6 N D)")


def fit_and_write(data: Path, records: list[dict], bootstrap: int, moe=None) -> int:
    """Fit the finished runs, write ``scaling_fit.json`` (``moe``, a ``MoEShape``: its own file) into the data
    folder, print the law."""
    from scaletrain.scaling.family import DENSE
    from scaletrain.scaling.fit import fit_law, law_params
    from scaletrain.scaling.grid import BATCH, EVAL_BATCHES, LR, MUP_BASE_WIDTH, SEQ_LEN, model_config, vocabulary
    from scaletrain.scaling.store import write_fit

    vocab = vocabulary(data)[0]  # N from the shape, by today's definition (``law_params``), not as recorded
    records = [{**r, "params": law_params(model_config(r["dim"], r["n_layers"], vocab, moe))} for r in records]
    records = [{**r, "flops": 6.0 * r["params"] * r["tokens"]} for r in records]
    fit = fit_law([r["params"] for r in records], [r["tokens"] for r in records],
                  [r["val_bpb"] for r in records], bootstrap=bootstrap)
    recipe = {"seq_len": SEQ_LEN, "batch": BATCH, "lr": LR, "parametrization": "mup", "mup_base_width": MUP_BASE_WIDTH,
              "schedule": "cosine to lr/10 over each run", "optimizer": "adamw", "eval_batches": EVAL_BATCHES}
    if moe is not None:  # what the MoE family is: its sparsity, its experts' width rule, its balancing
        recipe["moe"] = {"experts": moe.experts, "top_k": moe.top_k, "sparse_layers": "all",
                         "expert_width": "the dense ffn / top_k, rounded up to 16", "balance": "the model's default "
                         "(Switch auxiliary loss, model.moe_balance_coef)"}
    runs = [{k: r[k] for k in ("name", "dim", "n_layers", "params", "tokens", "flops", "val_bpb", "seconds",
                               "predicted_seconds")} for r in records]
    path = write_fit(data, fit, runs, recipe, moe.key if moe is not None else DENSE)
    print_fit(fit, max(r["flops"] for r in records))
    print(f"wrote {path}")
    return 0


def print_fit(fit, flops: float) -> None:
    """The law, its intervals and the compute-optimal tokens per parameter at ``flops``."""
    p, iv = fit.params, fit.param_intervals()

    def show(k: str, fmt: str) -> str:
        lo_hi = f" [{format(iv[k][0], fmt)}, {format(iv[k][1], fmt)}]" if k in iv else ""
        return f"{k} = {format(getattr(p, k), fmt)}{lo_hi}"

    print(f"L(N, D) = E + A/N^alpha + B/D^beta in bits per byte, fitted on the runs (90% bootstrap intervals, "
          f"{len(fit.bootstrap)} resamples):")
    print("  " + ", ".join(show(k, f) for k, f in (("E", ".4f"), ("A", ".4g"), ("alpha", ".3f"), ("B", ".4g"),
                                                 ("beta", ".3f"))))
    print(f"  residual scatter {fit.residual_std:.4f} in log bpb; compute-optimal tokens per parameter at "
          f"{flops:.3g} FLOPs: {fit.tokens_per_param(flops):.1f} (Chinchilla's 20 is a convention)")
    for note in fit.caveats(flops):
        print(f"  caveat: {note}")
