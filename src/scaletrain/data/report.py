"""The prepare report: what came in, what each stage removed and why, what went out, how fast.

Every stage writes into one ``Report``: counters of documents/bytes removed per (stage, reason), and
*issues* (a bad file, a JSONL line that is not JSON, replaced bytes, ...) as one-line messages naming the
file and line. Nothing is dropped without a counter; the messages kept per kind are capped so a corpus
with a million bad lines cannot exhaust memory, but the counts stay exact.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

MAX_MESSAGES_PER_KIND = 200  # bounded memory; counts stay exact beyond this


@dataclass
class Report:
    """Counters for one ``prepare`` run; ``to_dict()`` is what report.json holds."""

    documents_in: int = 0
    bytes_in: int = 0
    removed: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(lambda: [0, 0])))
    modified: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    issues: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    removed_examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    skipped: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    clusters: list[dict] = field(default_factory=list)
    splits: dict[str, dict] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    echo: bool = False  # print each issue as it happens (the CLI turns this on)
    # the setting a message about the text field names: the trainer's on-the-fly preparation reads data.text_field
    text_field_setting: str = "source.text_field"

    # -- recording ---------------------------------------------------------------------------------
    def document_in(self, n_bytes: int) -> None:
        self.documents_in += 1
        self.bytes_in += n_bytes

    def remove(self, stage: str, reason: str, n_bytes: int, name: str | None = None) -> None:
        """A document was dropped by ``stage`` for ``reason`` (e.g. filter / min_chars); ``name`` (its
        source) is kept for the first documents of each reason, so report.json says which ones."""
        slot = self.removed[stage][reason]
        slot[0] += 1
        slot[1] += n_bytes
        examples = self.removed_examples[f"{stage}: {reason}"]
        if name is not None and len(examples) < MAX_MESSAGES_PER_KIND:
            examples.append(name)

    def skip_file(self, reason: str, n_bytes: int, name: str) -> None:
        """A file was not read at all (the include/exclude globs left it out); counted, not an input
        document, so it is in neither ``documents_in`` nor ``bytes_in``."""
        slot = self.skipped[reason]
        slot[0] += 1
        slot[1] += n_bytes
        examples = self.removed_examples[f"skipped: {reason}"]
        if len(examples) < MAX_MESSAGES_PER_KIND:
            examples.append(name)

    def modify(self, what: str, count: int = 1) -> None:
        """A document was changed but kept (boilerplate stripped, bytes replaced, ...)."""
        self.modified[what] += count

    def issue(self, kind: str, message: str) -> None:
        """A problem with the input, counted under ``kind``; ``message`` names the file (and line)."""
        self.issues[kind] += 1
        if len(self.messages[kind]) < MAX_MESSAGES_PER_KIND:
            self.messages[kind].append(message)
        if self.echo and self.issues[kind] <= 5:
            print(f"warning: {message}"
                  + (" (further ones are counted, see report.json)" if self.issues[kind] == 5 else ""))

    def first_message(self, kind: str) -> str | None:
        """The first message counted under ``kind`` (it names the file and line), if any."""
        messages = self.messages.get(kind)
        return messages[0] if messages else None

    def removals(self) -> list[tuple[str, str, int]]:
        """(stage, reason, documents) of every removal, the largest first."""
        rows = [(stage, reason, v[0]) for stage, reasons in self.removed.items() for reason, v in reasons.items()]
        return sorted(rows, key=lambda row: -row[2])

    def removed_total(self) -> tuple[int, int]:
        docs = sum(v[0] for reasons in self.removed.values() for v in reasons.values())
        n_bytes = sum(v[1] for reasons in self.removed.values() for v in reasons.values())
        return docs, n_bytes

    # -- saving the pass-1 counters with its output, for a resumed run -------------------------------
    def counters(self) -> dict:
        """What pass 1 counted, JSON-able (``restore`` puts it back)."""
        return {"documents_in": self.documents_in, "bytes_in": self.bytes_in,
                "removed": {st: {r: list(v) for r, v in rs.items()} for st, rs in self.removed.items()},
                "modified": dict(self.modified), "issues": dict(self.issues),
                "skipped": {k: list(v) for k, v in self.skipped.items()},
                "messages": {k: list(v) for k, v in self.messages.items()}, "clusters": self.clusters,
                "removed_examples": {k: list(v) for k, v in self.removed_examples.items()}}

    def restore(self, saved: dict) -> None:
        self.documents_in, self.bytes_in = saved["documents_in"], saved["bytes_in"]
        for stage, reasons in saved["removed"].items():
            for reason, v in reasons.items():
                self.removed[stage][reason] = list(v)
        self.modified.update(saved["modified"])
        self.issues.update(saved["issues"])
        for k, v in saved["messages"].items():
            self.messages[k] = list(v)
        for reason, v in saved.get("skipped", {}).items():
            self.skipped[reason] = list(v)
        self.clusters = list(saved["clusters"])
        for k, v in saved.get("removed_examples", {}).items():
            self.removed_examples[k] = list(v)

    # -- output ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        seconds = time.perf_counter() - self.started
        tokens = sum(s.get("tokens", 0) for s in self.splits.values())
        kept_bytes = sum(s.get("bytes", 0) for s in self.splits.values())
        return {
            "documents_in": self.documents_in,
            "bytes_in": self.bytes_in,
            "removed": {stage: {r: {"documents": v[0], "bytes": v[1]} for r, v in reasons.items()}
                        for stage, reasons in self.removed.items()},
            "skipped_files": {r: {"files": v[0], "bytes": v[1]} for r, v in self.skipped.items()},
            "modified": dict(self.modified),
            "issues": dict(self.issues),
            "messages": {k: v for k, v in self.messages.items()},
            "removed_documents": {k: v for k, v in self.removed_examples.items() if v},
            "near_duplicate_clusters": self.clusters,
            "splits": self.splits,
            "tokens_out": tokens,
            "bytes_per_token": round(kept_bytes / tokens, 4) if tokens else None,
            "seconds": round(seconds, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "mb_per_second": round(self.bytes_in / 1e6 / seconds, 3) if seconds > 0 else None,
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False))

    def table(self) -> str:
        """A plain-text table (readable in logs and CI output, no terminal tricks)."""
        d = self.to_dict()
        rows: list[tuple[str, str, str]] = [("input", f"{d['documents_in']:,}", _mb(d["bytes_in"]))]
        for stage, reasons in d["removed"].items():
            for reason, v in reasons.items():
                rows.append((f"  - {stage}: {reason}", f"-{v['documents']:,}", f"-{_mb(v['bytes'])}"))
        for split, s in d["splits"].items():
            rows.append((f"{split} (out)", f"{s.get('documents', 0):,}",
                         f"{_mb(s.get('bytes', 0))}, {s.get('tokens', 0):,} tokens"))
        width = max(len(r[0]) for r in rows)
        lines = [f"{'stage':<{width}}  {'documents':>10}  bytes / tokens", "-" * (width + 40)]
        lines += [f"{a:<{width}}  {b:>10}  {c}" for a, b, c in rows]
        lines.append("-" * (width + 40))
        for reason, v in d["skipped_files"].items():
            lines.append(f"skipped, {reason}: {v['files']:,} files, {_mb(v['bytes'])} (not read; names in report.json)")
        if d["modified"]:
            lines.append("modified (kept): " + ", ".join(f"{k} {v:,}" for k, v in d["modified"].items()))
        if d["issues"]:
            lines.append("input issues: " + ", ".join(f"{k} {v:,}" for k, v in d["issues"].items()))
        if d["near_duplicate_clusters"]:
            lines.append(f"near-duplicate clusters: {len(d['near_duplicate_clusters'])} (listed in report.json)")
        bpt = d["bytes_per_token"]
        lines.append(f"bytes/token {bpt if bpt is not None else '-'}   time {d['seconds']:.2f} s   "
                     f"throughput {d['mb_per_second'] or 0:.2f} MB/s of raw input")
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"
