"""``scaletrain tune`` and ``scaletrain lr-find``: argparse wiring, input checks, output (docs/tuning.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from scaletrain.config import (
    JobConfig,
    add_config_arguments,
    add_renamed_flag,
    load_config,
    overrides_from_args,
    to_toml,
)
from scaletrain.core.files import guarded_write, write_file
from scaletrain.core.options import ConfigError


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``scaletrain tune``."""
    parser.description = ("Hyperparameter search with Optuna (TPE, median pruning on the eval losses) over any "
                          "config fields; the study is a SQLite file in --out, so a re-run continues it and "
                          "--parallel workers share it. The job is --config overridden by --section.field flags, "
                          "as for train; kebab-case flags are the search's own. See docs/tuning.md.")
    parser.add_argument("--config", help="the job TOML whose fields are searched (see configs/)")
    parser.add_argument("--space", required=True, help="search space TOML: [section.field] tables with type = "
                                                       "log | linear | int | categorical, low/high or choices")
    parser.add_argument("--trials", type=int, required=True,
                        help="finished trials the study should hold (complete, pruned or skipped; a re-run with a "
                             "larger number continues the study)")
    parser.add_argument("--parallel", type=int, default=1, help="worker processes sharing the study")
    parser.add_argument("--out", default="", help="the tune folder (study.db, trials/, best.toml); default "
                                                  "<train.run_dir>-tune")
    add_renamed_flag(parser, "--dir", "--out", dest="out")  # --out, as every command that writes a folder
    parser.add_argument("--pruner", default="median", choices=("median", "none"),
                        help="median: stop a trial whose val loss at an evaluation is worse than the median of "
                             "earlier trials at that step (set train.eval_interval so there are some)")
    parser.add_argument("--startup-trials", type=int, default=0,
                        help="random trials before TPE models the space, and trials before pruning starts; 0 = "
                             "a third of --trials, between 3 and 10")
    parser.add_argument("--metric", default="val_loss", choices=("val_loss", "val_bpb"),
                        help="what a trial minimises, at each evaluation (pruning) and at the end: the validation "
                             "loss, or bits per byte (val_bpb: comparable across tokenizers, e.g. when "
                             "data.tokenizer or data.vocab_size is searched; docs/evaluation.md)")
    # --objective was this flag's name; finetune.objective is the fine-tune's loss (sft, dpo, ...), not a metric
    add_renamed_flag(parser, "--objective", "--metric", dest="metric", choices=("val_loss", "val_bpb"))
    parser.add_argument("--seed", type=int, default=0, help="sampler seed (each worker adds its index)")
    parser.add_argument("--memory-gb", type=float, default=0.0,
                        help="skip trials the planner predicts need more per device than this; 0 = this machine's "
                             "available memory (or the GPU's) divided by --parallel")
    add_config_arguments(parser, JobConfig)


def _job(args: argparse.Namespace) -> JobConfig:
    return load_config(args.config, overrides_from_args(args))


def run_tune(args: argparse.Namespace) -> int:
    from scaletrain.data.run_data import prepare_data
    from scaletrain.train.precision import resolve_device
    from scaletrain.tune import study as st
    from scaletrain.tune.space import load_space

    if args.trials < 1 or args.parallel < 1:
        raise ConfigError(f"--trials and --parallel must be >= 1 (got {args.trials}, {args.parallel})")
    params = load_space(args.space)  # a bad space is refused before anything is written
    cfg = _job(args)
    st.optuna_module()  # installed? (one line saying how, before anything is written)
    folder = Path(args.out or f"{cfg.train.run_dir}-tune")
    job_text, space_text = to_toml(cfg), Path(args.space).read_text()
    st.same_setup(folder, job_text, space_text)
    with guarded_write(f"the tune folder {folder}", folder):
        folder.mkdir(parents=True, exist_ok=True)
    write_file(folder / "job.toml", job_text)
    write_file(folder / "space.toml", space_text)
    device_kind = "gpu" if resolve_device(cfg.train.device).type == "cuda" else "cpu"
    # Workers on one CPU share its cores: one thread each unless the job says otherwise.
    threads = cfg.train.threads or (max(1, (os.cpu_count() or 1) // args.parallel)
                                    if device_kind == "cpu" and args.parallel > 1 else 0)
    settings = {"seed": args.seed, "pruner": args.pruner, "device_kind": device_kind, "threads": threads,
                "objective": args.metric,
                "startup_trials": args.startup_trials or max(3, min(10, args.trials // 3)),
                "memory_limit": args.memory_gb * 2**30 if args.memory_gb > 0
                else st.default_memory_limit(device_kind, args.parallel)}
    # The data is prepared once here, so that workers starting together do not all prepare it.
    prepare_data(load_config(folder / "job.toml", st.trial_overrides(folder, 0, cfg, threads)))
    study = st.open_study(folder, args.seed, args.pruner, settings["startup_trials"], 0)
    st.set_objective(study, args.metric)  # a continued study keeps its objective
    if not study.trials:
        baseline = st.baseline_values(cfg, params)
        if baseline is not None:  # the hand-set config runs first, under the same budget
            study.enqueue_trial(baseline, user_attrs={"baseline": True})
    done = st.finished_count(study)
    print(f"study {folder / 'study.db'}: {done} of {args.trials} trials finished; searching "
          f"{', '.join(p.name for p in params)} with {args.parallel} worker(s)", flush=True)
    if done < args.trials:
        workers = st.start_workers(folder, args.parallel - 1, args.trials, settings)
        try:
            st.run_worker(folder, 0, args.trials, settings)
        finally:
            for w in workers:
                w.wait()
    study = st.open_study(folder, args.seed, args.pruner, settings["startup_trials"], 0)
    st.write_study_json(study, folder)
    rows = st.trial_rows(study)
    print(st.trial_table(rows, [p.name for p in params], args.metric))
    best = st.write_best(study, folder)
    counts = {s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "skipped", "fail")}
    print(f"{len(rows)} trials: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + " (* = the job's own "
          "values)")
    if best is None:
        print("no trial completed; nothing to recommend")
        return 0
    top = st.best_trial(study)
    print(f"best: trial {top.number}, {st.OBJECTIVES[args.metric]} {top.value:.4f}: "
          + ", ".join(f"{k}={st.format_value(v)}" for k, v in top.params.items())
          + f"; its job is {best} (scaletrain train --config {best}); scaletrain report {folder} draws the study")
    return 0


def add_lr_find_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``scaletrain lr-find``."""
    parser.description = ("Learning-rate range test: train with the lr growing exponentially from --start to "
                          "--end, smooth the loss, stop at divergence; print and save the curve and a suggested "
                          "optim.lr. See docs/tuning.md.")
    parser.add_argument("--config", help="the job TOML (see configs/)")
    parser.add_argument("--start", type=float, default=1e-6, help="first learning rate")
    parser.add_argument("--end", type=float, default=1.0, help="last learning rate")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of the sweep")
    parser.add_argument("--rule", default="steepest", choices=("steepest", "minimum"),
                        help="the suggestion: the lr where the smoothed loss falls fastest (steepest) or the lr at "
                             "its minimum divided by --divisor (minimum); both are printed and saved")
    parser.add_argument("--divisor", type=float, default=10.0,
                        help="with --rule minimum: the suggestion is the lr at the smoothed minimum divided by this")
    parser.add_argument("--out", default="", help="folder for lr_find.json (default <train.run_dir>-lr-find)")
    add_config_arguments(parser, JobConfig)


def run_lr_find(args: argparse.Namespace) -> int:
    from scaletrain.tune.lr_find import curve_table, lr_find, save

    if not 0 < args.start < args.end:
        raise ConfigError(f"lr-find needs 0 < --start < --end (got {args.start:g}, {args.end:g})")
    if args.steps < 10 or args.divisor <= 0:
        raise ConfigError(f"--steps must be >= 10 and --divisor > 0 (got {args.steps}, {args.divisor:g})")
    cfg = _job(args)
    out = Path(args.out or f"{cfg.train.run_dir}-lr-find")
    with guarded_write(f"the lr-find folder {out}", out):  # before the sweep, not after it
        out.mkdir(parents=True, exist_ok=True)
    result = lr_find(cfg, out / "run", args.start, args.end, args.steps, divisor=args.divisor, rule=args.rule)
    print(curve_table(result))
    path = save(result, out, args.config or "(defaults)")
    print(f"{result.stopped}; smoothed minimum at lr {result.min_lr:.3g}, steepest descent at "
          f"{result.steepest_lr:.3g}")
    how = "the steepest descent" if args.rule == "steepest" else f"the minimum's / {args.divisor:g}"
    print(f"suggested optim.lr = {result.suggested_lr:.3g} ({how}); curve saved to {path}")
    return 0
