"""Instruction data for fine-tuning: JSONL of prompt/response pairs or chat messages, loss on the answers only.

Accepted lines (one JSON object per line, blank lines skipped; the layouts of data/layouts.py):

    {"prompt": "...", "response": "..."}
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"instruction": "...", "input": "...", "output": "..."}                     Alpaca ("input" optional)
    {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}  ShareGPT

An Alpaca line is the prompt/response pair (instruction + "\\n\\n" + input, output): the input follows the
instruction after a blank line, as in Alpaca's own template ("### Instruction:", then "### Input:"), and an empty
input is left out. A ShareGPT line is the messages with human -> user, gpt -> assistant. prompt/response and
messages lines may share a file; any other mix is refused, naming the first line of another layout.

Two templates, chosen by ``finetune.chat_template`` (``uses_base_template``):

- the base's own chat template ('auto' when the base's tokenizer folder has one, or 'base'): the
  conversation is rendered by transformers' ``apply_chat_template`` and the targets are the assistant turns'
  contents and end-of-turn tokens, found in the rendered text (data/chat.py). A prompt/response line is the
  conversation [user: prompt, assistant: response].
- our plain template ('plain', or 'auto' for a base without a template): plain text in letters, colons and
  newlines only, so it works with any tokenizer - even a character vocabulary learnt from a play (no special
  tokens, no '#')::

    prompt/response:  "Instruction:\\n{prompt}\\n\\nResponse:\\n" + "{response}" + end
    messages:         "{Role}:\\n{content}\\n\\n" per system/user message, and "Assistant:\\n" + "{content}" + end
                      per assistant message

  ``end`` is the tokenizer's end-of-text token when it has one, else "\\n\\n". Only the response / assistant
  tokens (and ``end``) are targets. The pieces are encoded one by one without special tokens, after the ones
  the tokenizer puts before every text (Llama 3's ``<|begin_of_text|>``), once.

Everything that is no target has target -100, which ``F.cross_entropy`` ignores. Each example is cut at
``seq_len + 1`` tokens (counted and reported). Padded (``make_rows``): one example a row, padded with target -100.
Packed (``pack_rows``, finetune.packing): several examples a row, padding only at its end, with document ids
that the trainer turns into a block-causal mask, and rotary positions restarting at each example (the model
counts them from the mask), so no example attends to another and each example's loss is its padded loss. Either
way the loss is the mean over a micro-batch's answer tokens.

``render_prompt`` gives generation the prompt a model fine-tuned either way reads, ``stop_ids`` the tokens
that end its answer;
``python -m scaletrain.data.instructions FOLDER FILE.jsonl [N]`` prints the first N examples of a file with
their targets in ``[`` ``]``.
"""

from __future__ import annotations

import codecs
import json
import sys
from bisect import bisect_left, insort
from collections.abc import Iterator
from functools import lru_cache, partial
from pathlib import Path

import numpy as np
import torch

from scaletrain.data.chat import encode_conversation, mask_preview, render, uses_base_template
from scaletrain.data.layouts import FAMILY, fields_seen, instruction_layout
from scaletrain.data.sources import legacy_encoding_note, not_text_reason
from scaletrain.data.tokenizer import BPETokenizer, DataError, Tokenizer, load_tokenizer

IGNORE = -100  # F.cross_entropy's default ignore_index
INSTRUCTION = "Instruction:\n{prompt}\n\nResponse:\n"
ASSISTANT = "Assistant:\n"


ROLES = ("system", "user", "assistant")


def check_messages(messages: object, where: str) -> None:
    """The one rule for a ``messages`` list (fine-tuning data and generation prompts alike): a non-empty list of
    {"role": system|user|assistant, "content": str}. A DataError names the line (``where``) and the first bad
    message: a role no template knows would otherwise be dropped, or rendered as something else, silently."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role': {'|'.join(ROLES)}, "
                        f"'content': str}}")
    for number, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: message {number} must be {{'role': {'|'.join(ROLES)}, 'content': str}}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {number} has role {m['role']!r}; it must be one of "
                            f"{', '.join(ROLES)}")


SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def _alpaca_prompt(record: dict, where: str) -> str:
    """Alpaca's instruction and its optional input as one prompt: the two joined by a blank line, as Alpaca's
    template puts the "### Input:" section after the instruction (an empty or missing input: the instruction)."""
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"{where}: Alpaca's 'input' must be a string (got {type(extra).__name__})")
    return f"{record['instruction']}\n\n{extra}" if extra and extra.strip() else record["instruction"]


def _sharegpt_messages(turns: list, where: str) -> list[dict]:
    """ShareGPT's ``conversations`` (``{"from": system|human|gpt, "value": str}``) as messages."""
    messages = []
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or turn.get("from") not in \
                SHAREGPT_ROLES:
            raise DataError(f"{where}: conversation turn {number} must be {{'from': {'|'.join(SHAREGPT_ROLES)}, "
                            f"'value': str}} (got {json.dumps(turn, ensure_ascii=False)[:80]})")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages


def _conversation(record: object, where: str) -> tuple[list[dict], bool]:
    """One JSONL record in any layout (data/layouts.py) as (messages, whether it is one prompt and its answer,
    which the plain template writes as an instruction and its response)."""
    layout = instruction_layout(record)
    if layout == "prompt/response":
        return [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]}], True
    if layout == "Alpaca":
        return [{"role": "user", "content": _alpaca_prompt(record, where)},
                {"role": "assistant", "content": record["output"]}], True
    if layout in ("messages", "ShareGPT"):
        messages = record["messages"] if layout == "messages" else _sharegpt_messages(record["conversations"], where)
        check_messages(messages, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: {'messages' if layout == 'messages' else 'conversations'!r} has no "
                            f"{'assistant' if layout == 'messages' else 'gpt'} turn to learn from")
        return messages, False
    raise DataError(f"{where}: needs string fields 'prompt' and 'response', a 'messages' list of "
                    f"{{'role': system|user|assistant, 'content': str}}, Alpaca's 'instruction' and 'output' "
                    f"(and an optional 'input'), or ShareGPT's 'conversations' list of {{'from': human|gpt|system, "
                    f"'value': str}} ({fields_seen(record)})")


def _segments(messages: list[dict], is_pair: bool) -> list[tuple[str, bool]]:
    """A conversation in the plain template as [(text, is_target)]."""
    if is_pair:
        return [(INSTRUCTION.format(prompt=messages[0]["content"]), False), (messages[1]["content"], True)]
    return message_segments(messages)


def message_segments(messages: list[dict]) -> list[tuple[str, bool]]:
    """Chat messages [{"role", "content"}] in the template, as [(text, is_target)]: the assistant's words are
    the targets (each followed by ``end`` in ``encode_example``)."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            out += [(ASSISTANT, False), (m["content"], True)]
        else:
            out.append((f"{m['role'].capitalize()}:\n{m['content']}\n\n", False))
    return out


def chat_prompt(messages: list[dict], tokenizer: Tokenizer) -> list[int]:
    """The ids a model fine-tuned on this template reads before its next answer: the conversation so far, then
    "Assistant:\n" (``scaletrain chat``)."""
    ids, _ = encode_example(message_segments(messages) + [(ASSISTANT, False)], tokenizer)
    return ids


def end_text(tokenizer: Tokenizer) -> str | None:
    """What ends an answer as text, when the tokenizer has no end-of-text token ("\n\n"); else None."""
    return None if tokenizer.eos_id is not None else "\n\n"


def jinja_chat_template(tokenizer: Tokenizer) -> str:
    """The messages template above as a Jinja chat template (Hugging Face's ``chat_template``, GGUF's
    ``tokenizer.chat_template``), for runtimes that render conversations themselves (llama.cpp, Ollama)."""
    end = "{{ eos_token }}" if tokenizer.eos_id is not None else "\n\n"
    return ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
            "{{ 'Assistant:\n' + message['content'] }}" + end + "{% else %}"
            "{{ message['role'] | capitalize + ':\n' + message['content'] + '\n\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'Assistant:\n' }}{% endif %}")


def encode_example(segments: list[tuple[str, bool]], tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids and, per id, whether it is a target. A target segment ends with the end token."""
    ids: list[int] = tokenizer.prefix_ids()
    target: list[bool] = [False] * len(ids)
    for text, is_target in segments:
        piece = tokenizer.encode_text(text)
        ids += piece
        target += [is_target] * len(piece)
        if is_target:
            end = [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n\n")
            ids += end
            target += [True] * len(end)
    return ids, target


def encode_record(record: object, where: str, tokenizer: Tokenizer, hf) -> tuple[np.ndarray, np.ndarray]:
    """One prompt/response or messages record as (ids, is_target) arrays: in the base's template when ``hf``
    (its transformers tokenizer) is given, else in the plain one; a bad record is a DataError naming ``where``."""
    messages, is_pair = _conversation(record, where)
    try:
        ids, target = (encode_conversation(messages, hf) if hf is not None
                       else encode_example(_segments(messages, is_pair), tokenizer))
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None
    return np.array(ids, dtype=np.int64), np.array(target, dtype=bool)


def jsonl_records(path: str | Path, setting: str) -> Iterator[tuple[str, object]]:
    """(``file:line``, the parsed record) of every non-blank line of a JSONL file, read as ``prepare``'s text
    reader reads (data/sources.py): a UTF-8 byte order mark dropped, a UTF-16 or binary file named as such. A
    missing file names ``setting`` (e.g. finetune.instructions); bytes that are not UTF-8 (named with their
    offset in the file) and a line that is not JSON are a DataError naming the line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{setting}: file not found: {path}")
    with path.open("rb") as fh:
        reason = not_text_reason(fh.read(8192), path)
        if reason:
            raise DataError(f"{setting}: {path}: {reason}")
        fh.seek(0)
        offset = 0  # of the line in the file, for the message naming a byte that is not UTF-8
        for number, raw in enumerate(fh, 1):
            start, offset = offset, offset + len(raw)
            if number == 1 and raw.startswith(codecs.BOM_UTF8):  # what Windows editors put first
                raw, start = raw[len(codecs.BOM_UTF8):], start + len(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 at byte {start + exc.start:,} of the file"
                                f"{legacy_encoding_note(raw, path)}") from None
            try:
                yield where, json.loads(line)
            except ValueError:
                raise DataError(f"{where}: not a JSON object") from None


def read_instructions(path: str | Path, tokenizer: Tokenizer,
                      chat_template: str = "auto") -> list[tuple[np.ndarray, np.ndarray]]:
    """Every example of a JSONL file as (ids, is_target) arrays, in the template ``chat_template`` chooses
    (module docstring); a bad line is a DataError naming it."""
    hf = tokenizer.transformers_tokenizer() if uses_base_template(tokenizer, chat_template) else None
    examples, first = [], None  # first: (file:line, layout) of the first example, which the others must share
    for where, record in jsonl_records(path, "finetune.instructions"):
        layout = instruction_layout(record)
        if first is None:
            first = where, layout
        elif layout is not None and FAMILY[layout] != FAMILY[first[1]]:
            raise DataError(f"{where}: a line in the {layout} layout, but the file's first example ({first[0]}) is "
                            f"in the {first[1]} layout; one file holds one layout: convert or split it")
        examples.append(encode_record(record, where, tokenizer, hf))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def split_examples(examples: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """(train, val): a deterministic ``val_fraction`` of the examples held out (at least one of each when
    there are two or more)."""
    order = np.random.default_rng([seed, 7]).permutation(len(examples))
    n_val = min(max(1 if val_fraction > 0 and len(examples) > 1 else 0, round(val_fraction * len(examples))),
                len(examples) - 1)
    return [examples[i] for i in sorted(order[n_val:])], [examples[i] for i in sorted(order[:n_val])]


def make_rows(examples: list, seq_len: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (N, seq_len): next-token targets, -100 where the token is no target or padding."""
    inputs = np.full((len(examples), seq_len), pad_id, dtype=np.int64)
    targets = np.full((len(examples), seq_len), IGNORE, dtype=np.int64)
    for row, (ids, is_target) in enumerate(examples):
        ids, is_target = ids[:seq_len + 1], is_target[:seq_len + 1]
        n = len(ids) - 1
        inputs[row, :n] = ids[:-1]
        targets[row, :n] = np.where(is_target[1:], ids[1:], IGNORE)
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def pack_rows(examples: list, seq_len: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, doc_ids), each (R, seq_len): several examples a row, padding only at a row's end.

    Each example is cut at ``seq_len + 1`` tokens as ``make_rows`` cuts it and takes ``len - 1`` positions; rows
    are filled best-fit decreasing (the longest example first, into the row it leaves the least room in), a
    deterministic function of the examples, so a resume finds the same rows. ``doc_ids`` numbers the examples of
    a row 0, 1, ... and gives the padding one more id of its own: the block-causal mask
    (``data.loader.block_causal_mask``) keeps every example from seeing another, and the padding sees only
    padding (no query is left without a key). Targets of padding are -100."""
    lengths = [min(len(ids), seq_len + 1) - 1 for ids, _ in examples]
    rows: list[list[int]] = []  # example indices of each row
    room: list[tuple[int, int]] = []  # (free positions, row), sorted: the best fit is the first with enough room
    for index in sorted(range(len(examples)), key=lambda i: (-lengths[i], i)):
        slot = bisect_left(room, (lengths[index], -1))
        if slot == len(room):
            rows.append([])
            free, row = seq_len, len(rows) - 1
        else:
            free, row = room.pop(slot)
        rows[row].append(index)
        if free - lengths[index] > 0:
            insort(room, (free - lengths[index], row))
    inputs = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    targets = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
    doc_ids = np.zeros((len(rows), seq_len), dtype=np.int64)
    for r, members in enumerate(rows):
        start = 0
        for doc, index in enumerate(members):
            ids, is_target = examples[index][0][:seq_len + 1], examples[index][1][:seq_len + 1]
            end = start + len(ids) - 1
            inputs[r, start:end] = ids[:-1]
            targets[r, start:end] = np.where(is_target[1:], ids[1:], IGNORE)
            doc_ids[r, start:end] = doc
            start = end
        doc_ids[r, start:] = len(members)  # the padding: a document of its own
    return torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(doc_ids)


def truncated(examples: list, seq_len: int) -> int:
    return sum(len(ids) > seq_len + 1 for ids, _ in examples)


class InstructionLoader:
    """``TokenLoader``'s interface over instruction rows: (inputs, targets) batches forever - (inputs, targets,
    doc_ids) when ``packed`` (``pack_rows``: the trainer turns the ids into a block-causal mask) - each
    data-parallel rank its slice of one global batch, the order a pure function of (seed, epoch), and a
    ``state_dict`` so a resume continues with the next unseen row."""

    def __init__(self, examples: list, seq_len: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, packed: bool = False):
        self.packed = packed
        self.doc_ids = None
        if packed:
            self.inputs, self.targets, self.doc_ids = pack_rows(examples, seq_len)
        else:
            self.inputs, self.targets = make_rows(examples, seq_len)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle, self.seq_len = seed, shuffle, seq_len
        self.epoch, self.cursor = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.inputs)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        mine = self._next_rows()
        if self.doc_ids is not None:
            return self.inputs[mine], self.targets[mine], self.doc_ids[mine]
        return self.inputs[mine], self.targets[mine]

    def _next_rows(self) -> torch.Tensor:
        """The example indices of this rank's next micro-batch (the cursor moves over the whole global batch)."""
        rows = []
        for _ in range(self.batch_size * self.world_size):  # the global batch, then this rank's slice
            if self.cursor >= len(self.inputs):
                self.epoch, self.cursor = self.epoch + 1, 0
            rows.append(int(self._order(self.epoch)[self.cursor]))
            self.cursor += 1
        return torch.tensor(rows[self.rank * self.batch_size:(self.rank + 1) * self.batch_size])

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "examples": len(self.inputs), "packed": self.packed}

    def load_state_dict(self, state: dict) -> None:
        state = {"packed": False, **state}  # a checkpoint from before packing was padded
        for key in ("seq_len", "seed", "examples", "packed"):
            if state.get(key) != self.state_dict()[key]:
                raise DataError(f"cannot resume the instruction data: {key} was {state.get(key)}, now "
                                f"{self.state_dict()[key]}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def instruction_eval_batches(examples: list, seq_len: int, batch_size: int, num_batches: int):
    """The first ``num_batches`` batches of the held-out examples (all when <= 0), in file order."""
    inputs, targets = make_rows(examples, seq_len)
    n = len(inputs) if num_batches <= 0 else min(len(inputs), num_batches * batch_size)
    for i in range(0, n, batch_size):
        yield inputs[i:i + batch_size], targets[i:i + batch_size]


def instruction_splits(path: str | Path, tokenizer: Tokenizer, seq_len: int, val_fraction: float, seed: int,
                       message=print, chat_template: str = "auto") -> tuple[list, list]:
    """(train, val) examples of a JSONL file for rows of ``seq_len``, in the template ``chat_template``
    (finetune.chat_template) chooses; says how many were cut, and drops (with a count) those whose answer
    starts beyond ``seq_len`` (no target left: nothing to learn)."""
    examples = read_instructions(path, tokenizer, chat_template)
    cut = truncated(examples, seq_len)
    kept = [(ids, t) for ids, t in examples if t[1:seq_len + 1].any()]
    if not kept:
        raise DataError(f"{path}: no example has an answer token within data.seq_len={seq_len}; raise it")
    if cut or len(kept) < len(examples):
        message(f"instructions {path}: {len(examples)} examples, {cut} cut at data.seq_len={seq_len} + 1 tokens, "
                f"{len(examples) - len(kept)} dropped (answer beyond it)")
    train, val = split_examples(kept, val_fraction, seed)
    if not val:
        raise DataError(f"{path}: {len(kept)} example(s) leave none for validation; add examples or set "
                        f"data.val_fraction > 0")
    return train, val


@lru_cache(maxsize=4)
def _tokenizer_of(folder: Path, stamp: tuple) -> Tokenizer:
    return load_tokenizer(folder / "tokenizer.json")


def folder_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of a folder (a Hugging Face folder or a run), loaded again only when its files change."""
    folder = Path(folder).resolve()
    if not (folder / "tokenizer.json").is_file():
        raise DataError(f"{folder}: no tokenizer.json")
    stamp = tuple((p.name, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if "token" in p.name
                  or p.name.startswith("chat_template"))
    return _tokenizer_of(folder, stamp)


def render_prompt(messages: list[dict], tokenizer_folder: str | Path, add_generation_prompt: bool = True,
                  chat_template: str = "auto") -> list[int]:
    """The token ids of ``messages`` as a model fine-tuned with ``finetune.chat_template = chat_template`` read
    them in training - with ``add_generation_prompt``, what it reads before its next answer (``generate``,
    ``chat``). ``tokenizer_folder``: the base's Hugging Face folder or a run folder (a run fine-tuned from a
    Hugging Face folder keeps its tokenizer files). The plain template's generation prompt is "Assistant:\\n"."""
    tokenizer = folder_tokenizer(tokenizer_folder)
    if uses_base_template(tokenizer, chat_template):
        hf = tokenizer.transformers_tokenizer()
        return list(hf(render(hf, messages, add_generation_prompt), add_special_tokens=False)["input_ids"])
    segments = message_segments(messages) + ([(ASSISTANT, False)] if add_generation_prompt else [])
    return encode_example(segments, tokenizer)[0]


# The texts of the tokens that end a generation in the families' vocabularies, as llama.cpp's vocabulary reader
# lists them (its "end of generation" tokens): a family ends a turn with one and a text with another (Llama 3:
# <|eot_id|> closes a turn, <|end_of_text|> a text, <|eom_id|> a tool call's message; Qwen: <|im_end|> and
# <|endoftext|>), and a model fine-tuned briefly may still produce the one its template does not close with.
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
                     "<end_of_turn>", "<|end▁of▁sentence|>", "<|return|>", "<|call|>", "<EOT>")


def end_of_generation_ids(tokenizer: Tokenizer) -> list[int]:
    """The EOS and every token of ``END_OF_GENERATION`` in ``tokenizer``'s vocabulary (a character or plain BPE
    vocabulary has none of them; its EOS, when it has one, is ours)."""
    ids = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    if isinstance(tokenizer, BPETokenizer):
        ids += [i for i in map(tokenizer.tok.token_to_id, END_OF_GENERATION) if i is not None]
    return list(dict.fromkeys(ids))


def stop_ids(tokenizer_folder: str | Path, chat_template: str = "auto") -> list[int]:
    """The ids that end an answer in the template training used, for generation to stop at: with the base's
    template, the token that closes an assistant turn first (the last target of a one-turn conversation:
    ``<|im_end|>``, ``<|eot_id|>``, Gemma's ``<end_of_turn>``, which is not always the EOS), then the EOS and
    the vocabulary's other end-of-generation tokens (``end_of_generation_ids``); with the plain template, the
    latter (none when the tokenizer has none: "\\n\\n" text ends it, ``end_text``)."""
    tokenizer = folder_tokenizer(tokenizer_folder)
    ids = end_of_generation_ids(tokenizer)
    if uses_base_template(tokenizer, chat_template):
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        tokens, target = encode_conversation(probe, tokenizer.transformers_tokenizer())
        last = max(i for i, t in enumerate(target) if t)
        ids = list(dict.fromkeys([tokens[last]] + ids))
    return ids


def preview(folder: str | Path, path: str | Path, count: int = 3, chat_template: str = "auto") -> str:
    """The first ``count`` examples of an instruction JSONL as a fine-tune from ``folder`` sees them: the
    tokens as text, the targets between ``[`` and ``]``."""
    tokenizer = folder_tokenizer(folder)
    if uses_base_template(tokenizer, chat_template):
        decode = tokenizer.transformers_tokenizer().decode
    elif isinstance(tokenizer, BPETokenizer):  # show the end-of-text token, which decode leaves out
        decode = partial(tokenizer.tok.decode, skip_special_tokens=False)
    else:
        decode = tokenizer.decode
    examples = read_instructions(path, tokenizer, chat_template)[:count]
    return "\n\n".join(f"--- example {n} ---\n{mask_preview(ids.tolist(), target.tolist(), decode)}"
                        for n, (ids, target) in enumerate(examples, 1))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m scaletrain.data.instructions TOKENIZER_FOLDER FILE.jsonl [COUNT]")
    try:
        print(preview(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else 3))
    except DataError as exc:
        sys.exit(f"error: {exc}")
