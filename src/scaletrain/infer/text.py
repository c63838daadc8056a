"""Streaming text out of generated tokens: decode as the tokens come, hold back what may still turn into a stop
string (or an unfinished UTF-8 character), cut at the first stop string."""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from scaletrain.model.generate import cut_at_stop


class StreamPrinter:
    """Write the text of a growing token list to ``out`` as it becomes final."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], out: TextIO):
        self.decode, self.stops, self.out = decode, stops, out
        self.hold = max((len(s) for s in stops), default=1) - 1  # characters a stop string could still claim
        self.tokens: list[int] = []
        self.written = 0
        self.stopped = False

    def add(self, token: int) -> None:
        if self.stopped:
            return
        self.tokens.append(token)
        text = self.decode(self.tokens)
        cut = cut_at_stop(text, self.stops)
        if len(cut) < len(text):  # a stop string appeared: the text ends before it
            self._write(cut, len(cut))
            self.stopped = True
            return
        final = len(text) - self.hold
        while final > self.written and text[final - 1] == "\ufffd":  # half a multi-byte character so far
            final -= 1
        self._write(text, final)

    def finish(self) -> str:
        """Write what was held back; the whole text (cut at the first stop string)."""
        text = cut_at_stop(self.decode(self.tokens), self.stops)
        self._write(text, len(text))
        return text

    def _write(self, text: str, upto: int) -> None:
        if upto > self.written:
            self.out.write(text[self.written:upto])
            self.out.flush()
            self.written = upto
