"""Tokenization (stage 6): build the tokenizer, then encode documents into token arrays.

Building: a byte-level BPE trained on a deterministic sample of the cleaned corpus (``train_sample_mb``),
a char vocabulary, or an existing ``tokenizer.json``. Encoding: batches of about ``batch_mb`` of text go
to ``Tokenizer.encode_batch_fast`` (no offsets computed), either in this process, where the tokenizers
library spreads a batch over its own thread pool, or in ``encode_workers`` single-threaded processes.
Each document comes back as one array of the shard dtype, ending with EOS when the tokenizer has one.

Memory: the tokenizer's work per call (pre-tokenized pieces with byte alignments, then an ``Encoding``
per text) costs 50-140 bytes per byte of text, so a long document is encoded as pieces (cut where the
byte-level pre-tokenizer splits anyway, so the ids are identical) in calls of at most
``CALL_CHARS`` characters: the transient is bounded by that, not by the batch or the document size.

Special-token strings that occur *in the text* ("<|eos|>" typed in a document) are encoded as text
(``encode_special_tokens``), so a document can never forge a document boundary; real special tokens
(FIM sentinels from ``augment``) arrive as separate ``Special`` items and are mapped to their ids.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from scaletrain.data.augment import FIM_TOKENS, Special
from scaletrain.data.prepare_config import TokenizerConfig
from scaletrain.data.tokenizer import BPETokenizer, CharTokenizer, DataError, Tokenizer, load_tokenizer
from scaletrain.data.workers import ordered_map, release_freed_memory

Piece = str  # a document is a list of pieces: text, or Special(name) for a special token

CALL_CHARS = 1 << 20   # characters per tokenizer call (measured: ~50-140 MB of transient memory)
CUT_CHARS = 1 << 18    # a longer text is cut into pieces of at most about this many characters
# A cut point for GPT-2-style byte-level pre-tokenization: inside a run of spaces/newlines that is
# followed by a word character, just before the run's last character. The pre-tokenizer splits there
# anyway (the run minus its last character is one pre-token, "\n\n" + "\nWord" or " Word" the next),
# so encoding the two sides separately gives the same ids (checked in test_encode_pieces_are_exact).
_CUT = re.compile(r"(?<=[ \n])(?=[ \n]\w)")


def build_tokenizer(cfg: TokenizerConfig, sample_texts: Iterable[str], all_texts: Iterable[str],
                    need_fim: bool = False) -> Tokenizer:
    """Train (bpe on ``sample_texts``, char on ``all_texts``) or load the tokenizer ``cfg`` names."""
    if cfg.kind == "char":
        return CharTokenizer.train(all_texts)
    if cfg.kind == "bpe":
        specials = list(dict.fromkeys(cfg.special_tokens + (FIM_TOKENS if need_fim else [])))
        return BPETokenizer.train(sample_texts, cfg.vocab_size, special_tokens=tuple(specials))
    tok = load_tokenizer(cfg.kind)
    if need_fim and isinstance(tok, BPETokenizer) and any(tok.tok.token_to_id(t) is None for t in FIM_TOKENS):
        raise DataError(f"{cfg.kind}: augment.fim_rate > 0 but the tokenizer has no FIM tokens {FIM_TOKENS}")
    return tok


class Encoder:
    """Encodes batches of documents (lists of pieces) into arrays of ``dtype``."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype):
        self.tok = tokenizer
        self.dtype = np.dtype(dtype)
        self.eos = tokenizer.eos_id
        if isinstance(tokenizer, BPETokenizer):
            tokenizer.tok.encode_special_tokens = True  # "<|eos|>" typed in a text is text
            self._fast = getattr(tokenizer.tok, "encode_batch_fast", tokenizer.tok.encode_batch)
        self.cuttable = isinstance(tokenizer, CharTokenizer) or _splits_like_gpt2(tokenizer)
        self._drops_unknown: bool | None = None  # decided on first use (_check_known)
        self._known: set[str] = set()
        limit = np.iinfo(self.dtype).max + 1
        if tokenizer.vocab_size > limit:
            raise DataError(f"the tokenizer's vocabulary ({tokenizer.vocab_size:,} tokens) does not fit the "
                            f"{self.dtype.name} shard dtype (at most {limit:,}); set output.dtype = 'uint32'")

    def special_id(self, name: str) -> int:
        token_id = self.tok.tok.token_to_id(name) if isinstance(self.tok, BPETokenizer) else None
        if token_id is None:
            raise DataError(f"the tokenizer has no special token {name!r}")
        return token_id

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        """Plain texts -> id arrays (no EOS), in tokenizer calls of at most ``CALL_CHARS`` characters."""
        pieces, owner = [], []
        for i, text in enumerate(texts):
            for piece in (cut_text(text, CUT_CHARS) if self.cuttable else [text]):
                pieces.append(piece)
                owner.append(i)
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        start = 0
        while start < len(pieces):
            end, size = start, 0
            while end < len(pieces) and (end == start or size + len(pieces[end]) <= CALL_CHARS):
                size += len(pieces[end])
                end += 1
            for i, ids in zip(owner[start:end], self._encode_call(pieces[start:end])):
                parts[i].append(ids)
            start = end
        return [p[0] if len(p) == 1 else np.concatenate(p) if p else np.zeros(0, self.dtype) for p in parts]

    def _encode_call(self, texts: list[str]) -> list[np.ndarray]:
        if isinstance(self.tok, CharTokenizer):
            return [self.tok.encode_array(t, self.dtype) for t in texts]
        if isinstance(self.tok, BPETokenizer):
            self._check_known(texts)
            try:
                encodings = self._fast(texts)
            except Exception as exc:  # tokenizers' own Exception type, e.g. "Missing [UNK] token"
                raise self._unencodable(texts, exc) from None
            return [np.array(e.ids, dtype=self.dtype) for e in encodings]
        return [np.array(ids, dtype=self.dtype) for ids in self.tok.encode_batch(texts)]

    def _name(self) -> str:
        return getattr(self.tok, "source", "") or "the tokenizer"

    def _unencodable(self, texts: list[str], exc: Exception) -> DataError:
        """The one-line error for a text the tokenizer refuses, naming the first character it cannot encode."""
        for c in sorted(set().union(*map(set, texts))):
            try:
                self.tok.tok.encode(c)
            except Exception:
                return DataError(f"{self._name()}: cannot encode the character {c!r} of the text ({exc}); add it to "
                                 f"the tokenizer's vocabulary, or give its model an unk_token that is in the "
                                 f"vocabulary, or use --tokenizer bpe (byte-level: encodes any text)")
        return DataError(f"{self._name()}: cannot encode the text ({exc})")

    def _check_known(self, texts: list[str]) -> None:
        """A vocabulary model without an unknown token or byte fallback (e.g. a character-level BPE) silently
        drops the characters it does not know: refuse instead of losing text. Byte-level tokenizers and ones
        with an unk_token encode everything; whitespace may be dropped by the pre-tokenizer on purpose."""
        if self._drops_unknown is None:
            spec = json.loads(self.tok.tok.to_str())
            model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
            self._drops_unknown = (model.get("type") == "BPE" and not model.get("unk_token")
                                   and not model.get("byte_fallback") and "ByteLevel" not in json.dumps(pre))
        if not self._drops_unknown:
            return
        for c in set().union(*map(set, texts)) - self._known:
            if not c.isspace() and not self.tok.tok.encode(c).ids:
                raise DataError(f"{self._name()}: the character {c!r} of the text is not in the tokenizer's "
                                f"vocabulary and its model has no unk_token, so it would be dropped silently; add "
                                f"it to the vocabulary or an unk_token, or use --tokenizer bpe (byte-level)")
            self._known.add(c)

    def encode_documents(self, docs: list[list[Piece]]) -> list[np.ndarray]:
        """Documents -> one array each: its pieces' ids in order, then EOS (when the tokenizer has one)."""
        texts = [p for doc in docs for p in doc if not isinstance(p, Special)]
        encoded = iter(self.encode_texts(texts))
        eos = [np.array([self.eos], dtype=self.dtype)] if self.eos is not None else []
        out = []
        for doc in docs:
            parts = [np.array([self.special_id(p)], dtype=self.dtype) if isinstance(p, Special) else next(encoded)
                     for p in doc]
            out.append(np.concatenate(parts + eos) if len(parts) + len(eos) > 1 else parts[0])
        return out


def _splits_like_gpt2(tokenizer: Tokenizer) -> bool:
    """True for a BPE whose only text processing is the GPT-2 byte-level regex split (what
    ``BPETokenizer.train`` builds, and GPT-2's own tokenizer.json): then ``cut_text`` is exact."""
    if not isinstance(tokenizer, BPETokenizer):
        return False
    spec = json.loads(tokenizer.tok.to_str())
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space") and model.get("type") == "BPE" and not model.get("dropout"))


def cut_text(text: str, max_chars: int) -> list[str]:
    """``text`` in pieces of about ``max_chars`` (longer only where no cut point exists), cut at
    ``_CUT`` points; ``"".join(pieces) == text``."""
    pieces, start = [], 0
    while len(text) - start > max_chars:
        cut = None
        for m in _CUT.finditer(text, start + max_chars // 2, start + max_chars):
            cut = m.start()
        if cut is None:  # no cut point in the window: look further (rare: a huge line)
            m = _CUT.search(text, start + max_chars)
            if m is None:
                break
            cut = m.start()
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


# -- worker processes ---------------------------------------------------------------------------------

_WORKER: Encoder | None = None


def _init_worker(tokenizer_file: str, dtype: str) -> None:
    global _WORKER
    if _WORKER is not None and getattr(_WORKER, "_file", None) == tokenizer_file:
        return  # the in-process warm-up already built it
    if mp.parent_process() is not None:
        # one thread per worker process: N processes x N tokenizer threads would oversubscribe the cores
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = Encoder(load_tokenizer(tokenizer_file), np.dtype(dtype))
    _WORKER._file = tokenizer_file


def _encode_in_worker(docs: list[list[Piece]]) -> list[np.ndarray]:
    assert _WORKER is not None
    arrays = _WORKER.encode_documents(docs)
    release_freed_memory()  # the batch's Encoding objects are gone; their pages go back to the OS
    return arrays


def encode_stream(batches: Iterable[list[list[Piece]]], tokenizer: Tokenizer, tokenizer_file: Path,
                  dtype: np.dtype, workers: int) -> Iterator[list[np.ndarray]]:
    """Encode an iterator of document batches, in order. ``workers`` = 0: here, with the tokenizer's
    thread pool; N: N spawned processes (each loads ``tokenizer_file``)."""
    if workers <= 0:
        encoder = Encoder(tokenizer, dtype)
        for batch in batches:
            arrays = encoder.encode_documents(batch)
            release_freed_memory()
            yield arrays
        return
    Encoder(tokenizer, dtype)  # fail fast (dtype check) in this process, not in a worker
    yield from ordered_map(_encode_in_worker, batches, workers=workers, initializer=_init_worker,
                           initargs=(str(tokenizer_file), np.dtype(dtype).str), max_in_flight=2 * workers)
