"""``scaletrain chat``: a terminal conversation in the template the run was fine-tuned with.

The history is rendered in the template the run was fine-tuned with (``conversation_format``): the base's own
chat template (``finetune.chat_template``, rendered by transformers' ``apply_chat_template``) when the run used
it, else scaletrain's plain template ("System:", "User:", "Assistant:" blocks, ``data.instructions.chat_prompt``).
The answer is streamed as it is generated and ended by the template's end-of-turn token or the EOS, or by
"\\n\\n" with a tokenizer that has neither (the plain template's end). Before each answer the conversation is
cut, oldest turns first, until it leaves room for the answer (``--max-tokens``, at most half the context)
within the trained context; each cut is announced. A message that does not fit even alone is refused, and
the conversation kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from scaletrain.data.chat import uses_base_template
from scaletrain.data.instructions import chat_prompt, end_text, render_prompt, stop_ids
from scaletrain.data.tokenizer import DataError, Tokenizer
from scaletrain.infer.text import StreamPrinter
from scaletrain.model.decode import StaticDecoder
from scaletrain.model.generate import Sampling, stop_at_strings, stream

Render = Callable[[list[dict]], list[int]]


@dataclass
class ConversationFormat:
    """How a run reads a conversation: ``render`` (messages -> the prompt ids that end where its answer starts)
    and what ends an answer: token ids (the template's end of turn, the EOS) and texts (the plain template's
    "\\n\\n" for a tokenizer without an EOS)."""

    render: Render
    stop_ids: list[int]
    stop_texts: list[str]


def plain_format(tokenizer: Tokenizer) -> ConversationFormat:
    """scaletrain's plain template (data/instructions.py: ``chat_prompt``, ``end_text``)."""
    end = end_text(tokenizer)
    return ConversationFormat(lambda messages: chat_prompt(messages, tokenizer),
                              [] if tokenizer.eos_id is None else [tokenizer.eos_id], [end] if end else [])


def conversation_format(run_dir: str | Path, tokenizer: Tokenizer, chat_template: str) -> ConversationFormat:
    """The format a run was fine-tuned in. ``chat_template``: the run's ``finetune.chat_template``; with the base's
    template the run folder holds the base's tokenizer files (tokenizer_config.json with its chat_template)."""
    if uses_base_template(tokenizer, chat_template):
        return ConversationFormat(lambda messages: render_prompt(messages, run_dir, True, chat_template),
                                  stop_ids(run_dir, chat_template), [])
    return plain_format(tokenizer)


class Chat:
    def __init__(self, model: nn.Module, tokenizer: Tokenizer, context: int, sampling: Sampling, max_tokens: int,
                 stops: list[str], generator: torch.Generator, system: str = "",
                 conversation: ConversationFormat | None = None, decoder: StaticDecoder | None = None):
        self.model, self.tokenizer, self.context = model, tokenizer, context
        self.sampling, self.max_tokens, self.generator = sampling, max_tokens, generator
        fmt = conversation or plain_format(tokenizer)  # the run's own format (conversation_format), else plain
        self.render, self.stop_ids = fmt.render, fmt.stop_ids
        self.stops = list(stops) + fmt.stop_texts
        self.system = system
        self.decoder = decoder  # ``--compile``: a StaticDecoder of the whole context (one compiled step a chat)
        self.history: list[dict] = []

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def prompt_ids(self, out: TextIO) -> list[int] | None:
        """The rendered conversation, oldest turns dropped until the answer has room; None when the last message
        alone does not fit (it is then removed)."""
        room = min(self.max_tokens, self.context // 2)
        dropped = 0
        ids = self.render(self.messages())
        while len(ids) + room > self.context and len(self.history) > 1:
            self.history.pop(0)  # the oldest user message, and the answer to it
            if self.history and self.history[0]["role"] == "assistant":
                self.history.pop(0)
            dropped += 1
            ids = self.render(self.messages())
        if dropped:
            out.write(f"(dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to stay within the "
                      f"model's {self.context}-token context)\n")
        if len(ids) >= self.context:
            self.history.pop()
            out.write(f"(not sent: this message is {len(ids)} tokens with the template"
                      f"{' and system message' if self.system else ''}, the model's context is {self.context})\n")
            return None
        return ids

    def answer(self, text: str, out: TextIO) -> str | None:
        """Stream the model's answer to the user's ``text``; the answer (None when the message was refused)."""
        undecodable = next((c for c in text if "\udc80" <= c <= "\udcff"), None)  # stdin's surrogateescape
        if undecodable is not None:  # a tokenizer cannot encode it (BPE's raised a TypeError)
            out.write(f"(not sent: the message is not UTF-8 text (byte 0x{ord(undecodable) - 0xdc00:02x}))\n")
            return None
        self.history.append({"role": "user", "content": text})
        try:
            ids = self.prompt_ids(out)
        except DataError as exc:  # a character the char tokenizer does not know
            self.history.pop()
            out.write(f"(not sent: {exc})\n")
            return None
        if ids is None:
            return None
        printer = StreamPrinter(self.tokenizer.decode, self.stops, out)
        stop = stop_at_strings(self.tokenizer.decode, self.stops) if self.stops else None
        for step in stream(self.model, [ids], min(self.max_tokens, self.context - len(ids)), max_seq_len=self.context,
                           sampling=self.sampling, generator=self.generator, stop_id=self.stop_ids,
                           vocab_limit=self.tokenizer.vocab_size, stop=stop, decoder=self.decoder):
            for _, token in step:
                printer.add(token)
        answer = printer.finish()
        out.write("\n")
        self.history.append({"role": "assistant", "content": answer})
        return answer

    def loop(self, lines: TextIO, out: TextIO) -> None:
        """Read messages and commands from ``lines`` until /exit or the end of input."""
        interactive = lines.isatty()
        if interactive:
            out.write(f"chat with the model ({self.context}-token context); /reset, /system TEXT, /exit\n")
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = lines.readline()
            if not line:
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip() == "/exit":
                break
            if text.strip() == "/reset":
                self.history = []
                out.write("(conversation reset)\n")
            elif text.startswith("/system"):
                self.system = text[len("/system"):].strip()
                out.write(f"(system message {'set' if self.system else 'cleared'})\n")
            else:
                self.answer(text, out)
            out.flush()
