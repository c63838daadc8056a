"""Quality filters (stage 3): each configurable, each counted under its own reason in the report.

- ``min_chars`` / ``min_words``: too short to teach anything.
- ``max_non_alpha_ratio``: tables, number dumps, encoded junk.
- Gopher repetition (Rae et al. 2021, appendix A): duplicate-line fraction, characters in duplicate
  lines, the most frequent 2/3/4-gram's share of characters, characters inside repeated 5..10-grams.
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
    if cfg.max_dup_line_fraction < 1 or cfg.max_dup_line_char_fraction < 1:
        stats["dup_line_fraction"], stats["dup_line_char_fraction"] = line_repetition(text)
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
        max_n = 4 + len(cfg.max_dup_ngram_fraction) if cfg.max_dup_ngram_fraction else 1 + len(cfg.max_top_ngram_fraction)
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
