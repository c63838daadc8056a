"""The typed config tree of ``scaletrain prepare --config data.toml`` (one section a stage).

Built with the generic machinery of ``scaletrain.config`` (``opt``, ``load_config``, ``to_toml``), so
``--help`` shows every field's documentation and ``--section.field=value`` overrides the TOML.
Each stage receives only its own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.config import ConfigError, opt


@dataclass
class SourceConfig:
    paths: list[str] = opt([], "files, folders (searched recursively), 'builtin:tinyshakespeare', or "
                               "'hf:NAME' (a Hugging Face dataset by name; needs `datasets` and a network "
                               "or its cache). A folder holding a saved HF dataset (state.json) is read directly")
    include: list[str] = opt(["*.txt", "*.text", "*.md", "*.jsonl", "*.json", "*.parquet", "*.arrow"],
                             "glob patterns a file inside a folder must match (a compression suffix "
                             ".gz/.zst/.xz/.bz2 is ignored when matching)")
    exclude: list[str] = opt([], "glob patterns of files to skip inside folders (matched against the path "
                                 "relative to the folder and against the file name)")
    text_field: str = opt("text", "the field holding the text in .jsonl/.json/.parquet/HF records")
    encoding_errors: str = opt("replace", "bytes that are not UTF-8: 'replace' them with U+FFFD (counted), "
                                          "'skip' the document (counted) or 'fail' (stop with exit code 2)",
                               choices=("replace", "skip", "fail"))
    max_document_mb: float = opt(64.0, "a plain-text file larger than this is split at blank lines into "
                                       "several documents, so memory stays bounded", gt=0)
    hf_config: str = opt("", "hf:NAME sources: the dataset configuration (subset) name")
    hf_split: str = opt("train", "hf:NAME sources and saved dataset dicts: which split to read")


@dataclass
class CleanConfig:
    gutenberg: bool = opt(True, "remove Project Gutenberg headers, footers, license and SMALL PRINT blocks "
                                "(files without markers are left as they are)")
    unicode_nfc: bool = opt(True, "normalise Unicode to NFC (composed characters)")
    control_chars: bool = opt(True, "remove control characters other than newline and tab")
    strip_trailing_spaces: bool = opt(False, "remove spaces/tabs at the end of lines")


@dataclass
class FilterConfig:
    min_chars: int = opt(200, "drop documents shorter than this many characters (after cleaning); 0 = off", ge=0)
    min_words: int = opt(0, "drop documents with fewer words; 0 = off", ge=0)
    max_non_alpha_ratio: float = opt(0.5, "drop documents whose non-whitespace characters are more than this "
                                          "fraction non-alphabetic (tables, binary junk, number dumps); 1 = off",
                                     ge=0, le=1)
    max_dup_line_fraction: float = opt(0.6, "Gopher repetition: drop if more than this fraction of non-empty "
                                            "lines are repeats of an earlier line (Gopher uses 0.30 for web "
                                            "text; plays repeat speaker lines, so the default is looser); 1 = off",
                                       ge=0, le=1)
    max_dup_line_char_fraction: float = opt(0.4, "Gopher: drop if characters in repeated lines exceed this "
                                                 "fraction of all line characters (Gopher: 0.20); 1 = off",
                                            ge=0, le=1)
    max_top_ngram_fraction: list[float] = opt([0.20, 0.18, 0.16], "Gopher: for n = 2, 3, 4, drop if the most "
                                              "frequent word n-gram covers more than this fraction of the words' "
                                              "characters (Gopher's values); empty list = off")
    max_dup_ngram_fraction: list[float] = opt([0.15, 0.14, 0.13, 0.12, 0.11, 0.10], "Gopher: for n = 5..10, drop "
                                              "if characters inside repeated n-grams exceed this fraction "
                                              "(Gopher's values); empty list = off")
    language: list[str] = opt([], "keep only these ISO 639-1 languages (e.g. ['en']); needs the small "
                                  "`py3langid` package; empty = off")
    language_min_score: float = opt(0.5, "language filter: minimum probability of the detected language", ge=0, le=1)


@dataclass
class DedupConfig:
    exact: bool = opt(True, "drop documents whose cleaned text is byte-identical to an earlier one (sha256)")
    near: bool = opt(True, "drop near-duplicates: MinHash + LSH (datasketch) over word n-gram shingles")
    threshold: float = opt(0.2, "near-duplicate Jaccard threshold on the shingle sets. With ngram=3 and "
                                "fold_spelling, First Folio vs modern Shakespeare pairs measure 0.37-0.60 and "
                                "distinct plays <= 0.02 (docs/data.md)", gt=0, le=1)
    ngram: int = opt(3, "words per shingle", ge=1)
    num_perm: int = opt(128, "MinHash permutations (more = a more exact Jaccard estimate, more memory)", ge=16)
    fold_spelling: bool = opt(True, "shingles fold old spelling variants (u/v, i/j, doubled letters, final e) "
                                    "so an edition in old spelling still matches its modern one")
    seed: int = opt(1, "MinHash seed")


@dataclass
class AugmentConfig:
    fim_rate: float = opt(0.0, "fill-in-the-middle: fraction of train documents rearranged as "
                               "<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>M (Bavarian et al. 2022); "
                               "0 = off (the default). Needs a BPE tokenizer trained here", ge=0, le=1)
    fim_spm_rate: float = opt(0.5, "of FIM documents, the fraction in suffix-prefix-middle order", ge=0, le=1)
    seed: int = opt(0, "seed of the augmentation choices (deterministic per document)")


@dataclass
class TokenizerConfig:
    kind: str = opt("bpe", "'bpe' (byte-level BPE trained on the cleaned corpus), 'char' (one token per "
                           "character) or a path to an existing tokenizer.json")
    vocab_size: int = opt(8192, "BPE vocabulary size (including special tokens)", ge=260)
    special_tokens: list[str] = opt(["<|bos|>", "<|eos|>", "<|pad|>"], "BPE special tokens; <|eos|> separates "
                                                                       "documents in the shards")
    train_sample_mb: float = opt(64.0, "train the BPE on a deterministic sample of about this many MB of the "
                                       "cleaned corpus (bounds memory and time)", gt=0)
    batch_mb: float = opt(4.0, "encode in batches of about this many MB of text", gt=0)
    encode_workers: int = opt(0, "0 = encode in this process with the tokenizer's own thread pool; N >= 1 = "
                                 "N worker processes, each single-threaded", ge=0)


@dataclass
class SplitConfig:
    val_fraction: float = opt(0.1, "fraction held out for validation", ge=0, lt=1)
    by: str = opt("auto", "'document' (whole documents go to val, chosen by a seeded hash), 'tail' (the last "
                          "val_fraction of every document, like nanoGPT), 'auto' (tail when the corpus is one "
                          "document, else document)", choices=("auto", "document", "tail"))
    seed: int = opt(1337, "seed of the train/val choice")


@dataclass
class OutputConfig:
    dir: str = opt("data/prepared", "output folder: manifest.json, tokenizer.json, shards, report.json")
    dtype: str = opt("auto", "token dtype of the shards: auto (uint16 when the vocabulary fits, else uint32), "
                             "uint16 or uint32", choices=("auto", "uint16", "uint32"))
    shard_mb: float = opt(128.0, "shard size in MB (fixed-size shards; the last one of a split is smaller)", gt=0)
    force: bool = opt(False, "rebuild every stage even when a finished one matches the config")


@dataclass
class PrepareConfig:
    workers: int = opt(0, "processes for cleaning/filtering/MinHash; 0 = one per CPU core, 1 = in this process", ge=0)
    source: SourceConfig = field(default_factory=SourceConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def validate(cfg: PrepareConfig) -> None:
    """Cross-field checks no single field can make."""
    if not cfg.source.paths:
        raise ConfigError("source.paths is empty: give at least one file, folder or hf:NAME")
    if len(cfg.filter.max_top_ngram_fraction) > 3:
        raise ConfigError("filter.max_top_ngram_fraction takes at most 3 values (n = 2, 3, 4)")
    if len(cfg.filter.max_dup_ngram_fraction) > 6:
        raise ConfigError("filter.max_dup_ngram_fraction takes at most 6 values (n = 5..10)")
    kind = cfg.tokenizer.kind
    if kind not in ("bpe", "char") and not Path(kind).is_file():
        what = "no such file" if kind.endswith(".json") or "/" in kind else "not a choice nor a file"
        raise ConfigError(f"tokenizer {kind!r}: {what}; choose 'char', 'bpe' or the path of a tokenizer.json")
    if cfg.augment.fim_rate > 0 and cfg.tokenizer.kind != "bpe":
        raise ConfigError("augment.fim_rate > 0 needs tokenizer.kind = 'bpe' (the FIM sentinels are added "
                          "as special tokens when the BPE is trained)")


def minimal_config(source: str, out_dir: str, *, tokenizer: str = "char", vocab_size: int = 2048,
                   val_fraction: float = 0.1, seed: int = 1337, text_field: str = "text") -> PrepareConfig:
    """The trainer's on-the-fly preparation: text as given (normalised, Gutenberg boilerplate removed),
    no filters and no deduplication, so a small or synthetic training file is never dropped."""
    cfg = PrepareConfig(workers=1)
    cfg.source.paths = [source]
    cfg.source.text_field = text_field
    cfg.source.include = ["*.txt"]
    cfg.source.encoding_errors = "fail"
    cfg.filter = FilterConfig(min_chars=0, max_non_alpha_ratio=1.0, max_dup_line_fraction=1.0,
                              max_dup_line_char_fraction=1.0, max_top_ngram_fraction=[], max_dup_ngram_fraction=[])
    cfg.dedup = DedupConfig(exact=False, near=False)
    cfg.tokenizer.kind, cfg.tokenizer.vocab_size = tokenizer, vocab_size
    cfg.split.val_fraction, cfg.split.seed = val_fraction, seed
    cfg.output.dir = str(out_dir)
    return cfg
