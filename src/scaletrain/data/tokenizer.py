"""Tokenizers: character-level (nanoGPT-comparable) and byte-level BPE (Hugging Face ``tokenizers``).

Both are saved as one ``tokenizer.json`` and loaded with ``load_tokenizer``; a char tokenizer's file is
tagged ``"type": "scaletrain.char"`` so the two formats cannot be confused.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from scaletrain.options import UserError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


class DataError(UserError, ValueError):
    """A data problem a person can fix; printed as one line naming the file."""


class CharTokenizer:
    """One token per distinct character of the training text (no special tokens, like nanoGPT)."""

    def __init__(self, chars: list[str]):
        if any(len(c) != 1 for c in chars):
            raise DataError("a char tokenizer's vocabulary must be single characters")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self._table: np.ndarray | None = None
        self.eos_id: int | None = None
        self.bos_id: int | None = None

    @classmethod
    def train(cls, texts: Iterable[str]) -> CharTokenizer:
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls(sorted(seen))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as exc:
            raise DataError(f"character {exc.args[0]!r} is not in the char tokenizer's vocabulary") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_array(self, text: str, dtype: str = "<u2") -> np.ndarray:
        """Vectorised ``encode``: code points -> ids with one searchsorted (~100x faster than a dict
        lookup per character, which matters for the multi-MB texts of ``prepare``)."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = self._code_table()
        idx = np.searchsorted(table, codes)
        idx_clipped = np.minimum(idx, len(table) - 1)
        bad = table[idx_clipped] != codes
        if bad.any():
            raise DataError(f"character {chr(int(codes[np.argmax(bad)]))!r} is not in the char tokenizer's vocabulary")
        # chars are sorted by code point (see train), so the searchsorted index is the id; a loaded
        # tokenizer file in another order goes through the permutation
        return self._order[idx].astype(dtype)

    def _code_table(self) -> np.ndarray:
        if getattr(self, "_table", None) is None:
            codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)
            self._order = np.argsort(codes, kind="stable").astype(np.int64)
            self._table = codes[self._order]
        return self._table

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids if 0 <= i < len(self.chars))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"type": "scaletrain.char", "chars": self.chars}, ensure_ascii=False))


class BPETokenizer:
    """Byte-level BPE from Hugging Face ``tokenizers`` (any text encodes; no unknown tokens)."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.token_to_id(EOS)
        self.bos_id = tok.token_to_id(BOS)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int,
              special_tokens: tuple[str, ...] = (BOS, EOS, PAD)) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))


Tokenizer = CharTokenizer | BPETokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load either kind from a ``tokenizer.json``."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"tokenizer file not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise DataError(f"{p}: not a tokenizer.json (invalid JSON)") from None
    if isinstance(data, dict) and data.get("type") == "scaletrain.char":
        chars = data.get("chars")
        if not isinstance(chars, (list, str)) or not chars or not all(isinstance(c, str) for c in chars):
            raise DataError(f"{p}: a char tokenizer without a valid \"chars\" list; re-create it (scaletrain prepare)")
        return CharTokenizer(list(chars))
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = BPETokenizer(HFTokenizer.from_file(str(p)))
    except Exception as exc:  # tokenizers raises its own Exception type
        raise DataError(f"{p}: cannot load as a Hugging Face tokenizer ({exc})") from None
    tok.source = str(p)  # named in encoding errors (data/encode.py)
    return tok


def encode_known(tokenizer: Tokenizer, text: str) -> tuple[list[int], Counter]:
    """Encode ``text``, leaving out the characters a char tokenizer does not know (e.g. a book's curly
    quotes scored by a model trained on Tiny Shakespeare). Returns (ids, count per skipped character); a
    byte-level BPE encodes every text, so nothing is skipped there."""
    if not isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode(text), Counter()
    unknown = Counter(c for c in text if c not in tokenizer.stoi)
    if unknown:
        text = "".join(c for c in text if c in tokenizer.stoi)
    return tokenizer.encode(text), unknown


def describe_skipped(unknown: Counter) -> str:
    """One line for ``encode_known``'s count: "skipped 27 characters not in the tokenizer's vocabulary
    (e.g. '’' x20, '‘' x5, '“' x2)"; empty when nothing was skipped."""
    if not unknown:
        return ""
    shown = ", ".join(f"{c!r} x{n}" for c, n in unknown.most_common(3))
    total = sum(unknown.values())
    return (f"skipped {total:,} character{'s' if total != 1 else ''} not in the tokenizer's vocabulary "
            f"(e.g. {shown}{', ...' if len(unknown) > 3 else ''}); the rest is scored")


def iter_batches(items: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
