"""Small file helpers shared by data, checkpoints and export (the bottom layer, beside options.py: imports
nothing else of scaletrain): checksums, the one path every write that can fill a disk goes through
(``guarded_write``), and the one way a user's output file is written (``write_file``: whole or not at all)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from scaletrain.core.options import UserError


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte blocks (constant memory for any size)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


class StorageError(UserError, RuntimeError):
    """A write that failed for lack of space, quota or permission; the message is one line for a person:
    what was being written, why it failed, bytes needed vs free, and what is still intact."""


# Errors a full, read-only or over-quota disk produces. torch.save reports them as a RuntimeError from its
# zip writer ("[enforce fail at inline_container.cc ...] file write failed"), DCP gathers them into a
# CheckpointException (a BaseException) holding each rank's traceback as text: so the text is searched too.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
_STORAGE_TEXT = re.compile(r"No space left on device|Disk quota exceeded|File too large|Read-only file system|"
                           r"Permission denied|Input/output error|inline_container\.cc|file write failed|"
                           r"\[Errno \d+\]")


def is_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is a failed write to storage rather than a bug."""
    seen = 0
    while exc is not None and seen < 8:  # follow the chain: DCP and torch wrap the OSError
        if isinstance(exc, OSError) and (exc.errno in _STORAGE_ERRNOS or exc.errno is None):
            return True
        if _STORAGE_TEXT.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def storage_reason(exc: BaseException) -> str:
    """The short cause of a storage error: the OS's words when they can be found ('No space left on device')."""
    text = str(exc)
    for candidate in (exc, exc.__cause__, exc.__context__):
        if isinstance(candidate, OSError) and candidate.strerror:
            return candidate.strerror
    found = _STORAGE_TEXT.search(text)
    if found and not found.group(0).startswith(("inline_container", "file write", "[Errno")):
        return found.group(0)
    errno_text = re.search(r"\[Errno (\d+)\] ([^:'\"\n]+)", text)
    if errno_text:
        return errno_text.group(2).strip()
    if found:  # torch's zip writer drops the OS's reason ("unexpected pos", "file write failed")
        return "the disk refused the write (full, over quota, read-only or a file size limit)"
    return "the write failed (" + (text.strip().splitlines() or [type(exc).__name__])[-1][:160] + ")"


def free_bytes(path: str | Path) -> int:
    """Free bytes on the file system that holds ``path`` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@contextlib.contextmanager
def guarded_write(what: str, where: str | Path, cleanup: tuple[str | Path, ...] | Callable[[], Iterable] = (),
                  needed: int | None = None, intact: str = ""):
    """Run a block that writes ``what`` under ``where``; a storage failure (see ``is_storage_error``) removes the
    ``cleanup`` paths (temporary files or folders that would go on filling the disk; or a function that lists
    them at that moment) and becomes one
    ``StorageError`` line: what failed, why, bytes needed vs free, and ``intact`` (what is still good); or,
    when the path itself is the problem (a parent that is a file, a folder not writable: ``path_problem``),
    what is in the way, without free-space advice.
    Other errors pass through unchanged: they are bugs, and their traceback is what a developer needs.
    A Ctrl-C (KeyboardInterrupt) also removes the ``cleanup`` paths before it goes on: the write was abandoned,
    and its temporaries would otherwise be left behind for the user to find."""
    try:
        yield
    except KeyboardInterrupt:
        for path in cleanup() if callable(cleanup) else cleanup:
            remove_quietly(path)
        raise
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        # A UserError is already the one line for its user (a run folder in use, raised from the lock's EAGAIN):
        # its OSError cause must not turn it into a storage error.
        if isinstance(exc, (SystemExit, UserError)) or not is_storage_error(exc):
            raise
        for path in cleanup() if callable(cleanup) else cleanup:
            remove_quietly(path)
        blocked = path_problem(exc, where)
        if blocked:  # not a matter of space: say what is in the way, not how much is free
            raise StorageError(f"writing {what} failed: {blocked}; choose another path") from None
        try:
            free = human_bytes(free_bytes(where))
        except OSError:
            free = "unknown"
        need = f"needs about {human_bytes(needed)}, " if needed else ""
        tail = f"; {intact}" if intact else ""
        raise StorageError(f"writing {what} failed: {storage_reason(exc)} ({need}{free} free on the disk of "
                           f"{where}){tail}") from None


# Failures that are the path's fault, not the disk's fullness: a parent that is a file, a folder that cannot
# be written to, a read-only file system.
_PATH_ERRNOS = {errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                errno.ENAMETOOLONG}


def path_problem(exc: BaseException, where: str | Path) -> str:
    """The real cause of a write that failed because of its path (``"runs/x is a file, not a folder"``,
    ``"/data is not writable"``), or "" when ``exc`` is not such a failure (a full disk, an I/O error)."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    if exc is None or exc.errno not in _PATH_ERRNOS:
        return ""
    target = Path(exc.filename or where)
    if exc.errno == errno.ENAMETOOLONG:
        return f"{target}: the name is too long"
    existing = target
    while not existing.exists() and existing != existing.parent:  # the nearest part of the path that exists
        existing = existing.parent
    if existing.exists() and not existing.is_dir() and exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"{existing} is a file, not a folder"
    if exc.errno == errno.EISDIR:
        return f"{target} is a folder where a file was to be written"
    if exc.errno == errno.EROFS:
        return f"{existing} is on a read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{existing} is not writable (permission denied)"
    return ""


def remove_quietly(path: str | Path) -> None:
    """Remove a file or a folder tree; missing is fine (a failed write may not have created it)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def check_output_path(path: str | Path, what: str = "") -> Path:
    """Before the work that produces it: whether the output file ``path`` can be written, else one
    ``StorageError`` line naming it (``what``, e.g. "--json x.json", defaults to the path) and the reason: a
    folder where the file is to go, a path under a file, a folder that is not writable, or a folder that does
    not exist. One missing folder level is made at write time (as ``mkdir`` would); a deeper missing path is
    taken for a typo rather than created. Returns ``path``."""
    path = Path(path)
    folder, way_out = path.parent, "choose another path"
    if path.is_dir():
        problem = f"{path} is a folder where a file was to be written"
    elif not folder.exists() and not folder.parent.is_dir():
        missing = folder
        while not missing.parent.exists() and missing.parent != missing.parent.parent:
            missing = missing.parent
        if not missing.parent.is_dir():  # a file part-way along the path
            problem = f"{missing.parent} is a file, not a folder"
        else:
            problem, way_out = f"the folder {folder} does not exist (nor does {missing})", \
                "create it, or choose another path"
    else:
        existing = folder if folder.exists() else folder.parent
        problem = f"{existing} is a file, not a folder" if not existing.is_dir() else \
            "" if os.access(existing, os.W_OK | os.X_OK) else f"{existing} is not writable (permission denied)"
    if problem:
        raise StorageError(f"writing {what or path} failed: {problem}; {way_out}")  # guarded_write's words
    return path


def write_file(path: str | Path, data: str | bytes, what: str = "") -> Path:
    """Write a user's output file whole or not at all: into a temporary file beside it (the same folder, so the
    rename stays on one file system), flushed to the disk (fsync), then renamed over ``path``. A failure (a full
    disk, a folder that cannot be written, Ctrl-C) removes the temporary and leaves the previous file at
    ``path``, if any, as it was; a storage failure is one ``StorageError`` line naming ``what`` (default: the
    path). Text is written as UTF-8; a symlink at ``path`` keeps pointing at the file it names. Returns ``path``."""
    path = Path(path)
    what = what or str(path)
    target = path.resolve() if path.is_symlink() else path
    check_output_path(target, what)
    data = data.encode("utf-8") if isinstance(data, str) else data
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    previous = target.is_file()
    intact = f"the previous {path} is unchanged" if previous else "nothing was written"
    try:
        with guarded_write(what, target.parent, needed=len(data), intact=intact):
            target.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            if previous:  # the replacement keeps the file's permissions
                with contextlib.suppress(OSError):
                    os.chmod(tmp, target.stat().st_mode & 0o7777)
            os.replace(tmp, target)
    except BaseException:  # a full disk, a bug or Ctrl-C: no partial file is left beside the output
        remove_quietly(tmp)
        raise
    fsync_dir(target.parent)
    return path


def fsync_dir(path: str | Path) -> None:
    """Make a rename in folder ``path`` durable (a power cut after it must not bring the old name back)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
