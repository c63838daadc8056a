"""Turn raw text into a prepared token folder (manifest + shards + tokenizer.json).

This is the minimal path used by ``scaletrain train`` on raw text and by ``scaletrain prepare FILE``:
read -> normalise line endings -> train or load a tokenizer -> split train/val -> write shards.
"""

from __future__ import annotations

import hashlib
import random
import time
from importlib import resources
from pathlib import Path

from scaletrain.data.shards import MANIFEST, ShardWriter, dtype_for_vocab, read_manifest, write_manifest
from scaletrain.data.tokenizer import BPETokenizer, CharTokenizer, DataError, Tokenizer, file_sha256, load_tokenizer

BUILTIN = {"tinyshakespeare": "assets/tinyshakespeare/input.txt"}


def resolve_source(source: str) -> Path:
    """``builtin:NAME`` -> the bundled file; anything else -> an existing path."""
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in BUILTIN:
            raise DataError(f"unknown builtin dataset {name!r} (known: {', '.join(BUILTIN)})")
        return Path(str(resources.files("scaletrain").joinpath(BUILTIN[name])))
    path = Path(source)
    if not path.exists():
        raise DataError(f"data path not found: {path}")
    return path


def read_text_file(path: Path) -> str:
    """UTF-8 (a BOM is dropped), CRLF/CR -> LF. Undecodable bytes are an error naming the file."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 at byte {exc.start}; convert it, or use the full pipeline "
                        "(`scaletrain prepare --config data.toml`) with an encoding-error policy") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_documents(path: Path) -> list[tuple[str, str]]:
    """(name, text) for one file, or every ``*.txt`` under a folder (sorted, recursive)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"{path}: no .txt files found")
    docs = [(str(f), read_text_file(f)) for f in files]
    docs = [(n, t) for n, t in docs if t.strip()]
    if not docs:
        raise DataError(f"{path}: every file is empty")
    return docs


def split_documents(docs: list[tuple[str, str]], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """One document: split by characters (train first, like nanoGPT). Several: a seeded choice of whole
    documents goes to val, so no document is in both splits."""
    if len(docs) == 1:
        text = docs[0][1]
        cut = int(len(text) * (1 - val_fraction))
        return [text[:cut]], ([text[cut:]] if val_fraction > 0 else [])
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(docs) * val_fraction)) if val_fraction > 0 else 0
    val_idx = set(order[:n_val])
    train = [t for i, (_, t) in enumerate(docs) if i not in val_idx]
    val = [t for i, (_, t) in enumerate(docs) if i in val_idx]
    return train, val


def build_tokenizer(kind: str, texts: list[str], vocab_size: int) -> Tokenizer:
    if kind == "char":
        return CharTokenizer.train(texts)
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size)
    return load_tokenizer(kind)


def prepare_text(source: str, out_dir: str | Path, *, tokenizer: str = "char", vocab_size: int = 2048,
                 val_fraction: float = 0.1, seed: int = 1337) -> dict:
    """Prepare ``source`` into ``out_dir``; returns the manifest. Documents are joined with EOS when the
    tokenizer has one (BPE), so the model learns where a text ends."""
    t0 = time.perf_counter()
    src = resolve_source(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = read_documents(src)
    train_docs, val_docs = split_documents(docs, val_fraction, seed)
    # The char vocabulary comes from all text so val never has an unknown character (as nanoGPT does).
    tok = build_tokenizer(tokenizer, train_docs + val_docs if tokenizer == "char" else train_docs, vocab_size)
    dtype = dtype_for_vocab(tok.vocab_size)
    tok.save(out / "tokenizer.json")
    splits = {}
    for split, texts in (("train", train_docs), ("val", val_docs)):
        writer = ShardWriter(out, split, dtype)
        for ids in tok.encode_batch(texts):
            writer.add(ids + ([tok.eos_id] if tok.eos_id is not None else []))
        shards = writer.close()
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "documents": len(texts), "shards": shards}
    n_bytes = sum(len(t.encode("utf-8")) for _, t in docs)
    manifest = write_manifest(out, {
        "dtype": dtype.str,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": {"file": "tokenizer.json", "sha256": file_sha256(out / "tokenizer.json"),
                      "kind": "char" if isinstance(tok, CharTokenizer) else "bpe"},
        "source": {"path": source, "fingerprint": source_fingerprint(source, tokenizer, vocab_size, val_fraction, seed)},
        "splits": splits,
        "stats": {"documents": len(docs), "bytes": n_bytes, "seconds": round(time.perf_counter() - t0, 3)},
    })
    return read_manifest(manifest.parent)


def source_fingerprint(source: str, tokenizer: str, vocab_size: int, val_fraction: float, seed: int) -> str:
    """Changes when the input files or the preparation settings change (so caches are not reused wrongly)."""
    src = resolve_source(source)
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*.txt") if p.is_file())
    h = hashlib.sha256(f"{tokenizer}|{vocab_size}|{val_fraction}|{seed}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def ensure_prepared(source: str, cache_dir: str | Path, **kwargs) -> Path:
    """Use ``source`` if it is already a prepared folder; otherwise prepare it into ``cache_dir`` (once)."""
    if not source.startswith("builtin:") and (Path(source) / MANIFEST).is_file():
        return Path(source)
    cache = Path(cache_dir)
    fp = source_fingerprint(source, kwargs.get("tokenizer", "char"), kwargs.get("vocab_size", 2048),
                            kwargs.get("val_fraction", 0.1), kwargs.get("seed", 1337))
    if (cache / MANIFEST).is_file():
        try:
            if read_manifest(cache).get("source", {}).get("fingerprint") == fp:
                return cache
        except DataError:
            pass  # a broken cache is simply rebuilt
    prepare_text(source, cache, **kwargs)
    return cache
