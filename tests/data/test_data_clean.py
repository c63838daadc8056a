"""Cleaning and filters: Gutenberg boilerplate in every marker variant, normalisation, Gopher filters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scaletrain.data.clean import clean_text, strip_gutenberg
from scaletrain.data.filters import check, dup_ngram_fraction, line_repetition, non_alpha_ratio, top_ngram_fraction
from scaletrain.data.ngrams import repeated_ngrams, word_ids, words
from scaletrain.data.prepare_config import CleanConfig, FilterConfig

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gutenberg"
SHARED_RAW = Path(__file__).resolve().parents[3] / "shared" / "data" / "gutenberg-raw-sample"
EXPECTED = {k: v for k, v in json.loads((FIXTURES / "expected.json").read_text()).items() if not k.startswith("_")}
BOILERPLATE = re.compile(r"project\s+gutenberg|small\s+print|this file should be named|\*\*\*\s*(start|end)\b"
                         r"|end of (the )?project|full license|gutenberg-tm|\betexts?\b|\bebooks?\b", re.IGNORECASE)


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.split("\n") if line.strip()]


def _check_book(raw: bytes, name: str) -> None:
    cleaned, counts = clean_text(raw.decode("utf-8"), CleanConfig())
    first, last = EXPECTED[name]
    lines = _lines(cleaned)
    assert lines[0] == first
    if last is not None:
        assert lines[-1] == last
    found = [line for line in lines if BOILERPLATE.search(line)]
    assert not found, f"{name}: boilerplate left: {found[:3]}"
    assert "\r" not in cleaned and "\ufeff" not in cleaned


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gutenberg_fixture_excerpts(name):
    _check_book((FIXTURES / name).read_bytes(), name)


@pytest.mark.skipif(not SHARED_RAW.is_dir(), reason="../shared/data not present (fresh clone)")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gutenberg_full_books(name):
    _check_book((SHARED_RAW / name).read_bytes(), name)


def test_file_without_markers_is_unchanged():
    raw = (FIXTURES / "The-Call-of-Cthulhu.txt").read_text(encoding="utf-8")
    cleaned, counts = clean_text(raw, CleanConfig())
    assert cleaned == raw and counts == {}


# An old (1990s) etext: the SMALL PRINT block is the header, there is no START line. As in real files,
# the work is much longer than the legal block (the cleaner looks for header markers in the first half).
OLD_ETEXT = """**The Project Gutenberg Etext of The Example, by Nobody**
Please take a look at the important information in this header.
**Welcome To The World of Free Plain Vanilla Electronic Texts**
***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***
Why is this "Small Print!" statement here?  You know: lawyers.
*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*

THE EXAMPLE

Chapter 1. It was a dark night.
""" + "The night went on, as nights do.\n" * 40 + """It ended well.

End of Project Gutenberg Etext of The Example, by Nobody
"""
NO_STARS = """The Project Gutenberg EBook of Thing
*** START OF THE PROJECT GUTENBERG EBOOK, THING ***

Produced by Somebody

First line of Thing.
Last line of Thing.

END OF THE PROJECT GUTENBERG EBOOK THING
license text
"""
ONLY_FOOTER = "Body one.\n" * 30 + "Last body line.\n\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nlicense\n"


@pytest.mark.parametrize("raw, first, last", [
    (OLD_ETEXT, "THE EXAMPLE", "It ended well."),
    (NO_STARS, "First line of Thing.", "Last line of Thing."),
    (ONLY_FOOTER, "Body one.", "Last body line."),
])
def test_other_marker_variants(raw, first, last):
    cleaned, header, footer = strip_gutenberg(raw)
    lines = _lines(cleaned)
    assert (lines[0], lines[-1]) == (first, last)
    assert footer and not any(BOILERPLATE.search(line) for line in lines)


def test_normalisation_bom_newlines_nfc_controls():
    raw = "\ufeffcafe\u0301\r\nline two\rline\x00 three\x0c\x91quoted\x92"
    cleaned, counts = clean_text(raw, CleanConfig())
    assert cleaned == "caf\u00e9\nline two\nline three\u2018quoted\u2019"
    assert counts["bom_removed"] == 1 and counts["nfc_normalized"] == 1
    assert counts["control_chars_removed"] == 2 and counts["cp1252_c1_chars_mapped"] == 2


# -- filters ------------------------------------------------------------------------------------------

def test_ngram_statistics_on_known_inputs():
    tokens = words("a b c d e a b c d e")
    ids, vocab = word_ids(tokens)
    lengths = [1] * len(tokens)
    import numpy as np

    lengths = np.array(lengths)
    rep = repeated_ngrams(ids, 10)
    assert dup_ngram_fraction(rep, lengths, 5) == 0.5          # the second "a b c d e" repeats the first
    assert top_ngram_fraction(rep, lengths, 2) == pytest.approx(0.4)  # "a b" twice, 2 chars each, of 10
    assert dup_ngram_fraction(rep, lengths, 6) == 0.0
    assert line_repetition("x\ny\nx\nx\n") == (0.5, 0.5)
    assert non_alpha_ratio("ab 12") == 0.5


def test_filters_catch_junk_and_keep_books():
    cfg = FilterConfig()
    book = (FIXTURES / "pg844.txt").read_text(encoding="utf-8")
    assert check(clean_text(book, CleanConfig())[0], cfg)[0] is None
    assert check("too short", cfg)[0] == "min_chars"
    assert check("1234 5678 9012 %%%% ---- " * 20, cfg)[0] == "max_non_alpha_ratio"
    assert check("buy cheap pills now\n" * 40, cfg)[0] == "max_dup_line_fraction"
    spam = " ".join(f"word{i} click here to subscribe today" for i in range(60))
    assert check(spam, cfg)[0].startswith("max_top_") or check(spam, cfg)[0].startswith("max_dup_")
    off = FilterConfig(min_chars=0, max_non_alpha_ratio=1, max_dup_line_fraction=1, max_dup_line_char_fraction=1,
                       max_top_ngram_fraction=[], max_dup_ngram_fraction=[])
    assert check("buy cheap pills now\n" * 40, off)[0] is None


def test_language_filter():
    pytest.importorskip("py3langid")
    cfg = FilterConfig(language=["en"])
    french = clean_text((FIXTURES / "Candide.txt").read_text(encoding="utf-8"), CleanConfig())[0]
    english = clean_text((FIXTURES / "1952-0.txt").read_text(encoding="utf-8"), CleanConfig())[0]
    assert check(french, cfg)[0] == "language (fr)"
    assert check(english, cfg)[0] is None
