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

from typing import TextIO

import torch
from torch import nn

from scaletrain.data.tokenizer import DataError, Tokenizer
from scaletrain.infer.session import ConversationFormat, Render, Session, conversation_format, plain_format
from scaletrain.model.decode import StaticDecoder
from scaletrain.model.generate import Sampling

__all__ = ["Chat", "ConversationFormat", "Render", "conversation_format", "plain_format"]


class Chat:
    """A terminal conversation over a ``Session`` (``over``), or over a model and its parts (the session made here)."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, context: int, sampling: Sampling, max_tokens: int,
                 stops: list[str], generator: torch.Generator, system: str = "",
                 conversation: ConversationFormat | None = None, decoder: StaticDecoder | None = None):
        fmt = conversation or plain_format(tokenizer)  # the run's own format (conversation_format), else plain
        self.session = Session(model, tokenizer, context, fmt, decoder)
        self.tokenizer, self.context = tokenizer, context
        self.sampling, self.max_tokens, self.generator = sampling, max_tokens, generator
        self.render = fmt.render
        self.stops = list(stops) + fmt.stop_texts
        self.system = system
        self.history: list[dict] = []

    @classmethod
    def over(cls, session: Session, sampling: Sampling, max_tokens: int, stops: list[str],
             generator: torch.Generator, system: str = "") -> Chat:
        return cls(session.model, session.tokenizer, session.context, sampling, max_tokens, stops, generator,
                   system, session.conversation, session.decoder)

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
        answer = ""
        for piece in self.session.text_stream(ids, min(self.max_tokens, self.context - len(ids)), self.sampling,
                                              self.generator, self.stops):
            out.write(piece)
            out.flush()
            answer += piece
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
