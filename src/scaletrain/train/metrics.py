"""Step metrics (loss, tokens/s, MFU, memory) to a terminal, a JSONL file and TensorBoard."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from scaletrain.config import LoggingConfig


def peak_memory_bytes(device: torch.device) -> int:
    """Max allocated tensor memory on a GPU; peak resident set size of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def mfu(flops_per_token: float, tokens_per_second: float, job_peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's training FLOPs per token (``model.flops_per_token``) times the
    job's tokens/s, over the job's peak FLOP/s (``Trainer._job_peak_flops``: one device's measured peak times
    the devices the job runs on). Nothing of how the job was launched enters it."""
    return flops_per_token * tokens_per_second / job_peak_flops


class MetricsLogger:
    """Writes every record to ``metrics.jsonl``; shows a live bar on a terminal or plain lines."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, start_step: int = 0,
                 enabled: bool = True):
        self.enabled = enabled
        self.cfg = cfg
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.tb = None
        if enabled and cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional (`pip install scaletrain[monitor]`)
                self.tb = None
        mode = cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "off"
        self.progress = None
        if self.mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, record: dict) -> None:
        """A metrics record; must contain ``step``."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self.tb.add_scalar(key, value, record["step"])
                elif isinstance(value, list) and key.endswith("_per_rank"):  # the resource monitor's per rank
                    for rank, v in enumerate(value):
                        if isinstance(v, (int, float)):
                            self.tb.add_scalar(f"{key[:-len('_per_rank')]}/rank{rank}", v, record["step"])
        if "loss" in record:
            info = (f"loss {record['loss']:.4f} | {record['step_ms']:.1f} ms/step | "
                    f"{record['tokens_per_second']:,.0f} tok/s | MFU {100 * record['mfu']:.1f}%")
            if self.progress is not None:  # the live bar: also memory, and the ETA (TimeRemainingColumn)
                self.progress.update(self.task, completed=record["step"],
                                     info=f"{info} | mem {record['peak_memory_mb']:.0f} MB")
            elif self.mode == "plain":
                print(f"step {record['step']:>6} | {info} | lr {record['lr']:.2e} | "
                      f"mem {record['peak_memory_mb']:.0f} MB", flush=True)

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def message(self, text: str) -> None:
        """A line for people (eval results, samples), printed above the bar."""
        if not self.enabled or self.mode == "off":
            return
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
