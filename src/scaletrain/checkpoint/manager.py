"""One checkpoint manager over named stateful objects (anything with state_dict / load_state_dict).

Layout of ``<folder>/step-00000020/``:
    model.safetensors   the nn.Module registered as "model" (safetensors: no pickle, tied weights kept)
    state.pt            every other object's state_dict, loaded with ``weights_only=True`` (no arbitrary code)
    meta.json           written last: step, time, sha256 of each file. A folder without it is incomplete.

A checkpoint is written into a hidden temporary folder and renamed into place, so a crash mid-write never
leaves a folder that looks complete. ``latest()`` skips incomplete or corrupt folders, falling back to the
previous good one.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from scaletrain.data.tokenizer import file_sha256

META = "meta.json"


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> Any: ...


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the problem."""


class CheckpointManager:
    def __init__(self, folder: str | Path, keep_last: int = 2):
        self.folder = Path(folder)
        self.keep_last = keep_last

    @staticmethod
    def step_dir_name(step: int) -> str:
        return f"step-{step:08d}"

    def save(self, step: int, states: dict[str, Stateful], extra_meta: dict | None = None) -> Path:
        """Write a checkpoint for ``step`` atomically and apply the retention policy."""
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / self.step_dir_name(step)
        tmp = self.folder / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        others = {}
        for name, obj in states.items():
            if isinstance(obj, nn.Module):
                save_model(obj, str(tmp / f"{name}.safetensors"))
            else:
                others[name] = obj.state_dict()
        torch.save(others, tmp / "state.pt")
        files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir())}
        meta = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files, **(extra_meta or {})}
        (tmp / META).write_text(json.dumps(meta, indent=2))
        if final.exists():  # re-saving the same step (e.g. after a rollback) replaces it
            shutil.rmtree(final)
        tmp.rename(final)
        self._retain()
        return final

    def _retain(self) -> None:
        complete = self.list_complete()
        for old in complete[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def list_complete(self) -> list[Path]:
        """Folders with a completion marker, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.glob("step-*") if (p / META).is_file())

    def verify(self, path: Path) -> dict:
        """Check the marker and every file's checksum; raise CheckpointError naming the problem."""
        meta_file = path / META
        if not meta_file.is_file():
            raise CheckpointError(f"{path}: incomplete (no {META})")
        try:
            meta = json.loads(meta_file.read_text())
        except ValueError:
            raise CheckpointError(f"{meta_file}: unreadable marker") from None
        for name, digest in meta.get("files", {}).items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"{f}: missing")
            if file_sha256(f) != digest:
                raise CheckpointError(f"{f}: checksum mismatch (corrupt or truncated)")
        return meta

    def latest(self, warn=print) -> Path | None:
        """The newest checkpoint that verifies; broken newer ones are reported and skipped."""
        for path in reversed(self.list_complete()):
            try:
                self.verify(path)
                return path
            except CheckpointError as exc:
                warn(f"warning: skipping checkpoint {exc}; trying the previous one")
        return None

    def load(self, path: Path, states: dict[str, Stateful]) -> dict:
        """Load every named object from ``path``; returns the checkpoint's metadata."""
        meta = self.verify(path)
        others = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        for name, obj in states.items():
            if isinstance(obj, nn.Module):
                missing, unexpected = load_model(obj, str(path / f"{name}.safetensors"), strict=True)
            elif name in others:
                obj.load_state_dict(others[name])
            else:
                raise CheckpointError(f"{path}: has no state for {name!r}")
        return meta
