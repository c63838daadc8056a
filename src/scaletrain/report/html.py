"""One self-contained HTML page over one or more runs: header, plots, planned vs measured, samples, events.

Plots are plotly figures with plotly.js inlined once in the page (~4.7 MB): the file opens offline, with
no network fetch, and every curve can be hovered, zoomed and hidden from its legend, which matters when
several runs overlay on one axis (docs/monitoring.md says why plotly rather than matplotlib).
"""

from __future__ import annotations

import datetime
import html
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.plan.report import duration
from scaletrain.report.frontier import frontier_row
from scaletrain.report.runs import RunData

# Plotly's default colour cycle: one colour per run, so a run keeps its colour on every plot.
COLOURS = ["#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880"]
DASHES = ["solid", "dash", "dot", "dashdot", "longdash"]


@dataclass
class Series:
    """One curve per run: ``key`` of the records in ``source`` ("train" step records, "val" evaluations)."""

    source: str
    key: str
    label: str
    scale: float = 1.0


@dataclass
class PlotSpec:
    div_id: str
    title: str
    y_title: str
    series: list[Series]
    empty_note: str = "no data in these runs"
    log_y: bool = False
    predicted: str = ""  # "step" or "memory": draw the plan's prediction as a horizontal line


# Every plot of the report, against step and (a button away) wall time.
STEP_PLOTS = [
    PlotSpec("plot-loss", "Loss", "loss",
             [Series("train", "loss", "train loss"), Series("val", "val_loss", "val loss")]),
    PlotSpec("plot-val-bpb", "Validation bits per byte (comparable across tokenizers)", "bits per byte",
             [Series("val", "val_bpb", "val bpb")],
             empty_note="no val_bpb in these runs (recorded since bits per byte was added; `scaletrain eval --run R` "
                        "prints a checkpoint's)"),
    PlotSpec("plot-rewards", "Preference rewards (DPO: beta x log-ratio to the reference)", "reward",
             [Series("train", "reward_chosen", "chosen"), Series("train", "reward_rejected", "rejected"),
              Series("train", "reward_margin", "margin"), Series("val", "val_reward_margin", "val margin")],
             empty_note="no preference objective in these runs (finetune.objective = dpo, simpo or orpo)"),
    PlotSpec("plot-reward-accuracy", "Reward accuracy (share of pairs whose chosen reward is higher)", "%",
             [Series("train", "reward_accuracy", "train", 100.0), Series("val", "val_reward_accuracy", "val", 100.0)],
             empty_note="no preference objective in these runs (finetune.objective = dpo, simpo or orpo)"),
    PlotSpec("plot-lr", "Learning rate", "lr", [Series("train", "lr", "lr")]),
    PlotSpec("plot-grad-norm", "Gradient norm (before clipping)", "grad norm",
             [Series("train", "grad_norm", "grad norm")], log_y=True),
    PlotSpec("plot-expert-load", "Expert load (the busiest expert over the mean, worst sparse layer; 1 = even)",
             "max / mean", [Series("train", "moe_max_mean_load", "expert load")],
             empty_note="no mixture of experts in these runs (model.moe_experts = 0); each layer's load is in "
                        "metrics.jsonl (moe_max_mean_load/L, moe_tokens_per_expert/L)"),
    PlotSpec("plot-moe-auxiliary", "MoE auxiliary losses (summed over the sparse layers, as weighted)", "loss",
             [Series("train", "moe_balance_loss", "balance loss"), Series("train", "moe_z_loss", "z-loss")],
             empty_note="no MoE auxiliary loss in these runs (model.moe_balance_coef / moe_z_loss_coef)"),
    PlotSpec("plot-tokens-per-second", "Throughput", "tokens/s",
             [Series("train", "tokens_per_second", "tokens/s")]),
    PlotSpec("plot-step-time", "Step time (median of each log window)", "ms / step",
             [Series("train", "step_ms", "step time")], predicted="step"),
    PlotSpec("plot-mfu", "Model FLOPs utilisation", "MFU (%)", [Series("train", "mfu", "MFU", 100.0)]),
    PlotSpec("plot-memory", "Memory", "MiB",
             [Series("train", "peak_memory_mb", "peak (GPU: max allocated; CPU: peak RSS)"),
              Series("train", "rss_mb", "RSS (monitor)"),
              Series("train", "cuda_max_reserved_mb", "CUDA max reserved"),
              Series("train", "gpu_memory_used_mb", "GPU memory used (NVML)")], predicted="memory"),
    PlotSpec("plot-cpu", "CPU utilisation (monitor, mean of each log window)", "%",
             [Series("train", "process_cpu_percent", "process (100 = one core)"),
              Series("train", "system_cpu_percent", "system (100 = all cores)")],
             empty_note="no CPU samples (monitor.enabled = false, or log windows shorter than monitor.interval)"),
    PlotSpec("plot-gpu", "GPU utilisation (NVML)", "%",
             [Series("train", "gpu_util_percent", "GPU utilisation")],
             empty_note="no GPU samples: a CPU run, or nvidia-ml-py (pip install scaletrain[gpu]) not installed"),
    PlotSpec("plot-data-share", "Data loading share of the step", "%",
             [Series("train", "data_share", "waiting for batches", 100.0)],
             empty_note="no data-loading times (a run from before the monitor)"),
]
PLOT_IDS = [p.div_id for p in STEP_PLOTS] + ["plot-monitor"]


def _x_values(run: RunData, records: list[dict], unit: float) -> tuple[list, list]:
    start = run.start_time
    steps = [r["step"] for r in records]
    times = [round((r["time"] - start) / unit, 4) if start is not None and isinstance(r.get("time"), (int, float))
             else None for r in records]
    return steps, times


def _time_unit(runs: list[RunData]) -> tuple[float, str]:
    longest = max((r.wall_seconds or 0.0 for r in runs), default=0.0)
    if longest > 3 * 3600:
        return 3600.0, "h"
    if longest > 300:
        return 60.0, "min"
    return 1.0, "s"


def _value(record: dict, key: str, scale: float) -> float | None:
    v = record.get(key)
    return v * scale if isinstance(v, (int, float)) and math.isfinite(v) else None


def step_figure(spec: PlotSpec, runs: list[RunData], unit: float, unit_name: str) -> Any:
    """A figure with one trace per run and series, and buttons switching x between step and wall time."""
    import plotly.graph_objects as go

    fig = go.Figure()
    by_step, by_time = [], []
    for i, run in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        for j, s in enumerate(spec.series):
            records = [r for r in (run.train if s.source == "train" else run.val) if _value(r, s.key, s.scale)
                       is not None]
            if not records:
                continue
            steps, times = _x_values(run, records, unit)
            name = f"{run.name}: {s.label}" if len(runs) > 1 or len(spec.series) > 1 else run.name
            mode = "lines+markers" if s.source == "val" or len(records) < 30 else "lines"
            for rank, ys in _per_rank_values(records, s.key, s.scale).items():
                width = 2 if rank is None else 1  # one curve, or one thin curve per rank
                fig.add_trace(go.Scatter(x=steps, y=ys, name=name if rank is None else f"{name} (rank {rank})",
                                         mode=mode, legendgroup=run.name,
                                         line={"color": colour, "dash": DASHES[j % len(DASHES)], "width": width}))
                by_step.append(steps)
                by_time.append(times)
        predicted = _predicted_line(run, spec.predicted)
        if predicted is not None and (run.train or run.val):
            steps = [r["step"] for r in run.train + run.val]
            xs = [min(steps), max(steps)]
            _, times = _x_values(run, [min(run.train + run.val, key=lambda r: r["step"]),
                                       max(run.train + run.val, key=lambda r: r["step"])], unit)
            fig.add_trace(go.Scatter(x=xs, y=[predicted[0]] * 2, name=f"{run.name}: {predicted[1]}", mode="lines",
                                     legendgroup=run.name, line={"color": colour, "dash": "dot", "width": 1}))
            by_step.append(xs)
            by_time.append(times)
    layout: dict[str, Any] = {"title": {"text": spec.title}, "xaxis": {"title": {"text": "step"}},
                              "yaxis": {"title": {"text": spec.y_title}, "type": "log" if spec.log_y else "linear"},
                              "height": 380, "margin": {"t": 60, "b": 50, "l": 60, "r": 20},
                              "legend": {"orientation": "h", "y": -0.2}, "template": "plotly_white"}
    if fig.data:
        layout["updatemenus"] = [{"type": "buttons", "direction": "right", "x": 1.0, "xanchor": "right", "y": 1.18,
                                  "buttons": [
                                      {"label": "vs step", "method": "update",
                                       "args": [{"x": by_step}, {"xaxis.title.text": "step"}]},
                                      {"label": "vs wall time", "method": "update",
                                       "args": [{"x": by_time}, {"xaxis.title.text": f"wall time ({unit_name})"}]}]}]
    else:
        layout["annotations"] = [_empty_annotation(spec.empty_note)]
    fig.update_layout(**layout)
    return fig


def _per_rank_values(records: list[dict], key: str, scale: float) -> dict[int | None, list]:
    """{None: values} for a single-rank run; {rank: values} where the records carry ``KEY_per_rank`` (the
    trainer writes the list only where the ranks differ; elsewhere every rank had rank 0's value)."""
    lists = [r.get(f"{key}_per_rank") for r in records]
    ranks = max((len(v) for v in lists if isinstance(v, list)), default=0)
    if ranks < 2:
        return {None: [_value(r, key, scale) for r in records]}
    out: dict[int | None, list] = {}
    for rank in range(ranks):
        out[rank] = [(v[rank] * scale if isinstance(v, list) and rank < len(v) and isinstance(v[rank], (int, float))
                      else _value(r, key, scale)) for r, v in zip(records, lists)]
    return out


def _empty_annotation(text: str) -> dict:
    return {"text": text, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "showarrow": False,
            "font": {"size": 14, "color": "#888"}}


def _predicted_line(run: RunData, kind: str) -> tuple[float, str] | None:
    p = run_prediction(run)
    if p is None:
        return None
    if kind == "step" and p.get("step_seconds"):
        return 1000 * p["step_seconds"], "predicted step time"
    if kind == "memory" and p.get("memory_bytes"):
        return p["memory_bytes"] / 2**20, "predicted memory"
    return None


def monitor_figure(runs: list[RunData], unit: float, unit_name: str) -> Any:
    """The raw monitor samples of every rank against wall time: CPU (left axis) and RSS (right axis)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("CPU utilisation per rank (%)", "memory per rank (MiB)"))
    for i, run in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        start = run.start_time
        for rank, samples in sorted(run.monitor.items()):
            if not samples or start is None:
                continue
            xs = [round((s["time"] - start) / unit, 4) for s in samples]
            dash = DASHES[rank % len(DASHES)]
            for col, key in ((1, "process_cpu_percent"), (2, "rss_mb"), (1, "gpu_util_percent"),
                             (2, "gpu_memory_used_mb")):
                ys = [s.get(key) for s in samples]
                if all(y is None for y in ys):
                    continue
                label = {"process_cpu_percent": "CPU", "rss_mb": "RSS", "gpu_util_percent": "GPU",
                         "gpu_memory_used_mb": "GPU memory"}[key]
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{run.name} rank {rank}: {label}",
                                         legendgroup=run.name, line={"color": colour, "dash": dash}),
                              row=1, col=col)
    fig.update_layout(title={"text": f"Resource samples (every monitor.interval) against wall time ({unit_name})"},
                      height=380, margin={"t": 80, "b": 50, "l": 60, "r": 20}, template="plotly_white",
                      legend={"orientation": "h", "y": -0.2})
    if not fig.data:
        fig.update_layout(annotations=[_empty_annotation("no monitor samples in these runs")])
    return fig


# -- tables ----------------------------------------------------------------------------------------------


def run_prediction(run: RunData) -> dict | None:
    """The plan's prediction for this run: its config's [prediction] section (``plan --emit``), or a plan
    JSON given to the report (``attach_plan``)."""
    if run.plan_prediction:
        return run.plan_prediction
    if run.config is not None and run.config.prediction.plan:
        p = run.config.prediction
        return {"plan": p.plan, "step_seconds": p.step_seconds, "memory_bytes": p.memory_bytes,
                "tokens_per_second": p.tokens_per_second}
    return None


def final_quality(run: RunData) -> str:
    """'1.6012 (2.3101 bpb)': the last evaluation's val loss and bits per byte ('-' before any)."""
    summary = run.segments[-1].get("summary", {}) if run.segments else {}
    last = run.val[-1] if run.val else {}
    loss = summary.get("final_val_loss") or last.get("val_loss")
    bpb = summary.get("final_val_bpb") or last.get("val_bpb")
    if not isinstance(loss, (int, float)):
        return "-"
    return f"{loss:.4f}" + (f" ({bpb:.4f} bpb)" if isinstance(bpb, (int, float)) else "")


def prediction_rows(run: RunData) -> list[tuple[str, str, str, str]]:
    """(quantity, predicted, measured, error) rows; the error is measured / predicted - 1."""
    p = run_prediction(run)
    if p is None:
        return []
    rows = []
    for label, predicted, measured, fmt in (
            ("step time", p.get("step_seconds"), run.median_step_seconds(), lambda v: f"{1000 * v:.1f} ms"),
            ("peak memory per device", p.get("memory_bytes"), run.peak_memory_bytes(),
             lambda v: f"{v / 2**20:,.0f} MiB"),
            ("tokens/s", p.get("tokens_per_second"), run.median_tokens_per_second(), lambda v: f"{v:,.0f}")):
        if not predicted:
            continue
        error = f"{100 * (measured / predicted - 1):+.1f}%" if measured else "-"
        rows.append((label, fmt(predicted), fmt(measured) if measured else "not measured yet", error))
    if rows:  # what the planned compute bought, in the tokenizer-independent unit too
        rows.append(("final val loss (bits per byte)", "not predicted", final_quality(run), "-"))
    return rows


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float | None) -> str:
    return "-" if seconds is None else duration(seconds)


def steps_done(run: RunData) -> int:
    """The steps the run completed: its summary's (the trainer's count), else its last logged step (steps are
    logged every logging.log_interval, so a run stopped between two logs completed more)."""
    summary = run.segments[-1].get("summary", {}) if run.segments else {}
    return int(summary.get("steps", run.train[-1]["step"] if run.train else 0))


def run_status(run: RunData) -> str:
    """'finished' only for a run that reached train.steps; a run that ended before (a preemption notice or
    Ctrl-C, train.stop_at_step) says where it stopped, and why when the trainer recorded it."""
    if not run.finished:
        return "not finished (see the notes)"
    summary = run.segments[-1].get("summary", {})
    step = steps_done(run)
    total = run.config.train.steps if run.config else None
    if total is None or step >= total:
        return "finished"
    why = summary.get("preempted") or ("train.stop_at_step" if run.config and run.config.train.stop_at_step
                                       else "")
    return f"stopped at step {step:,} of {total:,}" + (f" ({why})" if why else "")


def last_val_loss(run: RunData) -> tuple[str, str]:
    """(label, value) of the last recorded validation loss, with its step: 'final val loss' only when it is the
    last step's of a run that finished (a run stopped early may hold only step 0's)."""
    if run.val:
        loss, step = run.val[-1]["val_loss"], run.val[-1]["step"]
    else:
        loss, step = run.segments[-1].get("summary", {}).get("final_val_loss") if run.segments else None, None
    if not isinstance(loss, (int, float)):
        return "final val loss", "-"
    at = f" (step {step:,})" if isinstance(step, (int, float)) else ""
    final = run_status(run) == "finished" and (step is None or not run.train or step >= run.train[-1]["step"])
    return ("final val loss" if final else "last val loss"), f"{loss:.4f}{at}"


def last_val_bpb(run: RunData) -> str:
    """The bits per byte of the evaluation ``last_val_loss`` shows (its row says which step), '-' without one:
    the header names the loss once, as 'final' or 'last' by the run's status."""
    record = run.val[-1] if run.val else (run.segments[-1].get("summary", {}) if run.segments else {})
    bpb = record.get("val_bpb", record.get("final_val_bpb"))
    return f"{bpb:.4f}" if isinstance(bpb, (int, float)) else "-"


def run_mfu(run: RunData) -> str:
    """The run's MFU as its ``done:`` line printed it (the summary's: ``train/metrics.py:mfu``, the one definition
    ``train`` and ``plan`` share), else the median of the logged windows' ('-' before any)."""
    summary = run.segments[-1].get("summary", {}) if run.segments else {}
    value = summary.get("mfu")
    if not isinstance(value, (int, float)) or value != value:  # NaN: no step finished
        logged = [r["mfu"] for r in run.train if isinstance(r.get("mfu"), (int, float))]
        value = statistics.median(logged) if logged else None
    return f"{100 * value:.1f}%" if value is not None else "-"


def header_rows(run: RunData, price: float) -> list[tuple[str, str]]:
    segs = run.segments
    last = segs[-1] if segs else {}
    hw = last.get("hardware", {})
    hardware = ", ".join(f"{k} {v}" for k, v in hw.items() if k != "load_average") if hw else "-"
    wall = run.wall_seconds
    devices = run.world_size
    if price and wall is not None:
        cost = f"${price * devices * wall / 3600:,.4f} ({devices} device(s) x {_duration(wall)} at ${price:g}/device-h)"
    else:
        cost = "pass --price USD_PER_DEVICE_HOUR" if wall is not None else "-"
    val_label, val_text = last_val_loss(run)
    bpb = last_val_bpb(run)
    frontier = frontier_row(run, steps_done(run), float(bpb) if bpb != "-" else None)
    return [("folder", str(run.path)),
            ("status", run_status(run)),
            ("command", "\n".join(s.get("command", "-") for s in segs) or "-"),
            ("git commit", last.get("git_commit", "-") or "-"),
            ("hardware", hardware),
            ("torch / python", f"{last.get('torch', '-')} / {last.get('python', '-')}"),
            ("load average", f"{hw['load_average']} at the start, {last.get('load_average_at_end', '-')} at the end "
                             f"(1, 5, 15 min; above the core count, other work shared the machine)"
             if "load_average" in hw else "-"),
            ("started", _fmt_time(run.start_time)),
            ("wall time", _duration(wall) + (f" over {len(segs)} segments (resumed)" if len(segs) > 1 else "")),
            ("steps", f"{steps_done(run):,}" + (f" of {run.config.train.steps:,}" if run.config else "")),
            (val_label, val_text),
            ("val bits per byte", bpb),
            *([frontier] if frontier else []),
            ("median step / tokens/s / MFU", f"{_duration(run.median_step_seconds())} / "
                                             f"{run.median_tokens_per_second() or 0:,.0f} / {run_mfu(run)}"),
            ("cost", cost)]


def html_table(rows: list[tuple], header: tuple | None = None) -> str:
    """An HTML table of ``rows`` (escaped), with an optional header row."""
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    return "".join(out) + "</table>"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px} h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd} h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0;font-size:13px} td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top;white-space:pre-wrap} th{background:#f4f4f4}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}
.note{color:#a15c00} pre{background:#f7f7f7;padding:8px;font-size:12px;overflow-x:auto}
.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle}
"""


def render(runs: list[RunData], price: float = 0.0, title: str = "scaletrain report",
           figure_html: Callable[[Any, str], str] | None = None) -> str:
    """The whole page as a string."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    config = {"displaylogo": False, "responsive": True, "toImageButtonOptions": {"format": "svg"}}

    def fig_html(fig: Any, div_id: str) -> str:
        return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, config=config)

    figure_html = figure_html or fig_html
    unit, unit_name = _time_unit(runs)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p>{len(runs)} run(s); written {_fmt_time(datetime.datetime.now().timestamp())}. Hover a curve for "
             f"values; click a legend entry to hide it; the buttons switch x between step and wall time.</p>"]
    parts.append("<h2>Runs</h2><div class='grid'>")
    for i, run in enumerate(runs):
        swatch = f"<span class='swatch' style='background:{COLOURS[i % len(COLOURS)]}'></span>"
        parts.append(f"<div><h3>{swatch}{html.escape(run.name)}</h3>{html_table(header_rows(run, price))}")
        if run.missing:
            parts.append("<p class='note'><b>Missing or incomplete:</b></p><ul class='note'>"
                         + "".join(f"<li>{html.escape(m)}</li>" for m in run.missing) + "</ul>")
        parts.append("</div>")
    parts.append("</div>")

    predicted = [(run, prediction_rows(run)) for run in runs]
    parts.append("<h2 id='predicted-vs-measured'>Predicted vs measured</h2>")
    if any(rows for _, rows in predicted):
        for run, rows in predicted:
            if rows:
                p = run_prediction(run)
                parts.append(f"<h3>{html.escape(run.name)}: plan {html.escape(str(p.get('plan', '')))}</h3>"
                             + html_table(rows, ("quantity", "predicted", "measured",
                                                 "error (measured / predicted - 1)")))
        parts.append("<p>Measured: the median of the logged step times (the first window, which pays compilation, "
                     "left out), the largest peak memory any rank logged (max allocated on a GPU; the process's "
                     "peak RSS on a CPU, which includes the runtime), the median tokens/s.</p>")
    else:
        parts.append("<p>No prediction: none of these runs was started from <code>scaletrain plan --emit</code>, and "
                     "no <code>--plan PLAN.json</code> was given.</p>")

    parts.append("<h2>Curves</h2><div class='grid'>")
    for spec in STEP_PLOTS:
        parts.append(f"<div>{figure_html(step_figure(spec, runs, unit, unit_name), spec.div_id)}</div>")
    parts.append("</div>")
    parts.append(figure_html(monitor_figure(runs, unit, unit_name), "plot-monitor"))

    parts.append("<h2>Events (NaN guard, rollbacks, preemption)</h2>")
    events = [(run.name, e["step"], e["kind"], e["detail"], _fmt_time(e.get("time"))) for run in runs
              for e in run.events]
    parts.append(html_table(events, ("run", "step", "event", "detail", "time")) if events
                 else "<p>None: no skipped update, rollback or preemption.</p>")

    parts.append("<h2>Checkpoints</h2>")
    ckpts = [(run.name, c["name"], "complete" if c["complete"] else "INCOMPLETE (no meta.json)",
              f"{c['bytes'] / 2**20:,.1f} MiB", _fmt_time(c["time"])) for run in runs for c in run.checkpoints]
    parts.append(html_table(ckpts, ("run", "checkpoint", "state", "size", "written")) if ckpts
                 else "<p>No checkpoints.</p>")

    parts.append("<h2>Samples</h2>")
    if any(run.samples for run in runs):
        for run in runs:
            for s in run.samples:
                parts.append(f"<h3>{html.escape(run.name)} at step {s['step']}</h3>"
                             f"<pre>{html.escape(str(s['sample']))}</pre>")
    else:
        parts.append("<p>No samples (train.sample_tokens = 0, or no evaluation yet).</p>")

    for run in runs:
        if run.top_ops:
            parts.append(f"<h2>Profile: top operators of {html.escape(run.name)} (rank 0, by self time)</h2>")
            rows = [(o["name"], f"{o['self_us'] / 1000:,.2f} ms", o["calls"], f"{100 * o['share']:.1f}%")
                    for o in run.top_ops]
            parts.append(html_table(rows, ("operator", "self time", "calls", "share")))
    parts.append("<h2>Configs</h2>")
    for run in runs:
        parts.append(f"<details><summary>{html.escape(run.name)}: config.toml</summary>"
                     f"<pre>{html.escape(run.config_text or 'no config.toml')}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)
