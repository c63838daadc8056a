"""Tokenization (stage 6): build the tokenizer, then encode documents into token arrays.

Building: a byte-level BPE trained on a deterministic sample of the cleaned corpus (``train_sample_mb``),
a char vocabulary, or an existing ``tokenizer.json``. Encoding: batches of about ``batch_mb`` of text go
to ``Tokenizer.encode_batch_fast`` (no offsets computed), either in this process, where the tokenizers
library spreads a batch over its own thread pool, or in ``encode_workers`` single-threaded processes.
Each document comes back as one array of the shard dtype, ending with EOS when the tokenizer has one.

Special-token strings that occur *in the text* ("<|eos|>" typed in a document) are encoded as text
(``encode_special_tokens``), so a document can never forge a document boundary; real special tokens
(FIM sentinels from ``augment``) arrive as separate ``Special`` items and are mapped to their ids.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from scaletrain.data.augment import FIM_TOKENS, Special
from scaletrain.data.prepare_config import TokenizerConfig
from scaletrain.data.tokenizer import BPETokenizer, CharTokenizer, DataError, Tokenizer, load_tokenizer
from scaletrain.data.workers import ordered_map

Piece = str  # a document is a list of pieces: text, or Special(name) for a special token


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
        """Plain texts -> id arrays (no EOS)."""
        if isinstance(self.tok, CharTokenizer):
            return [self.tok.encode_array(t, self.dtype) for t in texts]
        if isinstance(self.tok, BPETokenizer):
            return [np.array(e.ids, dtype=self.dtype) for e in self._fast(texts)]
        return [np.array(ids, dtype=self.dtype) for ids in self.tok.encode_batch(texts)]

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
    return _WORKER.encode_documents(docs)


def encode_stream(batches: Iterable[list[list[Piece]]], tokenizer: Tokenizer, tokenizer_file: Path,
                  dtype: np.dtype, workers: int) -> Iterator[list[np.ndarray]]:
    """Encode an iterator of document batches, in order. ``workers`` = 0: here, with the tokenizer's
    thread pool; N: N spawned processes (each loads ``tokenizer_file``)."""
    if workers <= 0:
        encoder = Encoder(tokenizer, dtype)
        for batch in batches:
            yield encoder.encode_documents(batch)
        return
    Encoder(tokenizer, dtype)  # fail fast (dtype check) in this process, not in a worker
    yield from ordered_map(_encode_in_worker, batches, workers=workers, initializer=_init_worker,
                           initargs=(str(tokenizer_file), np.dtype(dtype).str), max_in_flight=2 * workers)
