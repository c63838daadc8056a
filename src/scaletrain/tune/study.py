"""``scaletrain tune``: an Optuna study over config fields, stored in SQLite in the tune folder.

Why Optuna and its RDB storage rather than our own loop: TPE, the median pruner, heartbeats that mark a
killed worker's trial failed (and ``RetryHeartbeatStaleTrialCallback`` that runs its parameters again), and a study
that any number of processes share through one SQLite file are all there, tested by others.

Trials run **in-process** in each worker (the tune process itself is worker 0; ``--parallel K`` starts K - 1
more ``python -m scaletrain.tune.worker`` processes on the same study): the pruner needs each evaluation as
it happens, which the Trainer's ``on_eval`` hook gives directly (no log parsing), and a worker process
already isolates a failing trial from the study (its exception marks that one trial FAIL). Each trial is the
ordinary ``Trainer`` on the job config plus the trial's values, in its own run folder
``<tune>/trials/trial-NNNN`` (so ``scaletrain report`` can draw any trial's curves).

The folder: ``study.db`` (the study), ``job.toml`` and ``space.toml`` (what the study searches; a re-run
must give the same ones), ``study.json`` (the trials as plain JSON for ``scaletrain report``), ``best.toml``
(the best trial's job) and ``trials/``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletrain.config import JobConfig, load_config, to_toml
from scaletrain.core.files import write_file
from scaletrain.core.options import ConfigError
from scaletrain.tune.space import Param, load_space

if TYPE_CHECKING:
    from scaletrain.train.evaluate import ValidationScore

STUDY_NAME = "tune"
HEARTBEAT_SECONDS = 5  # a worker's running trial pings the storage this often
GRACE_SECONDS = 20  # a trial without a ping for this long belongs to a dead worker: failed, then retried


# What a trial minimises (``tune --metric``; a study keeps it as "objective"): a Trainer evaluation key, its name.
OBJECTIVES = {"val_loss": "final val loss", "val_bpb": "final val bpb"}


def optuna_module():
    try:
        import optuna
    except ImportError:
        raise ConfigError("scaletrain tune needs optuna: pip install 'scaletrain[tune]' (or pip install optuna)") \
            from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Heartbeats are marked experimental since Optuna 2.8; they are what makes a killed study resumable here.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def open_storage(folder: Path) -> Any:
    """The study's SQLite storage with heartbeats (a killed worker's trial is failed and retried)."""
    optuna = optuna_module()
    return optuna.storages.RDBStorage(
        f"sqlite:///{folder.resolve() / 'study.db'}", heartbeat_interval=HEARTBEAT_SECONDS,
        grace_period=GRACE_SECONDS,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
        # Several processes write one SQLite file: wait for the lock instead of failing at once.
        engine_kwargs={"connect_args": {"timeout": 120}})


def open_study(folder: Path, seed: int, pruner: str, startup_trials: int, worker: int) -> Any:
    """The folder's study with this worker's TPE sampler (a seed of its own, and the constant liar so
    parallel workers do not all propose the same point) and pruner."""
    optuna = optuna_module()
    sampler = optuna.samplers.TPESampler(seed=seed + 1000 * worker, n_startup_trials=startup_trials,
                                         constant_liar=True)
    chosen = optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0) \
        if pruner == "median" else optuna.pruners.NopPruner()
    return optuna.create_study(study_name=STUDY_NAME, storage=open_storage(folder), sampler=sampler,
                               pruner=chosen, direction="minimize", load_if_exists=True)


def finished_count(study: Any) -> int:
    """Trials that count towards ``--trials``: complete, pruned and skipped ones (failed ones are retried)."""
    states = optuna_module().trial.TrialState
    return len(study.get_trials(deepcopy=False, states=(states.COMPLETE, states.PRUNED)))


# -- one trial --------------------------------------------------------------------------------------------------

def trial_overrides(folder: Path, number: int, base: JobConfig, threads: int) -> dict[str, str]:
    """What tune sets in every trial's config: its own run folder, the shared prepared data, no checkpoints."""
    over = {"train.run_dir": str(folder / "trials" / f"trial-{number:04d}"), "train.overwrite": "true",
            "train.resume": "false", "checkpoint.enabled": "false", "train.sample_tokens": "0",
            "logging.progress": "off"}
    if not base.data.cache_dir:
        over["data.cache_dir"] = str(folder / "data")
    if threads:
        over["train.threads"] = str(threads)
    return over


def trial_config(folder: Path, number: int, values: dict[str, Any], threads: int) -> JobConfig:
    """The saved job (``job.toml``) with the trial's values; ConfigError when the values do not make a job."""
    base = load_config(folder / "job.toml")
    over = {k: ",".join(map(str, v)) if isinstance(v, list) else str(v) for k, v in values.items()}
    return load_config(folder / "job.toml", {**over, **trial_overrides(folder, number, base, threads)})


def predicted_memory(cfg: JobConfig, device_kind: str) -> float:
    """Bytes per device the planner's memory model (``plan/memory.py``) predicts for ``cfg`` on one device,
    after the trainer's own entry check (``check_runnable``), which raises ConfigError for a job it refuses."""
    import torch

    from scaletrain.data.run_data import prepare_data, resolve_vocab
    from scaletrain.data.shards import read_manifest
    from scaletrain.hardware.allocator import in_use
    from scaletrain.plan.memory_check import estimated_bytes
    from scaletrain.train.precision import resolve_precision
    from scaletrain.train.validate import check_runnable

    # the trainer's own rule on this machine (auto: bf16 on a CPU with fast bf16 matmuls), not a copy of it
    device = "cuda" if device_kind == "gpu" else "cpu"
    precision = resolve_precision(cfg.train.precision, torch.device(device))[0]
    check_runnable(cfg, 1, device, precision)
    cfg, _ = resolve_vocab(cfg, read_manifest(prepare_data(cfg)))
    return estimated_bytes(cfg, precision, device_kind, allocator=in_use())


class Objective:
    """One trial: sample the values, skip it if the trainer refuses it or the planner says it does not fit, else
    train it with the Trainer, reporting each evaluation to the pruner."""

    def __init__(self, folder: Path, params: list[Param], memory_limit: float, device_kind: str, threads: int,
                 say=print, objective: str = "val_loss"):
        self.folder, self.params, self.memory_limit = folder, params, memory_limit
        self.device_kind, self.threads, self.say = device_kind, threads, say
        self.objective = objective  # a key of OBJECTIVES and of the trainer's evaluations (``Trainer.evals``)

    def __call__(self, trial: Any) -> float:
        optuna = optuna_module()
        from scaletrain.train.trainer import Trainer

        values = {p.name: p.suggest(trial) for p in self.params}
        shown = ", ".join(f"{k}={format_value(v)}" for k, v in values.items())
        try:
            cfg = trial_config(self.folder, trial.number, values, self.threads)
            need = predicted_memory(cfg, self.device_kind)
            trial.set_user_attr("predicted_memory_mb", round(need / 2**20, 1))
            if need > self.memory_limit:
                raise ConfigError(f"the planner predicts {need / 2**30:.2f} GiB per device, over the "
                                  f"{self.memory_limit / 2**30:.2f} GiB limit")
        except ConfigError as exc:  # skipped before it starts: counted, never trained
            trial.set_user_attr("skipped", str(exc))
            self.say(f"trial {trial.number} ({shown}): skipped: {exc}")
            raise optuna.TrialPruned(str(exc)) from None
        trial.set_user_attr("run_dir", cfg.train.run_dir)
        t0 = time.time()
        trainer = Trainer(cfg, log=False)
        tokens_per_step = trainer.tokens_per_step
        trial.set_user_attr("flops_per_token", trainer.flops_per_token)

        name = self.objective.replace("_", " ")  # "val loss", "val bpb"

        def report(step: int, score: ValidationScore) -> None:
            if step == 0:  # before any training: says nothing about the hyperparameters
                return
            value = score.loss if self.objective == "val_loss" else score.bpb
            trial.report(value, step)
            if step < cfg.train.steps and trial.should_prune():
                raise optuna.TrialPruned(f"{name} {value:.4f} at step {step}")

        trainer.on_eval = report
        try:
            summary = trainer.train()
        except optuna.TrialPruned:
            trainer.close()
            self._record(trial, trainer.state.step, tokens_per_step, t0)
            last = trainer.evals[-1]
            self.say(f"trial {trial.number} ({shown}): pruned at step {last['step']} ({name} "
                     f"{last[self.objective]:.4f})")
            raise
        except BaseException:
            trainer.close()
            raise
        self._record(trial, summary["steps"], tokens_per_step, t0)
        value = summary["evals"][-1][self.objective]
        self.say(f"trial {trial.number} ({shown}): {name} {value:.4f} ({time.time() - t0:.0f} s)")
        return value

    @staticmethod
    def _record(trial: Any, steps: int, tokens_per_step: int, t0: float) -> None:
        trial.set_user_attr("steps", steps)
        trial.set_user_attr("tokens", steps * tokens_per_step)
        trial.set_user_attr("seconds", round(time.time() - t0, 2))


# -- workers ---------------------------------------------------------------------------------------------------

def run_worker(folder: Path, worker: int, total: int, settings: dict) -> None:
    """Run trials of the folder's study until it holds ``total`` finished ones (shared with other workers)."""
    optuna = optuna_module()
    params = load_space(folder / "space.toml")
    study = open_study(folder, settings["seed"], settings["pruner"], settings["startup_trials"], worker)
    objective = Objective(folder, params, settings["memory_limit"], settings["device_kind"], settings["threads"],
                          say=lambda text: print(f"[worker {worker}] {text}", flush=True),
                          objective=settings.get("objective", "val_loss"))
    remaining = total - finished_count(study)
    if remaining <= 0:
        return

    def export(study: Any, _trial: Any) -> None:
        write_study_json(study, folder)

    study.optimize(objective, n_trials=remaining, catch=(Exception,),
                   callbacks=[optuna.study.MaxTrialsCallback(total, states=(optuna.trial.TrialState.COMPLETE,
                                                                            optuna.trial.TrialState.PRUNED)),
                              export])


def _die_with_parent(parent: int) -> None:
    """In a worker process (Linux): be killed when the tune process dies, even by SIGKILL, so that killing
    `scaletrain tune` stops the whole study; its running trials are then failed by heartbeat and retried."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def start_workers(folder: Path, count: int, total: int, settings: dict) -> list[subprocess.Popen]:
    """``count`` worker processes on the folder's study (``python -m scaletrain.tune.worker``)."""
    parent = os.getpid()
    spec = json.dumps(settings)
    return [subprocess.Popen([sys.executable, "-m", "scaletrain.tune.worker", str(folder), str(i), str(total), spec],
                             preexec_fn=lambda: _die_with_parent(parent)) for i in range(1, count + 1)]


# -- results ---------------------------------------------------------------------------------------------------

def format_value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def trial_rows(study: Any) -> list[dict]:
    """Every trial as a plain dict (number, state, value, params, intermediate values, attributes)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        state = "skipped" if t.user_attrs.get("skipped") else t.state.name.lower()
        rows.append({"number": t.number, "state": state, "value": t.value, "params": t.params,
                     "intermediate": {str(k): v for k, v in sorted(t.intermediate_values.items())},
                     "steps": t.user_attrs.get("steps", 0), "tokens": t.user_attrs.get("tokens", 0),
                     "seconds": t.user_attrs.get("seconds"), "note": t.user_attrs.get("skipped", ""),
                     "flops": t.user_attrs.get("tokens", 0) * t.user_attrs.get("flops_per_token", 0.0),
                     "baseline": bool(t.user_attrs.get("baseline")),
                     "run_dir": t.user_attrs.get("run_dir", "")})
    return rows


def best_trial(study: Any) -> Any | None:
    states = optuna_module().trial.TrialState
    done = study.get_trials(deepcopy=False, states=(states.COMPLETE,))
    return min(done, key=lambda t: t.value) if done else None


def write_study_json(study: Any, folder: Path) -> Path:
    """``study.json``: what ``scaletrain report`` draws (it needs no optuna). Written atomically: several
    workers rewrite it as their trials finish."""
    best = best_trial(study)
    doc = {"kind": "scaletrain-tune", "study": STUDY_NAME, "direction": "minimize",
           "objective": OBJECTIVES[study_objective(study)],
           "params": [{"name": p.name, "kind": p.kind} for p in load_space(folder / "space.toml")],
           "best": None if best is None else {"number": best.number, "value": best.value, "params": best.params},
           "trials": trial_rows(study)}
    tmp = folder / f".study.json.{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, folder / "study.json")
    return folder / "study.json"


def study_objective(study: Any) -> str:
    """The study's objective (``tune --metric``, kept in the study): val_loss for studies from before it."""
    return study.user_attrs.get("objective", "val_loss")


def set_objective(study: Any, objective: str) -> None:
    """Record ``objective`` in a new study; a continued study must keep the one it started with (ConfigError)."""
    saved = study.user_attrs.get("objective", "val_loss" if study.trials else None)
    if saved is not None and saved != objective:
        raise ConfigError(f"--metric {objective}: the study was started with --metric {saved} (its trials "
                          f"are values of that); continue it with {saved}, or start a new --out")
    study.set_user_attr("objective", objective)


def trial_table(rows: list[dict], params: list[str], objective: str = "val_loss") -> str:
    """The trials as a plain-text table (one line each)."""
    head = ["#", "state", objective.replace("_", " "), "steps", *params]
    lines = [head]
    for r in rows:
        value = f"{r['value']:.4f}" if r["value"] is not None else "-"
        if r["state"] == "pruned" and r["intermediate"]:
            value = f"({list(r['intermediate'].values())[-1]:.4f})"
        lines.append([str(r["number"]) + ("*" if r["baseline"] else ""), r["state"], value, str(r["steps"]),
                      *[format_value(r["params"].get(p, "-")) for p in params]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def write_best(study: Any, folder: Path) -> Path | None:
    """``best.toml``: the job with the best trial's values (its own run folder, checkpoints as the job had)."""
    best = best_trial(study)
    if best is None:
        return None
    base = load_config(folder / "job.toml")
    over = {k: str(v) for k, v in best.params.items()}
    over["train.run_dir"] = f"{base.train.run_dir}-best"
    cfg = load_config(folder / "job.toml", over)
    header = (f"# The best trial (#{best.number}, {OBJECTIVES[study_objective(study)]} {best.value:.4f}) of the "
              f"study in {folder}:\n"
              f"# {', '.join(f'{k} = {format_value(v)}' for k, v in best.params.items())}\n"
              f"#   scaletrain train --config {folder / 'best.toml'}\n")
    path = folder / "best.toml"
    return write_file(path, header + to_toml(cfg))


def baseline_values(cfg: JobConfig, params: list[Param]) -> dict[str, Any] | None:
    """The job's own settings of the searched fields, when every one is a point of the space (it then runs
    first, so the table shows the hand-set config under the same budget)."""
    values = {}
    for p in params:
        section, name = p.name.split(".", 1)
        value = getattr(getattr(cfg, section), name)
        if not p.contains(value):
            return None
        values[p.name] = value
    return values


def default_memory_limit(device_kind: str, parallel: int) -> float:
    """Bytes a trial may use: this machine's available memory (or the GPU's) shared by the workers."""
    if device_kind == "gpu":
        import torch

        return torch.cuda.get_device_properties(0).total_memory / parallel
    import psutil

    return psutil.virtual_memory().available / parallel


def same_setup(folder: Path, job_text: str, space_text: str) -> None:
    """A re-run continues the study only with the job and space it was started with (ConfigError otherwise)."""
    for name, text in (("job.toml", job_text), ("space.toml", space_text)):
        saved = folder / name
        if saved.is_file() and saved.read_text() != text:
            raise ConfigError(f"{folder} holds a study started with another {name.split('.')[0]} ({saved} differs); "
                              f"give the same --config / --space / flags to continue it, or a new --out")
