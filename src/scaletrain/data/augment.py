"""Augmentation (stage 5, optional, off by default): fill-in-the-middle (FIM).

Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the Middle": a fraction of the
training documents is cut at two random points into prefix / middle / suffix and rearranged as

    PSM: <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle
    SPM: <|fim_prefix|> <|fim_suffix|> suffix <|fim_middle|> prefix middle

so the model also learns to infill, at (the paper reports) no cost to left-to-right quality. It is the
one augmentation here because it is the one with evidence for LM pretraining; it matters for code and
editing use cases, little for a plain prose model - hence off by default. Only the train split is
augmented; the choice and cut points are a deterministic function of (seed, document), so a re-run
produces the same shards.

The sentinels are returned as separate items (not text) so a literal "<|fim_prefix|>" inside a document
can never be mistaken for one: the encoder maps the items to their special-token ids.
"""

from __future__ import annotations

import hashlib
import random

from scaletrain.data.prepare_config import AugmentConfig

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"
FIM_TOKENS = [FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX]


class Special(str):
    """A special-token name in a document's piece list (encoded as its id, never as text)."""


def fim(text: str, doc_key: bytes, cfg: AugmentConfig) -> list[str]:
    """The document as pieces: ``[text]`` unchanged, or a FIM rearrangement with ``Special`` sentinels."""
    if cfg.fim_rate <= 0 or len(text) < 2:
        return [text]
    seed = int.from_bytes(hashlib.blake2b(doc_key, digest_size=8, key=str(cfg.seed).encode()).digest(), "little")
    rng = random.Random(seed)
    if rng.random() >= cfg.fim_rate:
        return [text]
    i, j = sorted((rng.randrange(len(text) + 1), rng.randrange(len(text) + 1)))
    prefix, middle, suffix = text[:i], text[i:j], text[j:]
    if rng.random() < cfg.fim_spm_rate:
        return [Special(FIM_PREFIX), Special(FIM_SUFFIX), suffix, Special(FIM_MIDDLE), prefix + middle]
    return [Special(FIM_PREFIX), prefix, Special(FIM_SUFFIX), suffix, Special(FIM_MIDDLE), middle]
