"""A run folder read back for the report, whatever state it is in.

A run may have no metrics yet, a last JSONL line cut in half (the trainer is writing it, or was killed
mid-write), no ``run_info.json`` (a run from before the monitor) or no checkpoints: each of these becomes a
note in ``RunData.missing`` and the rest is still read. Nothing here raises on a file's content; only a
folder that does not exist is an error (``ConfigError``, one line, exit 2).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.config import JobConfig, load_config
from scaletrain.core.options import ConfigError


def read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    """The records of a JSONL file and notes on what could not be read: a truncated last line (a file being
    written ends without its newline) is skipped with a note, as is any other unreadable line."""
    notes: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return [], [f"{path.name}: cannot be read ({exc.strerror})"]
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            last = number == len(lines) and not text.endswith("\n")
            notes.append(f"{path.name}: last line truncated ({len(line)} bytes, no newline: still being written, "
                         f"or cut off); skipped" if last else f"{path.name}: line {number} is not JSON; skipped")
            continue
        if isinstance(record, dict):
            records.append(record)
    return records, notes


@dataclass
class RunData:
    """Everything the report shows about one run folder."""

    path: Path
    name: str
    config: JobConfig | None = None
    config_text: str = ""
    segments: list[dict] = field(default_factory=list)  # run_info.json: one per training invocation
    train: list[dict] = field(default_factory=list)  # step records (with "loss")
    val: list[dict] = field(default_factory=list)  # evaluation records (with "val_loss")
    samples: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # NaN-guard skips, rollbacks, preemptions
    monitor: dict[int, list[dict]] = field(default_factory=dict)  # rank -> raw monitor samples
    checkpoints: list[dict] = field(default_factory=list)
    top_ops: list[dict] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # what the report cannot show, and why
    finished: bool = False
    plan_prediction: dict | None = None  # from a plan JSON given to the report (report --plan)

    @property
    def start_time(self) -> float | None:
        """The wall clock the curves count from: the first segment's start, else the first record's time."""
        if self.segments and "started" in self.segments[0]:
            return float(self.segments[0]["started"])
        times = [r["time"] for r in self.train + self.val if isinstance(r.get("time"), (int, float))]
        return min(times) if times else None

    @property
    def wall_seconds(self) -> float | None:
        """Time spent training: the sum of each segment's start to its finish (or its last record)."""
        if not self.segments:
            times = [r["time"] for r in self.train + self.val if isinstance(r.get("time"), (int, float))]
            return max(times) - min(times) if len(times) > 1 else None
        total = 0.0
        records = self.train + self.val + self.events
        for i, seg in enumerate(self.segments):
            start = seg.get("started")
            if start is None:
                continue
            end = seg.get("finished")
            if end is None:  # unfinished: up to its last record before the next segment began
                nxt = self.segments[i + 1].get("started", float("inf")) if i + 1 < len(self.segments) else float("inf")
                times = [r["time"] for r in records if isinstance(r.get("time"), (int, float)) and start <= r["time"]
                         < nxt]
                end = max(times) if times else start
            total += end - start
        return total

    @property
    def world_size(self) -> int:
        for seg in reversed(self.segments):
            if "world_size" in seg.get("hardware", {}):
                return int(seg["hardware"]["world_size"])
        if self.config is not None:
            p = self.config.parallel
            return max(1, p.dp_replicate) * max(1, p.dp_shard) * p.tp * p.pp * p.cp
        return 1

    def median_step_seconds(self) -> float | None:
        """The median of the logged step times (each itself the median of its log window)."""
        values = [r["step_ms"] / 1000 for r in self.train if isinstance(r.get("step_ms"), (int, float))]
        # The first window pays compilation and warm-up; leave it out when there are others.
        values = values[1:] if len(values) > 2 else values
        return statistics.median(values) if values else None

    def peak_memory_bytes(self) -> float | None:
        """The largest peak memory any rank logged (max allocated on a GPU, peak RSS on a CPU)."""
        peaks = []
        for r in self.train:
            peaks += [v for v in r.get("peak_memory_mb_per_rank", []) if isinstance(v, (int, float))]
            if isinstance(r.get("peak_memory_mb"), (int, float)):
                peaks.append(r["peak_memory_mb"])
        return max(peaks) * 2**20 if peaks else None

    def median_tokens_per_second(self) -> float | None:
        values = [r["tokens_per_second"] for r in self.train if isinstance(r.get("tokens_per_second"), (int, float))]
        values = values[1:] if len(values) > 2 else values
        return statistics.median(values) if values else None


# What the trainer writes into a run folder (any one is enough to draw something).
RUN_FILES = ("config.toml", "run.json", "run_info.json", "metrics.jsonl", "monitor", "checkpoints")


def has_run_files(path: str | Path) -> bool:
    """Whether ``path`` holds anything a run writes (``RUN_FILES``): an empty folder has nothing to draw."""
    return any((Path(path) / name).exists() for name in RUN_FILES)


def read_run(path: str | Path, name: str = "") -> RunData:
    """Read a run folder (``train.run_dir``); ``ConfigError`` only when it is not a folder."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run folder; pass the train.run_dir of a run")
    run = RunData(path=run_dir, name=name or run_dir.resolve().name)
    _read_config(run)
    _read_info(run)
    _read_metrics(run)
    for file in sorted((run_dir / "monitor").glob("rank*.jsonl")):
        records, notes = read_jsonl(file)
        rank = int(file.stem[4:]) if file.stem[4:].isdigit() else len(run.monitor)
        run.monitor[rank] = [r for r in records if isinstance(r.get("time"), (int, float))]
        run.missing += [f"monitor/{n}" for n in notes]
    if not run.monitor:
        run.missing.append("no monitor/rank*.jsonl: no resource samples (monitor.enabled = false, a run from "
                           "before the monitor, or one shorter than monitor.interval)")
    _read_checkpoints(run)
    top = run_dir / "profile" / "top_ops_rank0.json"
    if top.is_file():
        try:
            run.top_ops = json.loads(top.read_text())
        except (OSError, json.JSONDecodeError):
            run.missing.append("profile/top_ops_rank0.json is unreadable")
    return run


def _read_config(run: RunData) -> None:
    path = run.path / "config.toml"
    if not path.is_file():
        run.missing.append("no config.toml (the trainer writes it once the data is prepared)")
        return
    run.config_text = path.read_text(errors="replace")
    try:
        run.config = load_config(path)
    except ConfigError as exc:
        run.missing.append(f"config.toml does not load: {exc}")


def _read_info(run: RunData) -> None:
    path = run.path / "run_info.json"
    if not path.is_file():
        run.missing.append("no run_info.json: command, commit and hardware unknown (a run from before the monitor)")
        return
    try:
        run.segments = [s for s in json.loads(path.read_text()).get("segments", []) if isinstance(s, dict)]
    except (OSError, json.JSONDecodeError, AttributeError):
        run.missing.append("run_info.json is unreadable (being written?); header incomplete")
        return
    run.finished = bool(run.segments) and "finished" in run.segments[-1]


def _read_metrics(run: RunData) -> None:
    path = run.path / "metrics.jsonl"
    if not path.is_file():
        run.missing.append("no metrics.jsonl: the run has logged nothing yet (or this is not a run folder)")
        return
    records, notes = read_jsonl(path)
    run.missing += notes
    for r in records:
        if not isinstance(r.get("step"), (int, float)):
            continue
        if "loss" in r:
            run.train.append(r)
        if "val_loss" in r:
            run.val.append(r)
        if "sample" in r:
            run.samples.append(r)
        for kind in ("skipped_update", "rollback", "preempted"):
            if kind in r:
                run.events.append({"step": r["step"], "time": r.get("time"), "kind": kind, "detail": r[kind],
                                   **({"checkpoint_seconds": r["checkpoint_seconds"]}
                                      if "checkpoint_seconds" in r else {})})
    if not run.train:
        run.missing.append("metrics.jsonl has no training step yet (logging.log_interval steps not reached)")
    if not run.finished:
        last = max((r["time"] for r in records if isinstance(r.get("time"), (int, float))), default=None)
        age = f"; its last record is {time.time() - last:.0f} s old" if last is not None else ""
        run.missing.append(f"the run has not finished (still running, stopped, or killed){age}: the curves end at "
                           f"step {run.train[-1]['step'] if run.train else 0}")


def _read_checkpoints(run: RunData) -> None:
    folder = run.path / "checkpoints"
    if not folder.is_dir():
        run.missing.append("no checkpoints folder")
        return
    complete = {p.name for p in CheckpointManager(folder).list_complete()}
    for p in sorted(folder.glob("step-*")):
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        run.checkpoints.append({"name": p.name, "complete": p.name in complete, "bytes": size,
                                "time": p.stat().st_mtime})
