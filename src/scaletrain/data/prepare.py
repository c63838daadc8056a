"""``prepare``: raw text -> cleaned -> filtered -> deduplicated -> tokenized -> shards + manifest.

The stages are plain functions in their own modules; this file only strings them together:

    pass 1  sources.iter_documents -> [workers: clean.clean_text, filters.check, dedup.signature]
            -> dedup.Deduplicator (in order, this process) -> .work/cleaned.zst (the kept documents)
    pass 2  split plan (train/val by document, seeded) and the tokenizer (BPE trained on a sample)
    pass 3  .work/cleaned.zst -> augment.fim (train only, optional) -> encode.encode_stream
            -> shards.ShardWriter per split -> manifest.json (last) -> report.json

Memory is bounded by the batches in flight plus what dedup must remember per kept document (see
dedup.py), never by the corpus. Resuming: pass 1's output is kept with a fingerprint of its inputs and
settings, so an interrupted or re-configured run (new tokenizer, new split) skips it; the shards are
always rewritten as a whole. The old manifest is deleted before the first shard is written and the new
one is written last, so a manifest never describes a half-written shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from scaletrain.core.files import file_sha256, guarded_write
from scaletrain.data import augment, clean, dedup, filters
from scaletrain.data.encode import CUT_CHARS, build_tokenizer, cut_text, encode_stream
from scaletrain.data.ngrams import mix64, words
from scaletrain.data.prepare_config import PrepareConfig, minimal_config, validate
from scaletrain.data.report import Report
from scaletrain.data.shards import (
    MANIFEST,
    ShardWriter,
    dtype_for_vocab,
    read_manifest,
    record_verified,
    remove_stale,
    write_manifest,
)
from scaletrain.data.sources import (
    Document,
    decode_text_file,
    fingerprint_items,
    input_bytes,
    iter_documents,
    resolve_source,
)
from scaletrain.data.tokenizer import CharTokenizer, DataError
from scaletrain.data.workers import ordered_map, release_freed_memory, resolve_workers

PIPELINE_VERSION = 3           # bump when a stage's output changes for the same config
WORK = ".work"                 # pass-1 output and markers, inside the output folder
BATCH_BYTES = 1 << 20          # documents per worker task: about 1 MB of text (amortises pickling)
BATCH_DOCS = 256
POOL_MIN_BYTES = 8 << 20       # smaller inputs are processed here: spawning workers costs ~1 s
_RECORD = struct.Struct("<IQ")  # cleaned-corpus record header: name length, text length (bytes)

__all__ = ["prepare", "prepare_text", "ensure_prepared", "resolve_source", "read_text_file", "source_fingerprint"]


# -- pass 1: clean, filter, signature (workers) and dedup (here) --------------------------------------

_STAGE_CFG: PrepareConfig | None = None


def _init_stage_worker(cfg: PrepareConfig) -> None:
    global _STAGE_CFG
    _STAGE_CFG = cfg


def _process_batch(batch: list[Document]) -> list[tuple]:
    """Worker: (source, n_bytes, text|None, removal (stage, reason)|None, counts, digest, signature)."""
    cfg = _STAGE_CFG
    out = []
    for doc in batch:
        text, counts = clean.clean_text(doc.text, cfg.clean)
        if not text.strip():
            out.append((doc.source, doc.n_bytes, None, ("clean", "empty after cleaning"), counts, None, None))
            continue
        tokens = words(text) if (cfg.dedup.near or filters.needs_words(cfg.filter)) else None
        reason, _ = filters.check(text, cfg.filter, tokens)
        if reason is not None:
            out.append((doc.source, doc.n_bytes, None, ("filter", reason), counts, None, None))
            continue
        sig = dedup.signature(text, cfg.dedup, tokens) if cfg.dedup.near else None
        out.append((doc.source, doc.n_bytes, text, None, counts, dedup.content_hash(text), sig))
    release_freed_memory()
    return out


def _batches(docs: Iterable[Document]) -> Iterator[list[Document]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += doc.n_bytes
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _spill_writer(path: Path):
    """zstd level 1 (~400 MB/s, ~3x smaller) when zstandard is installed, else a plain file: the
    trainer's on-the-fly preparation must not need the optional data dependencies."""
    try:
        import zstandard
    except ImportError:
        return open(path, "wb")
    return zstandard.ZstdCompressor(level=1).stream_writer(open(path, "wb"))


def clean_corpus(cfg: PrepareConfig, spill: Path, report: Report) -> np.ndarray:
    """Pass 1: write every kept document to ``spill``; return their content keys (uint64, in order)."""
    dedupper = dedup.Deduplicator(cfg.dedup)
    keys: list[int] = []
    tmp = spill.with_suffix(".tmp")
    workers = resolve_workers(cfg.workers) if input_bytes(cfg.source) >= POOL_MIN_BYTES else 1
    with _spill_writer(tmp) as out:
        results = ordered_map(_process_batch, _batches(iter_documents(cfg.source, report)),
                              workers=workers, initializer=_init_stage_worker, initargs=(cfg,))
        for batch in results:
            for source, n_bytes, text, removal, counts, digest, sig in batch:
                for what, n in counts.items():
                    report.modify(what, n)
                if removal is not None:
                    report.remove(removal[0], removal[1], n_bytes, source)
                    continue
                reason = dedupper.check(len(keys), source, digest, sig)
                if reason is not None:
                    report.remove("dedup", reason, n_bytes, source)
                    continue
                name, data = source.encode(), text.encode("utf-8")
                out.write(_RECORD.pack(len(name), len(data)) + name + data)
                keys.append(int.from_bytes(digest[:8], "little"))
    tmp.replace(spill)
    report.clusters = dedupper.cluster_report()
    return np.array(keys, dtype=np.uint64)


def read_cleaned(spill: Path) -> Iterator[tuple[str, str]]:
    """(source, text) of every kept document, in order (streaming)."""
    with open(spill, "rb") as raw:
        if raw.read(4) == b"\x28\xb5\x2f\xfd":  # the zstd frame magic
            import zstandard

            raw.seek(0)
            reader = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), buffer_size=1 << 20)
        else:
            raw.seek(0)
            reader = raw
        while header := reader.read(_RECORD.size):
            n_name, n_text = _RECORD.unpack(header)
            name = reader.read(n_name).decode()
            yield name, reader.read(n_text).decode("utf-8")


# -- pass 2: split plan and tokenizer ----------------------------------------------------------------

def _keyed(keys: np.ndarray, salt: str) -> np.ndarray:
    """A seeded, order-independent pseudo-random value per document (from its content hash)."""
    s = int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little")
    return mix64(keys ^ np.uint64(s))


def plan_split(keys: np.ndarray, cfg: PrepareConfig) -> tuple[str, np.ndarray]:
    """('tail' | 'document', val mask per document). Document mode puts the ``round(n * val_fraction)``
    documents with the smallest seeded hash in val: deterministic, and independent of document order."""
    n = keys.size
    by = cfg.split.by if cfg.split.by != "auto" else ("tail" if n == 1 else "document")
    val = np.zeros(n, dtype=bool)
    if by == "document" and cfg.split.val_fraction > 0:
        n_val = max(1, round(n * cfg.split.val_fraction))
        if n_val >= n:
            raise DataError(f"only {n} document(s) left after filtering: too few for a document split with "
                            f"val_fraction {cfg.split.val_fraction}; use split.by = 'tail' or add text")
        val[np.argsort(_keyed(keys, f"split:{cfg.split.seed}"), kind="stable")[:n_val]] = True
    return by, val


def _split_texts(spill: Path, by: str, val: np.ndarray, fraction: float) -> Iterator[tuple[int, str, str]]:
    """(document index, split, text) in order; in tail mode each document yields its two parts."""
    for i, (_, text) in enumerate(read_cleaned(spill)):
        if by == "tail":
            cut = int(len(text) * (1 - fraction))
            yield i, "train", text[:cut]
            if fraction > 0:
                yield i, "val", text[cut:]
        else:
            yield i, ("val" if val[i] else "train"), text


def make_tokenizer(cfg: PrepareConfig, spill: Path, keys: np.ndarray, by: str, val: np.ndarray,
                   kept_bytes: int, out: Path):
    """Train or load the tokenizer and save it as ``out/tokenizer.json``."""
    rate = min(1.0, cfg.tokenizer.train_sample_mb * 1e6 / max(kept_bytes, 1))
    picked = _keyed(keys, "tokenizer-sample") <= np.uint64(min(rate * 2**64, 2**64 - 1))

    def sample() -> Iterator[str]:
        # in pieces cut where the byte-level pre-tokenizer splits anyway (the word counts, hence the
        # BPE, are the same): the trainer reads ahead 256 texts, so this bounds what it holds
        for i, split, text in _split_texts(spill, by, val, cfg.split.val_fraction):
            if split == "train" and picked[i] and text:
                yield from cut_text(text, CUT_CHARS // 4)

    def everything() -> Iterator[str]:
        for _, text in read_cleaned(spill):
            yield text

    tok = build_tokenizer(cfg.tokenizer, sample(), everything(), need_fim=cfg.augment.fim_rate > 0)
    release_freed_memory()  # the trainer's word and pair counts are gone
    tmp = out / "tokenizer.json.tmp"
    tok.save(tmp)
    tmp.replace(out / "tokenizer.json")
    return tok


# -- pass 3: encode and write --------------------------------------------------------------------------

def write_shards(cfg: PrepareConfig, spill: Path, keys: np.ndarray, by: str, val: np.ndarray, tok, out: Path,
                 report: Report) -> dict:
    """Encode every document into per-split shards; returns the manifest's ``splits``."""
    dtype = dtype_for_vocab(tok.vocab_size, cfg.output.dtype)
    shard_tokens = max(1, int(cfg.output.shard_mb * 1e6) // dtype.itemsize)
    writers = {s: ShardWriter(out, s, dtype, shard_tokens) for s in ("train", "val")}
    stats = {s: {"documents": 0, "bytes": 0} for s in writers}
    labels: deque[list[str]] = deque()
    batch_bytes = int(cfg.tokenizer.batch_mb * 1e6)

    def batches() -> Iterator[list[list[str]]]:
        batch, names, size = [], [], 0
        for i, split, text in _split_texts(spill, by, val, cfg.split.val_fraction):
            if not text:
                continue
            stats[split]["documents"] += 1
            stats[split]["bytes"] += len(text.encode("utf-8"))
            pieces = augment.fim(text, int(keys[i]).to_bytes(8, "little"), cfg.augment) if split == "train" else [text]
            batch.append(pieces)
            names.append(split)
            size += len(text)
            if size >= batch_bytes:
                labels.append(names)
                yield batch
                batch, names, size = [], [], 0
        if batch:
            labels.append(names)
            yield batch

    t0 = time.perf_counter()
    try:
        for arrays in encode_stream(batches(), tok, out / "tokenizer.json", dtype, cfg.tokenizer.encode_workers):
            for split, ids in zip(labels.popleft(), arrays):
                writers[split].add(ids)
    except DataError:
        if not isinstance(tok, CharTokenizer):
            raise  # a BPE's messages name the tokenizer and the character already (encode.Encoder)
        raise DataError(_unknown_characters(spill, tok, cfg.tokenizer.kind)) from None
    report.timings["encode_and_write"] = time.perf_counter() - t0
    splits = {}
    for split, writer in writers.items():  # val is listed even when empty, as the trainer expects
        shards = writer.close()
        splits[split] = {"tokens": writer.tokens, **stats[split], "shards": shards,
                         "doc_index": writer.write_doc_index()}
    if splits["train"]["tokens"] == 0:
        report.write(out / "report.json")
        raise DataError(f"the train split is empty: {keys.size:,} document(s) left after cleaning and filtering "
                        f"hold no train text with split.by = {by!r} and split.val_fraction = "
                        f"{cfg.split.val_fraction} (add text, or lower split.val_fraction); see {out / 'report.json'}")
    return splits


def _unknown_characters(spill: Path, tok: CharTokenizer, kind: str) -> str:
    """Which documents a given char vocabulary cannot encode (the encoder stops at the first character it
    lacks, without its document): the first one by name, how many there are, and the characters."""
    unknown: Counter = Counter()
    first, count, total = None, 0, 0
    for source, text in read_cleaned(spill):
        total += 1
        missing = set(text) - tok.stoi.keys()
        if missing:
            first, count = first or source, count + 1
            unknown.update(c for c in text if c in missing)
    shown = ", ".join(f"{c!r} x{n:,}" for c, n in unknown.most_common(3))
    return (f"{first}: characters not in the char vocabulary of tokenizer.kind = {kind} (e.g. {shown}); "
            f"{count:,} of {total:,} document(s) hold such characters, so prepare stopped: use --tokenizer char (a "
            f"vocabulary of this text) or bpe, or a tokenizer that covers it")


# -- the whole run ---------------------------------------------------------------------------------------

_ISSUE_OF_REASON = {"not UTF-8": "not_utf8_skipped"}  # else the reason with underscores (sources._skip_file)


def _removal_advice(stage: str, reason: str, count: int, cfg: PrepareConfig, report: Report) -> str:
    """One removal of the report as a clause that says what to change, e.g. "3 dropped by filter.min_chars
    (fewer than 200 characters after cleaning): lower filter.min_chars (0 = off)"."""
    if stage == "filter":
        if reason in ("min_chars", "min_words"):
            unit = "characters" if reason == "min_chars" else "words"
            return (f"{count:,} dropped by filter.{reason} (fewer than {getattr(cfg.filter, reason):,} {unit} after "
                    f"cleaning): lower filter.{reason} (0 = off)")
        if reason.startswith("language"):
            return f"{count:,} dropped by filter.language = {cfg.filter.language} (detected {reason[9:].strip('()')})"
        setting = re.sub(r"_\dgram_", "_ngram_", reason)  # max_top_2gram_fraction -> max_top_ngram_fraction
        off = "an empty list = off" if setting != reason else "1 = off"
        return f"{count:,} dropped by filter.{reason}: raise filter.{setting} ({off})"
    if stage == "source":
        first = report.first_message(_ISSUE_OF_REASON.get(reason, reason.lower().replace(" ", "_")))
        what = {"missing text field": f"without a {cfg.source.text_field!r} field", "utf16 file": "UTF-16 file",
                "not UTF-8": "not UTF-8 (source.encoding_errors = 'skip')"}.get(reason, reason)
        return f"{count:,} {what}" + (f" ({first})" if first else "")
    return f"{count:,} dropped by {stage}: {reason}"


def nothing_left(report: Report, cfg: PrepareConfig, report_path: Path) -> str:
    """The one line that says why no document is left: how many came in, which stage or filter dropped how many
    and what to change, then the input issues that dropped nothing (bytes replaced, a bad JSON array)."""
    parts = [_removal_advice(stage, reason, count, cfg, report) for stage, reason, count in report.removals()]
    covered = {_ISSUE_OF_REASON.get(reason, reason.lower().replace(" ", "_")) for stage, reason, _ in
               report.removals() if stage == "source"}
    parts += [report.first_message(kind) for kind in report.issues if kind not in covered][:2]
    n = report.documents_in
    return (f"no document left after cleaning, filtering and deduplication: {n:,} document{'s' if n != 1 else ''} "
            f"in; {'; '.join(p for p in parts if p) or 'no input read'}; see {report_path}")


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprints(cfg: PrepareConfig) -> tuple[str, str]:
    """(pass-1 fingerprint, whole-run fingerprint): inputs (paths, sizes, mtimes) and the settings
    that change each pass's output. Worker counts and the output folder are not part of them."""
    files = fingerprint_items(cfg.source)
    c = dataclasses.asdict(cfg)
    stage1 = _digest([PIPELINE_VERSION, files, c["source"], c["clean"], c["filter"], c["dedup"]])
    tok = c["tokenizer"] | {"encode_workers": None, "batch_mb": None}
    tok_file = Path(cfg.tokenizer.kind)
    if cfg.tokenizer.kind not in ("bpe", "char") and tok_file.is_file():
        tok["sha256"] = file_sha256(tok_file)
        # A Hugging Face folder's special tokens (the EOS appended after each document) live beside the file.
        for side in ("tokenizer_config.json", "special_tokens_map.json"):
            if (tok_file.parent / side).is_file():
                tok[side] = file_sha256(tok_file.parent / side)
    whole = _digest([stage1, tok, c["augment"], c["split"], c["output"]["dtype"], c["output"]["shard_mb"]])
    return stage1, whole


def prepare(cfg: PrepareConfig, report: Report | None = None, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the pipeline into ``cfg.output.dir``; returns the manifest (also written there).

    A write that fails (a full disk) removes the temporary files and is one ``StorageError`` line; the
    manifest is written last, so a half-written folder is never taken for a prepared one, and a run
    again reuses the passes that completed."""
    validate(cfg)
    cfg = dataclasses.replace(cfg, dedup=dedup.available(cfg.dedup, log))
    out = Path(cfg.output.dir)
    with guarded_write(f"prepared data in {out}", out, cleanup=lambda: list(out.rglob("*.tmp")),
                       intact="nothing half-written is used (the manifest is written last); free space and run "
                              "again"):
        return _prepare(cfg, out, report or Report(), log)


def _prepare(cfg: PrepareConfig, out: Path, report: Report, log: Callable[[str], None]) -> dict:
    work = out / WORK
    work.mkdir(parents=True, exist_ok=True)
    fp_clean, fp_all = fingerprints(cfg)
    if not cfg.output.force and (out / MANIFEST).is_file():
        try:
            manifest = read_manifest(out)
            if manifest.get("fingerprint") == fp_all:
                log(f"{out}: up to date (same inputs and settings); output.force=true rebuilds")
                return manifest
        except DataError:
            pass  # a broken output is rebuilt
    spill, marker = work / "cleaned.zst", work / "cleaned.json"

    # pass 1, or its saved result
    t0 = time.perf_counter()
    saved = json.loads(marker.read_text()) if marker.is_file() else {}
    if not cfg.output.force and saved.get("fingerprint") == fp_clean and spill.is_file():
        keys = np.load(work / "keys.npy")
        report.restore(saved["report"])
        log(f"pass 1 (clean/filter/dedup): reusing {spill} ({keys.size:,} documents)")
    else:
        marker.unlink(missing_ok=True)
        keys = clean_corpus(cfg, spill, report)
        np.save(work / "keys.npy", keys)
        marker.write_text(json.dumps({"fingerprint": fp_clean, "report": report.counters()}))
    report.timings["clean_filter_dedup"] = time.perf_counter() - t0
    if keys.size == 0:
        report.write(out / "report.json")  # written before the error that names it
        raise DataError(nothing_left(report, cfg, out / "report.json"))
    kept_bytes = report.bytes_in - report.removed_total()[1]

    # pass 2
    t0 = time.perf_counter()
    by, val = plan_split(keys, cfg)
    (out / MANIFEST).unlink(missing_ok=True)  # from here on the folder is being rewritten
    tok = make_tokenizer(cfg, spill, keys, by, val, kept_bytes, out)
    report.timings["tokenizer"] = time.perf_counter() - t0
    asked = cfg.tokenizer.vocab_size if cfg.tokenizer.kind == "bpe" and tok.vocab_size < cfg.tokenizer.vocab_size \
        else None
    if asked:  # the BPE trainer stops when no pair of tokens is left to merge: the run must not differ silently
        report.issue("vocab_smaller_than_asked", f"tokenizer.vocab_size = {asked:,} asked, but the corpus supports "
                                                 f"only {tok.vocab_size:,} tokens (every pair of tokens in it is "
                                                 f"merged); the vocabulary is {tok.vocab_size:,}")

    # pass 3
    splits = write_shards(cfg, spill, keys, by, val, tok, out, report)
    report.splits = {s: {k: v for k, v in info.items() if k in ("documents", "bytes", "tokens")}
                     | {"shards": len(info["shards"])}
                     for s, info in splits.items()}
    manifest = {
        "dtype": dtype_for_vocab(tok.vocab_size, cfg.output.dtype).str,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": getattr(tok, "bos_id", None),
        "tokenizer": {"file": "tokenizer.json", "sha256": file_sha256(out / "tokenizer.json"),
                      "kind": "char" if isinstance(tok, CharTokenizer) else "bpe"}
                     | ({"vocab_size_asked": asked} if asked else {}),
        "source": {"path": cfg.source.paths[0] if len(cfg.source.paths) == 1 else cfg.source.paths,
                   "paths": cfg.source.paths, "fingerprint": fp_all},
        "fingerprint": fp_all,
        "split": {"by": by, "val_fraction": cfg.split.val_fraction, "seed": cfg.split.seed},
        "splits": splits,
        "stats": {k: v for k, v in report.to_dict().items() if k not in ("messages", "removed_documents")},
        "config": dataclasses.asdict(cfg),
    }
    report.write(out / "report.json")
    write_manifest(out, manifest)
    remove_stale(out, manifest)
    record_verified(out, manifest)  # hashed while written: the first loader start need not read them again
    return read_manifest(out)


# -- the trainer's entry points (kept signatures) -----------------------------------------------------

def read_text_file(path: Path) -> str:
    """UTF-8 (a BOM is dropped), CRLF/CR -> LF. UTF-16, binary or undecodable bytes are an error naming the
    file (``sources.decode_text_file``, the reader prepare's text files share)."""
    return decode_text_file(Path(path).read_bytes(), path, "convert it, or use the full pipeline (`scaletrain "
                            "prepare --config data.toml`) with an encoding-error policy")


def prepare_text(source: str, out_dir: str | Path, *, tokenizer: str = "char", vocab_size: int = 2048,
                 val_fraction: float = 0.1, seed: int = 1337, text_field: str = "text") -> dict:
    """Prepare ``source`` (a file, a folder of .txt, or builtin:NAME) as given - normalised, Gutenberg
    boilerplate removed, no filters, no dedup - into ``out_dir``; returns the manifest. Its messages name the
    training config's settings (data.text_field), which are the ones a person running ``train`` can set."""
    cfg = minimal_config(source, str(out_dir), tokenizer=tokenizer, vocab_size=vocab_size,
                         val_fraction=val_fraction, seed=seed, text_field=text_field)
    return prepare(cfg, Report(text_field_setting="data.text_field"))


def source_fingerprint(source: str, tokenizer: str, vocab_size: int, val_fraction: float, seed: int,
                       text_field: str = "text") -> str:
    """Changes when the input files or the preparation settings change (so caches are not reused wrongly)."""
    return fingerprints(minimal_config(source, "", tokenizer=tokenizer, vocab_size=vocab_size,
                                       val_fraction=val_fraction, seed=seed, text_field=text_field))[1]


def ensure_prepared(source: str, cache_dir: str | Path, **kwargs) -> Path:
    """Use ``source`` if it is already a prepared folder; otherwise prepare it into ``cache_dir`` (once:
    a cache whose fingerprint matches is reused)."""
    if not source.startswith("builtin:") and (Path(source) / MANIFEST).is_file():
        return Path(source)
    prepare_text(source, cache_dir, **kwargs)
    return Path(cache_dir)
