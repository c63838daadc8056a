"""Dense or mixture of experts: which reaches a target bpb cheaper on this hardware, and where that flips.

Each family's own law (scaling/family.py) gives the tokens a size needs to reach the target; the planner prices
those tokens on the hardware (what an MoE FLOP costs in time, the router, the grouped GEMM at few rows an expert,
the load imbalance, is the planner's step time, not the law's); the cheaper family is the answer
(``plan --data D --target-bpb X`` with both fits in D).

The crossover is the same search over a ladder of targets, from the hardest bpb both fits reach within their
scopes to the easiest any of their grids measured: where the cheaper family changes between two neighbouring
targets, the target it changes at is interpolated (the log cost ratio, linear in log bpb). A law buys its MoE
advantage per FLOP and the planner takes some back per second, so the answer is the hardware's as much as the
data's: a GPU's grouped GEMM keeps more of it than a two-core CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaletrain.core.options import ConfigError
from scaletrain.scaling.family import DENSE, family_name, shape_of
from scaletrain.scaling.fit import ScalingFit

LADDER = 10  # targets the crossover is searched over
TIE = 0.05  # two families' costs within 5% of each other: neither is cheaper (``_flips``)
# Sizes tried at each target of the ladder, x the compute-optimal one: finer than one target's answer (0.5, 1, 2),
# since the cheapest of three whole family members jumps by up to ~30% between neighbouring targets
LADDER_FACTORS = tuple(float(f) for f in np.geomspace(0.25, 4.0, 9))
_REACH = 1.002  # the ladder's hardest target: 0.2% above the least loss each fit's scope reaches


@dataclass
class FamilySearch:
    """One family's fit, scope and the search's other inputs: ``cheapest(target)`` is ``cheapest_for_target``."""

    key: str
    fit: ScalingFit
    doc: dict
    scope: Any  # quality.Scope
    common: tuple  # vocab, cluster, seq, batch, precision, pins, prices, as_of, max_nodes
    search: Callable[..., dict]  # quality.cheapest_for_target (passed in: quality prints what this module finds)

    def cheapest(self, target: float, factors: tuple[float, ...] | None = None) -> dict:
        extra = {"factors": factors} if factors else {}
        return self.search(self.fit, target, self.scope, *self.common, moe=shape_of(self.key), **extra)

    def least_reachable(self) -> float:
        """The lowest bpb the law predicts within the scope (its largest size on its most tokens)."""
        return float(self.fit.params.loss(self.scope.n_high, self.scope.max_tokens))

    def easiest_measured(self) -> float | None:
        """The highest val bpb of the fit's grid runs (every size reaches it); None when the runs do not say."""
        bpbs = [r["val_bpb"] for r in self.doc.get("runs", []) if isinstance(r.get("val_bpb"), (int, float))]
        return max(bpbs) if bpbs else None


def price(result: dict) -> float:
    """What a search's choice costs: on-demand dollars (hours where the price table has none)."""
    choice = result["choice"]
    return choice["on_demand_usd"] if choice["on_demand_usd"] > 0 else choice["hours"]


def compare(results: dict[str, dict]) -> dict:
    """The cheapest family of the searches that found a choice, and how much each other one costs beside it."""
    ranked = sorted(results, key=lambda k: price(results[k]))
    best = ranked[0]
    return {"family": best, "ratios": {k: price(results[k]) / price(results[best]) for k in ranked[1:]}}


def ladder(searches: list[FamilySearch]) -> list[float]:
    """Targets from the hardest all families reach to the easiest any grid measured, log-spaced; [] when none."""
    hard = max(s.least_reachable() for s in searches) * _REACH
    measured = [m for m in (s.easiest_measured() for s in searches) if m is not None]
    easy = max(measured) if measured else hard * 1.25
    if not easy > hard:
        return []
    return [float(t) for t in np.exp(np.linspace(math.log(hard), math.log(easy), LADDER))]


def crossover(searches: list[FamilySearch]) -> dict:
    """Every MoE family against the dense one over ``ladder``'s targets: the costs and where the cheaper flips.

    ``crossovers``: {family, bpb, cheaper_below, cheaper_above} for each flip; a target neither family can reach
    on this hardware is left out of the ladder."""
    by_key = {s.key: s for s in searches}
    targets = ladder(searches)
    costs: dict[str, list[float | None]] = {k: [] for k in by_key}
    for target in targets:
        for key, search in by_key.items():
            try:
                costs[key].append(price(search.cheapest(target, LADDER_FACTORS)))
            except ConfigError:  # out of this family's scope or hardware at this target
                costs[key].append(None)
    flips = []
    if DENSE in by_key:
        for key in by_key:
            if key != DENSE:
                flips += _flips(key, targets, costs[DENSE], costs[key])
    return {"targets": targets, "costs": costs, "crossovers": flips}


def _flips(key: str, targets: list[float], dense: list, moe: list) -> list[dict]:
    """Where the cheaper family changes along the ladder (interpolated where log(moe / dense) crosses 0, in log
    target) after a running median of three. Costs within ``TIE`` of each other are a tie, not a side: the
    searches price whole family members, whose steps in size move a cost by several percent, and such steps must
    not read as crossovers."""
    sided = [(t, r) for t, r in _smoothed(targets, dense, moe) if abs(r) > math.log1p(TIE)]
    out = []
    for (t0, r0), (t1, r1) in zip(sided, sided[1:]):
        if (r0 < 0) != (r1 < 0):
            at = math.exp(math.log(t0) + (math.log(t1) - math.log(t0)) * r0 / (r0 - r1))
            below, above = (key, DENSE) if r0 < 0 else (DENSE, key)
            out.append({"family": key, "bpb": at, "cheaper_below": below, "cheaper_above": above})
    return out


def _smoothed(targets: list[float], dense: list, moe: list) -> list[tuple[float, float]]:
    """(target, log(moe / dense)) where both reach it, as a running median of three: one target's cost can jump
    ~2x where the tokens it needs meet the data's cap, and a single such target is no crossover."""
    points = [(t, math.log(m / d)) for t, d, m in zip(targets, dense, moe) if d and m]
    logs = [r for _, r in points]
    return [(t, float(np.median(logs[max(0, i - 1): i + 2]))) for i, (t, _) in enumerate(points)]


def crossover_lines(result: dict, hardware: str) -> list[str]:
    """One line a MoE family: the flip(s), or which family is cheaper over the whole ladder and by how much."""
    targets, costs = result["targets"], result["costs"]
    if not targets or DENSE not in costs:
        return ["crossover: not searched (it needs the dense fit and an MoE fit whose scopes reach a common bpb)"]
    span = f"{targets[0]:.4g}-{targets[-1]:.4g} bpb, {len(targets)} targets"
    lines = []
    for key in (k for k in costs if k != DENSE):
        flips = [f for f in result["crossovers"] if f["family"] == key]
        if flips:
            lines += [f"crossover on {hardware}: at {f['bpb']:.4g} bpb, {family_name(f['cheaper_below'])} is cheaper "
                      f"for targets below it and {family_name(f['cheaper_above'])} above (searched {span})"
                      for f in flips]
            continue
        ratios = [m / d for d, m in zip(costs[DENSE], costs[key]) if d and m]
        if not ratios:
            lines.append(f"crossover: no target of {span} is reachable by both dense and {family_name(key)}")
            continue
        spread = f"{family_name(key)} costs {min(ratios):.2f}x-{max(ratios):.2f}x dense's"
        smooth = [r for _, r in _smoothed(targets, costs[DENSE], costs[key])]
        if all(abs(r) <= math.log1p(TIE) for r in smooth):
            lines.append(f"no crossover on {hardware} over {span}: a tie at every target ({spread}, within "
                         f"{TIE:.0%}: the family's size steps move a cost by as much)")
            continue
        cheaper = family_name(key) if min(smooth) < -math.log1p(TIE) else DENSE
        lines.append(f"no crossover on {hardware} over {span}: {cheaper} is cheaper or tied at every target "
                     f"({spread})")
    return lines
