"""One checkpoint manager over a run's state: sharded (DCP), optionally asynchronous, atomic and verified.

Layout of ``<folder>/step-00000040/``::

    .metadata, __0_0.distcp, __1_0.distcp, ...   torch.distributed.checkpoint: model + optimizer tensors,
                                                 each rank writes its own shards in parallel
    rank-00000.pt, rank-00001.pt, ...            each rank's small state (data position, RNG streams,
                                                 counters, grad scaler), loaded with weights_only=True
    meta.json                                    written last: step, world size, parallel plan, config
                                                 hash, global batch, sha256 of every file

Atomic: every rank writes into the hidden ``.step-00000040.tmp/``; when all ranks are done, rank 0 hashes
the files, writes ``meta.json`` and renames the folder into place. A crash (or ``kill -9``) at any point
leaves either the previous checkpoints untouched or a hidden folder that nothing reads. ``latest()``
re-hashes the newest complete checkpoint and falls back to the previous one, with a message, when a file
is missing, truncated or altered.

Asynchronous: ``save(..., blocking=False)`` returns at once; background threads copy the tensors to CPU
memory and then write them. The caller must not change the tensors until ``wait_staged()`` returns (the
trainer calls it just before the next optimizer step, so the copy overlaps a forward and backward). The
next save - or ``wait()`` - waits for the previous one, so at most one staged copy exists (bounded memory:
one copy of this rank's model and optimizer shards, reused from save to save). DCP's own collectives run on a
dedicated gloo group so they never interleave with the
training loop's collectives on the default group.

Write failures (a full disk, a quota, a read-only mount): every rank agrees that the save failed, the
hidden folder is removed, the previous checkpoints stay as they were, and a ``StorageError`` says in one line
what failed and how many bytes were needed vs free. An asynchronous save that fails in the background is
noticed by ``background_failed()`` (the trainer asks after every step) and reported by ``wait()``.

Safety: tensors are read back by DCP with ``torch.load(weights_only=True)``; DCP's ``.metadata`` index is a
pickle written by torch, and is only read after its sha256 matched the one our JSON marker recorded.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import enum
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from scaletrain.core.files import StorageError, file_sha256, fsync_dir, guarded_write, remove_quietly
from scaletrain.core.options import UserError

META = "meta.json"

# DCP notes every single-process save/load (we ask for it with no_dist=True); asynchronous saves run in a
# background thread, where a catch_warnings() block in the caller would not reach, so filter by message.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized",
                        category=UserWarning)


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> Any: ...


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the problem."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class CheckpointManager:
    """Save and find checkpoints of one run. In a distributed run every method is collective (all ranks
    call it); rank 0 alone finalises, prunes and verifies."""

    def __init__(self, folder: str | Path, keep_last: int = 2, keep_every: int = 0, run_id: str | None = None,
                 collective_timeout_s: float | None = None):
        """``run_id``: the run these checkpoints belong to (written into each ``meta.json``); retention deletes
        only checkpoints of this run. None: every checkpoint in the folder counts as this run's.
        ``collective_timeout_s``: how long the save's collectives wait for a rank that stopped answering (the
        training loop's, ``parallel.collective_timeout_seconds``); None: torch's default (30 min on gloo)."""
        self.folder = Path(folder)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.run_id = run_id
        self.rank = dist.get_rank() if _distributed() else 0
        self.world_size = dist.get_world_size() if _distributed() else 1
        # DCP's plan/result exchange runs on its own gloo group: a background save must not interleave
        # with the training loop's collectives on the default group (and gloo handles CPU objects on GPU runs).
        timeout = None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if _distributed() else None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._stager = None  # created at the first asynchronous save
        self._staging: concurrent.futures.Future | None = None
        self.last_save_seconds = {"blocked": 0.0}
        self.damaged: list[tuple[str, str]] = []  # (folder name, problem) of those the last latest() skipped
        # (damaged, or another run's: ``run_id`` differs)

    # -- saving ----------------------------------------------------------------------------------------
    def save(self, step: int, tensors: dict[str, Any], local: dict[str, Stateful], meta: dict,
             blocking: bool = True) -> Path:
        """Write checkpoint ``step``: ``tensors`` through DCP (sharded), ``local`` as this rank's file,
        ``meta`` into the marker. Returns the final folder (complete once ``wait()`` returns)."""
        t0 = time.perf_counter()
        final, tmp, what, meta = self._begin(step, meta)
        self._write_local(tmp, what, local)
        if blocking:
            with self._guard(what, tmp):  # DCP gathers every rank's failure: all ranks raise here together
                self._write(tensors, tmp)
            self._finish(tmp, final, meta)
        else:
            staged = self._stage_and_start(tensors, tmp)
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            self._pending = self._executor.submit(self._complete_async, staged, tmp, final, meta)
        self.last_save_seconds = {"blocked": time.perf_counter() - t0}
        return final

    def save_with(self, step: int, write: Callable[[Path], None], local: dict[str, Stateful], meta: dict) -> Path:
        """``save`` (blocking) for tensors another library writes: ``write(folder)`` runs on every rank (e.g.
        DeepSpeed's ``engine.save_checkpoint``), then this rank's small state and, last, the marker."""
        final, tmp, what, meta = self._begin(step, meta)
        self._write_local(tmp, what, local, write)  # every rank's files are on disk before rank 0 writes the marker
        self._finish(tmp, final, meta)
        return final

    def _begin(self, step: int, meta: dict) -> tuple[Path, Path, str, dict]:
        """Start checkpoint ``step`` (collective): wait for the save in flight (one at most: bounded staging
        memory, checkpoints complete in order), create the hidden folder, and return (final folder, hidden
        folder, what it is for messages, the marker's record with step, world size and run id)."""
        self.wait()
        final = self.folder / step_dir_name(step)
        tmp = self.folder / f".{final.name}.tmp"
        what = f"checkpoint {final}"
        failure = None
        if self.rank == 0:
            try:
                with self._guard(what, tmp):
                    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash; nobody else is writing it now
                    tmp.mkdir(parents=True)
            except StorageError as exc:
                failure = exc
        self._agree(failure, what)  # also the barrier: the folder exists before anyone writes into it
        meta = {"step": step, "world_size": self.world_size, **meta}
        if self.run_id:
            meta["run_id"] = self.run_id
        return final, tmp, what, meta

    def _write_local(self, tmp: Path, what: str, local: dict[str, Stateful],
                     write: Callable[[Path], None] | None = None) -> None:
        """This rank's small state (and ``write(tmp)``, when another library writes the tensors) into the
        hidden folder; collective: every rank raises when any rank's write failed."""
        failure = None
        try:
            with self._guard(what, tmp):
                torch.save({name: obj.state_dict() for name, obj in local.items()}, tmp / rank_file(self.rank))
                if write is not None:
                    write(tmp)
        except StorageError as exc:
            failure = exc
        self._agree(failure, what, tmp)

    def _write(self, tensors: dict, path: Path) -> None:
        if _distributed():
            dcp.save(tensors, checkpoint_id=str(path), process_group=self.group)
        else:
            dcp.save(tensors, checkpoint_id=str(path), no_dist=True)

    def _stage_and_start(self, tensors: dict, path: Path):
        """DCP's async save: the CPU copy ("staging") and the writing both run in background threads.

        The copy must be complete before the tensors change again, i.e. before the next optimizer step:
        the trainer calls ``wait_staged()`` there, so the copy overlaps the next forward and backward.
        One stager lives as long as the manager and refills the same CPU copies at every save, which is
        the bound on staging memory: one copy of this rank's tensors."""
        if self._stager is None:
            self._stager = _persistent_stager()
        kwargs = {"async_stager": self._stager} if self._stager is not None else {}
        if _distributed():
            response = dcp.async_save(tensors, checkpoint_id=str(path), process_group=self.group, **kwargs)
        else:
            response = dcp.async_save(tensors, checkpoint_id=str(path), no_dist=True, **kwargs)
        self._staging = getattr(response, "staging_completion", None)  # None: staged before returning
        return response

    def wait_staged(self) -> float:
        """Block until the save in flight has copied the tensors (call before changing them); returns the
        seconds waited, also kept in ``last_save_seconds["staging_wait"]``."""
        if self._staging is None:
            return 0.0
        t0 = time.perf_counter()
        staging, self._staging = self._staging, None
        staging.result()
        waited = time.perf_counter() - t0
        self.last_save_seconds["staging_wait"] = waited
        return waited

    def _complete_async(self, staged, tmp: Path, final: Path, meta: dict) -> None:
        # dcp.async_save returns a Future (or, in newer torch, a response holding one).
        future = getattr(staged, "upload_completion", staged)
        with self._guard(f"checkpoint {final} (in the background)", tmp):
            future.result()
            # DCP's save ends with a gather of every rank's write results on rank 0, so when rank 0's write
            # has completed, every rank's files are on disk: rank 0 can finalise without another collective.
            if self.rank == 0:
                self._finalize(tmp, final, meta)

    def _finish(self, tmp: Path, final: Path, meta: dict) -> None:
        failure = None
        if self.rank == 0:
            try:
                with self._guard(f"checkpoint {final}", tmp):
                    self._finalize(tmp, final, meta)
            except StorageError as exc:
                failure = exc
        # Every rank learns whether rank 0 finished (and nobody races ahead, or exits, while it still renames).
        self._agree(failure, f"checkpoint {final}")

    def _finalize(self, tmp: Path, final: Path, meta: dict) -> None:
        files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        meta = {**meta, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
        marker = tmp / META
        marker.write_text(json.dumps(meta, indent=2))
        fsync_dir(tmp)
        if final.exists():  # re-saving the same step (after a rollback) replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.folder)
        self._retain()

    def _guard(self, what: str, tmp: Path):
        """``guarded_write`` for a checkpoint: on a storage failure the hidden folder goes (it would go on
        filling the disk) and the message says which checkpoint is still the latest good one."""
        complete = self.list_complete()
        intact = (f"the previous checkpoint {complete[-1].name} is intact" if complete else
                  "no earlier checkpoint exists") + "; free space (or lower checkpoint.keep_last), then --resume"
        return guarded_write(what, self.folder, cleanup=(tmp,), needed=self._last_size(complete), intact=intact)

    @staticmethod
    def _last_size(complete: list[Path]) -> int | None:
        """Bytes of the newest complete checkpoint: what the next one will need, about."""
        if not complete:
            return None
        return sum(p.stat().st_size for p in complete[-1].iterdir() if p.is_file())

    def _agree(self, failure: StorageError | None, what: str, tmp: Path | None = None) -> None:
        """Collective: raise on every rank when any rank's write failed (the failing rank with its own
        message), so no rank goes on into a save the others abandoned. A barrier otherwise."""
        failed = failure is not None
        if _distributed():
            box = torch.tensor([float(failed)])
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
            failed = bool(box.item())
        if not failed:
            return
        if tmp is not None and self.rank == 0:
            remove_quietly(tmp)
        raise failure or StorageError(f"writing {what} failed on another rank (see its message); no rank "
                                      f"completed it")

    def background_failed(self) -> bool:
        """Whether the asynchronous save in flight has already failed (without waiting for it); ``wait()``
        then raises its error."""
        pending = self._pending
        return pending is not None and pending.done() and pending.exception() is not None

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; re-raises its error."""
        self._staging = None  # the write starts only after the copy, so waiting for it covers both
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight, then free the writer thread and the staging copies."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _retain(self) -> None:
        """Keep the newest ``keep_last`` and every step divisible by ``keep_every``; delete the rest. Only this
        run's checkpoints are considered (another run's never count towards ``keep_last`` nor get deleted)."""
        complete = [p for p in self.list_complete() if self.belongs_to_run(p)]
        for path in complete[:-self.keep_last]:
            step = int(path.name.split("-")[1])
            if self.keep_every and step % self.keep_every == 0:
                continue
            shutil.rmtree(path, ignore_errors=True)

    def belongs_to_run(self, path: Path) -> bool:
        """Whether checkpoint ``path`` is this run's (by the run id in its marker; a checkpoint written before
        run ids existed counts as this run's)."""
        meta = self.readable_meta(path)
        return meta is not None and self._same_run(meta)

    def _same_run(self, meta: dict) -> bool:
        return self.run_id is None or meta.get("run_id", self.run_id) == self.run_id

    # -- finding and verifying -------------------------------------------------------------------------
    def list_complete(self) -> list[Path]:
        """Folders with a completion marker, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.glob("step-*") if (p / META).is_file())

    def remove_partial(self) -> None:
        """Delete hidden folders left by saves that never completed (call only when none is in flight)."""
        if self.rank == 0 and self.folder.is_dir():
            for tmp in self.folder.glob(".step-*.tmp"):
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def verify(path: Path) -> dict:
        """Check the marker and every file's checksum; raise CheckpointError naming the problem."""
        marker = path / META
        if not marker.is_file():
            raise CheckpointError(f"{path}: incomplete (no {META})")
        meta = CheckpointManager.readable_meta(path)
        files = meta.get("files") if meta is not None else None
        if not isinstance(files, dict):
            raise CheckpointError(f"{marker}: unreadable marker (not the JSON record a save writes: damaged or "
                                  f"truncated)")
        for name, digest in files.items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"{f}: missing")
            if file_sha256(f) != digest:
                raise CheckpointError(f"{f}: checksum mismatch (corrupt or truncated)")
        check_dcp_index(path)
        return meta

    def latest(self, warn=print) -> Path | None:
        """The newest checkpoint that verifies (chosen by rank 0, the same on every rank); broken newer
        ones are reported and skipped, and their problems kept in ``self.damaged`` (newest first) so a
        resume can tell "no checkpoint" from "only damaged ones". None when there is no good one."""
        choice, damaged = None, []
        if self.rank == 0 and self.folder.is_dir():
            # every step folder, not only marked ones: a folder whose marker was deleted is reported too
            for path in sorted(self.folder.glob("step-*"), reverse=True):
                try:
                    meta = self.verify(path)
                    if not self._same_run(meta):  # copied in from another run folder: not this run's to go on from
                        raise CheckpointError(f"{path}: belongs to another run (run id {meta.get('run_id')}; this "
                                              f"run folder's is {self.run_id}): copied from another run folder?")
                    choice = str(path)
                    break
                except CheckpointError as exc:
                    damaged.append((path.name, str(exc)))
                    warn(f"warning: skipping checkpoint {exc}; trying the previous one")
        if _distributed():
            box = [choice, damaged]
            dist.broadcast_object_list(box, src=0, group=self.group)
            choice, damaged = box
        self.damaged = damaged
        return Path(choice) if choice else None

    @staticmethod
    def read_meta(path: Path) -> dict:
        return json.loads((path / META).read_text())

    @staticmethod
    def readable_meta(path: Path) -> dict | None:
        """``read_meta``, or None when the marker is missing or damaged (``verify`` names the problem)."""
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def newest_meta(self) -> dict | None:
        """The marker of the newest complete checkpoint of this run whose marker reads, or None: what a resume
        checks before loading (damaged or foreign newer ones are ``latest()``'s to name and skip)."""
        for path in reversed(self.list_complete()):
            meta = self.readable_meta(path)
            if meta is not None and self._same_run(meta):
                return meta
        return None

    # -- loading ---------------------------------------------------------------------------------------
    def load(self, path: Path, tensors: dict[str, Any]) -> None:
        """Read every tensor of ``tensors`` in place from ``path`` (each rank reads the slices it holds)."""
        load_tensors(path, tensors, self.group)

    def load_local(self, path: Path) -> tuple[dict, bool]:
        """This rank's small state: (state by name, True when it is this rank's own file). After a change
        of world size a rank without its own file gets rank 0's (the data position and counters are the
        same on every rank; RNG streams are then re-seeded by the caller)."""
        meta = self.read_meta(path)
        own = meta.get("world_size") == self.world_size
        name = rank_file(self.rank if own else 0)
        try:
            return torch.load(path / name, map_location="cpu", weights_only=True), own
        except FileNotFoundError:
            raise CheckpointError(f"{path / name}: missing") from None
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
            # weights_only=True refuses any object but tensors and plain containers: a file carrying a
            # pickled call (or garbage) is reported, never run.
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise CheckpointError(f"{path / name}: refused by torch.load(weights_only=True) ({first}); this "
                                  f"checkpoint cannot be trusted, resume from another one") from None


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` index allowing only the types such an index is made of."""

    ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
               ("builtins", "set"), ("builtins", "frozenset")}

    def find_class(self, module: str, name: str):
        if module in self.ALLOWED_MODULES or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            # Some Python builds (3.11.2, 3.12+) pickle an enum member (the index's memory-format enum) as
            # getattr(EnumClass, "NAME"); a general getattr would reach any method of the allowed types.
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format,
                                                                          torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}")


def _enum_member(cls, name: str):
    """``getattr`` as a DCP index may use it: a member of an enum of the index's own module, nothing else."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ in _IndexUnpickler.ALLOWED_MODULES \
            and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"refers to getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})")


def check_dcp_index(path: Path) -> None:
    """Refuse a checkpoint whose DCP index (``.metadata``, which DCP reads with plain ``pickle``) names anything
    but the types an index is made of: a checksum only shows the file is the one the marker lists, not that
    whoever wrote both meant well. Raises CheckpointError naming what it found; the call never runs."""
    index = path / ".metadata"
    if not index.is_file():
        return  # DCP reports a missing index itself
    try:
        with open(index, "rb") as fh:
            _IndexUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{index}: not a plain DCP index ({str(exc)[:120]}); refusing to load it, since "
                              f"unpickling it could run code") from None


def _persistent_stager():
    """DCP's DefaultStager with its CPU copies cached between saves (pinned memory and non-blocking copies
    on CUDA); None on a torch without it, where each save stages into fresh memory.

    Before torch 2.13 a DefaultStager that stages a second time into its cached copies fails (``KeyError:
    <class 'type'>`` in its deepcopy), so there every save gets a fresh one (torch's own default)."""
    if torch.__version__ < "2.13":
        return None
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=cuda))


def load_tensors(path: Path, tensors: dict[str, Any], group=None) -> None:
    """DCP load of ``tensors`` (in place) from checkpoint folder ``path``; a key the checkpoint lacks, or a
    tensor whose saved shape differs from the current one, is a one-line CheckpointError naming it."""
    try:
        if _distributed():
            dcp.load(tensors, checkpoint_id=str(path), process_group=group)
        else:
            dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
    # DCP gathers every rank's failure into a CheckpointException, which derives from BaseException (not
    # Exception); the diagnosis below runs after that collective failure, so no rank is left waiting.
    except (Exception, CheckpointException) as exc:
        mismatch = shape_mismatch(path, tensors)
        if mismatch:
            raise CheckpointError(mismatch) from None
        # The message holds every failing rank's traceback: keep the last "SomeError: what" line.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
        detail = errors[-1] if errors else lines[-1] if lines else type(exc).__name__
        advice = f"; {_other_settings(path)}" if "Missing key" in detail else ""
        raise CheckpointError(f"{path}: cannot load ({detail[:300]}){advice}") from exc


def shape_mismatch(path: Path, tensors: dict[str, Any]) -> str | None:
    """The first tensor of ``tensors`` (``{"model": {name: tensor}, "optimizer": ...}``) whose shape differs
    from the one saved in checkpoint ``path``, as a message for a person; None when all agree (or the
    checkpoint's index cannot be read, which DCP then reports itself).

    The usual cause is a config that builds another model than the run trained (a different vocabulary,
    width or tokenizer), so the message names the run folder and the two ways out."""
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:
        return None
    for section, entries in tensors.items():
        for name, tensor in entries.items() if isinstance(entries, dict) else ():
            size = getattr(saved.get(f"{section}.{name}"), "size", None)
            if size is None or not isinstance(tensor, torch.Tensor) or tuple(size) == tuple(tensor.shape):
                continue
            what = "parameter" if section == "model" else f"{section} state"
            return (f"{path}: {what} {name} is {list(size)} in the checkpoint but {list(tensor.shape)} in the model "
                    f"the current config builds, so {_other_settings(path)}")
    return None


def _other_settings(path: Path) -> str:
    """What to do about a model that does not fit checkpoint ``path`` (a folder in ``<run>/checkpoints``)."""
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return (f"the settings differ from those run folder {run} was trained with; use those (drop the changed "
            f"--config / model.* / data.* settings) or train into a new train.run_dir")
