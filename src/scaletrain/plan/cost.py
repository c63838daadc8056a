"""Money: device-hours times an editable price table (USD per device-hour, on-demand and spot).

Prices move every month. The table says when it was written and where each figure comes from; pass
``--prices my_prices.toml`` (same shape: ``[h100-sxm] on_demand = 3.0  spot = 1.6``) to use your own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scaletrain.config import ConfigError, read_toml

PRICES_AS_OF = "2025-06"

# USD per device-hour. "cpu" is one host of the reference kind (2 vCPU, ~24 GiB).
PRICES: dict[str, dict] = {
    "h100-sxm": {"on_demand": 3.00, "spot": 1.70,
                 "source": "GPU clouds' list prices for 8x H100 SXM nodes "
                           "(Lambda, RunPod, CoreWeave ~2.5-3.5 $/GPU-h); "
                           "spot from marketplace / preemptible listings (~55%)"},
    "h100-pcie": {"on_demand": 2.50, "spot": 1.40,
                  "source": "GPU clouds' list prices for H100 PCIe (~2.0-2.9 $/GPU-h)"},
    "h200": {"on_demand": 3.80, "spot": 2.20, "source": "GPU clouds' list prices for 8x H200 nodes (~3.5-4.3 $/GPU-h)"},
    "a100-40gb": {"on_demand": 1.30, "spot": 0.70,
                  "source": "GPU clouds' list prices for A100 40GB (~1.1-1.5 $/GPU-h)"},
    "a100-80gb": {"on_demand": 1.80, "spot": 0.95,
                  "source": "GPU clouds' list prices for A100 80GB SXM (~1.3-2.0 $/GPU-h)"},
    "l40s": {"on_demand": 1.00, "spot": 0.55, "source": "GPU clouds' list prices for L40S (~0.8-1.2 $/GPU-h)"},
    "rtx-4090": {"on_demand": 0.40, "spot": 0.25, "source": "community GPU marketplaces (~0.3-0.7 $/GPU-h)"},
    "cpu": {"on_demand": 0.10, "spot": 0.035,
            "source": "a 2 vCPU / ~16-24 GiB cloud VM (e.g. AWS c7a.large/m7a.large 0.10-0.12 $/h; spot ~1/3)"},
}


@dataclass
class Cost:
    device_hours: float
    on_demand_usd: float
    spot_usd: float
    price_on_demand: float
    price_spot: float
    prices_as_of: str
    price_source: str

    def as_dict(self) -> dict:
        return asdict(self)


def load_prices(path: str | None = None) -> tuple[dict[str, dict], str]:
    """The built-in table, or it overlaid with a TOML file (whose optional ``as_of`` key dates it)."""
    if not path:
        return PRICES, PRICES_AS_OF
    raw = read_toml(path)
    as_of = str(raw.pop("as_of", f"user table {path}"))
    table = {k: dict(v) for k, v in PRICES.items()}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or "on_demand" not in entry:
            raise ConfigError(f"{path}: [{name}] needs on_demand = <USD per device-hour> (and optionally spot)")
        table[name] = {"on_demand": float(entry["on_demand"]), "spot": float(entry.get("spot", entry["on_demand"])),
                       "source": str(entry.get("source", path))}
    return table, as_of


def training_cost(hardware_name: str, devices: int, seconds: float, prices: dict[str, dict], as_of: str,
                  hosts: int | None = None) -> Cost:
    """Device-hours and dollars of ``devices`` devices busy for ``seconds``.

    ``hosts``: for CPU plans the price is per host (its ranks share it), so pass the number of nodes.
    """
    key = hardware_name.split("(")[-1].rstrip(")").replace("this cpu", "cpu").strip()
    entry = prices.get(key, {"on_demand": 0.0, "spot": 0.0, "source": f"no price for {key!r} in the table"})
    device_hours = devices * seconds / 3600
    billed_hours = hosts * seconds / 3600 if hosts is not None else device_hours
    return Cost(device_hours, billed_hours * entry["on_demand"], billed_hours * entry["spot"], entry["on_demand"],
                entry["spot"], as_of, entry["source"])
