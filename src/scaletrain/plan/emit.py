"""Write a plan as a runnable job config (a full ``JobConfig`` TOML that ``load_config`` reads back)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from scaletrain.config import PredictionConfig, to_toml
from scaletrain.core.files import write_file
from scaletrain.plan.workload import Plan, Workload, job_config


def write_config(path: str | Path, workload: Workload, plan: Plan, device_kind: str, header: str = "",
                 prediction: PredictionConfig | None = None) -> Path:
    """Write the TOML (with each field's help as a comment) and return its path. ``prediction`` (the plan's
    predicted step time, memory and tokens/s) goes into its [prediction] section, which the run folder's
    config.toml keeps, so ``scaletrain report`` can set it beside what the run measured."""
    cfg = job_config(workload, plan, device_kind)
    if prediction is not None:
        cfg = dataclasses.replace(cfg, prediction=prediction)
    text = to_toml(cfg)
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + "\n" + text
    return write_file(path, text, f"the plan's job config {path}")
