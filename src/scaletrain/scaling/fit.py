"""The scaling law L(N, D) = E + A / N^alpha + B / D^beta, fitted as Hoffmann et al. 2022 (approach 3).

L is the validation loss in bits per byte (``val_bpb``, a unit that holds across tokenizers), N the model's
non-embedding parameters, D the training tokens. The fit minimises the Huber loss (delta 1e-3) between the
predicted and the measured log L, with the predicted log L written as a log-sum-exp,

    log L(N, D) = LSE(a - alpha log N, b - beta log D, e),    A = exp(a), B = exp(b), E = exp(e),

which keeps A, B, E positive without constraints and the problem well conditioned. It runs L-BFGS (torch,
float64: no SciPy needed) from the best starts of a grid of initialisations (the grid's losses are evaluated in
one batch; the lowest few are optimised), as Chinchilla did to avoid local minima. Intervals: the same fit on
runs resampled with replacement (``bootstrap``), warm-started from the full fit; a prediction's interval is the
5th-95th percentile of the bootstrap fits' predictions, widened (in quadrature, in log space) by the fit's
residual scatter so it covers the run-to-run noise of a single new run, not only the parameters' uncertainty.

Nothing here knows about training: the inputs are numbers, so the same code serves ``scaletrain scale``,
``plan --data`` and the tests on synthetic data.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from scaletrain.core.options import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.presets import block_params, moe_extra_params, sparse_layers

HUBER_DELTA = 1e-3  # Hoffmann et al.'s delta, on log L
MIN_RUNS = 5  # five parameters: fewer runs leave the law undetermined
INTERVAL = (5.0, 95.0)  # percentiles of the bootstrap: a 90% interval
PARAMS = ("E", "A", "alpha", "B", "beta")
# Chinchilla's initialisation grid (their appendix D.2), coarsened: the best starts of these go to L-BFGS.
_GRID = {"alpha": (0.0, 0.5, 1.0, 1.5), "beta": (0.0, 0.5, 1.0, 1.5), "e": (-1.0, -0.5, 0.0, 0.5),
         "a": (0.0, 5.0, 10.0, 15.0), "b": (0.0, 5.0, 10.0, 15.0)}
_STARTS = 8  # grid points optimised from
# |gradient| of the mean Huber loss / delta (O(1) away from the optimum) at which a fit counts as converged
_GRAD_TOL = 1e-4
_STALL = 1e-5  # 100 L-BFGS iterations that lower the objective by less than this (relative) have converged
_SAME_OPTIMUM = 1e-3  # objectives within 0.1% of the lowest count as the same optimum
# Where a fit's parameters still mean something. E: the largest models measured on English text reach about
# 0.5-0.7 bits per byte and Shannon's estimate of English is 0.6-1.3 bits per character, so an irreducible loss
# below 0.1 bits per byte is no property of text: it is an E the runs did not identify (they never level off).
E_FLOOR = 0.1
# Compute-optimal tokens per parameter: published fits put it at about 20 (Chinchilla and its replication) to
# ~100 (Chinchilla's own approach-3 fit at its largest compute), Kaplan et al.'s at a few: outside 1-1000, 50x
# either side of 20, the N/D trade-off is not one the runs measured.
TOKENS_PER_PARAM_RANGE = (1.0, 1000.0)


def law_params(cfg: ModelConfig) -> int:
    """N of the law: the non-embedding parameters, i.e. the blocks and the final norm, without the input embedding
    and the output matrix (Kaplan et al. 2020 exclude all vocabulary matrices: at small sizes they are most of the
    parameters and scale with the tokenizer, not with the model's capacity). A mixture of experts counts its
    *active* ones (the router, the top-k and shared experts a token runs: scaling/family.py), so 6 N D is the
    compute of either family."""
    moe = sparse_layers(cfg) * moe_extra_params(cfg, active=True) if cfg.moe_experts else 0
    return cfg.n_layers * block_params(cfg) + cfg.dim + moe


class ScalingFitError(ConfigError):
    """A fit that cannot be made or used (too few runs, no convergence, a target below E, other data)."""


@dataclass
class LawParams:
    """E + A / N^alpha + B / D^beta (bits per byte)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, n: np.ndarray | float, d: np.ndarray | float) -> np.ndarray | float:
        with np.errstate(over="ignore"):  # N^alpha past float range: its term is 0, as it should be
            return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    def compute_optimal(self, flops: float) -> tuple[float, float]:
        """(N, D) minimising L at C = 6 N D FLOPs (Hoffmann et al. eq. 4): N = G (C/6)^(beta/(alpha+beta))."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        n = g * (flops / 6.0) ** (self.beta / (self.alpha + self.beta))
        return n, flops / (6.0 * n)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ScalingFit:
    """The fit, its bootstrap replicates (for intervals) and how well it matches its own runs."""

    params: LawParams
    bootstrap: list[LawParams] = field(default_factory=list)
    residual_std: float = 0.0  # std of log(measured) - log(predicted) over the fitted runs
    huber: float = 0.0  # the objective at the optimum

    def predict(self, n: float, d: float) -> tuple[float, float, float]:
        """(predicted bpb, low, high): the 90% interval of a new run of N non-embedding params on D tokens (the
        runs' scatter alone when the fit has no bootstrap replicates: ``scale --bootstrap 0``)."""
        mid = float(self.params.loss(n, d))
        lo = hi = math.log(mid)
        if self.bootstrap:
            logs = np.log([float(p.loss(n, d)) for p in self.bootstrap])
            lo, hi = np.percentile(logs, INTERVAL)
        z = 1.645  # the 90% normal quantile, for the residual scatter
        lo = math.log(mid) - math.hypot(math.log(mid) - lo, z * self.residual_std)
        hi = math.log(mid) + math.hypot(hi - math.log(mid), z * self.residual_std)
        return mid, math.exp(lo), math.exp(hi)

    def implausible(self, flops: float | None = None) -> list[str]:
        """Where the fit leaves the range in which its parameters mean something (``E_FLOOR``, and at ``flops``,
        the compute of its largest run, ``TOKENS_PER_PARAM_RANGE``): the searches refuse such a fit."""
        notes = []
        if self.params.E < E_FLOOR:
            notes.append(f"E = {self.params.E:.4g} bits per byte is below the plausible {E_FLOOR:g} (text's entropy "
                         f"is far above it): the runs do not show the loss levelling off (too short or too small), "
                         f"so the irreducible loss is not identified and predictions far beyond the grid lean "
                         f"optimistic")
        low, high = TOKENS_PER_PARAM_RANGE
        if flops:
            p = self.params  # a negative exponent has no compute-optimal split (a complex power)
            ratio = self.tokens_per_param(flops) if p.alpha > 0 and p.beta > 0 else math.nan
            if not low <= ratio <= high:  # NaN too
                notes.append(f"compute-optimal tokens per parameter {ratio:,.1f} at the grid's largest compute "
                             f"({flops:.3g} FLOPs) is outside the plausible {low:g}-{high:g} (published fits: "
                             f"about 20-100): the N/D trade-off is not identified by these runs")
        return notes

    def caveats(self, flops: float | None = None) -> list[str]:
        """What the fit cannot tell from its runs (printed with it, stored with it); ``flops``: the compute of
        the grid's largest run, where the compute-optimal ratio is judged."""
        notes = self.implausible(flops)
        for k in ("alpha", "beta"):
            if not 0.02 <= getattr(self.params, k) <= 2.0:
                notes.append(f"{k} = {getattr(self.params, k):.3g} is outside the usual 0.02-2: that term is "
                             f"barely constrained by these runs")
        if not self.bootstrap:
            notes.append("no bootstrap replicates (`scale --bootstrap 0`): an interval covers the runs' scatter "
                         "only, not the parameters' uncertainty")
        return notes

    def param_intervals(self) -> dict[str, list[float]]:
        """Each parameter's 90% bootstrap interval."""
        if not self.bootstrap:
            return {}
        return {k: [float(x) for x in np.percentile([getattr(p, k) for p in self.bootstrap], INTERVAL)]
                for k in PARAMS}

    def tokens_per_param(self, flops: float) -> float:
        """The compute-optimal D / N at ``flops`` (constant only when alpha == beta)."""
        n, d = self.params.compute_optimal(flops)
        return d / n

    def as_dict(self, flops: float | None = None) -> dict:
        return {"params": self.params.as_dict(), "intervals": self.param_intervals(), "caveats": self.caveats(flops),
                "residual_std_log": self.residual_std, "huber": self.huber,
                "bootstrap": [p.as_dict() for p in self.bootstrap]}

    @classmethod
    def from_dict(cls, doc: dict) -> ScalingFit:
        return cls(LawParams(**doc["params"]), [LawParams(**p) for p in doc.get("bootstrap", [])],
                   float(doc.get("residual_std_log", 0.0)), float(doc.get("huber", 0.0)))


def _predicted_log(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor) -> torch.Tensor:
    """log L for parameters ``theta`` (..., 5) = (a, alpha, b, beta, e) at every run; (..., runs)."""
    a, alpha, b, beta, e = (theta[..., i: i + 1] for i in range(5))
    terms = torch.stack(torch.broadcast_tensors(a - alpha * log_n, b - beta * log_d, e.expand_as(a - alpha * log_n)))
    return torch.logsumexp(terms, dim=0)


def _objective(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor, log_l: torch.Tensor) -> torch.Tensor:
    """Mean Huber loss of the log residuals (per start when ``theta`` is a batch of starts)."""
    residual = _predicted_log(theta, log_n, log_d) - log_l
    huber = torch.nn.functional.huber_loss(residual, torch.zeros_like(residual), delta=HUBER_DELTA, reduction="none")
    return huber.mean(-1) / HUBER_DELTA  # / delta: O(|residual|), so one tolerance fits any noise level


def _lbfgs(theta0: torch.Tensor, log_n, log_d, log_l) -> tuple[torch.Tensor, float, bool]:
    """(theta, objective, converged) after L-BFGS from ``theta0``. Converged: the gradient is below
    ``_GRAD_TOL``, or a further round of L-BFGS no longer lowers the objective (by ``_STALL``, relative): the
    Huber loss is linear beyond delta, so at its optimum the gradient need not vanish (a kink, as for L1)."""
    theta = theta0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=100, tolerance_grad=_GRAD_TOL * 0.1, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = _objective(theta, log_n, log_d, log_l)
        value.backward()
        return value

    value, converged = float(closure().detach()), False
    for _ in range(10):  # L-BFGS stops at max_iter; a restart picks up from where it stopped
        opt.step(closure)
        before, value = value, float(closure().detach())
        if float(theta.grad.abs().max()) <= _GRAD_TOL or before - value <= _STALL * max(value, 1e-12):
            converged = True
            break
    return theta.detach(), value, converged


def _starts(log_n, log_d, log_l) -> torch.Tensor:
    """The ``_STARTS`` grid points with the lowest objective (evaluated in one batch)."""
    grid = torch.tensor(list(itertools.product(_GRID["a"], _GRID["alpha"], _GRID["b"], _GRID["beta"], _GRID["e"])),
                        dtype=torch.float64)
    values = _objective(grid, log_n, log_d, log_l)
    values = torch.where(torch.isfinite(values), values, torch.full_like(values, float("inf")))
    return grid[torch.argsort(values)[:_STARTS]]


def _to_params(theta: torch.Tensor) -> LawParams:
    a, alpha, b, beta, e = (float(x) for x in theta)
    return LawParams(E=math.exp(e), A=math.exp(a), alpha=alpha, B=math.exp(b), beta=beta)


def _fit_once(n: np.ndarray, d: np.ndarray, loss: np.ndarray, starts: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, float, bool]:
    """(theta, objective, converged): the best converged start when one reaches the lowest objective found
    (within ``_SAME_OPTIMUM``: in a flat valley, e.g. E -> 0, starts stop at slightly different points of
    nearly the same objective), else the best start, not converged."""
    t = [torch.tensor(np.log(x), dtype=torch.float64) for x in (n, d, loss)]
    starts = _starts(*t) if starts is None else starts
    found = []
    for theta0 in starts:
        theta, value, converged = _lbfgs(theta0, *t)
        # exp(theta) finite too: a start that ran off to A = e^800 (a term the runs do not constrain) is no fit
        if math.isfinite(value) and bool(torch.isfinite(theta.exp()).all()):
            found.append((value, theta, converged or value < 1e-14))
    if not found:
        return starts[0], float("inf"), False
    lowest = min(v for v, _, _ in found)
    converged = [(v, th) for v, th, ok in found if ok and v <= lowest * (1 + _SAME_OPTIMUM) + 1e-14]
    if converged:
        value, theta = min(converged, key=lambda x: x[0])
        return theta, value, True
    value, theta, _ = min(found, key=lambda x: x[0])
    return theta, value, False


def fit_law(n, d, loss, bootstrap: int = 200, seed: int = 0) -> ScalingFit:
    """Fit E + A/N^alpha + B/D^beta to runs (N non-embedding params, D tokens, loss in bpb).

    ScalingFitError: fewer than ``MIN_RUNS`` runs, a non-positive or non-finite value, fewer than two distinct
    N or D (the two terms cannot be told apart), or no start converging."""
    n, d, loss = (np.asarray(x, dtype=np.float64).ravel() for x in (n, d, loss))
    check_runs(n, d, loss)
    # one order for one set of runs (by N, then D): the sums' rounding, and so L-BFGS's path and the bootstrap's
    # resamples, would otherwise depend on the order the grid folder lists them in
    order = np.lexsort((loss, d, n))
    n, d, loss = n[order], d[order], loss[order]
    theta, value, converged = _fit_once(n, d, loss)
    if not converged:
        raise ScalingFitError(f"the fit of {n.size} runs did not converge (L-BFGS from {_STARTS} starts; best "
                              f"objective {value:.3g}): add runs over more sizes and token counts, or longer runs")
    params = _to_params(theta)
    residual = np.log(loss) - np.log(params.loss(n, d))
    rng = np.random.default_rng(seed)
    replicas = []
    for _ in range(bootstrap):  # resample runs; warm start from the full fit (and the grid's best start)
        pick = rng.integers(0, n.size, n.size)
        if np.unique(n[pick]).size < 2 or np.unique(d[pick]).size < 2:
            continue
        t, _, ok = _fit_once(n[pick], d[pick], loss[pick], starts=theta.unsqueeze(0))
        if ok:
            replicas.append(_to_params(t))
    return ScalingFit(params, replicas, float(residual.std(ddof=0)), value)


def check_runs(n: np.ndarray, d: np.ndarray, loss: np.ndarray) -> None:
    """Enough finite, positive runs with more than one N and more than one D."""
    if n.size < MIN_RUNS:
        raise ScalingFitError(f"{n.size} finished run(s): a fit of 5 parameters needs at least {MIN_RUNS}; "
                              f"run more of the grid (`scaletrain scale` resumes it)")
    for name, x in (("parameters", n), ("tokens", d), ("val_bpb", loss)):
        if not np.all(np.isfinite(x)) or np.any(x <= 0):
            raise ScalingFitError(f"a run has a non-positive or non-finite {name}; remove it from the grid folder")
    if np.unique(n).size < 2 or np.unique(d).size < 2:
        raise ScalingFitError("the runs need at least two model sizes and two token counts to separate the N and "
                              "D terms")


def check_searchable(fit: ScalingFit, flops: float | None) -> None:
    """ScalingFitError when the fit is ``implausible``: the searches pick a model size from its N/D trade-off and
    its E, the very numbers such a fit did not measure, and every bootstrap replicate shares the degenerate
    optimum, so no interval widened from them would be honest either."""
    notes = fit.implausible(flops)
    if notes:
        raise ScalingFitError("the fit cannot choose a model size: " + "; ".join(notes) + ". Fit a grid of longer "
                              "runs (a larger `scale --budget`), or ask for one run (`plan --data DATA "
                              "--model.preset=M --tokens T`), which is predicted with this caveat")


def check_target(fit: ScalingFit, target_bpb: float) -> None:
    """ScalingFitError when ``target_bpb`` is at or below the fitted irreducible loss E (no size reaches it)."""
    if target_bpb <= fit.params.E:
        raise ScalingFitError(f"--target-bpb {target_bpb:g} is at or below the fitted irreducible loss E = "
                              f"{fit.params.E:.4f} bpb of this data: no model size or token count reaches it; "
                              f"aim above E")
