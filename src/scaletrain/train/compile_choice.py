"""``train.compile = auto``: compile only when this run's steps repay the compile.

A compile is a fixed cost paid before the first step (inductor traces the model and builds its kernels:
on the 2-core CPU machines ~20-30 s for the baby recipe with an empty cache, ~5 s with a warm one) for a
per-step saving (0.87-0.91x of the eager step on that recipe). A 2000-step run of a 0.8M-parameter model
saves ~10 s, so there it loses on a fresh machine; a run of an hour saves minutes. ``decide`` weighs the two:

    compile  iff  steps to go x eager step x saving  >  compile cost

from this machine's own measurements when it has them, else from stated priors:

* the record (``compile.json`` in the measurement cache, ``peak.cache_dir``), one entry per run shape (device,
  torch, model, batch, context, precision, whole model or per block, inductor's cache folder): an eager run
  leaves its median step; a compiled run its median step and its first step's extra seconds (the compile,
  cold or from inductor's cache). The next ``auto`` run of that shape uses them.
* without a record: the eager step from the model's FLOPs and this machine's measured peak at 40% MFU (the
  baby recipe's eager step measured 38-44%), a saving of 10% and a cold compile of 30 s (the CPU seconds the
  baby recipe's first compile took: benchmarks/compile_cold_start.py).

On a GPU ``auto`` compiles: there a compiled step saves 20-40% and a run is rarely shorter than its compile.
The choice is the run's (config.toml records ``true`` or ``false``), so a resume carries on as it began.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
from pathlib import Path

import torch

from scaletrain.config import ConfigError, JobConfig, read_toml
from scaletrain.finetune.method_table import method_entry
from scaletrain.hardware.peak import cache_dir, device_fingerprint, devices_in_job, peak_flops
from scaletrain.model import flops_per_token

PRIOR_SAVING = 0.10  # compiled step = 0.90x eager (baby recipe: 0.87-0.91x, docs/training.md)
PRIOR_COLD_SECONDS = 30.0  # the baby recipe's first compile with an empty cache, CPU seconds
PRIOR_MFU = 0.40  # eager MFU on this CPU (baby recipe 38-44%)
MIN_STEPS_TO_RECORD = 20  # a median over fewer steps says little


def record_path() -> Path:
    return cache_dir() / "compile.json"


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled graphs, by its own rule ($TORCHINDUCTOR_CACHE_DIR, else a per-user /tmp
    folder), computed without creating it: a compile is warm only while that folder still holds graphs."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())


def shape_key(cfg: JobConfig, device: torch.device, whole_model: bool) -> str:
    """One key per run shape whose compile and step time carry over: another model, batch, context, precision,
    device, torch version, thread count or inductor cache folder is another key."""
    what = json.dumps({"model": dataclasses.asdict(cfg.model), "batch": cfg.train.batch_size,
                       "seq": cfg.data.seq_len, "accum": cfg.train.grad_accum_steps,
                       "precision": cfg.train.precision, "whole_model": whole_model,
                       "inductor": inductor_cache_dir(), "device": device_fingerprint(device)}, sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def read_record(key: str) -> dict:
    try:
        return json.loads(record_path().read_text()).get(key, {})
    except (OSError, ValueError):
        return {}


def write_record(key: str, entry: dict) -> None:
    """Merge ``entry`` into the record (best effort: a read-only home only loses the measurement)."""
    try:
        data = json.loads(record_path().read_text()) if record_path().exists() else {}
        data[key] = {**data.get(key, {}), **entry}
        record_path().parent.mkdir(parents=True, exist_ok=True)
        tmp = record_path().with_suffix(f".{os.getpid()}.tmp")  # atomic: a reader never sees half a file
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(record_path())
    except (OSError, ValueError):
        pass


def estimated_eager_ms(cfg: JobConfig, device: torch.device, world_size: int) -> float:
    """The eager step from FLOPs: tokens per step x FLOPs per token / (this machine's peak x PRIOR_MFU)."""
    tokens = cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
    peak = peak_flops(device, "fp32") * devices_in_job(device.type, world_size, torch.get_num_threads())
    return 1000 * tokens * flops_per_token(cfg.model, cfg.data.seq_len) / (peak * PRIOR_MFU)


def expected_eager_ms(cfg: JobConfig, device: torch.device, world_size: int, whole_model: bool,
                      rec: dict | None = None) -> float:
    """The eager step this run expects: an earlier run of this shape here measured it, else the FLOP estimate."""
    rec = read_record(shape_key(cfg, device, whole_model)) if rec is None else rec
    return rec.get("eager_ms") or estimated_eager_ms(cfg, device, world_size)


def decide(cfg: JobConfig, device: torch.device, world_size: int, whole_model: bool,
           steps_to_go: int) -> tuple[bool, str]:
    """(compile?, why: one line with the numbers it weighed)."""
    if method_entry(cfg.finetune.method).quantized_base:
        return False, ("train.compile=auto: eager (QLoRA's model runs eagerly; finetune.qlora_compile compiles the "
                       "dequantization of its 4-bit base alone)")
    if cfg.model.moe_experts and cfg.parallel.tp > 1:
        return False, ("train.compile=auto: eager (a tensor-parallel mixture of experts: its experts' local "
                       "compute is not compiled, train/validate.py)")
    if device.type != "cpu":
        return True, f"train.compile=auto: compiling (a {device.type} run; a compiled step saves 20-40% there)"
    rec = read_record(shape_key(cfg, device, whole_model))
    eager_ms = expected_eager_ms(cfg, device, world_size, whole_model, rec)
    measured = "eager_ms" in rec and "compiled_ms" in rec
    saving = max(0.0, 1 - rec["compiled_ms"] / rec["eager_ms"]) if measured else PRIOR_SAVING
    warm = _warm(rec)
    if warm:  # inductor's cache holds graphs: ~0.2x of the cold compile (6.3 vs 30.6 CPU s on the baby)
        cost = rec.get("warm_seconds") or 0.25 * rec["cold_seconds"]
    else:
        cost = rec.get("cold_seconds") or PRIOR_COLD_SECONDS
    gain = steps_to_go * eager_ms / 1000 * saving
    source = "measured here" if measured else "estimated"
    why = (f"train.compile=auto: {'compiling' if gain > cost else 'eager'}: {steps_to_go:,} steps x "
           f"{eager_ms:.0f} ms x {saving:.0%} saved ({source}) = {gain:.0f} s "
           f"{'>' if gain > cost else '<='} a {'warm' if warm else 'cold'} compile of ~{cost:.0f} s")
    return gain > cost, why


def remember(cfg: JobConfig, device: torch.device, whole_model: bool, compiled: bool, step_seconds: list[float],
             was_warm: bool) -> None:
    """After a single-process CPU run: its median step, and (compiled) its first step's extra seconds."""
    if device.type != "cpu" or len(step_seconds) < MIN_STEPS_TO_RECORD:
        return
    median = statistics.median(step_seconds[5:])
    entry = {("compiled_ms" if compiled else "eager_ms"): 1000 * median}
    if compiled:
        entry["warm_seconds" if was_warm else "cold_seconds"] = max(0.0, step_seconds[0] - median)
    write_record(shape_key(cfg, device, whole_model), entry)


def compiled_before(cfg: JobConfig, device: torch.device, whole_model: bool) -> bool:
    """Whether this shape was compiled here before (and inductor's cache folder is still there)."""
    return _warm(read_record(shape_key(cfg, device, whole_model)))


def _warm(rec: dict) -> bool:
    """A record of a compile, and inductor's cache still holding graphs (a reboot clears /tmp: cold again)."""
    graphs = Path(inductor_cache_dir()) / "fxgraph"
    return ("cold_seconds" in rec or "warm_seconds" in rec) and graphs.is_dir() and any(graphs.iterdir())


def previous_choice(run_dir: Path) -> str | None:
    """The compile choice a run folder's config.toml recorded ("true"/"false"), for a resume to keep."""
    try:
        value = read_toml(run_dir / "config.toml").get("train", {}).get("compile")
    except ConfigError:  # no config.toml (a new run), or not readable: decide afresh
        return None
    return {True: "true", False: "false"}.get(value, value) if value in (True, False, "true", "false") else None


def choose(cfg: JobConfig, device: torch.device, world_size: int, whole_model: bool,
           run_dir: Path) -> tuple[str, str | None]:
    """("true"/"false", the line that says why, or None): train.compile with "auto" decided - a resume keeps
    the choice the run began with (its numerics: a compiled step rounds differently from an eager one)."""
    if cfg.train.compile != "auto":
        return cfg.train.compile, None
    if cfg.train.resume and (kept := previous_choice(run_dir)):
        return kept, f"train.compile=auto: {'compiling' if kept == 'true' else 'eager'}, as the run began"
    compile_it, why = decide(cfg, device, world_size, whole_model, cfg.train.steps)
    return ("true" if compile_it else "false"), why
