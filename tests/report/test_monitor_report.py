"""The resource monitor, the profiler and `scaletrain report` (issue 12)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import MonitorConfig, load_config, to_toml
from scaletrain.report.html import PLOT_IDS
from scaletrain.train.monitor import ResourceMonitor, timed

ROOT = Path(__file__).resolve().parents[2]


class _Fetches(HTMLParser):
    """Every attribute through which a browser would fetch something."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href", "data", "action", "poster", "srcset", "background") and value:
                self.urls.append(f"<{tag} {name}={value}>")
            if tag == "link":
                self.urls.append(f"<link {name}={value}>")


def external_urls(page: str) -> list[str]:
    """Network fetches a page would make: src/href/... attributes to a remote or protocol-relative URL, any
    <link>, and CSS @import / url(http...)."""
    parser = _Fetches()
    parser.feed(page)
    found = [u for u in parser.urls if re.search(r"=\s*(https?:)?//", u) or u.startswith("<link")]
    styles = re.findall(r"<style[^>]*>(.*?)</style>", page, re.S)
    found += [m for css in styles for m in re.findall(r"@import[^;]*|url\(\s*['\"]?(?:https?:)?//[^)]*\)", css)]
    return found


def _train(tiny, run: Path, *extra: str) -> None:
    over = tiny(run, **{"train.steps": "12", "train.eval_interval": "6", "train.sample_tokens": "8",
                        "logging.log_interval": "2", "monitor.interval": "0.02", "checkpoint.interval": "6"})
    args = ["train"] + [f"--{k}={v}" for k, v in over.items()] + list(extra)
    assert main(args) == 0


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from helpers.tiny import tiny_overrides

    run = tmp_path_factory.mktemp("report") / "run"
    _train(tiny_overrides, run)
    return run


def test_monitor_samples_in_a_thread(tmp_path):
    monitor = ResourceMonitor(MonitorConfig(interval=0.01), tmp_path, rank=3, device=torch.device("cpu")).start()
    deadline = time.time() + 10
    while monitor.samples < 3 and time.time() < deadline:
        sum(i * i for i in range(20000))  # keep this process busy, so its CPU share is above zero
    window = monitor.window()
    monitor.stop()
    assert monitor.samples >= 3, "the sampler thread took no samples"
    assert window["rss_mb"] > 10 and window["available_mb"] > 0 and window["process_cpu_percent"] > 0
    assert "gpu_util_percent" not in window  # a CPU run has no GPU readings, rather than zeros
    lines = (tmp_path / "monitor" / "rank3.jsonl").read_text().splitlines()
    assert len(lines) >= 3 and all("rss_mb" in json.loads(line) for line in lines)
    assert monitor.window() == {}  # the window restarts after each read


def test_timed_adds_the_time_spent_producing_items():
    def slow():
        for i in range(3):
            time.sleep(0.02)
            yield i

    seconds = [0.0]
    assert list(timed(slow(), seconds)) == [0, 1, 2]
    assert 0.05 < seconds[0] < 1.0


def test_training_writes_monitor_metrics_and_run_info(trained_run):
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert all(0 <= r["data_share"] < 1 for r in steps)
    assert any("rss_mb" in r and "process_cpu_percent" in r for r in steps), "no monitor window reached metrics"
    assert [r["step"] for r in records if "sample" in r] == [0, 6, 12]  # at each evaluation
    info = json.loads((trained_run / "run_info.json").read_text())["segments"]
    assert len(info) == 1 and info[0]["torch"] == torch.__version__ and "finished" in info[0]
    # the command as cli.main got it (this test calls it in-process: not pytest's own command line)
    assert info[0]["command"].startswith("scaletrain train --model.dim=32 ")
    assert info[0]["hardware"]["device"] == "cpu"


def test_report_has_every_plot_and_no_external_urls(trained_run, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(trained_run), "--out", str(out), "--price", "2.5"]) == 0
    page = out.read_text()
    for div in PLOT_IDS:
        assert f'id="{div}"' in page, div
    # One Plotly.newPlot per plot, and plotly.js itself inline (not fetched).
    assert page.count("Plotly.newPlot(") - page.count("Plotly.newPlot(\"") <= len(PLOT_IDS) + 1
    assert len(re.findall(r'Plotly\.newPlot\(\s*"plot-', page)) == len(PLOT_IDS)
    assert "<script src" not in page.replace(" ", "").lower().replace("<scriptsrc", "<script src")
    assert external_urls(page) == []
    # Header, samples, checkpoints.
    assert "git commit" in page and torch.__version__ in page and "$2.5/device-h" in page
    assert "step-00000006" in page and "step-00000012" in page and "at step 12" in page
    assert "finished" in page


def test_external_url_check_catches_fetches():
    assert external_urls('<script src="https://cdn.plot.ly/plotly.min.js"></script>')
    assert external_urls('<img src="//example.com/a.png">')
    assert external_urls('<link rel="stylesheet" href="style.css">')
    assert external_urls("<style>@import url('https://fonts.example/x.css');</style>")
    assert external_urls('<a href="#top">x</a><script>var u = "https://x";</script>') == []


def test_report_overlays_runs_and_reads_bad_input(trained_run, tmp_path, capsys):
    # A folder with nothing in it, a copy whose last JSONL line is cut in half and that never finished
    # (a run still being written), and the good run: all on one page.
    empty = tmp_path / "empty"
    empty.mkdir()
    partial = tmp_path / "partial"
    shutil.copytree(trained_run, partial, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    text = (partial / "metrics.jsonl").read_text()
    (partial / "metrics.jsonl").write_text(text + '{"time": 1, "step": 14, "loss": 3.')
    info = json.loads((partial / "run_info.json").read_text())
    del info["segments"][-1]["finished"]
    (partial / "run_info.json").write_text(json.dumps(info))
    (partial / "monitor" / "rank0.jsonl").write_text('{"time": 1.0, "rss_mb": 3')  # only a truncated sample

    out = tmp_path / "r.html"
    assert main(["report", str(trained_run), str(empty), str(partial), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    page = out.read_text()
    assert "empty: no metrics.jsonl" in said and "no config.toml" in said
    assert "partial: metrics.jsonl: last line truncated" in said
    assert "partial: the run has not finished" in said
    assert "monitor/rank0.jsonl: last line truncated" in said
    for div in PLOT_IDS:
        assert f'id="{div}"' in page
    assert "Missing or incomplete" in page and "last line truncated" in page
    # Both readable runs are drawn: a train-loss trace for each.
    assert page.count('"name":"run: train loss"') == 1 and page.count('"name":"partial: train loss"') == 1
    # A folder that does not exist: one line, exit 2.
    assert main(["report", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "no such run folder" in capsys.readouterr().err


def test_report_of_a_run_from_plan_emit_shows_predicted_vs_measured(tmp_path, tiny, capsys):
    job = tmp_path / "tiny.toml"
    over = tiny(tmp_path / "unused")
    job.write_text(to_toml(load_config(None, {k: v for k, v in over.items() if k.startswith(("model.", "data."))})))
    emitted = tmp_path / "best.toml"
    assert main(["plan", "--config", str(job), "--model.vocab_size=65", "--hardware", "cpu", "--tokens", "4096",
                 "--global-batch", "8", "--emit", str(emitted)]) == 0
    predicted = load_config(emitted).prediction
    assert predicted.plan and predicted.step_seconds > 0 and predicted.memory_bytes > 0
    run = tmp_path / "run"
    assert main(["train", "--config", str(emitted), "--train.steps=6", f"--train.run_dir={run}",
                 f"--data.cache_dir={tmp_path / 'data'}", "--logging.progress=off", "--logging.tensorboard=false",
                 "--train.eval_interval=0", "--train.sample_tokens=0", "--checkpoint.enabled=false",
                 "--logging.log_interval=2", "--schedule.warmup_steps=1"]) == 0
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    page = out.read_text()
    section = page[page.index("id='predicted-vs-measured'"):page.index("<h2>Curves")]
    for quantity in ("step time", "peak memory per device", "tokens/s"):
        row = re.search(rf"<tr><td>{quantity}</td><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td></tr>", section)
        assert row, quantity
        assert row.group(1) != "-" and "not measured" not in row.group(2) and re.fullmatch(r"[+-]\d+\.\d%",
                                                                                          row.group(3))
    assert f"{1000 * predicted.step_seconds:.1f} ms" in section
    # What the planned compute bought, in bits per byte too: the final evaluation's record.
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_bpb" in line][-1]
    assert (f"<tr><td>final val loss (bits per byte)</td><td>not predicted</td><td>{final['val_loss']:.4f} "
            f"({final['val_bpb']:.4f} bpb)</td>") in section


def test_report_takes_a_plan_json(trained_run, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model.preset=nano", "--model.vocab_size=65", "--hardware", "cpu:1", "--tokens", "1M",
                 "--json", str(plan)]) == 0
    out = tmp_path / "r.html"
    assert main(["report", str(trained_run), "--plan", str(plan), "--out", str(out)]) == 0
    assert "<td>step time</td>" in out.read_text()
    plan.write_text("{}")
    assert main(["report", str(trained_run), "--plan", str(plan), "--out", str(out)]) == 2
    assert "not a `scaletrain plan --json` document" in capsys.readouterr().err


def test_profiled_run_writes_a_trace_and_top_operators(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    over = tiny(run, **{"train.steps": "6", "logging.progress": "plain", "profile.enabled": "true",
                        "profile.wait": "1", "profile.warmup": "1", "profile.active": "2", "profile.top": "8"})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    said = capsys.readouterr().out
    assert "profile of steps 3-4: top operators by self CPU time" in said and "aten::" in said
    path = run / "profile" / "rank0.pt.trace.json"
    try:  # torch's own checker of the Chrome traces torch.profiler writes (torch >= 2.13)
        from torch.profiler._trace_validator import validate_trace
    except ImportError:
        validate_trace = None
    if validate_trace is not None:
        passed, violations = validate_trace(str(path))
        assert passed, violations
    trace = json.loads(path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    # The profiler counts steps from 0: training steps 3 and 4 are its #2 and #3.
    assert {"aten::mm", "ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    top = json.loads((run / "profile" / "top_ops_rank0.json").read_text())
    assert len(top) == 8 and top[0]["self_us"] >= top[-1]["self_us"] > 0
    assert any(op["name"] in ("aten::mm", "aten::addmm", "aten::bmm") for op in top)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium binary (apt-get install chromium)")
def test_report_draws_every_plot_in_headless_chromium(trained_run, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from report_in_browser import check

    out = tmp_path / "r.html"
    assert main(["report", str(trained_run), "--out", str(out)]) == 0
    result = check(out, PLOT_IDS)
    assert result["ok"], result


@pytest.mark.distributed
def test_two_rank_run_records_every_rank(tmp_path, tiny):
    """2 gloo ranks (FSDP): a monitor file and a profiler trace per rank, per-rank lists in metrics.jsonl, and a
    report that draws a curve per rank."""
    from helpers.launch import torchrun

    run = tmp_path / "run"
    over = tiny(run, **{"train.steps": "8", "logging.log_interval": "2", "monitor.interval": "0.02",
                        "parallel.dp_shard": "2", "profile.enabled": "true", "profile.wait": "2",
                        "profile.warmup": "1", "profile.active": "2", "train.threads": "1"})
    torchrun(2, "-m", "scaletrain.cli", "train", *[f"--{k}={v}" for k, v in over.items()])
    for rank in (0, 1):
        assert (run / "monitor" / f"rank{rank}.jsonl").read_text().strip(), rank
        trace = json.loads((run / "profile" / f"rank{rank}.pt.trace.json").read_text())
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"]), rank
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert all(len(r["peak_memory_mb_per_rank"]) == 2 for r in steps)
    # Two processes never have the same resident memory to 0.1 MB: the monitor's per-rank lists are there.
    assert any(len(r.get("rss_mb_per_rank", [])) == 2 for r in steps), steps[-1]
    assert json.loads((run / "run_info.json").read_text())["segments"][0]["hardware"]["world_size"] == 2
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    page = out.read_text()
    assert "(rank 0)" in page and "(rank 1)" in page and "run rank 1: CPU" in page


def test_report_reads_events_segments_and_per_rank_values(tmp_path):
    """A hand-written run folder: NaN-guard skips, a rollback and a preemption become the events table; a
    resumed run's wall time is the sum of its segments; per-rank lists become a curve per rank."""
    from scaletrain.report.html import render
    from scaletrain.report.runs import read_run

    run = tmp_path / "synthetic"
    run.mkdir()
    t0 = 1_700_000_000.0
    records = [{"time": t0 + 10 * s, "step": s, "loss": 4.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0,
                "step_ms": 50.0, "tokens_per_second": 1000.0, "mfu": 0.1, "peak_memory_mb": 100.0 + s,
                "peak_memory_mb_per_rank": [100.0 + s, 90.0 + s], "rss_mb": 120.0,
                "rss_mb_per_rank": [120.0, 110.0]} for s in (2, 4, 6)]
    records += [{"time": t0 + 45, "step": 5, "skipped_update": 1}, {"time": t0 + 46, "step": 5, "rollback": 1},
                {"time": t0 + 61, "step": 6, "preempted": "SIGTERM", "checkpoint_seconds": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # Two segments (a resume): 0-61 s, then 100-130 s; the first has no finish mark (it was preempted).
    (run / "run_info.json").write_text(json.dumps({"segments": [
        {"command": "scaletrain train", "started": t0, "hardware": {"world_size": 2}},
        {"command": "scaletrain train --resume", "started": t0 + 100, "finished": t0 + 130}]}))
    data = read_run(run)
    assert data.finished and data.wall_seconds == pytest.approx(61 + 30)
    assert [(e["step"], e["kind"]) for e in data.events] == [(5, "skipped_update"), (5, "rollback"),
                                                              (6, "preempted")]
    assert data.peak_memory_bytes() == 106 * 2**20 and data.world_size == 2
    page = render([data], price=1.0)
    assert "<td>SIGTERM</td>" in page and "<td>rollback</td>" in page and "<td>skipped_update</td>" in page
    assert "over 2 segments (resumed)" in page and "$0.0506 (2 device(s)" in page  # 2 x 91 s x $1/h
    assert "synthetic: peak (GPU: max allocated; CPU: peak RSS) (rank 1)" in page and "RSS (monitor) (rank 0)" in page


def test_report_of_a_run_stopped_early_says_where_and_labels_the_val_loss_with_its_step(tmp_path, tiny):
    """A run preempted at step 1 of 1,500 (its trigger file there from the start) read "status finished" and
    gave step 0's loss as the "final val loss"."""
    from scaletrain.report.html import header_rows
    from scaletrain.report.runs import read_run

    trigger = tmp_path / "stop-now"
    trigger.touch()
    later = time.time() + 3600  # "written after the run started", however long the start takes (a stale one is not)
    os.utime(trigger, (later, later))
    over = tiny(tmp_path / "run", **{"train.steps": "1500", "train.eval_interval": "500",
                                     "checkpoint.trigger_file": str(trigger)})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 75
    rows = dict(header_rows(read_run(tmp_path / "run"), price=0.0))
    assert rows["status"].startswith("stopped at step 1 of 1,500 (trigger file ") and rows["steps"] == "1 of 1,500"
    assert "final val loss" not in rows and re.fullmatch(r"\d+\.\d{4} \(step 0\)", rows["last val loss"])


def test_report_of_a_finished_run_gives_the_final_val_loss_with_its_step(trained_run):
    from scaletrain.report.html import header_rows
    from scaletrain.report.runs import read_run

    rows = dict(header_rows(read_run(trained_run), price=0.0))
    assert rows["status"] == "finished" and re.fullmatch(r"\d+\.\d{4} \(step 12\)", rows["final val loss"])


@pytest.mark.parametrize("price", ["nan", "inf", "-1"])
def test_report_refuses_a_price_that_is_not_a_finite_non_negative_number(trained_run, tmp_path, capsys, price):
    assert main(["report", str(trained_run), "--out", str(tmp_path / "r.html"), "--price", price]) == 2
    err = capsys.readouterr().err
    assert "--price must be a finite number >= 0" in err and err.count("\n") == 1
    assert not (tmp_path / "r.html").exists()
