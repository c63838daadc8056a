"""Deduplication (stage 4): exact (sha256 of the cleaned text) and near-duplicate (MinHash + LSH).

The work is split so it parallelises: ``signature(text)`` is a pure function run in the worker
processes (it is the expensive part: shingling and hashing), and ``Deduplicator.check`` runs in the main
process, in document order, so the first document of a cluster is always the one kept and the result
does not depend on the number of workers.

Shingles are word n-grams (``ngram``, default 3) of the lower-cased words, optionally with old spelling
folded (see ``ngrams.fold_spelling``). The MinHash is computed with numpy (affine hashing of 32-bit
shingle hashes, ``num_perm`` permutations, chunked so a huge document needs bounded memory) and handed
to ``datasketch.MinHashLSH`` for the banded candidate search; a candidate counts as a duplicate only if
the estimated Jaccard similarity of the two signatures reaches ``threshold`` (LSH alone admits some
false candidates by design).

Memory grows with the number of *kept* documents: the sha256 (exact), the signature (num_perm x 4
bytes), the name, and above all the LSH index: at threshold 0.2 datasketch uses 28 bands of 2 rows,
and each band stores a key (bytes) and a set per document. Measured (benchmarks/data_pipeline.py,
``dedup_state``): about 9.4 KB per kept document at num_perm=128, i.e. ~9.4 GB per million.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from scaletrain.config import ConfigError
from scaletrain.data.ngrams import ngram_hashes, stable_word_hashes, words
from scaletrain.data.prepare_config import DedupConfig

SIGNATURE_CHUNK = 8192  # shingles hashed at once: bounds the (chunk x num_perm) temporary to 4 MB


def content_hash(text: str) -> bytes:
    """Exact-duplicate key: sha256 of the cleaned text."""
    return hashlib.sha256(text.encode("utf-8")).digest()


@lru_cache(maxsize=4)
def _permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, num_perm])
    a = rng.integers(0, 2**31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)  # odd: a bijection
    b = rng.integers(0, 2**32, num_perm, dtype=np.uint32)
    return a, b


def signature(text: str, cfg: DedupConfig, tokens: list[str] | None = None) -> np.ndarray | None:
    """MinHash signature (num_perm uint32 values) of the document's shingle set; None if it has no
    shingle (fewer than ``ngram`` words): such documents are only deduplicated exactly.
    ``tokens`` = ``words(text)`` when the caller already has them (the filters do)."""
    tokens = words(text) if tokens is None else tokens
    shingles = ngram_hashes(stable_word_hashes(tokens, fold=cfg.fold_spelling), cfg.ngram)
    if shingles.size == 0:
        return None
    # a set (repeats do not change a MinHash), folded to 32 bits: the affine32 scheme of datasketch 2,
    # h -> a*h + b mod 2^32 with odd a, on uint32 arrays (half the memory traffic of uint64)
    shingles = np.unique((shingles >> np.uint64(32)).astype(np.uint32) ^ shingles.astype(np.uint32))
    a, b = _permutations(cfg.num_perm, cfg.seed)
    sig = np.full(cfg.num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
    for i in range(0, shingles.size, SIGNATURE_CHUNK):
        chunk = shingles[i:i + SIGNATURE_CHUNK, None]          # (C, 1)
        permuted = chunk * a + b                                # (C, num_perm), wraps mod 2^32
        np.minimum(sig, permuted.min(axis=0), out=sig)
    return sig


@lru_cache(maxsize=4)
def _stacked_permutations(num_perm: int, seed: int) -> np.ndarray:
    # Handing MinHash() the permutations that made the signature saves it drawing its own (num_perm
    # RandomState calls: 1.2 ms per object, 90% of the dedup stage's time in the main process). One
    # (2, num_perm) uint32 array is datasketch 2's canonical affine32 form, shared without a copy; its
    # `a` row must be odd, which ours is (a bijection mod 2^32).
    a, b = _permutations(num_perm, seed)
    return np.stack([a, b])


def _as_minhash(sig: np.ndarray, seed: int):
    """Wrap our numpy signature in datasketch's MinHash for the LSH index (which only reads its hash
    values). datasketch 2 wants the hashing scheme named for uint32 values; 1.x has no such argument."""
    from datasketch import MinHash

    perms = _stacked_permutations(len(sig), seed)
    try:
        return MinHash(num_perm=len(sig), hashvalues=sig, permutations=perms, scheme="affine32")
    except TypeError:
        return MinHash(num_perm=len(sig), hashvalues=sig, permutations=perms)


NEAR_OFF = ("near-duplicate removal is off: it needs the datasketch package, not installed (pip install "
            "'scaletrain[data]'); exact duplicates are still removed")


def available(cfg: DedupConfig, log: Callable[[str], None]) -> DedupConfig:
    """``cfg``, or ``cfg`` with ``near`` off and one line said when datasketch is not installed: near-dedup is on
    by default, datasketch (with scipy, which it pulls in) is an extra, and the README's plain install must be
    able to prepare a corpus (docs/architecture.md, the dependency list). The setting is part of the data's
    fingerprint, so installing datasketch later redoes the pass with near-dedup."""
    if not cfg.near:
        return cfg
    try:
        import datasketch  # noqa: F401
    except ImportError:
        log(NEAR_OFF)
        return replace(cfg, near=False)
    return cfg


@dataclass
class Deduplicator:
    """Decides, in document order, whether each document is a duplicate of one kept earlier."""

    cfg: DedupConfig
    seen: set[bytes] = field(default_factory=set)
    signatures: dict[int, np.ndarray] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    clusters: dict[int, list[dict]] = field(default_factory=dict)
    _lsh: object = None

    def __post_init__(self) -> None:
        if self.cfg.near:
            try:
                from datasketch import MinHashLSH
            except ImportError:
                raise ConfigError("dedup.near needs the `datasketch` package (pip install 'scaletrain[data]'), "
                                  "or set dedup.near = false") from None

            self._lsh = MinHashLSH(threshold=self.cfg.threshold, num_perm=self.cfg.num_perm)

    def check(self, key: int, name: str, digest: bytes | None, sig: np.ndarray | None) -> str | None:
        """``None`` to keep the document (and remember it), else the removal reason."""
        if self.cfg.exact and digest is not None:
            if digest in self.seen:
                return "exact duplicate"
        if self.cfg.near and sig is not None:
            match = self._best_match(sig)
            if match is not None:
                other, similarity = match
                self.clusters.setdefault(other, []).append({"document": name, "jaccard": round(similarity, 3)})
                return "near duplicate"
        if self.cfg.exact and digest is not None:
            self.seen.add(digest)
        if self.cfg.near and sig is not None:
            self._lsh.insert(key, _as_minhash(sig, self.cfg.seed))
            self.signatures[key] = sig
            self.names[key] = name
        return None

    def _best_match(self, sig: np.ndarray) -> tuple[int, float] | None:
        best = None
        for other in self._lsh.query(_as_minhash(sig, self.cfg.seed)):
            similarity = float(np.mean(self.signatures[other] == sig))  # the MinHash Jaccard estimate
            if similarity >= self.cfg.threshold and (best is None or similarity > best[1]):
                best = (other, similarity)
        return best

    def cluster_report(self) -> list[dict]:
        """Each cluster: the kept document and the near-duplicates removed in its favour."""
        return [{"kept": self.names[k], "removed": v} for k, v in sorted(self.clusters.items())]
