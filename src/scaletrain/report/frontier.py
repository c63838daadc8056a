"""Where a run sits against its data's scaling frontier (``scaling_fit.json`` beside its prepared data).

The report's header gets one row when the run's data.path holds a fit: the measured val bpb against the fit's
prediction for the run's own N (non-embedding parameters) and D (tokens trained), and the compute-optimal
frontier at the run's compute C = 6 N D (the lowest bpb the law predicts for that compute, and at which size).
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.report.runs import RunData
from scaletrain.scaling.family import family_key
from scaletrain.scaling.fit import ScalingFitError, law_params
from scaletrain.scaling.store import fit_path, load_fit


def frontier_row(run: RunData, steps: int, bpb: float | None) -> tuple[str, str] | None:
    """('scaling frontier', text), or None when the run's data has no fit (or the run has no config)."""
    cfg = run.config
    if cfg is None or not cfg.data.path or not fit_path(cfg.data.path, family_key(cfg.model)).is_file():
        return None
    try:
        fit, _ = load_fit(Path(cfg.data.path), family_key(cfg.model))  # the law of the run's own family
    except ScalingFitError as exc:
        return "scaling frontier", f"not shown: {exc}"
    n = law_params(cfg.model)
    d = steps * cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len * max(1, run.world_size)
    if n <= 0 or d <= 0:
        return None
    mid, lo, hi = fit.predict(n, d)
    flops = 6.0 * n * d
    n_opt, d_opt = fit.params.compute_optimal(flops)
    best = float(fit.params.loss(n_opt, d_opt))
    measured = (f"measured {bpb:.4f} bpb vs predicted {mid:.4f} [90%: {lo:.4f}, {hi:.4f}] for its size and tokens ("
                f"{'inside' if lo <= bpb <= hi else 'outside'} the interval); " if bpb is not None else
                f"predicted {mid:.4f} [90%: {lo:.4f}, {hi:.4f}] bpb for its size and tokens; ")
    return "scaling frontier", (
        f"{measured}{n:,} non-embedding parameters x {d:,} tokens = {flops:.3g} FLOPs ({d / n:.1f} tokens per "
        f"parameter); the data's compute-optimal frontier there: {best:.4f} bpb with {n_opt:,.0f} parameters on "
        f"{d_opt:,.0f} tokens ({d_opt / n_opt:.1f} per parameter)")
