"""``scaletrain report RUN [RUN ...] [--out report.html]``: one offline HTML page over one or more runs."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from scaletrain.core.files import check_output_path, write_file
from scaletrain.core.options import ConfigError


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders (train.run_dir); several overlay on the "
                                                               "same axes")
    parser.add_argument("--out", default="report.html", help="the HTML file to write")
    parser.add_argument("--price", type=float, default=0.0,
                        help="USD per device-hour: the header's cost is this x devices x wall time")
    parser.add_argument("--plan", default="", help="a `scaletrain plan --json` file: its best plan's prediction is "
                                                   "set beside each run that has none of its own (runs started "
                                                   "from `plan --emit` carry theirs in config.toml)")
    parser.add_argument("--title", default="scaletrain report", help="the page title")


def plan_prediction(path: str) -> dict:
    """The best plan of a ``scaletrain plan --json`` document as a prediction dict; ConfigError if unusable."""
    try:
        doc = json.loads(Path(path).read_text())
        best = doc["plans"][0]
        hardware = doc.get("hardware", {})
        where = f"{hardware.get('devices_per_node', '?')} x {hardware.get('name', '?')}"
        return {"plan": f"{best['label']} on {where} ({path})", "step_seconds": float(best["time"]["step"]),
                "memory_bytes": float(best["memory"]["total"]),
                "tokens_per_second": float(best["time"]["tokens_per_second"])}
    except OSError as exc:
        raise ConfigError(f"--plan {path}: cannot be read ({exc.strerror})") from None
    except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
        raise ConfigError(f"--plan {path}: not a `scaletrain plan --json` document with a plan that fits") from None


def write_page(out: Path, html: str) -> Path:
    """Write the page whole or not at all (``write_file``): a path that cannot be written is one line, and a
    failure leaves an earlier page there as it was."""
    return write_file(out, html, f"the report {out}")


def run_report(args: argparse.Namespace) -> int:
    from scaletrain.report.runs import RUN_FILES, has_run_files, read_run

    if not math.isfinite(args.price) or args.price < 0:  # NaN passed every comparison and printed "$nan"
        raise ConfigError(f"--price must be a finite number >= 0, USD per device-hour (got {args.price})")
    check_output_path(args.out, f"--out {args.out}")  # before the runs are read and drawn
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise ConfigError("scaletrain report draws with plotly: pip install 'scaletrain[monitor]' "
                          "(or pip install plotly)") from None
    from scaletrain.report.html import render
    from scaletrain.report.study import is_study_folder

    if any(is_study_folder(path) for path in args.runs):  # `scaletrain tune` folders: the study page
        return _report_studies(args)
    prediction = plan_prediction(args.plan) if args.plan else None
    if all(Path(path).is_dir() and not has_run_files(path) for path in args.runs):  # nothing to draw
        raise ConfigError(f"{', '.join(args.runs)}: not a run folder (it holds none of {', '.join(RUN_FILES)}); "
                          f"pass the train.run_dir of a run")
    runs, names = [], set()
    for path in args.runs:
        run = read_run(path)
        while run.name in names:  # two folders of the same name: keep the legend unambiguous
            run.name = f"{run.name}'"
        names.add(run.name)
        if prediction and not (run.config and run.config.prediction.plan):
            run.plan_prediction = prediction
        runs.append(run)
    out = write_page(Path(args.out), render(runs, price=args.price, title=args.title))
    for run in runs:
        for note in run.missing:
            print(f"{run.name}: {note}")
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {len(runs)} run(s); opens offline)")
    return 0


def _report_studies(args: argparse.Namespace) -> int:
    """``scaletrain report TUNE_FOLDER ...``: the studies' page (report/study.py)."""
    from scaletrain.report.study import is_study_folder, render_studies

    others = [path for path in args.runs if not is_study_folder(path)]
    if others:
        study = next(path for path in args.runs if is_study_folder(path))
        raise ConfigError(f"{others[0]} is a run folder and {study} a tune folder: report them in two commands")
    out = write_page(Path(args.out), render_studies(args.runs, args.title))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {len(args.runs)} tune stud(ies); opens offline)")
    return 0
