"""Word and n-gram hashing shared by the repetition filters and the MinHash deduplication.

Everything after the one regex pass is numpy, so the Gopher statistics and MinHash signatures of a
1 MB book cost milliseconds, not the seconds a Python loop over n-grams would.
"""

from __future__ import annotations

import re
import zlib
from functools import lru_cache

import numpy as np

_WORD = re.compile(r"\w+")
_FOLD_DOUBLE = re.compile(r"([a-z])\1")
# Odd 64-bit multipliers: position k of an n-gram is weighted by _MULT[k] (a polynomial hash mod 2^64).
_MULT = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5,
                  0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9,
                  0x85EBCA77C2B2AE63, 0xD6E8FEB86659FD93], dtype=np.uint64)


def words(text: str) -> list[str]:
    """Lower-cased words (``\\w+`` runs): the unit of the repetition filters and of the shingles."""
    return _WORD.findall(text.lower())


def fold_spelling(word: str) -> str:
    """Map early-modern spelling variants together (u/v, i/j, doubled letters, a final e):
    'vnfold' -> 'unfold', 'selfe' -> 'self', 'houre' -> 'hour'."""
    word = word.replace("v", "u").replace("j", "i")
    word = _FOLD_DOUBLE.sub(r"\1", word)
    return word[:-1] if len(word) > 2 and word.endswith("e") else word


def word_ids(tokens: list[str]) -> tuple[np.ndarray, list[str]]:
    """Per-document integer ids (first-seen order) and the vocabulary they index."""
    # dict.fromkeys and map(dict.__getitem__) run in C: ~5x faster than a generator with setdefault
    vocab = {w: i for i, w in enumerate(dict.fromkeys(tokens))}
    ids = np.fromiter(map(vocab.__getitem__, tokens), dtype=np.int64, count=len(tokens))
    return ids, list(vocab)


def repeated_ngrams(ids: np.ndarray, max_n: int) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For n = 2..max_n: the start positions of every n-gram that occurs at least twice, its count,
    and whether that position is the n-gram's first occurrence: ``{n: (pos, count, is_first)}``.

    An n-gram can only repeat where both of its (n-1)-grams repeat, so each level sorts just the
    candidates the previous level left (a few percent of positions in real text) instead of every
    position: the whole 2..10 ladder costs about one full sort.
    """
    out: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    n_words = len(ids)
    if n_words < 2:
        return out
    multi = np.bincount(ids)[ids] >= 2  # level 1: words that occur twice or more
    word_h = ids.astype(np.uint64)
    for n in range(2, max_n + 1):
        count = n_words - n + 1
        if count <= 0:
            break
        cand = np.flatnonzero(multi[:count] & multi[1:count + 1])
        h = np.zeros(cand.size, dtype=np.uint64)
        for k in range(n):
            h += word_h[cand + k] * _MULT[k % len(_MULT)]
        h = mix64(h)
        order = np.argsort(h)
        sorted_h = h[order]
        starts = np.flatnonzero(np.r_[True, sorted_h[1:] != sorted_h[:-1]]) if cand.size else np.zeros(0, np.int64)
        sizes = np.diff(np.r_[starts, cand.size])
        cnt = np.empty(cand.size, dtype=np.int64)
        cnt[order] = np.repeat(sizes, sizes)
        first = np.zeros(count, dtype=bool)
        if cand.size:
            first[np.minimum.reduceat(cand[order], starts)] = True
        keep = cnt >= 2
        pos = cand[keep]
        out[n] = (pos, cnt[keep], first[pos])
        multi = np.zeros(count, dtype=bool)
        multi[pos] = True
    return out


def stable_word_hashes(tokens: list[str], fold: bool = False) -> np.ndarray:
    """A 64-bit hash per word that is the same in every process and run (unlike ``hash()``).
    ``fold`` applies ``fold_spelling`` first - per distinct word, so it costs little."""
    ids, vocab = word_ids(tokens)
    table = np.fromiter((_word_hash(w, fold) for w in vocab), dtype=np.uint64, count=len(vocab))
    return table[ids] if len(vocab) else np.zeros(0, dtype=np.uint64)


@lru_cache(maxsize=1 << 18)  # a corpus reuses its vocabulary: most words are hashed once per process
def _word_hash(word: str, fold: bool) -> int:
    if fold:
        word = fold_spelling(word)
    data = word.encode()
    return zlib.crc32(data) | (zlib.adler32(data) << 32)


def ngram_hashes(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """Hash of every window of ``n`` consecutive words, shape (len - n + 1,), uint64."""
    count = len(word_hashes) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = np.zeros(count, dtype=np.uint64)
    for k in range(n):  # overflow is the point: arithmetic mod 2^64
        h += word_hashes[k:k + count].astype(np.uint64) * _MULT[k % len(_MULT)]
    return mix64(h)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads every input bit over the output (vectorised)."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x
