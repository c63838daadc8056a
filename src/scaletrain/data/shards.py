"""The token file format: fixed-size shard files of raw little-endian uint16/uint32 plus a manifest.

    <dir>/manifest.json        format, dtype, vocab, tokenizer hash, splits -> shards (tokens, sha256)
    <dir>/tokenizer.json
    <dir>/train-00000.bin ...  np.memmap-able, documents separated by EOS (when the tokenizer has one)
    <dir>/train-docs.bin       uint64 cumulative token count at the end of each document (optional;
                               lets the loader confine attention to a document even without EOS)

Every file is written to ``*.tmp`` and renamed into place; ``prepare`` deletes an old manifest before
it writes any shard and writes the new manifest last, so a manifest never points at a half-written
(or a previous run's) shard.

Checksums: ``read_manifest`` (which every loader and the trainer call) checks each listed file's size,
and its sha256 once per (size, mtime): what was verified is remembered in ``<dir>/.verified.json``
(or, when the folder is read-only, under ``~/.cache/scaletrain/verified/``), so a file that is
rewritten or corrupted through a write - even to the same size - is hashed again and refused on the
next start, while an unchanged dataset costs one ``stat`` per file. ``prepare`` records the files it
has just written (it hashed them while writing). A corruption that leaves size *and* mtime unchanged
(bit rot) is only found by ``scaletrain prepare --verify DIR``, which rehashes everything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from scaletrain.core.files import file_sha256
from scaletrain.data.tokenizer import DataError

FORMAT = "scaletrain.tokens"
VERSION = 1
MANIFEST = "manifest.json"
VERIFIED = ".verified.json"  # {file: [size, mtime_ns, sha256]} of the files whose checksum matched


def dtype_for_vocab(vocab_size: int, requested: str = "auto") -> np.dtype:
    """The smallest unsigned dtype that holds every token id, or ``requested`` ('uint16'/'uint32')
    after checking that the vocabulary fits it."""
    if requested == "auto":
        if vocab_size <= 2**16:
            return np.dtype("<u2")
        requested = "uint32"
    dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[requested])
    if vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"a vocabulary of {vocab_size:,} tokens does not fit {requested} shards "
                        f"(at most {np.iinfo(dtype).max + 1:,} ids); use uint32 or a smaller vocabulary")
    return dtype


@dataclass
class ShardWriter:
    """Streams token ids into fixed-size shards ``<split>-NNNNN.bin``: each is written to ``.tmp``
    (hashed on the way), fsynced and renamed when full, so memory holds one document, not one shard."""

    out_dir: Path
    split: str
    dtype: np.dtype
    shard_tokens: int = 1 << 26
    shards: list[dict] = field(default_factory=list)
    doc_ends: list[int] = field(default_factory=list)
    tokens: int = 0
    _fh: BinaryIO | None = None
    _hash: Any = None
    _in_shard: int = 0

    def add(self, ids: Iterable[int] | np.ndarray, end_of_document: bool = True) -> None:
        """Append one document's ids (or a piece of one, with ``end_of_document=False``)."""
        if isinstance(ids, np.ndarray) and ids.dtype == self.dtype:
            arr = ids  # produced by the encoder for this dtype: already range-checked
        else:
            wide = np.asarray(ids, dtype=np.int64)
            if wide.size and (wide.min() < 0 or wide.max() >= np.iinfo(self.dtype).max + 1):
                raise DataError(f"token id {int(wide.max())} does not fit the {self.dtype.name} shard dtype")
            arr = wide.astype(self.dtype)
        pos = 0
        while pos < arr.size:
            if self._fh is None:
                self._open()
            take = min(arr.size - pos, self.shard_tokens - self._in_shard)
            data = np.ascontiguousarray(arr[pos:pos + take]).tobytes()
            self._fh.write(data)
            self._hash.update(data)
            self._in_shard += take
            pos += take
            if self._in_shard == self.shard_tokens:
                self._finish()
        self.tokens += arr.size
        if end_of_document:
            self.doc_ends.append(self.tokens)

    def _path(self) -> Path:
        return self.out_dir / f"{self.split}-{len(self.shards):05d}.bin"

    def _open(self) -> None:
        self._fh = open(self._path().with_suffix(".bin.tmp"), "wb", buffering=1 << 20)
        self._hash = hashlib.sha256()
        self._in_shard = 0

    def _finish(self) -> None:
        path = self._path()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        path.with_suffix(".bin.tmp").replace(path)
        self.shards.append({"file": path.name, "tokens": self._in_shard, "sha256": self._hash.hexdigest()})
        self._fh = None

    def close(self) -> list[dict]:
        """Finish the last (shorter) shard; returns the shard list for the manifest."""
        if self._fh is not None:
            self._finish()
        return self.shards

    def write_doc_index(self) -> dict:
        """Write ``<split>-docs.bin`` (cumulative document ends, uint64) and return its manifest entry."""
        name = f"{self.split}-docs.bin"
        path = self.out_dir / name
        tmp = path.with_suffix(".bin.tmp")
        np.asarray(self.doc_ends, dtype="<u8").tofile(tmp)
        tmp.replace(path)
        return {"file": name, "documents": len(self.doc_ends), "sha256": file_sha256(path)}


def write_manifest(out_dir: Path, manifest: dict) -> Path:
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    path = out_dir / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)
    return path


def read_manifest(data_dir: str | Path, verify: bool = True) -> dict:
    """Read and sanity-check a manifest; every problem is a one-line DataError naming the file.
    ``verify``: also check the sha256 of every listed file not verified before at its current size and
    mtime (see the module docstring); the first start on a new dataset reads every file once."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: no manifest (run `scaletrain prepare` on the raw text first)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise DataError(f"{path}: invalid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a scaletrain token manifest (format={manifest.get('format')!r})")
    if manifest.get("version", 0) > VERSION:
        raise DataError(f"{path}: written by a newer scaletrain (version {manifest['version']}); upgrade")
    for split, info in manifest.get("splits", {}).items():
        for shard in info["shards"]:
            f = Path(data_dir) / shard["file"]
            expected = shard["tokens"] * np.dtype(manifest["dtype"]).itemsize
            if not f.is_file():
                raise DataError(f"{f}: shard listed in the manifest is missing")
            if f.stat().st_size != expected:
                raise DataError(f"{f}: {f.stat().st_size} bytes, the manifest says {expected}; re-run prepare")
    if verify:
        verify_once(data_dir, manifest)
    return manifest


def _listed_files(manifest: dict) -> list[tuple[str, str]]:
    """(file name, sha256) of every shard, document index and the tokenizer the manifest lists."""
    out = []
    for info in manifest["splits"].values():
        for entry in info["shards"] + ([info["doc_index"]] if info.get("doc_index") else []):
            out.append((entry["file"], entry["sha256"]))
    tok = manifest.get("tokenizer", {})
    if tok.get("file") and tok.get("sha256"):
        out.append((tok["file"], tok["sha256"]))
    return out


def _check_file(f: Path, expected: str) -> None:
    if not f.is_file():
        raise DataError(f"{f}: listed in the manifest but missing; re-run prepare")
    actual = file_sha256(f)
    if actual != expected:
        raise DataError(f"{f}: checksum does not match the manifest (sha256 {actual[:12]}..., manifest "
                        f"{expected[:12]}...); the file is corrupt or was changed after prepare: re-run prepare")


def _stamp(f: Path, sha256: str) -> list:
    st = f.stat()
    return [st.st_size, st.st_mtime_ns, sha256]


def _cache_paths(data_dir: Path) -> list[Path]:
    """Where the verified stamps live: in the dataset folder, else (read-only folder) the user cache."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return [data_dir / VERIFIED, home / "scaletrain" / "verified" / f"{key}.json"]


def _load_stamps(data_dir: Path) -> dict:
    for path in _cache_paths(data_dir):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return {}


def _save_stamps(data_dir: Path, stamps: dict) -> None:
    """Atomic (a unique tmp file renamed), so ranks starting together cannot leave a torn file; a
    folder that cannot be written falls back to the user cache, and failing both only costs a re-hash."""
    for path in _cache_paths(data_dir):
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(stamps))
            tmp.replace(path)
            return
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def verify_once(data_dir: str | Path, manifest: dict) -> int:
    """Check the sha256 of every listed file whose (size, mtime) was not verified before; returns the
    number of files hashed (0 on an unchanged, already verified dataset)."""
    data_dir = Path(data_dir)
    stamps = _load_stamps(data_dir)
    hashed = 0
    for name, sha in _listed_files(manifest):
        f = data_dir / name
        if f.is_file() and stamps.get(name) == _stamp(f, sha):
            continue
        _check_file(f, sha)
        stamps[name] = _stamp(f, sha)
        hashed += 1
    if hashed:
        _save_stamps(data_dir, {name: stamps[name] for name, _ in _listed_files(manifest)})
    return hashed


def record_verified(data_dir: str | Path, manifest: dict) -> None:
    """Stamp the files ``prepare`` has just written (hashed while writing) as verified."""
    data_dir = Path(data_dir)
    _save_stamps(data_dir, {name: _stamp(data_dir / name, sha) for name, sha in _listed_files(manifest)})


def verify_checksums(data_dir: str | Path) -> int:
    """Recompute every shard's, doc index's and the tokenizer's sha256, whatever was verified before
    (``scaletrain prepare --verify DIR``); returns the number of files checked."""
    manifest = read_manifest(data_dir, verify=False)
    files = _listed_files(manifest)
    for name, sha in files:
        _check_file(Path(data_dir) / name, sha)
    record_verified(data_dir, manifest)
    return len(files)


def open_doc_index(data_dir: str | Path, split: str, manifest: dict) -> np.ndarray | None:
    """The split's cumulative document ends (memory-mapped), or None for data prepared without one."""
    entry = manifest["splits"].get(split, {}).get("doc_index")
    if not entry:
        return None
    path = Path(data_dir) / entry["file"]
    if not path.is_file() or path.stat().st_size != 8 * entry["documents"]:
        raise DataError(f"{path}: document index missing or of the wrong size; re-run prepare")
    if entry["documents"] == 0:
        return np.zeros(0, dtype="<u8")
    return np.memmap(path, dtype="<u8", mode="r")


def remove_stale(out_dir: Path, manifest: dict) -> list[str]:
    """Delete ``*.bin`` files of earlier runs that the (new) manifest does not list."""
    listed = {e["file"] for info in manifest["splits"].values()
              for e in info["shards"] + ([info["doc_index"]] if info.get("doc_index") else [])}
    removed = []
    for f in out_dir.glob("*.bin"):
        if f.name not in listed and (f.name.split("-")[0] in ("train", "val")):
            f.unlink()
            removed.append(f.name)
    for f in out_dir.glob("*.tmp"):
        f.unlink()
        removed.append(f.name)
    return removed


def open_split(data_dir: str | Path, split: str, manifest: dict | None = None) -> list[np.memmap]:
    """Memory-map every shard of a split (read-only)."""
    manifest = manifest or read_manifest(data_dir)
    if split not in manifest["splits"]:
        raise DataError(f"{Path(data_dir) / MANIFEST}: no {split!r} split (have: {', '.join(manifest['splits'])})")
    dtype = np.dtype(manifest["dtype"])
    return [np.memmap(Path(data_dir) / s["file"], dtype=dtype, mode="r") for s in manifest["splits"][split]["shards"]
            if s["tokens"] > 0]
