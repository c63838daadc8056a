"""Tokenizers: character-level (nanoGPT-comparable), byte-level BPE (Hugging Face ``tokenizers``), and a
Hugging Face model folder's own tokenizer.

All are saved as one ``tokenizer.json`` and loaded with ``load_tokenizer``; a char tokenizer's file is
tagged ``"type": "scaletrain.char"`` so the two formats cannot be confused. A ``tokenizer.json`` with a
``tokenizer_config.json`` beside it (a Hugging Face folder, or a run fine-tuned from one) is an
``HFTokenizer``: the ``tokenizers`` library encodes with the file as it is (normalizer, pre-tokenizer, the
post-processor that adds BOS), and the config names its BOS/EOS tokens and chat template, which
``data/chat.py`` renders through transformers.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from scaletrain.core.options import UserError

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

    def encode_text(self, text: str) -> list[int]:
        """``encode`` without special tokens (a char vocabulary has none)."""
        return self.encode(text)

    def prefix_ids(self) -> list[int]:
        """The special tokens the tokenizer puts before every text: none."""
        return []

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

    def encode_text(self, text: str) -> list[int]:
        """``text`` alone, without what the post-processor adds around it (Llama 3's ``<|begin_of_text|>``):
        the pieces of one example are encoded one by one, and a BOS before each would be wrong."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def prefix_ids(self) -> list[int]:
        """The special tokens the post-processor puts before every text (Llama 3: ``<|begin_of_text|>``; our
        own BPE and Qwen: none), so that an example encoded in pieces starts as one encoded whole would."""
        for text in ("a", "0", " "):  # a text the vocabulary knows: its leading special tokens are the prefix
            try:
                encoding = self.tok.encode(text)
            except Exception:  # a vocabulary without this character nor an unknown token
                continue
            mask = encoding.special_tokens_mask
            if not all(mask):
                return encoding.ids[:mask.index(0)]
        return []

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))


# What a Hugging Face folder's tokenizer is made of (transformers reads the same files); copied as they are
# into a run folder or a prepared data folder with the tokenizer.json, so that they keep the chat template.
HF_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


class HFTokenizer(BPETokenizer):
    """A Hugging Face folder's ``tokenizer.json`` with its ``tokenizer_config.json``: encoded by ``tokenizers``
    as the file says, with the BOS/EOS tokens the config names (``eos_token``: Qwen3's ``<|im_end|>``, Llama
    3.1's ``<|eot_id|>``) and its chat template (rendered by ``data/chat.py`` through transformers).

    Padding side and pad token do not matter here: instruction rows are padded on the right with target
    -100 (data/instructions.py) and attention is causal, so no real token ever sees a pad."""

    def __init__(self, tok, folder: Path, config: dict, special_map: dict):
        super().__init__(tok)
        self.folder = folder
        self.config = config
        # tokenizer_config.json's value first, then special_tokens_map.json's (older folders), as transformers
        # reads them; a folder that names none keeps what BPETokenizer found (our own "<|eos|>", if any).
        for attr, key in (("eos_id", "eos_token"), ("bos_id", "bos_token")):
            name = _token_name(config[key] if key in config else special_map.get(key))
            if name is not None:
                token_id = tok.token_to_id(name)
                if token_id is None:
                    raise DataError(f"{folder / 'tokenizer_config.json'}: {key} {name!r} is not in tokenizer.json")
                setattr(self, attr, token_id)
            elif key in config:  # named as null (Qwen3's bos_token): there is none
                setattr(self, attr, None)
        self._transformers = None

    @property
    def has_chat_template(self) -> bool:
        """Whether the folder brings its own chat template (in tokenizer_config.json or a separate file)."""
        return bool(self.config.get("chat_template")) or any(
            (self.folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json"))

    def transformers_tokenizer(self):
        """The folder loaded by transformers' ``AutoTokenizer`` (for ``apply_chat_template``), once."""
        if self._transformers is None:
            self._transformers = load_transformers_tokenizer(self.folder)
        return self._transformers

    def save(self, path: str | Path) -> None:
        """``path`` (a tokenizer.json) and the folder's other tokenizer files beside it, copied unchanged."""
        path = Path(path)
        for source, target in [(self.folder / "tokenizer.json", path)] + [
                (self.folder / name, path.parent / name) for name in HF_TOKENIZER_FILES]:
            if source.is_file() and source.resolve() != target.resolve():  # a resumed run saves onto itself
                shutil.copyfile(source, target)


def _token_name(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_transformers_tokenizer(folder: str | Path):
    """transformers' tokenizer of a Hugging Face folder (what ``apply_chat_template`` belongs to); without
    transformers installed, a DataError saying what to install."""
    folder = Path(folder)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{folder}: rendering its chat template needs transformers (pip install "
                        f"'scaletrain[finetune]'), or set finetune.chat_template = 'plain'") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, ...); one line for people
        first_line = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise DataError(f"{folder}: transformers cannot load its tokenizer ({first_line})") from None
    jinja = folder / "chat_template.jinja"
    if not hf.chat_template and jinja.is_file():  # older transformers read only tokenizer_config.json's
        hf.chat_template = jinja.read_text(encoding="utf-8")
    return hf


Tokenizer = CharTokenizer | BPETokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load any kind from a ``tokenizer.json``; one with a ``tokenizer_config.json`` beside it is an
    ``HFTokenizer``."""
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
    from tokenizers import Tokenizer as RustTokenizer

    try:
        rust = RustTokenizer.from_file(str(p))
    except Exception as exc:  # tokenizers raises its own Exception type
        raise DataError(f"{p}: cannot load as a Hugging Face tokenizer ({exc})") from None
    config_file = p.parent / "tokenizer_config.json"
    if config_file.is_file():
        config = _read_config(config_file)
        special_map = p.parent / "special_tokens_map.json"
        tok = HFTokenizer(rust, p.parent, config, _read_config(special_map) if special_map.is_file() else {})
    else:
        tok = BPETokenizer(rust)
    tok.source = str(p)  # named in encoding errors (data/encode.py)
    return tok


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object")
    return config


def encode_known(tokenizer: Tokenizer, text: str, where: str = "the text",
                 min_tokens: int = 0) -> tuple[list[int], Counter]:
    """Encode ``text``, leaving out the characters a char tokenizer does not know (e.g. a book's curly
    quotes scored by a model trained on Tiny Shakespeare). Returns (ids, count per skipped character); a
    byte-level BPE encodes every text, so nothing is skipped there. Fewer than ``min_tokens`` ids left (a text
    all or nearly all out of the vocabulary) is a DataError naming ``where`` (its file) and what was skipped."""
    unknown = Counter()
    if isinstance(tokenizer, CharTokenizer):
        unknown = Counter(c for c in text if c not in tokenizer.stoi)
        if unknown:
            text = "".join(c for c in text if c in tokenizer.stoi)
    ids = tokenizer.encode(text)
    if len(ids) < min_tokens:
        skipped = f"{_skipped_characters(unknown)} were skipped" if unknown else "nothing was skipped"
        raise DataError(f"{where}: {len(ids)} token(s) left to score, fewer than {min_tokens} (a context and a "
                        f"target): {skipped}; score a longer text, or one in the model's alphabet")
    return ids, unknown


def _skipped_characters(unknown: Counter) -> str:
    """ "27 characters not in the tokenizer's vocabulary (e.g. '’' x20, '‘' x5, '“' x2)"."""
    shown = ", ".join(f"{c!r} x{n}" for c, n in unknown.most_common(3))
    total = sum(unknown.values())
    return (f"{total:,} character{'s' if total != 1 else ''} not in the tokenizer's vocabulary "
            f"(e.g. {shown}{', ...' if len(unknown) > 3 else ''})")


def describe_skipped(unknown: Counter) -> str:
    """One line for ``encode_known``'s count: "skipped 27 characters not in the tokenizer's vocabulary
    (e.g. '’' x20, '‘' x5, '“' x2)"; empty when nothing was skipped."""
    if not unknown:
        return ""
    return f"skipped {_skipped_characters(unknown)}; the rest is scored"


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """(vocab_size,) int64: the UTF-8 bytes of text each token id stands for, so that the bytes of any scored
    tokens are a sum (bits per byte, ``train/evaluate.py``). A char token: its character's UTF-8 length. A
    byte-level BPE token (ours, GPT-2, Llama 3, Qwen): one byte per symbol of its byte alphabet. A SentencePiece-
    style piece (Mistral, Gemma): ``<0xNN>`` is one byte, ``▁`` a space. Special tokens (BOS, EOS, pad, chat
    markers) are 0: they stand for no text. Decoding tokens one by one would not do: a byte-level token that
    holds half a character decodes to U+FFFD, three bytes."""
    if isinstance(tokenizer, CharTokenizer):
        return np.array([len(c.encode("utf-8")) for c in tokenizer.chars], dtype=np.int64)
    tok = tokenizer.tok
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    added = tok.get_added_tokens_decoder()  # {id: AddedToken}: written as plain text, not in the byte alphabet
    byte_level = "ByteLevel" in json.dumps(json.loads(tok.to_str()).get("decoder"))
    alphabet = set(_byte_alphabet()) if byte_level else set()
    for token_id in range(len(lengths)):
        if token_id in added:
            lengths[token_id] = 0 if added[token_id].special else len(added[token_id].content.encode("utf-8"))
            continue
        piece = tok.id_to_token(token_id)
        if piece is None:  # a hole in the id range
            continue
        if byte_level and all(c in alphabet for c in piece):
            lengths[token_id] = len(piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            lengths[token_id] = 1
        else:
            lengths[token_id] = len(piece.replace("\u2581", " ").encode("utf-8"))
    return lengths


def _byte_alphabet() -> list[str]:
    """The 256 characters byte-level BPE writes bytes as (GPT-2's ``bytes_to_unicode``), in byte order."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()


def iter_batches(items: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
