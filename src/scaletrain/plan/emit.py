"""Write a plan as a runnable job config (a full ``JobConfig`` TOML that ``load_config`` reads back)."""

from __future__ import annotations

from pathlib import Path

from scaletrain.config import to_toml
from scaletrain.plan.spec import Plan, Workload, job_config


def write_config(path: str | Path, workload: Workload, plan: Plan, device_kind: str, header: str = "") -> Path:
    """Write the TOML (with each field's help as a comment) and return its path."""
    text = to_toml(job_config(workload, plan, device_kind))
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + "\n" + text
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
