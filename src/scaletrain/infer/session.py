"""The generation API: one ``Session`` a run folder (model, tokenizer, chat template, stop ids, decoder), under
``scaletrain generate``, ``scaletrain chat`` and ``scaletrain serve`` alike.

``Session.from_run(run)`` reads any run ``checkpoint.run.load_run`` reads (pretrained, fine-tuned with
adapters, pruned, quantized, a family base with its own template); ``stream`` / ``generate`` continue token
ids, ``text_stream`` yields the text as it becomes final (held back while it may still turn into a stop string),
``chat`` renders a conversation in the run's template first. The sampling defaults of every command are
``SAMPLING_DEFAULTS``; the ids that end an answer are the conversation format's (``stop_ids``: the template's
end of turn and every end-of-generation token of the vocabulary).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from scaletrain.core.files import human_bytes
from scaletrain.core.options import ConfigError
from scaletrain.data.chat import uses_base_template
from scaletrain.data.instructions import chat_prompt, end_of_generation_ids, end_text, render_prompt, stop_ids
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.infer.load import load_run
from scaletrain.infer.text import StreamPrinter
from scaletrain.model.decode import StaticDecoder, dequantized_bytes, slower_than_eager, supports
from scaletrain.model.generate import Sampling, stop_at_strings, stream

Render = Callable[[list[dict]], list[int]]

# Each command's sampling when the user says nothing: `generate` continues text (varied), `chat` answers (a little
# more focused), `serve` follows the OpenAI API's defaults (temperature 1, all tokens, top_p 1).
SAMPLING_DEFAULTS: dict[str, Sampling] = {
    "generate": Sampling(temperature=0.8, top_k=200),
    "chat": Sampling(temperature=0.7, top_k=50),
    "serve": Sampling(temperature=1.0, top_k=0),
}


def default_sampling(command: str, **changes) -> Sampling:
    """``SAMPLING_DEFAULTS[command]`` with ``changes`` (a copy: the table is never written)."""
    return replace(SAMPLING_DEFAULTS[command], **changes)


@dataclass
class ConversationFormat:
    """How a run reads a conversation: ``render`` (messages -> the prompt ids that end where its answer starts)
    and what ends an answer: token ids (the template's end of turn, the EOS, the vocabulary's other ends) and
    texts (the plain template's "\\n\\n" for a tokenizer without an EOS)."""

    render: Render
    stop_ids: list[int]
    stop_texts: list[str]


def plain_format(tokenizer: Tokenizer) -> ConversationFormat:
    """scaletrain's plain template (data/instructions.py: ``chat_prompt``, ``end_text``)."""
    end = end_text(tokenizer)
    return ConversationFormat(lambda messages: chat_prompt(messages, tokenizer), end_of_generation_ids(tokenizer),
                              [end] if end else [])


def conversation_format(run_dir: str | Path, tokenizer: Tokenizer, chat_template: str) -> ConversationFormat:
    """The format a run was fine-tuned in. ``chat_template``: the run's ``finetune.chat_template``; with the base's
    template the run folder holds the base's tokenizer files (tokenizer_config.json with its chat_template)."""
    if uses_base_template(tokenizer, chat_template):
        return ConversationFormat(lambda messages: render_prompt(messages, run_dir, True, chat_template),
                                  stop_ids(run_dir, chat_template), [])
    return plain_format(tokenizer)


def compiled_decoder(model: nn.Module, run: str, capacity: int = 0) -> StaticDecoder | None:
    """``--compile``'s decoder (``capacity``: fixed slots, chat's whole context), a ConfigError saying why this
    run's model cannot have one, or None (the eager decode, said in one line) where it would be slower."""
    reason = supports(model)
    if reason:
        raise ConfigError(f"--compile: the compiled decode cannot run {run}'s model ({reason}); drop --compile")
    slower = slower_than_eager(model)
    if slower:
        print(f"--compile: decoding eagerly: the compiled step is slower here for {slower}", file=sys.stderr)
        return None
    decoder = StaticDecoder(model, capacity=capacity)
    if decoder.held:
        half, full = (human_bytes(dequantized_bytes(model, itemsize)) for itemsize in (2, 4))
        print(f"--compile: int8 weights on a CPU without AVX-512, where inductor's int8 kernels run slower than the "
              f"eager decode: the compiled step holds them as float16 at one row (+{half}) and as float32 "
              f"at more (+{full}) while it decodes", file=sys.stderr)
    return decoder


class TextSink:
    """A ``TextIO`` stand-in that keeps what a ``StreamPrinter`` writes, for the caller to take as deltas."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self.parts = "".join(self.parts), []
        return text


@dataclass
class Session:
    """A run's model ready to generate: ``context`` is the trained one (``data.seq_len``), ``conversation`` the
    template it was fine-tuned in, ``decoder`` the compiled decode (``--compile``) or None (eager)."""

    model: nn.Module
    tokenizer: Tokenizer
    context: int
    conversation: ConversationFormat
    decoder: StaticDecoder | None = None
    name: str = "model"

    @classmethod
    def from_run(cls, run: str | Path, device: str = "cpu", compile: bool = False, capacity: int = 0) -> Session:
        """The session of any run folder; ``compile``: with ``compiled_decoder(capacity=...)``."""
        cfg, model, tokenizer, _ = load_run(run, device)
        fmt = conversation_format(run, tokenizer, cfg.finetune.chat_template)
        decoder = compiled_decoder(model, str(run), capacity=capacity) if compile else None
        return cls(model, tokenizer, cfg.data.seq_len, fmt, decoder, Path(run).resolve().name)

    @property
    def stop_ids(self) -> list[int]:
        """The ids that end an answer (not produced): the template's end of turn, the EOS, the other ends."""
        return self.conversation.stop_ids

    def render(self, messages: list[dict]) -> list[int]:
        """The prompt ids of a conversation in the run's template, ending where the assistant's answer starts."""
        return self.conversation.render(messages)

    def stream(self, prompts: list[list[int]], max_tokens: int, sampling: Sampling | None = None,
               generator: torch.Generator | None = None, stops: list[str] | tuple[str, ...] = (), *,
               slide: bool = True, use_cache: bool = True) -> Iterator[list[tuple[int, int]]]:
        """``model.generate.stream`` over this run: each step's [(row, token)], ending at ``stop_ids``, a stop
        string of ``stops``, ``max_tokens`` or (``slide=False``) the context; greedy without ``sampling``."""
        return stream(self.model, prompts, max_tokens, max_seq_len=self.context, sampling=sampling,
                      generator=generator, stop_id=self.stop_ids, vocab_limit=self.tokenizer.vocab_size,
                      stop=stop_at_strings(self.tokenizer.decode, list(stops)) if stops else None,
                      use_cache=use_cache, slide=slide, decoder=self.decoder)

    def generate(self, prompts: list[list[int]], max_tokens: int, sampling: Sampling | None = None,
                 generator: torch.Generator | None = None, stops: list[str] | tuple[str, ...] = (),
                 **kw) -> list[list[int]]:
        """The new tokens of every prompt (``stream``'s arguments), the rows generated as one batch."""
        new: list[list[int]] = [[] for _ in prompts]
        for step in self.stream(prompts, max_tokens, sampling, generator, stops, **kw):
            for row, token in step:
                new[row].append(token)
        return new

    def text_stream(self, prompt: list[int], max_tokens: int, sampling: Sampling | None = None,
                    generator: torch.Generator | None = None, stops: list[str] | tuple[str, ...] = (),
                    **kw) -> Iterator[str]:
        """The new text of one prompt, a piece at each step where some became final, cut before the first stop
        string (the pieces joined are the whole answer)."""
        sink = TextSink()
        printer = StreamPrinter(self.tokenizer.decode, list(stops), sink)
        for step in self.stream([prompt], max_tokens, sampling, generator, stops, **kw):
            for _, token in step:
                printer.add(token)
            if sink.parts:
                yield sink.take()
        printer.finish()
        if sink.parts:
            yield sink.take()

    def chat(self, messages: list[dict], max_tokens: int, sampling: Sampling | None = None,
             generator: torch.Generator | None = None, stops: list[str] | tuple[str, ...] = ()) -> Iterator[str]:
        """The answer to a conversation as ``text_stream`` pieces: rendered in the run's template, ended by its
        end of turn (or the plain template's end text), within the context."""
        prompt = self.render(messages)
        if len(prompt) >= self.context:
            raise ConfigError(f"the conversation is {len(prompt)} tokens with the template; the model's context "
                              f"is {self.context}")
        return self.text_stream(prompt, min(max_tokens, self.context - len(prompt)), sampling, generator,
                                list(stops) + self.conversation.stop_texts)
