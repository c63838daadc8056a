"""The token file format: fixed-size shard files of raw little-endian uint16/uint32 plus a manifest.

    <dir>/manifest.json        format, dtype, vocab, tokenizer hash, splits -> shards (tokens, sha256)
    <dir>/tokenizer.json
    <dir>/train-00000.bin ...  np.memmap-able, documents separated by EOS (when the tokenizer has one)

Every file is written to ``*.tmp`` and renamed into place; the manifest is written last, so a manifest
never points at a half-written shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scaletrain.data.tokenizer import DataError, file_sha256

FORMAT = "scaletrain.tokens"
VERSION = 1
MANIFEST = "manifest.json"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    if vocab_size <= 2**16:
        return np.dtype("<u2")
    if vocab_size <= 2**32:
        return np.dtype("<u4")
    raise DataError(f"vocabulary of {vocab_size} tokens does not fit a uint32 shard")


@dataclass
class ShardWriter:
    """Buffers token ids and writes fixed-size shards ``<split>-NNNNN.bin`` atomically."""

    out_dir: Path
    split: str
    dtype: np.dtype
    shard_tokens: int = 1 << 26
    shards: list[dict] = field(default_factory=list)
    _buffer: list[np.ndarray] = field(default_factory=list)
    _buffered: int = 0

    def add(self, ids: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= np.iinfo(self.dtype).max + 1):
            raise DataError(f"token id {int(arr.max())} does not fit the {self.dtype.name} shard dtype")
        self._buffer.append(arr.astype(self.dtype))
        self._buffered += arr.size
        while self._buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, n: int) -> None:
        data = np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        chunk, rest = data[:n], data[n:]
        self._buffer, self._buffered = ([rest] if rest.size else []), rest.size
        name = f"{self.split}-{len(self.shards):05d}.bin"
        path = self.out_dir / name
        tmp = path.with_suffix(".bin.tmp")
        with open(tmp, "wb") as fh:
            fh.write(chunk.tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
        self.shards.append({"file": name, "tokens": int(chunk.size), "sha256": file_sha256(path)})

    def close(self) -> list[dict]:
        if self._buffered:
            self._flush(self._buffered)
        return self.shards


def write_manifest(out_dir: Path, manifest: dict) -> Path:
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    path = out_dir / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)
    return path


def read_manifest(data_dir: str | Path) -> dict:
    """Read and sanity-check a manifest; every problem is a one-line DataError naming the file."""
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
    return manifest


def verify_checksums(data_dir: str | Path) -> None:
    """Recompute every shard's sha256 (slow on big corpora; sizes are always checked by read_manifest)."""
    manifest = read_manifest(data_dir)
    for info in manifest["splits"].values():
        for shard in info["shards"]:
            f = Path(data_dir) / shard["file"]
            if file_sha256(f) != shard["sha256"]:
                raise DataError(f"{f}: checksum does not match the manifest; the shard is corrupt, re-run prepare")


def open_split(data_dir: str | Path, split: str, manifest: dict | None = None) -> list[np.memmap]:
    """Memory-map every shard of a split (read-only)."""
    manifest = manifest or read_manifest(data_dir)
    if split not in manifest["splits"]:
        raise DataError(f"{Path(data_dir) / MANIFEST}: no {split!r} split (have: {', '.join(manifest['splits'])})")
    dtype = np.dtype(manifest["dtype"])
    return [np.memmap(Path(data_dir) / s["file"], dtype=dtype, mode="r") for s in manifest["splits"][split]["shards"]
            if s["tokens"] > 0]
