"""One writer at a time: an advisory lock on a folder, taken by whatever writes into it (``train``'s run folder,
``prepare``'s output folder, ``export`` and ``compress``'s targets).

``RunLock`` is an ``flock`` on an open file, so the kernel releases it when the process ends in any way (an
exception, Ctrl-C, ``kill -9``, a power cut of the node); the file also records the holder's host, PID and start
time, so a second process is told who has it. Where the file system has no ``flock`` (some network file systems)
the record alone is the lock, and a record whose process is gone (same host, PID not alive) is stale and taken
over. It is here, below every layer, because commands of every layer write (checkpoint/run_folder.py holds what
a run folder adds: the run id, the refusal of a fresh start over checkpoints, the disk check).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from pathlib import Path

from scaletrain.core.files import guarded_write
from scaletrain.core.options import ConfigError

LOCK_FILE = ".lock"
_HELD: dict[str, RunLock] = {}  # locks this process holds, by folder: a second Trainer in it may reuse one


class RunLock:
    """The advisory lock of one run folder (see the module docstring). ``acquire`` raises ``ConfigError``
    naming the holder; ``release`` (or the process's end) frees it.

    The same one-writer lock guards what other commands write (``one_writer``): ``prepare``'s output folder,
    ``export``'s target (a lock file beside it, since the export replaces the folder or file as a whole).
    ``what`` names the guarded thing and ``elsewhere`` the way out in the refusal."""

    def __init__(self, run_dir: str | Path, name: str = LOCK_FILE, what: str = "",
                 elsewhere: str = "train into another train.run_dir"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        self.what, self.elsewhere = what or f"run folder {self.run_dir}", elsewhere
        self._fd: int | None = None

    @classmethod
    def take(cls, run_dir: str | Path, name: str = LOCK_FILE, what: str = "",
             elsewhere: str = "train into another train.run_dir") -> RunLock:
        """The lock of ``run_dir`` for this process: the one it already holds, or a newly acquired one."""
        key = str((Path(run_dir) / name).resolve())
        held = _HELD.get(key)
        if held is not None and held._fd is not None:
            return held
        lock = cls(run_dir, name, what, elsewhere)
        lock.acquire()
        _HELD[key] = lock
        return lock

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = _describe(self._read(fd))
            os.close(fd)
            raise ConfigError(self._refusal(holder)) from None
        except (ImportError, OSError) as exc:  # no flock here (Windows, some network file systems)
            if isinstance(exc, OSError) and exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            record = self._read(fd)
            if record and _alive(record) and record.get("pid") != os.getpid():
                os.close(fd)
                raise ConfigError(self._refusal(_describe(record))) from None
        if not _still_named(fd, self.path):  # its holder removed it as it released it (one_writer's remove)
            os.close(fd)
            return self.acquire()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "command": _command(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode(), 0)
        self._fd = fd

    def _refusal(self, holder: str) -> str:
        return f"{self.what} is in use by {holder}; wait for it to finish, stop it, or {self.elsewhere}"

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (ValueError, OSError):
            return {}

    def release(self, remove: bool = False) -> None:
        """Free the lock (the record stays: it only names the last holder; ``remove``: the file goes too,
        unlinked while still held, so that a process waiting on it finds it gone and opens a new one)."""
        if self._fd is not None:
            if remove:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
        _HELD.pop(str(self.path.resolve()), None)


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the open file ``fd`` (not unlinked, nor replaced by a newer lock file)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


@contextlib.contextmanager
def one_writer(folder: str | Path, what: str, elsewhere: str, name: str = LOCK_FILE, remove: bool = False):
    """Hold ``RunLock`` of ``folder`` (lock file ``name`` in it) while the block writes: a second process
    writing the same thing is refused in one line naming ``what``, the holder and ``elsewhere``. ``remove``: the
    lock file goes when the block ends (one beside a user's output, ``.model.gguf.lock``, is no file of theirs)."""
    folder = Path(folder)
    made = folder  # the outermost folder the lock file makes (None: the folder exists)
    while not made.parent.exists() and made.parent != made.parent.parent:
        made = made.parent
    made = None if folder.exists() else made
    with guarded_write(f"the folder {folder}", folder):  # a path that cannot be made: one line naming it
        lock = RunLock.take(folder, name, what, elsewhere)
    try:
        yield lock
    except BaseException:
        if made is not None:  # refused or interrupted: no folder left behind that only the lock made
            lock.release()
            _remove_made(lock.path, made)
        raise
    finally:
        lock.release(remove=remove)


def _remove_made(lock_file: Path, made: Path) -> None:
    """Remove ``lock_file`` and the folders above it up to ``made`` while they are empty."""
    with contextlib.suppress(OSError):
        lock_file.unlink()
    folder = lock_file.parent
    while True:
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == made:
            return
        folder = folder.parent


def _command() -> str:
    """'scaletrain export' (the command and subcommand holding a lock, for the refusal of a second one)."""
    from scaletrain.core.invocation import invocation

    return " ".join(invocation().split()[:2])


def _alive(record: dict) -> bool:
    """Whether the process a lock record names may still run: another host cannot be checked (assume yes);
    on this host, whether its PID exists."""
    if record.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(record.get("pid", 0)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True
    return int(record.get("pid", 0)) > 0


def _describe(record: dict) -> str:
    if not record:
        return "another process"
    command = f" ({record['command']})" if record.get("command") else ""
    return (f"process {record.get('pid', '?')}{command} on {record.get('host', '?')} "
            f"(since {record.get('started', '?')})")
