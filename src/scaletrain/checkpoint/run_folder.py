"""One writer per run folder, and what a new run may do to a folder that holds an earlier one.

A run folder (``train.run_dir``) belongs to one run at a time:

- ``RunLock`` (core/writer_lock.py, which ``prepare``, ``export`` and ``compress`` take on their outputs too): an
  advisory lock on ``<run>/.lock`` held by the job's rank 0 for the life of the run.
- ``claim_run_folder``: a fresh start (no ``--resume``) in a folder that holds checkpoints is refused, naming
  the run found and the three ways on (``--resume``, another ``train.run_dir``, ``--overwrite``).
  ``--overwrite`` deletes the old checkpoints and moves the old run's logs into ``replaced-<time>/``.
- A run id: every fresh run gets one (``run.json``); each checkpoint's ``meta.json`` carries it, a resume
  takes it from the checkpoint it loads, and retention (``CheckpointManager._retain``) only ever deletes
  checkpoints of the current run.
- ``disk_verdict``: before step 1, what the checkpoints will take against the disk's free space (a refusal
  when not even one fits): nothing tells a person how much disk the checkpoints take unless we do.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from torch import nn

from scaletrain.checkpoint.manager import CheckpointManager, step_dir_name
from scaletrain.config import CheckpointConfig
from scaletrain.core.files import StorageError, free_bytes, guarded_write, human_bytes, write_file
from scaletrain.core.options import ConfigError, UserError
from scaletrain.core.writer_lock import RunLock
from scaletrain.model.presets import checkpoint_size

RUN_FILE = "run.json"
# A fresh run replaces these leftovers of an earlier one (moved aside, never appended to).
RUN_LOGS = ("metrics.jsonl", "tensorboard", "config.toml", "tokenizer.json", RUN_FILE, "run_info.json", "monitor",
            "profile")
# A compressed run (compress/run.py) holds what was done to its source, and a quantized one its torchao tensors
# (which DCP does not write) in one torch.save file: checkpoint/run.py tells the kinds of run apart by these.
COMPRESS_RECORD = "compress.json"
QUANTIZED_WEIGHTS = Path("quantized") / "model.pt"

def is_quantized_run(run: Path) -> bool:
    """Whether ``run`` is a quantized run (compress --quantize): its weights are torchao's, not a checkpoint."""
    return (run / COMPRESS_RECORD).is_file() and (run / QUANTIZED_WEIGHTS).is_file()


def quantized_from(run: Path) -> str:
    """The run a compressed run was made from (its compress.json's ``source``), or "unknown" when unreadable."""
    try:
        return str(json.loads((run / COMPRESS_RECORD).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def new_run_id() -> str:
    """A run's identity: its start time (readable) and a random suffix (unique)."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def claim_run_folder(run_dir: str | Path, checkpoints: CheckpointManager, resume: bool, overwrite: bool,
                     say=print) -> str:
    """Decide what this run is in ``run_dir`` and return its run id (rank 0 only; call with the lock held).

    - ``resume`` with a checkpoint: the run goes on; its id is the newest checkpoint's.
    - a fresh start in a folder with checkpoints: refused (ConfigError), unless ``overwrite``, which deletes
      the old checkpoints and moves the old run's logs into ``replaced-<time>/``.
    - a fresh start otherwise: leftovers of an earlier run that never checkpointed (its metrics, config)
      are moved aside, so the new run's metrics.jsonl holds only the new run.
    """
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                          f"{run_dir}, --overwrite replaces it; choose one")
    complete = checkpoints.list_complete()
    if resume and complete:
        # The run folder's own id (run.json, written when the run started): a checkpoint copied in from another
        # run carries that run's id, and ``latest()`` skips it. Without run.json, the newest readable marker's.
        return _read_run_id(run_dir) or (checkpoints.newest_meta() or {}).get("run_id") or new_run_id()
    unmarked = [p for p in sorted(checkpoints.folder.glob("step-*")) if p not in complete]  # damaged (no meta.json)
    if resume and unmarked:  # nothing moved aside: the resume names them and refuses (checkpoint_to_resume)
        return _read_run_id(run_dir) or new_run_id()
    if complete and not overwrite:
        steps = [int(p.name.split("-")[1]) for p in complete]
        raise ConfigError(f"run folder {run_dir} holds checkpoints of an earlier run (step {steps[-1]}"
                          + (f", {len(steps)} checkpoints" if len(steps) > 1 else "") + "); pass --resume to "
                          "continue it, another --train.run_dir to start a new one beside it, or --overwrite to "
                          "delete it and start again")
    moved = _set_aside(run_dir)
    if overwrite and (complete or unmarked):  # the old run's checkpoints go, damaged ones too
        for path in complete + unmarked:
            shutil.rmtree(path, ignore_errors=True)
        say(f"--overwrite: deleted the earlier run's {len(complete) + len(unmarked)} checkpoint(s) in "
            f"{checkpoints.folder}" + (f"; its logs are in {moved}" if moved else ""))
    elif moved:
        say(f"note: {run_dir} held files of an earlier run without a checkpoint; moved them to {moved}")
    checkpoints.remove_partial()
    run_id = new_run_id()
    write_file(run_dir / RUN_FILE, json.dumps({"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                               "host": socket.gethostname()}, indent=2) + "\n")
    return run_id


def take_run_folder(run_dir: str | Path, checkpoints: CheckpointManager, resume: bool, overwrite: bool,
                    say: Callable[[str], None] = print) -> tuple[RunLock | None, str | None, UserError | None]:
    """Rank 0 of a job: take the folder's lock, then ``claim_run_folder``. Returns (the lock, run id, None), or
    (the lock if taken, None, the refusal): a folder in use by another process, a fresh start over an earlier
    run's checkpoints without --overwrite, or a path that cannot be made (StorageError). The refusal is
    returned, not raised, so rank 0 can hand it to the other ranks first."""
    run_dir, lock = Path(run_dir), None
    try:
        with guarded_write(f"the run folder {run_dir}", run_dir):  # a path that cannot be made
            lock = RunLock.take(run_dir)
        return lock, claim_run_folder(run_dir, checkpoints, resume, overwrite, say=say), None
    except (ConfigError, StorageError) as exc:
        return lock, None, exc


def checkpoint_config(run_dir: str | Path) -> tuple[str, str] | None:
    """(the config TOML saved with the newest checkpoint of ``run_dir``'s run whose marker reads, that checkpoint's
    folder name), or None when it holds none (no checkpoint at all, or one written before checkpoints kept their
    config). Reads files only: called before the job's process group or lock exist."""
    run_dir = Path(run_dir)
    meta = CheckpointManager(run_dir / "checkpoints", run_id=_read_run_id(run_dir)).newest_meta() or {}
    if not isinstance(meta.get("config"), str):
        return None
    return meta["config"], step_dir_name(int(meta["step"]))


def _read_run_id(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def _set_aside(run_dir: Path) -> Path | None:
    """Move an earlier run's logs into ``replaced-<time>/``; None when there were none."""
    present = [run_dir / name for name in RUN_LOGS if (run_dir / name).exists()]
    if not present:
        return None
    target = run_dir / time.strftime("replaced-%Y%m%d-%H%M%S")
    n = 1
    while target.exists():
        target, n = run_dir / f"{target.name}-{n}", n + 1
    target.mkdir(parents=True)
    for path in present:
        shutil.move(str(path), str(target / path.name))
    return target


def checkpoint_disk_check(run_dir: str | Path, bytes_per_checkpoint: int, copies: int, free: int) -> str | None:
    """Before a run starts: ``copies`` more checkpoints of ``bytes_per_checkpoint`` each must fit in ``free``
    bytes. Raises ConfigError when even one does not fit; returns a warning when all of them do not, else
    None (the caller prints the plan line either way)."""
    if bytes_per_checkpoint <= 0:
        return None
    if bytes_per_checkpoint > free:
        raise ConfigError(f"run folder {run_dir}: one checkpoint takes about {human_bytes(bytes_per_checkpoint)} but "
                          f"only {human_bytes(free)} are free on its disk; free space or choose a train.run_dir on "
                          f"a larger disk")
    need = bytes_per_checkpoint * copies
    if need > free:
        return (f"warning: {copies} checkpoints of about {human_bytes(bytes_per_checkpoint)} (checkpoint.keep_last + "
                f"the one being written) need {human_bytes(need)} but {human_bytes(free)} are free in {run_dir}; "
                f"lower checkpoint.keep_last or free space before the run gets there")
    return None


def checkpoint_bytes(total_params: int, modules: Iterable[nn.Module], trainable_weights_only: bool) -> int:
    """Estimated bytes of one checkpoint: fp32 weights + AdamW's two moments of the trainable ones. ``modules``:
    this rank's parts (the trainable share is theirs); ``trainable_weights_only``: a fine-tune's checkpoint
    holds only the trainable tensors (the base is referenced, not copied)."""
    local = [p for m in modules for p in m.parameters()]
    trainable = total_params * sum(p.numel() for p in local if p.requires_grad) / (sum(p.numel() for p in local) or 1)
    return checkpoint_size(total_params, trainable, trainable_weights_only)


def disk_verdict(run_dir: str | Path, store: CheckpointManager, cfg: CheckpointConfig, bytes_per_checkpoint: int,
                 say: Callable[[str], None]) -> tuple[str, str | None]:
    """Rank 0, before training: the checkpoints against the free space of the run folder's disk: (note for the
    start line, None), or ("", refusal) when not even one fits; ``say`` gets a warning when all retained ones
    do not fit (``checkpoint_disk_check``)."""
    if not cfg.enabled:
        return "", None
    existing = len([p for p in store.list_complete() if store.belongs_to_run(p)])
    copies = max(1, cfg.keep_last + 1 - existing)
    free = free_bytes(run_dir)
    try:
        warning = checkpoint_disk_check(run_dir, bytes_per_checkpoint, copies, free)
    except ConfigError as exc:
        return "", str(exc)
    if warning:
        say(warning)
    size = human_bytes(bytes_per_checkpoint)
    return f"checkpoints ~{size} each, {cfg.keep_last} kept ({human_bytes(free)} free)", None
