"""A run's data: the prepared token folder (or instruction examples) a run trains on, the vocabulary the model
gets from it, and the validation windows that training's evaluation and ``scaletrain eval`` both score.

The trainer, ``tune`` and ``compress`` call these instead of restating where a run's data lives."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.config import ConfigError, JobConfig
from scaletrain.data.instructions import InstructionLoader, instruction_eval_batches, instruction_splits
from scaletrain.data.loader import TokenLoader, eval_batches
from scaletrain.data.preferences import PreferenceLoader, preference_eval_batches, preference_splits
from scaletrain.data.prepare import ensure_prepared
from scaletrain.data.shards import MANIFEST, read_manifest
from scaletrain.data.tokenizer import Tokenizer, load_tokenizer
from scaletrain.parallel.dims import VOCAB_MULTIPLE, padded_vocab_size
from scaletrain.parallel.distributed import barrier


def data_cache_dir(cfg: JobConfig, run_dir: str | Path | None = None) -> Path:
    """Where a run's prepared tokens are: data.cache_dir, else <run_dir>/data (``run_dir`` defaults to
    train.run_dir; a compressed run passes the folder it read its source from)."""
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(run_dir or cfg.train.run_dir) / "data"


def prepare_data(cfg: JobConfig) -> Path:
    """The prepared token folder for ``cfg.data`` (preparing raw text into the cache once)."""
    return ensure_prepared(cfg.data.path, str(data_cache_dir(cfg)), tokenizer=cfg.data.tokenizer,
                           vocab_size=cfg.data.vocab_size, val_fraction=cfg.data.val_fraction, seed=cfg.train.seed,
                           text_field=cfg.data.text_field)


def resolve_vocab(cfg: JobConfig, manifest: dict, tp: int = 1) -> tuple[JobConfig, str]:
    """Fill model.vocab_size from the data, padded for the plan (``padded_vocab_size``: a multiple of ``tp``,
    and of 64 where that adds at most 1% rows), or check that an explicit model.vocab_size covers the data's.

    Returns the config and the vocabulary as the model log line says it, e.g. "65 -> 66 (padded for
    parallel.tp=2; ...)". Rows beyond the tokenizer's vocabulary are masked out of the loss and sampling
    (the trainer passes the tokenizer's size on as ``vocab_limit``)."""
    data_vocab = manifest["vocab_size"]
    explicit = cfg.model.vocab_size != 0
    if not explicit:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                 vocab_size=padded_vocab_size(data_vocab, tp)))
    if cfg.model.vocab_size < data_vocab:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the data's tokenizer "
                          f"vocabulary ({data_vocab}); set it to 0 to use the data's")
    vocab = cfg.model.vocab_size
    asked = manifest.get("tokenizer", {}).get("vocab_size_asked")  # a BPE the corpus could not make that large
    short = f" (a BPE of {asked} was asked; the text supports only {data_vocab})" if asked else ""
    if vocab == data_vocab:
        return cfg, str(vocab) + short
    masked = "masked out of the loss and sampling"
    if explicit:
        return cfg, f"{vocab} (model.vocab_size; tokenizer {data_vocab}, rows >= {data_vocab} {masked}){short}"
    multiple = math.lcm(VOCAB_MULTIPLE, tp)
    why = f"to a multiple of {multiple}" if vocab % multiple == 0 else f"for parallel.tp={tp}"
    return cfg, f"{data_vocab} -> {vocab} (padded {why}; padding rows {masked}){short}"


def record_tokenizer(cfg: JobConfig, manifest: dict, data_dir: Path) -> JobConfig:
    """``cfg`` with data.tokenizer saying what the data's tokenizer really is. With a prepared folder as data.path
    the setting is not used (the folder has its tokenizer), and its default 'char' would stand in the run's
    config.toml beside a BPE tokenizer.json: the folder's kind ('bpe', 'char') or its file is recorded instead.
    A fine-tune already records its base's tokenizer file."""
    if cfg.finetune.source or not (Path(cfg.data.path) / MANIFEST).is_file():
        return cfg
    kind = manifest["tokenizer"].get("kind")
    real = kind if kind in ("bpe", "char") else str(data_dir / manifest["tokenizer"]["file"])
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=real))


@dataclass
class TrainingData:
    """What a run trains and evaluates on: a prepared token folder, or instruction examples (then
    ``data_dir`` is None), the tokenizer, and the config with its tokenizer and vocabulary resolved."""

    cfg: JobConfig
    tokenizer: Tokenizer
    vocab_note: str  # the vocabulary as the model log line says it (``resolve_vocab``)
    data_dir: Path | None = None
    instructions: tuple[list, list] | None = None  # (train, val) instruction examples
    preferences: tuple[list, list] | None = None  # (train, val) preference pairs (data/preferences.py)

    def train_loader(self, dp_rank: int, dp_size: int, balanced: bool = False,
                     packed: bool = False) -> InstructionLoader | TokenLoader:
        """This data-parallel rank's loader of the train split. ``balanced`` (parallel.balance = "throughput"):
        every rank walks the one global stream of micro-batches and keeps its own run of them
        (train/adaptive.py), so the loader is the single-process one on every rank. ``packed``: instruction
        examples share rows (finetune/method_table.py:packs_instructions, which knows the method)."""
        cfg = self.cfg
        if self.preferences is not None:
            return PreferenceLoader(self.preferences[0], cfg.data.seq_len, cfg.train.batch_size, rank=dp_rank,
                                    world_size=dp_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        if self.instructions is not None:
            return InstructionLoader(self.instructions[0], cfg.data.seq_len, cfg.train.batch_size, rank=dp_rank,
                                     world_size=dp_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle,
                                     packed=packed)
        return TokenLoader(str(self.data_dir), "train", cfg.data.seq_len, cfg.train.batch_size,
                           rank=0 if balanced else dp_rank, world_size=1 if balanced else dp_size,
                           seed=cfg.train.seed, shuffle=cfg.data.shuffle, return_doc_ids=cfg.data.document_attention)


def training_data(cfg: JobConfig, is_main: bool = True, say: Callable[[str], None] = print,
                  tp: int = 1) -> TrainingData:
    """The data of ``cfg``: instruction JSONL (finetune.instructions, data/instructions.py) split into train and
    validation examples, or a text corpus prepared once (rank 0 prepares, the other ranks wait at a barrier and
    then find it cached). ``tp``: the tensor-parallel degree the vocabulary is padded for."""
    if cfg.finetune.preferences:
        tokenizer = load_tokenizer(Path(cfg.data.tokenizer))
        preferences = preference_splits(cfg.finetune.preferences, tokenizer, cfg.data.seq_len, cfg.data.val_fraction,
                                        cfg.train.seed, chat_template=cfg.finetune.chat_template)
        cfg, vocab_note = resolve_vocab(cfg, {"vocab_size": tokenizer.vocab_size}, tp)
        return TrainingData(cfg, tokenizer, vocab_note, preferences=preferences)
    if cfg.finetune.instructions:
        tokenizer = load_tokenizer(Path(cfg.data.tokenizer))
        instructions = instruction_splits(cfg.finetune.instructions, tokenizer, cfg.data.seq_len,
                                          cfg.data.val_fraction, cfg.train.seed, say,
                                          chat_template=cfg.finetune.chat_template)
        cfg, vocab_note = resolve_vocab(cfg, {"vocab_size": tokenizer.vocab_size}, tp)
        return TrainingData(cfg, tokenizer, vocab_note, instructions=instructions)
    if is_main:
        data_dir = prepare_data(cfg)
    barrier()
    if not is_main:
        data_dir = prepare_data(cfg)
    manifest = read_manifest(data_dir)
    cfg = record_tokenizer(cfg, manifest, data_dir)
    cfg, vocab_note = resolve_vocab(cfg, manifest, tp)
    return TrainingData(cfg, load_tokenizer(data_dir / manifest["tokenizer"]["file"]), vocab_note, data_dir=data_dir)


def validation_batches(cfg: JobConfig, data: TrainingData, num_batches: int | None = None,
                       split: str = "val") -> Iterator[tuple[torch.Tensor, ...]]:
    """The batches every validation loss of a run is computed over: ``num_batches`` (default train.eval_batches;
    <= 0: all) batches of train.batch_size windows of data.seq_len tokens, spread evenly over the split (the
    same windows at every evaluation), or the first held-out instruction examples in file order."""
    count = cfg.train.eval_batches if num_batches is None else num_batches
    if data.preferences is not None:
        return preference_eval_batches(data.preferences[1], cfg.data.seq_len, cfg.train.batch_size, count)
    if data.instructions is not None:
        return instruction_eval_batches(data.instructions[1], cfg.data.seq_len, cfg.train.batch_size, count)
    return eval_batches(str(data.data_dir), split, cfg.data.seq_len, cfg.train.batch_size, count,
                        return_doc_ids=cfg.data.document_attention)


def describe_validation(cfg: JobConfig, data: TrainingData, num_batches: int | None = None,
                        trained: JobConfig | None = None) -> str:
    """Which windows ``validation_batches`` scores, for the line that prints the loss. ``trained``: the run's own
    job, which training's eval scored, when ``cfg`` overrides some of its fields (``scaletrain eval
    --train.batch_size=2``)."""
    where = ("the first held-out preference pairs in file order" if data.preferences is not None
             else "the first held-out instruction examples in file order" if data.instructions is not None
             else "evenly spread over the val split")
    trained = trained or cfg
    batches = cfg.train.eval_batches if num_batches is None else num_batches
    if (cfg.train.batch_size, cfg.data.seq_len) != (trained.train.batch_size, trained.data.seq_len):
        return (f"{where} (training's eval scores train.eval_batches={trained.train.eval_batches} batches x "
                f"{trained.train.batch_size} x {trained.data.seq_len} tokens)")
    if batches == trained.train.eval_batches:
        return f"{where} (the windows training's eval scores)"
    return f"{where} (training's eval scores train.eval_batches={trained.train.eval_batches} batches)"
