"""Sources: turn files, folders and datasets into a stream of ``Document``s (stage 1).

Supported: folders (recursive, include/exclude globs), plain text, ``.jsonl``/``.json`` (a text field),
``.parquet`` and ``.arrow`` (a text column, read batch by batch), any of them compressed with
``.gz``/``.zst``/``.xz``/``.bz2``, a folder saved with ``datasets.save_to_disk`` (read with pyarrow, no
``datasets`` needed) and ``hf:NAME`` through ``datasets.load_dataset(..., streaming=True)``.

Everything streams: a file is read line by line or batch by batch, and a plain-text file larger than
``max_document_mb`` is cut at blank lines into several documents, so memory is bounded by one document,
not by the corpus. Every file that yields nothing (unreadable, binary, empty, a bad JSON line) is counted
in the report with a message naming the file and line; ``encoding_errors='fail'`` and a missing path are
the only hard errors.
"""

from __future__ import annotations

import bz2
import codecs
import fnmatch
import gzip
import io
import json
import lzma
import os
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse

from scaletrain.data.layouts import fields_seen, instruction_layout
from scaletrain.data.prepare_config import SourceConfig
from scaletrain.data.report import Report
from scaletrain.data.tokenizer import DataError

# wikitext2: the validation split of WikiText-2 (trains configs/wikitext_zero.toml), wikitext2-test its test split
BUILTIN = {"tinyshakespeare": "assets/tinyshakespeare/input.txt", "wikitext2": "assets/wikitext-2/valid.txt",
           "wikitext2-test": "assets/wikitext-2/test.txt",
           # the names WikiText is usually written with (``eval --text builtin:wikitext-2``): the same files
           "wikitext-2": "assets/wikitext-2/valid.txt", "wikitext-2-test": "assets/wikitext-2/test.txt"}
COMPRESSED = {".gz", ".zst", ".xz", ".bz2"}
BINARY_MAGIC = (b"\x89PNG", b"%PDF", b"PK\x03\x04", b"\x7fELF", b"GIF8", b"\xff\xd8\xff", b"PAR1")


@dataclass
class Document:
    """One unit of text: the cleaning, filtering and dedup stages keep or drop it whole."""

    text: str
    source: str        # where it came from: "path", "path:LINE", "path#partK", "hf:name[i]"
    n_bytes: int       # raw UTF-8 size as read (the report's "bytes in")


# -- paths ------------------------------------------------------------------------------------------

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


def _base_suffix(path: Path) -> tuple[str, str]:
    """(format suffix, compression suffix): ``a.jsonl.zst`` -> ('.jsonl', '.zst')."""
    suffixes = [s.lower() for s in path.suffixes]
    comp = suffixes[-1] if suffixes and suffixes[-1] in COMPRESSED else ""
    rest = suffixes[:-1] if comp else suffixes
    return (rest[-1] if rest else ""), comp


def _name_without_compression(path: Path) -> str:
    _, comp = _base_suffix(path)
    return path.name[: -len(comp)] if comp else path.name


def is_saved_hf_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def list_files(folder: Path, include: list[str], exclude: list[str],
               skipped: list[tuple[Path, str]] | None = None) -> list[Path]:
    """Files under ``folder`` (recursive, sorted, so the order is the same on every machine). Files left
    out by the globs go to ``skipped`` as (path, "not included" | "excluded"), for the report."""
    out = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or any(part.startswith(".") for part in p.relative_to(folder).parts):
            continue  # hidden files and folders (.git, .cache) are never corpus
        name = _name_without_compression(p)
        rel = str(p.relative_to(folder))
        if include and not any(fnmatch.fnmatch(name, pat) for pat in include):
            reason = "not included"
        elif any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(p.name, pat) for pat in exclude):
            reason = "excluded"
        else:
            out.append(p)
            continue
        if skipped is not None:
            skipped.append((p, reason))
    return out


def expand_sources(cfg: SourceConfig, skipped: list[tuple[Path, str]] | None = None) -> list[str | Path]:
    """Every input as a file path, a saved-dataset folder, or an ``hf:NAME`` string (files the globs
    leave out go to ``skipped``)."""
    items: list[str | Path] = []
    for raw in cfg.paths:
        if raw.startswith("hf:"):
            items.append(raw)
            continue
        path = resolve_source(raw)
        if is_saved_hf_dataset(path):
            items.append(path)
        elif path.is_dir():
            files = list_files(path, cfg.include, cfg.exclude, skipped)
            if not files:
                raise DataError(f"{path}: no files match source.include {cfg.include}")
            items.extend(files)
        else:
            items.append(path)
    return items


def fingerprint_items(cfg: SourceConfig) -> list[str]:
    """What identifies the input: each file's path, size and mtime (or the dataset name)."""
    out = []
    for item in expand_sources(cfg):
        if isinstance(item, str):
            out.append(f"{item}|{cfg.hf_config}|{cfg.hf_split}")
        else:
            files = sorted(item.rglob("*")) if item.is_dir() else [item]
            for f in files:
                if f.is_file():
                    st = f.stat()
                    out.append(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    return out


def input_bytes(cfg: SourceConfig) -> int:
    """Total size of the input files on disk (compressed size for compressed files); an ``hf:NAME``
    source counts as large, since its size is unknown before it is read."""
    total = 0
    for item in expand_sources(cfg):
        if isinstance(item, str):
            return 1 << 62
        files = item.rglob("*") if item.is_dir() else [item]
        total += sum(f.stat().st_size for f in files if f.is_file())
    return total


# -- opening and decoding ---------------------------------------------------------------------------

def open_binary(path: Path) -> BinaryIO:
    """Open a file for reading bytes, decompressing by suffix."""
    _, comp = _base_suffix(path)
    if comp == ".gz":
        return gzip.open(path, "rb")
    if comp == ".xz":
        return lzma.open(path, "rb")
    if comp == ".bz2":
        return bz2.open(path, "rb")
    if comp == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst files needs `zstandard` (pip install 'scaletrain[data]')") from None

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def looks_binary(head: bytes) -> bool:
    """NUL bytes or a known binary file signature in the first bytes: not text."""
    return b"\x00" in head[:8192] or head.startswith(BINARY_MAGIC)


def utf16_variant(head: bytes) -> str | None:
    """The UTF-16 encoding of a file from its first bytes, as iconv names it, else None: 'UTF-16' after a byte
    order mark (iconv reads it), else 'UTF-16LE' / 'UTF-16BE' when every other byte is NUL (text in Latin
    letters; Windows' "Unicode" saves LE), which is what makes such a file look binary."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) and not head.startswith(b"\xff\xfe\x00\x00"):
        return "UTF-16"
    sample = head[:8192]
    pairs = len(sample) // 2
    if pairs < 2:
        return None
    even, odd = sample[0:2 * pairs:2], sample[1:2 * pairs:2]
    if odd.count(0) >= 0.9 * pairs and even.count(0) == 0:
        return "UTF-16LE"
    if even.count(0) >= 0.9 * pairs and odd.count(0) == 0:
        return "UTF-16BE"
    return None


def _convert_command(encoding: str, path: str | Path) -> str:
    """The iconv command that writes a UTF-8 copy of ``path`` beside it."""
    name = Path(path)
    return f"iconv -f {encoding} -t UTF-8 {name} > {name.with_name(name.stem + '-utf8' + name.suffix)}"


def not_text_reason(head: bytes, path: str | Path) -> str | None:
    """Why a file is not UTF-8 text, judged from its first bytes (one phrase for a message naming it): UTF-16,
    with the command that converts it, or binary; None when it may be text."""
    variant = utf16_variant(head)
    if variant:
        return f"{variant} text, not UTF-8; convert it: {_convert_command(variant, path)}"
    if looks_binary(head):
        return "looks binary (NUL bytes or a binary signature), not text"
    return None


_HIGH_BYTES = bytes(range(0x80, 0x100))


def legacy_encoding_note(raw: bytes, path: str | Path | None = None) -> str:
    """For bytes that are not UTF-8: "; it reads as Windows-1252 (Latin-1) text: convert it: iconv ..." when
    they decode as Windows-1252 (a superset of Latin-1's letters: what Windows editors and old European text
    save) with few bytes above 127, as text in a Latin alphabet has; else "". A guess, said as one."""
    try:
        raw.decode("cp1252")
    except UnicodeDecodeError:  # bytes cp1252 leaves undefined (0x81, 0x8d, 0x8f, 0x90, 0x9d): not that either
        return ""
    high = len(raw) - len(raw.translate(None, _HIGH_BYTES))
    if not raw or high > 0.3 * len(raw):
        return ""
    how = _convert_command("CP1252", path) if path is not None else "iconv -f CP1252 -t UTF-8"
    return f"; it reads as Windows-1252 (Latin-1) text: convert it: {how}"


def decode_text_file(raw: bytes, path: str | Path, hint: str) -> str:
    """A whole file's bytes as text: UTF-8 (a BOM dropped), CRLF / CR -> LF. UTF-16, binary or otherwise
    undecodable bytes are one DataError naming the file (``hint``: what to do about bytes that are not UTF-8)."""
    reason = not_text_reason(raw[:8192], path)
    if reason:
        raise DataError(f"{path}: {reason}")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 at byte {exc.start}{legacy_encoding_note(raw, path)}; {hint}") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def decode(raw: bytes, where: str, policy: str, report: Report) -> str | None:
    """UTF-8 decode under the ``encoding_errors`` policy; ``None`` means skip this document."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        where_line = f"{where}:{line}" if ":" not in where.rsplit("/", 1)[-1] else where
        file = re.sub(r"(#part\d+)?(:\d+)?$", "", where)  # the file, for the command that converts it
        bad = f"{where_line}: not valid UTF-8 at byte {exc.start}{legacy_encoding_note(raw, file)}"
        if policy == "fail":
            raise DataError(f"{bad}; fix the file or set source.encoding_errors = 'replace' or 'skip'") from None
        if policy == "skip":
            report.issue("not_utf8_skipped", f"{bad}; document skipped")
            report.remove("source", "not UTF-8", len(raw), where_line)
            return None
        text = raw.decode("utf-8", errors="replace")
        replaced = text.count("\ufffd") - raw.count("\ufffd".encode())
        report.issue("not_utf8_replaced", f"{bad}; {replaced} invalid byte sequence(s) replaced with U+FFFD")
        report.modify("utf8_sequences_replaced", replaced)
        return text


def _skip_file(path: Path, kind: str, message: str, n_bytes: int, report: Report) -> None:
    report.document_in(n_bytes)
    report.issue(kind, f"{path}: {message}")
    report.remove("source", kind.replace("_", " "), n_bytes, str(path))


def _skipped_as_not_text(head: bytes, path: Path, report: Report) -> bool:
    """Whether a file is UTF-16 or binary by its first bytes (``not_text_reason``); then it is counted, named as
    such, and skipped."""
    reason = not_text_reason(head, path)
    if reason:
        kind = "utf16_file" if utf16_variant(head) else "binary_file"
        _skip_file(path, kind, f"{reason}; skipped", len(head), report)
    return reason is not None


# -- readers ----------------------------------------------------------------------------------------

def read_text(path: Path, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    """One document per file; a file over ``max_document_mb`` becomes several, cut at blank lines."""
    limit = int(cfg.max_document_mb * 1e6)
    with open_binary(path) as fh:
        buf = fh.read(limit + 1)
        if _skipped_as_not_text(buf, path, report):
            return
        part = 0
        while True:
            more = len(buf) > limit
            if more:
                cut = _cut_point(buf, limit)
                piece, buf = buf[:cut], buf[cut:]
            else:
                piece = buf
            name = f"{path}#part{part}" if (more or part) else str(path)
            yield from _text_document(piece, name, cfg, report)
            if not more:
                return
            part += 1
            buf += fh.read(limit + 1 - len(buf))


def _cut_point(buf: bytes, limit: int) -> int:
    """Cut at the last blank line (else newline, else a UTF-8 character boundary) before ``limit``."""
    for sep in (b"\n\n", b"\n"):
        i = buf.rfind(sep, 0, limit)
        if i > 0:
            return i + len(sep)
    i = limit
    while i > 0 and (buf[i] & 0xC0) == 0x80:  # never split inside a multi-byte character
        i -= 1
    return i or limit


def _text_document(raw: bytes, name: str, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    if not raw.strip():
        _skip_file(Path(name), "empty_file", "empty (or only whitespace); skipped", len(raw), report)
        return
    text = decode(raw, name, cfg.encoding_errors, report)
    report.document_in(len(raw))
    if text is not None:
        yield Document(text, name, len(raw))


def _record_text(record: object, where: str, field: str, report: Report, n_bytes: int,
                 file: Path | None = None) -> str | None:
    """The text of one record, or None (counted, with a message naming ``where``, the fields it has, and for an
    instruction line of a ``file`` the flag that reads it as one)."""
    if not isinstance(record, dict) or field not in record:
        layout = instruction_layout(record) if file is not None else None
        seen = fields_seen(record) + (f": instruction data in the {layout} layout, which "
                                      f"finetune.instructions={file} reads" if layout else "")
        report.issue("missing_text_field", f"{where}: no {field!r} field ({seen}); record skipped (to read "
                                           f"another field as the text, set {report.text_field_setting})")
        report.remove("source", "missing text field", n_bytes, where)
        return None
    value = record[field]
    if not isinstance(value, str):
        report.issue("missing_text_field", f"{where}: field {field!r} is {type(value).__name__}, not text; skipped")
        report.remove("source", "missing text field", n_bytes, where)
        return None
    return value


def read_jsonl(path: Path, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    """One document per line's ``text_field``; a bad line is counted and named (file:line), not fatal. A
    UTF-16 or binary file is skipped whole, named as such (its lines would each read as bad JSON)."""
    with open_binary(path) as fh:
        if _skipped_as_not_text(fh.read(8192), path, report):
            return
    with open_binary(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            report.document_in(len(raw))
            line = decode(raw, where, cfg.encoding_errors, report)
            if line is None:
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                report.issue("bad_json_line",
                             f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); line skipped")
                report.remove("source", "bad JSON line", len(raw), where)
                continue
            text = _record_text(record, where, cfg.text_field, report, len(raw), path)
            if text is not None:
                yield Document(text, where, len(text.encode("utf-8")))


JSON_CHUNK = 1 << 20  # bytes read at a time when streaming a JSON array


def _json_array_elements(fh: BinaryIO, limit: int) -> Iterator[object]:
    """The elements of the top-level JSON array in ``fh``, one at a time: the standard library's
    ``JSONDecoder.raw_decode`` over a buffer refilled in ``JSON_CHUNK`` pieces, so memory holds one
    element plus a chunk, never the file. An element larger than ``limit`` bytes (or text that is not
    JSON, which looks the same until the end) raises ValueError."""
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    buf, pos, eof = "", 0, False

    def fill() -> None:
        nonlocal buf, pos, eof
        data = fh.read(JSON_CHUNK)
        eof = not data
        buf, pos = buf[pos:] + utf8.decode(data, final=eof), 0
        if len(buf) > limit:
            raise ValueError(f"not valid JSON, or an element over {limit / 1e6:g} MB (source.max_document_mb)")

    def next_char() -> str:  # the next non-blank character ("" at the end), not consumed
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or eof:
                return buf[pos:pos + 1]
            fill()

    fill()
    if next_char() != "[":
        raise ValueError("not a JSON array")
    pos += 1
    if next_char() == "]":
        return
    while True:
        try:
            value, end = decoder.raw_decode(buf, pos)
            if end == len(buf) and not eof:
                raise ValueError("may continue")  # e.g. a number cut by the chunk boundary
        except ValueError:
            if eof:
                raise
            fill()
            continue
        yield value
        pos = end
        sep = next_char()
        if sep == "]":
            return
        if sep != ",":
            raise ValueError(f"expected ',' or ']', found {sep or 'the end of the file'!r}")
        pos += 1
        next_char()


def read_json(path: Path, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    """A ``.json`` file. A top-level array of records streams (one record in memory at a time); an
    object with one list of records, or a single record, is loaded whole, so such a file must not
    exceed ``max_document_mb`` (a clear message otherwise: use an array or ``.jsonl``). JSON Lines
    saved as ``.json`` is read as JSONL."""
    limit = int(cfg.max_document_mb * 1e6)
    with open_binary(path) as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        yield from _read_json_array(path, cfg, report, limit)
        return
    with open_binary(path) as fh:
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        _skip_file(path, "bad_json_file", f"a JSON object over {limit / 1e6:g} MB (source.max_document_mb) is "
                   "not streamed; store the records as a top-level array or as .jsonl; skipped", len(raw), report)
        return
    try:
        data = json.loads(raw.decode("utf-8-sig", errors="replace"))
    except ValueError as exc:
        if "Extra data" in str(exc):
            yield from read_jsonl(path, cfg, report)
            return
        _skip_file(path, "bad_json_file", f"not valid JSON ({exc}); skipped", len(raw), report)
        return
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else [data]
    if not isinstance(data, list):
        _skip_file(path, "bad_json_file", "holds neither records nor a list of records; skipped", len(raw), report)
        return
    for i, record in enumerate(data):
        yield from _json_record(record, f"{path}[{i}]", cfg, report)


def _read_json_array(path: Path, cfg: SourceConfig, report: Report, limit: int) -> Iterator[Document]:
    index = 0  # of the element being read, for the message
    with open_binary(path) as fh:
        try:
            for record in _json_array_elements(fh, limit):
                yield from _json_record(record, f"{path}[{index}]", cfg, report)
                index += 1
        except ValueError as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            report.issue("bad_json_file", f"{path}[{index}]: {msg}; this element and the rest of the file skipped")


def _json_record(record: object, where: str, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    n = len(json.dumps(record, ensure_ascii=False).encode()) if not isinstance(record, dict) else \
        len(str(record.get(cfg.text_field, "")).encode())
    report.document_in(n)
    text = _record_text(record, where, cfg.text_field, report, n)
    if text is not None:
        yield Document(text, where, len(text.encode("utf-8")))


def _iter_record_batches(batches, where: str, field: str, report: Report) -> Iterator[Document]:
    row = 0
    for batch in batches:
        if field not in batch.schema.names:
            report.issue("missing_text_field", f"{where}: no column {field!r} (have: {', '.join(batch.schema.names)}); "
                                               f"file skipped (set {report.text_field_setting})")
            return
        for value in batch.column(field).to_pylist():
            n = len(value.encode("utf-8")) if isinstance(value, str) else 0
            report.document_in(n)
            if not isinstance(value, str):
                report.issue("missing_text_field", f"{where}[{row}]: {field!r} is {type(value).__name__}; skipped")
                report.remove("source", "missing text field", n, f"{where}[{row}]")
            else:
                yield Document(value, f"{where}[{row}]", n)
            row += 1


def _pyarrow(path: Path, what: str):
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading {what} files needs `pyarrow` (pip install 'scaletrain[data]')") from None
    return pq if what == "parquet" else pa


def read_parquet(path: Path, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    """Stream a parquet file's text column, 1024 rows at a time."""
    pq = _pyarrow(path, "parquet")

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        _skip_file(path, "unreadable_file", f"not a readable parquet file ({exc}); skipped", path.stat().st_size,
                   report)
        return
    if cfg.text_field not in pf.schema_arrow.names:
        _skip_file(path, "missing_text_field",
                   f"no column {cfg.text_field!r} (have: {', '.join(pf.schema_arrow.names)}); "
                   f"file skipped (set {report.text_field_setting})", path.stat().st_size, report)
        return
    yield from _iter_record_batches(pf.iter_batches(batch_size=1024, columns=[cfg.text_field]), str(path),
                                    cfg.text_field, report)


def read_arrow(path: Path, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    """An Arrow IPC file (stream format, as ``datasets.save_to_disk`` writes, or file format)."""
    pa = _pyarrow(path, "arrow")

    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        try:
            f = pa.ipc.open_file(pa.memory_map(str(path)))
            reader = (f.get_batch(i) for i in range(f.num_record_batches))
        except pa.ArrowInvalid as exc:
            _skip_file(path, "unreadable_file", f"not an Arrow file ({exc}); skipped", path.stat().st_size, report)
            return
    yield from _iter_record_batches(reader, str(path), cfg.text_field, report)


def read_saved_dataset(path: Path, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    """A folder written by ``Dataset.save_to_disk`` (or a ``DatasetDict``: ``source.hf_split`` picks)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if cfg.hf_split not in splits:
            raise DataError(f"{path}: no split {cfg.hf_split!r} (have: {', '.join(splits)}); set source.hf_split")
        path = path / cfg.hf_split
    state = json.loads((path / "state.json").read_text())
    for entry in state.get("_data_files", []):
        yield from read_arrow(path / entry["filename"], cfg, report)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the hub (HF_ENDPOINT, default huggingface.co) within ``timeout`` seconds?
    Never probed when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set to 1 (False then). The probe runs in a daemon
    thread because the socket timeout does not bound the DNS lookup before it, which can hang for long
    on a machine whose resolver is cut off."""
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True, name="scaletrain-hub-probe")
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def read_hf(name: str, cfg: SourceConfig, report: Report) -> Iterator[Document]:
    """``hf:NAME`` via ``datasets.load_dataset(streaming=True)``. Offline never hangs: unless
    HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is already set, a 3 s probe decides, and when the hub is
    unreachable the offline mode is switched on so only the local cache is used."""
    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    if not offline and not hub_reachable():
        os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
        offline = True
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")
    try:
        import datasets
    except ImportError:
        raise DataError(f"hf:{name}: the `datasets` package is not installed (pip install datasets), or save the "
                        "dataset to disk / parquet and give that path") from None
    if offline:
        datasets.config.HF_DATASETS_OFFLINE = True  # the env var is read at import; set both
    try:
        ds = datasets.load_dataset(name, cfg.hf_config or None, split=cfg.hf_split, streaming=not offline)
    except Exception as exc:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        mode = "offline (no network; only the local cache is searched)" if offline else "online"
        raise DataError(f"hf:{name}: cannot load ({mode}): "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    for i, record in enumerate(ds):
        where = f"hf:{name}[{i}]"
        text = record.get(cfg.text_field) if isinstance(record, dict) else None
        n = len(text.encode("utf-8")) if isinstance(text, str) else 0
        report.document_in(n)
        text = _record_text(record, where, cfg.text_field, report, n)
        if text is not None:
            yield Document(text, where, n)


READERS = {".jsonl": read_jsonl, ".ndjson": read_jsonl, ".json": read_json, ".parquet": read_parquet,
           ".arrow": read_arrow}


def iter_documents(cfg: SourceConfig, report: Report) -> Iterator[Document]:
    """Every document of every source, in a deterministic order. Files in a folder that the
    include/exclude globs leave out are counted in the report (``skipped``), not read."""
    skipped: list[tuple[Path, str]] = []
    items = expand_sources(cfg, skipped)
    for path, reason in skipped:
        report.skip_file(f"{reason} (source.{'include' if reason == 'not included' else 'exclude'})",
                         path.stat().st_size, str(path))
    for item in items:
        if isinstance(item, str):
            yield from read_hf(item[3:], cfg, report)
        elif item.is_dir():
            yield from read_saved_dataset(item, cfg, report)
        else:
            fmt, comp = _base_suffix(item)
            if fmt == ".parquet" and comp:
                _skip_file(item, "unreadable_file", "compressed parquet is not supported (parquet compresses "
                                                    "internally); skipped", item.stat().st_size, report)
                continue
            try:
                yield from READERS.get(fmt, read_text)(item, cfg, report)
            except (OSError, EOFError, lzma.LZMAError) as exc:
                # unreadable, a truncated .gz, a corrupt .zst: name it, count it, go on with the rest
                _skip_file(item, "unreadable_file", f"cannot be read ({type(exc).__name__}: {exc}); skipped", 0, report)
            except Exception as exc:
                if type(exc).__module__.startswith("zstandard"):
                    _skip_file(item, "unreadable_file", f"cannot be decompressed ({exc}); skipped", 0, report)
                else:
                    raise
