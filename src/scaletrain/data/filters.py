"""Quality filters (stage 3): each configurable, each counted under its own reason in the report.

- ``min_chars`` / ``min_words``: too short to teach anything.
- ``max_non_alpha_ratio``: tables, number dumps, encoded junk.
- Gopher repetition (Rae et al. 2021, appendix A): duplicate-line fraction, characters in duplicate
  lines, the most frequent 2/3/4-gram's share of characters, characters inside repeated 5..10-grams.
  They are measured without a book's front matter list (table of contents, list of illustrations; see
  ``front_matter_spans``): its entries come back as the body's chapter headings, which is not repetition.
- ``language``: py3langid (a small pure-Python model) when the option is set.

``check(text, cfg)`` returns the first failing reason or ``None``, with the measured values, so a
test or a person can see why a document went.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache

import numpy as np

from scaletrain.config import ConfigError
from scaletrain.data.ngrams import repeated_ngrams, word_ids, words
from scaletrain.data.prepare_config import FilterConfig

_NOT_LETTER = re.compile(r"[\W\d_]+")
_ASCII_LETTERS = string.ascii_letters.encode()
_ASCII_SPACE = string.whitespace.encode()
LANGUAGE_SAMPLE_CHARS = 20_000  # language id on a prefix: enough for a confident answer, cheap on books

# Front matter (see front_matter_spans). A contents list must end within this leading fraction of the document:
# a "list" that runs on further is the document itself (a poem in short stanzas, spam under a CONTENTS line),
# and skipping it would hide exactly the repetition the filters look for.
FRONT_MATTER_MAX_FRACTION = 0.25
# A heading is short: "CONTENTS", "Contents of Volume I", "List of Illustrations". Longer one-line paragraphs
# that start so are prose ("The contents of the chest which he found..."), except Caxton's long form
# ("The Table or Rubric of the Content of Chapters of the First Book of King Arthur"), which needs both words.
FRONT_HEADING_MAX_WORDS = 8
FRONT_TABLE_HEADING_MAX_WORDS = 20
CONTENTS_ENTRY_MAX_WORDS = 40  # a longer paragraph is prose (the body has begun) unless its lines are entries
CONTENTS_MIN_ENTRIES = 3      # fewer entries after the heading: not a list, measure everything
_WS = r"[^\S\n]"  # a space or tab, never a newline: the heading must be one line of its own
# The heading: a one-line paragraph (a blank line after it, and before it a blank line or the start of the
# text; two patterns, as "\A|" in front makes the scan for the blank line about 4x slower).
_HEADING_LINE = (rf"(?P<line>{_WS}*(?:"
                 rf"(?:the{_WS}+)?(?:table{_WS}+of{_WS}+)?contents\b"
                 rf"|(?:list{_WS}+of{_WS}+(?:the{_WS}+)?)?(?:illustrations|plates|figures|maps|engravings)\b"
                 rf"|(?P<table>(?:here{_WS}+(?:followeth|beginneth){_WS}+)?the{_WS}+table\b[^\n]*"
                 rf"\b(?:contents?|chapters)\b)"
                 rf")[^\n]*)\n{_WS}*\n")
_FRONT_HEADING = re.compile(rf"\n{_WS}*\n{_HEADING_LINE}", re.IGNORECASE)
_FRONT_HEADING_AT_START = re.compile(_HEADING_LINE, re.IGNORECASE)
# The first line of a list entry: "CHAPTER XII. ...", "XII. ...", "12 ...", "ACT I", or a page number or
# "Frontispiece" at its end. Roman numerals are upper case only ("mix." is prose).
_ENTRY_LINE = re.compile(
    r"^\s*(?:(?i:chapter|chap|book|part|act|scene|canto|stave|letter|section|volume|vol)\b|[IVXLC]+\.|\d+\b)"
    r"|(?:[\s.]\d{1,4}|(?i:frontispiece))\s*$")
_CONTINUATION_LINE = re.compile(r"^[ \t]+\S")  # an entry wrapped onto an indented second line
_PARAGRAPH = re.compile(r"[^\n]*\S[^\n]*(?:\n[^\n]*\S[^\n]*)*")  # maximal run of non-blank lines


def non_alpha_ratio(text: str) -> float:
    """Fraction of non-whitespace characters that are not letters."""
    if text.isascii():  # bytes.translate runs at memory speed; the regex below is ~50x slower
        raw = text.encode("ascii")
        visible = len(raw.translate(None, _ASCII_SPACE))
        letters = len(raw) - len(raw.translate(None, _ASCII_LETTERS))
    else:
        visible = len("".join(text.split()))
        letters = len(_NOT_LETTER.sub("", text))
    if visible == 0:
        return 1.0
    return 1.0 - letters / visible


def line_repetition(text: str) -> tuple[float, float]:
    """(fraction of non-empty lines that repeat an earlier line, their share of line characters)."""
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line]
    if not lines:
        return 0.0, 0.0
    counts = Counter(lines)
    dup_lines = sum(c - 1 for c in counts.values())
    dup_chars = sum(len(line) * (c - 1) for line, c in counts.items())
    total_chars = sum(len(line) for line in lines)
    return dup_lines / len(lines), dup_chars / max(total_chars, 1)


def top_ngram_fraction(repeated: dict, lengths: np.ndarray, n: int) -> float:
    """Characters covered by the most frequent n-gram (each occurrence) / all word characters."""
    total = int(lengths.sum())
    if n not in repeated or repeated[n][0].size == 0 or total == 0:
        return 0.0
    pos, count, _ = repeated[n]
    top = int(np.argmax(count))
    start = int(pos[top])
    return float(count[top] * lengths[start:start + n].sum()) / total


def dup_ngram_fraction(repeated: dict, lengths: np.ndarray, n: int) -> float:
    """Characters of words inside any repeated occurrence of an n-gram (overlaps counted once) / all."""
    total = int(lengths.sum())
    if n not in repeated or total == 0:
        return 0.0
    pos, _, is_first = repeated[n]
    starts = pos[~is_first]  # every occurrence after the first is a repeat
    if starts.size == 0:
        return 0.0
    cover = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.add.at(cover, starts, 1)
    np.add.at(cover, starts + n, -1)
    covered = np.cumsum(cover[:-1]) > 0
    return float(lengths[covered].sum()) / total


def _list_entries(paragraph: str) -> int:
    """How many contents/illustrations entries ``paragraph`` holds; 0 means it is prose. A short paragraph
    is one entry; a long one is a list printed without blank lines between its entries when at least two
    thirds of its lines start an entry or continue one (indented)."""
    if len(paragraph.split()) <= CONTENTS_ENTRY_MAX_WORDS:
        return 1
    lines = paragraph.split("\n")
    starts = sum(1 for line in lines if _ENTRY_LINE.search(line))
    continued = sum(1 for line in lines if _CONTINUATION_LINE.match(line) and not _ENTRY_LINE.search(line))
    return starts if starts and 3 * (starts + continued) >= 2 * len(lines) else 0


def front_matter_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of front-matter lists near the start of ``text``: a table of
    contents or a list of illustrations, from its heading to the first prose paragraph after it.

    Why: such a list names every chapter once, and the body names each again as its heading, so to the
    n-gram statistics every heading is a repeat. On Malory's *Le Morte d'Arthur* that lifted the characters
    in repeated 5-grams from 0.128 to 0.153 (limit 0.15) and dropped a real book. The span runs on through
    the short paragraphs that follow the entries (the body's first "BOOK I" / "CHAPTER I" headings) and
    ends where prose starts. A list that has not ended by ``FRONT_MATTER_MAX_FRACTION`` of the text, or
    that has fewer than ``CONTENTS_MIN_ENTRIES`` entries, is not front matter and nothing is skipped.
    """
    limit = int(len(text) * FRONT_MATTER_MAX_FRACTION)
    spans: list[tuple[int, int]] = []
    pos = 0
    # the regex needs a blank line (or the start) before a heading: a prose line saying "contents" never matches
    heading = _FRONT_HEADING_AT_START.match(text, 0, limit) or _FRONT_HEADING.search(text, 0, limit)
    while heading is not None:
        pos = heading.end("line")
        max_words = FRONT_TABLE_HEADING_MAX_WORDS if heading.group("table") else FRONT_HEADING_MAX_WORDS
        if len(heading.group("line").split()) <= max_words:
            entries = 0
            for para in _PARAGRAPH.finditer(text, heading.end(), limit):
                if found := _list_entries(para.group()):
                    entries += found
                    continue
                if entries >= CONTENTS_MIN_ENTRIES:
                    spans.append((heading.start("line"), para.start()))
                pos = para.start()
                break
            else:
                break  # still a list at the limit: the document itself, not its front matter (nor any later one)
        heading = _FRONT_HEADING.search(text, pos, limit)
    return spans


def _without_spans(text: str, spans: list[tuple[int, int]]) -> str:
    pieces, pos = [], 0
    for start, end in spans:
        pieces.append(text[pos:start])
        pos = end
    pieces.append(text[pos:])
    return "".join(pieces)


def _words_outside(text: str, spans: list[tuple[int, int]], n_words: int) -> np.ndarray:
    """Mask over ``words(text)`` (``n_words`` long): True for words outside ``spans``. Spans start and end
    at line starts, so no word straddles a boundary and counting the words of each piece is exact; only
    the text up to the last span is scanned again."""
    keep = np.ones(n_words, dtype=bool)
    done, pos = 0, 0  # words in text[:pos]
    for start, end in spans:
        first = done + len(words(text[pos:start]))
        done, pos = first + len(words(text[start:end])), end
        keep[first:done] = False
    return keep


@lru_cache(maxsize=1)
def _language_identifier():
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError:
        raise ConfigError("filter.language needs the `py3langid` package (pip install py3langid), "
                          "or set filter.language = []") from None
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def detect_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability) of the text's first characters."""
    lang, prob = _language_identifier().classify(text[:LANGUAGE_SAMPLE_CHARS])
    return lang, float(prob)


def needs_words(cfg: FilterConfig) -> bool:
    return bool(cfg.min_words or cfg.max_top_ngram_fraction or cfg.max_dup_ngram_fraction)


def check(text: str, cfg: FilterConfig, tokens: list[str] | None = None) -> tuple[str | None, dict[str, float]]:
    """The first filter ``text`` fails (a reason for the report) or ``None``, plus the measured values.
    ``tokens`` = ``ngrams.words(text)`` when the caller has them already (dedup needs them too)."""
    stats: dict[str, float] = {"chars": len(text)}
    if cfg.min_chars and len(text) < cfg.min_chars:
        return "min_chars", stats
    if cfg.max_non_alpha_ratio < 1:
        stats["non_alpha_ratio"] = non_alpha_ratio(text)
        if stats["non_alpha_ratio"] > cfg.max_non_alpha_ratio:
            return "max_non_alpha_ratio", stats
    measures_lines = cfg.max_dup_line_fraction < 1 or cfg.max_dup_line_char_fraction < 1
    # every repetition statistic below is measured on the body: the front matter's list is not repetition
    spans = front_matter_spans(text) if measures_lines or needs_words(cfg) else []
    body = _without_spans(text, spans) if spans else text
    if spans:
        stats["front_matter_chars"] = len(text) - len(body)
    if measures_lines:
        stats["dup_line_fraction"], stats["dup_line_char_fraction"] = line_repetition(body)
        if stats["dup_line_fraction"] > cfg.max_dup_line_fraction:
            return "max_dup_line_fraction", stats
        if stats["dup_line_char_fraction"] > cfg.max_dup_line_char_fraction:
            return "max_dup_line_char_fraction", stats
    if needs_words(cfg):
        tokens = words(text) if tokens is None else tokens
        stats["words"] = len(tokens)
        if cfg.min_words and len(tokens) < cfg.min_words:
            return "min_words", stats
        ids, vocab = word_ids(tokens)
        lengths = np.array([len(w) for w in vocab], dtype=np.int64)[ids] if vocab else np.zeros(0, np.int64)
        if spans:  # min_words above counts the whole document; the n-gram statistics count the body
            keep = _words_outside(text, spans, len(tokens))
            ids, lengths = ids[keep], lengths[keep]
        max_n = (4 + len(cfg.max_dup_ngram_fraction) if cfg.max_dup_ngram_fraction
                 else 1 + len(cfg.max_top_ngram_fraction))
        repeated = repeated_ngrams(ids, max_n)
        for n, limit in zip((2, 3, 4), cfg.max_top_ngram_fraction):
            stats[f"top_{n}gram_fraction"] = value = top_ngram_fraction(repeated, lengths, n)
            if value > limit:
                return f"max_top_{n}gram_fraction", stats
        for n, limit in zip(range(5, 11), cfg.max_dup_ngram_fraction):
            stats[f"dup_{n}gram_fraction"] = value = dup_ngram_fraction(repeated, lengths, n)
            if value > limit:
                return f"max_dup_{n}gram_fraction", stats
    if cfg.language:
        lang, prob = detect_language(text)
        stats["language_probability"] = prob
        if lang not in cfg.language or prob < cfg.language_min_score:
            return f"language ({lang})", stats
    return None, stats
