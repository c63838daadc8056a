"""``scaletrain report TUNE_FOLDER``: a ``scaletrain tune`` study drawn into one offline HTML page.

It reads the folder's ``study.json`` (written by tune as trials finish; plain JSON, so no optuna is needed
here): the best trial, val loss against the trial number and against each searched parameter, each trial's
evaluations against the step (where pruned trials stop), and the table of trials.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from scaletrain.core.options import ConfigError
from scaletrain.report.html import COLOURS, CSS, html_table

STUDY_FILE = "study.json"
STATE_STYLE = {"complete": COLOURS[0], "pruned": "#999999", "skipped": "#dddddd", "fail": COLOURS[1]}


def is_study_folder(path: str | Path) -> bool:
    return (Path(path) / STUDY_FILE).is_file()


def read_study(path: str | Path) -> dict:
    """The folder's study.json; ConfigError (one line) when it is unreadable."""
    file = Path(path) / STUDY_FILE
    try:
        doc = json.loads(file.read_text())
        if doc.get("kind") != "scaletrain-tune" or not isinstance(doc.get("trials"), list):
            raise ValueError
        return doc
    except (OSError, ValueError):
        raise ConfigError(f"{file}: not a readable `scaletrain tune` study (re-run tune in that folder to rewrite "
                          f"it)") from None


def _shown_value(trial: dict) -> float | None:
    """A complete trial's final val loss, or a pruned one's last evaluation."""
    if trial["value"] is not None:
        return trial["value"]
    values = list(trial["intermediate"].values())
    return values[-1] if values else None


def _scatter(trials: list[dict], x_of, x_title: str, title: str, log_x: bool = False) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for state, colour in STATE_STYLE.items():
        chosen = [t for t in trials if t["state"] == state and _shown_value(t) is not None]
        if not chosen:
            continue
        label = state if state != "pruned" else "pruned (last eval)"
        fig.add_trace(go.Scatter(
            x=[x_of(t) for t in chosen], y=[_shown_value(t) for t in chosen], mode="markers", name=label,
            marker={"color": colour, "size": 9, "symbol": ["star" if t["baseline"] else "circle" for t in chosen]},
            text=[f"trial {t['number']}" + (" (the job's own values)" if t["baseline"] else "") for t in chosen]))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title="val loss", height=380,
                      margin={"l": 50, "r": 20, "t": 40, "b": 40})
    if log_x:
        fig.update_xaxes(type="log")
    return fig


def _curves(trials: list[dict]) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for t in trials:
        if not t["intermediate"]:
            continue
        steps = [int(s) for s in t["intermediate"]]
        fig.add_trace(go.Scatter(x=steps, y=list(t["intermediate"].values()), mode="lines+markers",
                                 name=f"trial {t['number']} ({t['state']})",
                                 line={"color": STATE_STYLE.get(t["state"], COLOURS[2]), "width": 1}))
    fig.update_layout(title="Evaluations of each trial (pruned trials stop early)", xaxis_title="step",
                      yaxis_title="val loss", height=380, margin={"l": 50, "r": 20, "t": 40, "b": 40})
    return fig


def study_section(name: str, doc: dict, fig_html) -> str:
    """One study: summary, plots and the trial table, as HTML."""
    trials, params = doc["trials"], doc.get("params", [])
    counts = {s: sum(t["state"] == s for t in trials) for s in STATE_STYLE}
    best = doc.get("best")
    parts = [f"<h2>{html.escape(name)}</h2>",
             f"<p>{len(trials)} trials: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
             + f"; trained steps in all: {sum(t['steps'] for t in trials):,}. Objective: {doc.get('objective', '')} "
               f"(lower is better); a star marks the job's own values.</p>"]
    if best:
        values = ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}"
                           for k, v in best["params"].items())
        parts.append(f"<p><b>Best:</b> trial {best['number']}, val loss {best['value']:.4f}: {html.escape(values)}"
                     f" (its job: best.toml).</p>")
    slug = "".join(c if c.isalnum() else "-" for c in name)
    parts.append("<div class='grid'>")
    by_trial = _scatter(trials, lambda t: t["number"], "trial", "Val loss by trial")
    parts.append(f"<div>{fig_html(by_trial, f'{slug}-by-trial')}</div>")
    for p in params:
        key = p["name"]
        with_value = [t for t in trials if key in t["params"]]
        fig = _scatter(with_value, lambda t, k=key: t["params"][k], key, f"Val loss vs {key}", log_x=p["kind"] == "log")
        parts.append(f"<div>{fig_html(fig, f'{slug}-{key}')}</div>")
    parts.append(f"<div>{fig_html(_curves(trials), f'{slug}-curves')}</div></div>")
    names = [p["name"] for p in params]
    rows = [(str(t["number"]) + ("*" if t["baseline"] else ""), t["state"],
             "-" if _shown_value(t) is None else f"{_shown_value(t):.4f}", t["steps"],
             *[t["params"].get(k, "-") for k in names], t.get("note", "")) for t in trials]
    parts.append(html_table(rows, ("trial", "state", "val loss", "steps", *names, "note")))
    return "\n".join(parts)


def render_studies(folders: list[str], title: str) -> str:
    """The page for one or more tune folders."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    config = {"displaylogo": False, "responsive": True}

    def fig_html(fig: Any, div_id: str) -> str:
        return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, config=config)

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    for folder in folders:
        parts.append(study_section(Path(folder).resolve().name, read_study(folder), fig_html))
    parts.append("</body></html>")
    return "\n".join(parts)
