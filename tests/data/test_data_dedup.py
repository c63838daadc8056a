"""Deduplication: exact, and Folio-vs-modern Shakespeare caught as near duplicates while distinct
plays are kept, at the documented threshold (dedup.threshold = 0.2 on word 3-gram shingles)."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import pytest

from scaletrain.data.dedup import NEAR_OFF, Deduplicator, content_hash, signature
from scaletrain.data.prepare_config import DedupConfig

FIXTURES = Path(__file__).parents[1] / "fixtures" / "shakespeare"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "gutenberg-shakespeare"


def _run(texts: dict[str, str], cfg: DedupConfig) -> tuple[list[str], Deduplicator]:
    d = Deduplicator(cfg)
    removed = [name for i, (name, text) in enumerate(texts.items())
               if d.check(i, name, content_hash(text), signature(text, cfg))]
    return removed, d


def test_exact_duplicates():
    cfg = DedupConfig(near=False)
    removed, _ = _run({"a": "same text here", "b": "other text", "c": "same text here"}, cfg)
    assert removed == ["c"]


def test_folio_and_modern_excerpts_are_near_duplicates():
    texts = {p.name: p.read_text() for p in sorted(FIXTURES.glob("*.txt"))}
    removed, d = _run(texts, DedupConfig())
    # sorted order puts "<play>_gut.txt" before "<play>_gut_f.txt": each Folio text goes, nothing else
    assert sorted(removed) == sorted(n for n in texts if n.endswith("_f.txt"))
    for cluster in d.cluster_report():
        assert len(cluster["removed"]) == 1
        assert cluster["removed"][0]["document"].split("_gut")[0] == cluster["kept"].split("_gut")[0]
        assert cluster["removed"][0]["jaccard"] >= 0.2


def test_spelling_folding_is_what_makes_the_pairs_match():
    texts = {p.name: p.read_text() for p in sorted(FIXTURES.glob("hamlet*.txt"))}
    folded = [signature(t, DedupConfig()) for t in texts.values()]
    plain = [signature(t, DedupConfig(fold_spelling=False)) for t in texts.values()]
    assert (folded[0] == folded[1]).mean() > (plain[0] == plain[1]).mean() + 0.1


def test_threshold_is_configurable():
    texts = {p.name: p.read_text() for p in sorted(FIXTURES.glob("*.txt"))}
    removed, _ = _run(texts, DedupConfig(threshold=0.9))
    assert removed == []


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data not present (fresh clone)")
def test_all_shakespeare_folio_modern_pairs():
    """35 Folio texts, each with a modern edition: all 35 removed, no distinct play removed."""
    files = sorted(p for p in SHARED.glob("*.txt") if p.name != "metadata.txt")
    texts = {p.name: p.read_text(encoding="utf-8") for p in files}
    removed, d = _run(texts, DedupConfig())
    assert len(removed) == 35
    assert all(len(c["removed"]) == 1 for c in d.cluster_report())
    for c in d.cluster_report():  # the same play, whatever the spelling of its file name
        kept, gone = c["kept"].split("_gut")[0], c["removed"][0]["document"].split("_gut")[0]
        assert {c["kept"].endswith("_f.txt"), c["removed"][0]["document"].endswith("_f.txt")} == {True, False}
        assert difflib.SequenceMatcher(None, kept, gone).ratio() > 0.6, (kept, gone)
        assert re.findall(r"\d", kept) == re.findall(r"\d", gone), (kept, gone)
    assert all(r["jaccard"] >= 0.3 for c in d.cluster_report() for r in c["removed"])


def test_prepare_without_datasketch_removes_exact_duplicates_and_says_how_to_enable_near(tmp_path, monkeypatch,
                                                                                         capsys):
    """The README's `pip install -e .` has no datasketch: `scaletrain prepare` stopped at once ("dedup.near
    needs the datasketch package"). Now near-dedup is off with one line, and exact duplicates still go."""
    import sys

    from scaletrain.cli import main

    monkeypatch.setitem(sys.modules, "datasketch", None)  # import datasketch -> ImportError
    books = tmp_path / "books"
    books.mkdir()
    play = (Path(__file__).resolve().parents[2] / "src/scaletrain/assets/tinyshakespeare/input.txt").read_text()
    for name in ("a.txt", "b.txt"):  # the same book twice: an exact duplicate
        (books / name).write_text(play[:30000])
    (books / "c.txt").write_text(play[30000:60000])
    assert main(["prepare", str(books), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == NEAR_OFF and out.count("datasketch") == 1
    assert "dedup: exact duplicate" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["documents_in"] == 3 and report["removed"]["dedup"] == {"exact duplicate": {"documents": 1,
                                                                                            "bytes": 30000}}
