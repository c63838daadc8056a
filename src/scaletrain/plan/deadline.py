"""``scaletrain plan --deadline HOURS`` / ``--budget USD``: which device count, and which plan on it.

For each device count of the chosen hardware (1, 2, 4 devices of one node, then 1, 2, 4, ... full nodes up
to ``--max-nodes``; CPU: 1, 2, 4, ... hosts), the plan search (``search``) picks the fastest plan that fits,
and the price table (``cost.training_cost``) prices its hours on demand and on spot. Then:

- ``--deadline H``: the cheapest option that finishes within H hours (on demand and spot, each);
- ``--budget USD``: the fastest option that costs at most USD (on demand and spot, each);
- both: the cheapest option that meets both.

Spot prices are list prices: the time lost to preemptions (the last checkpoint interval, the restart) is not
added; leave headroom in the deadline, or budget with the on-demand answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.config import ConfigError
from scaletrain.hardware.catalog import Cluster
from scaletrain.plan.cost import Cost, training_cost
from scaletrain.plan.search import Candidate, search
from scaletrain.plan.workload import Workload


@dataclass
class Option:
    cluster: Cluster
    best: Candidate
    hours: float
    cost: Cost

    def usd(self, pricing: str) -> float:
        return self.cost.spot_usd if pricing == "spot" else self.cost.on_demand_usd

    def as_dict(self) -> dict:
        return {"devices": self.cluster.world_size, "devices_per_node": self.cluster.devices_per_node,
                "nodes": self.cluster.nodes, "plan": self.best.plan.label(), "hours": self.hours,
                "tokens_per_second": self.best.time.tokens_per_second,
                "on_demand_usd": self.cost.on_demand_usd, "spot_usd": self.cost.spot_usd}


def device_counts(base: Cluster, max_nodes: int) -> list[Cluster]:
    """The clusters tried: part of one node (powers of two), then 1, 2, 4, ... whole nodes."""
    hw, per_node = base.hardware, base.devices_per_node
    if hw.kind == "cpu":  # a CPU "device" is one rank's share of a host; the host is what is rented
        return [Cluster(hw, per_node, n) for n in _powers(max_nodes)]
    full = hw.devices_per_node
    out = [Cluster(hw, d, 1) for d in _powers(full) if d < full]
    return out + [Cluster(hw, full, n) for n in _powers(max_nodes)]


def _powers(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def options(workload: Workload, base: Cluster, pins: dict, prices: dict, as_of: str, max_nodes: int) -> list[Option]:
    """Every device count with a plan that fits: its fastest plan, hours and price."""
    out = []
    for cluster in device_counts(base, max_nodes):
        try:
            result = search(workload, cluster, pins)
        except ConfigError:  # pins that do not divide this device count
            continue
        if not result.ranked:
            continue
        best = result.ranked[0]
        seconds = best.time.step * workload.steps
        hosts = cluster.nodes if cluster.hardware.kind == "cpu" else None
        out.append(Option(cluster, best, seconds / 3600,
                          training_cost(cluster.hardware.name, cluster.world_size, seconds, prices, as_of, hosts)))
    return out


def choose(opts: list[Option], pricing: str, deadline_h: float | None, budget_usd: float | None) -> Option | None:
    """The cheapest option within the deadline (and budget), or with only a budget the fastest within it."""
    ok = [o for o in opts if (deadline_h is None or o.hours <= deadline_h)
          and (budget_usd is None or o.usd(pricing) <= budget_usd)]
    if not ok:
        return None
    if deadline_h is not None:
        return min(ok, key=lambda o: (o.usd(pricing), o.hours))
    return min(ok, key=lambda o: (o.hours, o.usd(pricing)))


def check_limits(deadline_h: float | None, budget_usd: float | None, max_nodes: int) -> None:
    """--deadline and --budget finite and > 0 (NaN passed ``<= 0`` and was planned), --max-nodes >= 1."""
    if deadline_h is not None and not (math.isfinite(deadline_h) and deadline_h > 0):
        raise ConfigError(f"--deadline must be a finite number > 0 hours (got {deadline_h:g})")
    if budget_usd is not None and not (math.isfinite(budget_usd) and budget_usd > 0):
        raise ConfigError(f"--budget must be a finite number > 0 USD (got {budget_usd:g})")
    if max_nodes < 1:
        raise ConfigError(f"--max-nodes must be >= 1 (got {max_nodes})")


def answer(workload: Workload, base: Cluster, pins: dict, prices: dict, as_of: str, deadline_h: float | None,
           budget_usd: float | None, max_nodes: int) -> dict:
    """The options table and the choice for on-demand and spot pricing; ``error`` set when nothing qualifies."""
    check_limits(deadline_h, budget_usd, max_nodes)
    opts = options(workload, base, pins, prices, as_of, max_nodes)
    doc: dict = {"deadline_hours": deadline_h, "budget_usd": budget_usd, "prices_as_of": as_of,
                 "options": [o.as_dict() for o in opts], "choice": {}}
    if not opts:
        doc["error"] = f"no device count up to {max_nodes} node(s) of {base.hardware.name} has a plan that fits"
        return doc
    for pricing in ("on_demand", "spot"):
        pick = choose(opts, pricing, deadline_h, budget_usd)
        doc["choice"][pricing] = pick.as_dict() if pick else None
    if not any(doc["choice"].values()):
        fastest = min(opts, key=lambda o: o.hours)
        cheapest = min(opts, key=lambda o: o.cost.spot_usd)
        doc["error"] = (f"nothing meets {_limits(deadline_h, budget_usd)}: the fastest option "
                        f"({fastest.cluster.describe()}) takes {fastest.hours:.1f} h, the cheapest "
                        f"({cheapest.cluster.describe()}) costs ${cheapest.cost.spot_usd:,.0f} on spot; "
                        f"raise the limit, train fewer tokens, or raise --max-nodes")
    return doc


def _limits(deadline_h: float | None, budget_usd: float | None) -> str:
    parts = ([f"a {deadline_h:g} h deadline"] if deadline_h is not None else []) + \
        ([f"a ${budget_usd:,.0f} budget"] if budget_usd is not None else [])
    return " and ".join(parts)
