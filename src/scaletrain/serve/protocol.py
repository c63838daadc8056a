"""The OpenAI API's requests read and checked, and its error shape: a bad request is one ``ApiError`` (status,
one message naming the field, the ``param``), never a traceback, never silently changed.

What is read (the rest of the API refuses the fields it does not implement, by name):

- ``/v1/chat/completions``: ``messages`` (system, developer (as system), user, assistant; ``content`` a string
  or a list of text parts), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``
  (an extension, as vLLM's), ``stop``, ``seed``, ``n`` (1), ``stream``, ``stream_options.include_usage``.
- ``/v1/completions``: ``prompt`` (a string, or a list of token ids), the same sampling fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from scaletrain.model.generate import Sampling

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 4  # OpenAI's limit on stop sequences
# Fields clients send that change nothing here (kept by OpenAI for billing or storage): accepted, unused.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
# Fields of the API this server does not implement, with the values that ask nothing of it (their defaults).
NO_OP_VALUES = {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
                "prediction": (None,), "modalities": (None, ["text"]), "audio": (None,)}


class ApiError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> object:
    """The body as JSON: UTF-8 only (no other encoding guessed), no NaN or Infinity (not JSON), a 400 naming
    what is wrong otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8 (byte 0x{raw[exc.start]:02x} at {exc.start})") from None
    if not text.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply to be read") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def _string(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise ApiError(400, f"'{param}' must be a string (got {type(value).__name__})", param)
    bad = next((c for c in value if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:  # "\ud800" in JSON is valid JSON, but no text: a tokenizer cannot encode it
        raise ApiError(400, f"'{param}' holds a lone surrogate (U+{ord(bad):04X}), which is not text", param)
    return value


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer (got {json.dumps(value)[:40]})", name)
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ApiError(400, f"'{name}' must be {bound} (got {value})", name)
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number (got {json.dumps(value)[:40]})", name)
    if value > high or value < low or (low_open and value == low):
        raise ApiError(400, f"'{name}' must be in {'(' if low_open else '['}{low}, {high}] (got {value})", name)
    return float(value)


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false (got {json.dumps(value)[:40]})", name)
    return value


@dataclass
class Limits:
    """What one request may ask: ``max_tokens`` (new tokens), ``messages``, body bytes (checked by the app)."""

    max_tokens: int
    max_messages: int = 256
    max_body_bytes: int = 1 << 20
    max_choices: int = 8  # ``n``: each choice is a row of the batch, so at most the server's slots (serve/cli.py)


@dataclass
class Generation:
    """A checked request: its prompt (``messages`` or ``prompt``/``prompt_ids``), sampling and options."""

    sampling: Sampling
    max_tokens: int | None
    stops: list[str]
    seed: int | None
    stream: bool
    include_usage: bool
    n: int = 1  # choices: one generation each, sampled with the request's sampling (seed + i for choice i)
    messages: list[dict] = field(default_factory=list)
    prompt: str | None = None
    prompt_ids: list[int] | None = None


def check_object(body: object) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object (got {type(body).__name__})")
    return body


def check_model(body: dict, served: str) -> None:
    """``model`` (optional, as vLLM's) must name the model this server serves: else 404, OpenAI's answer."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string (got {type(model).__name__})", "model")
    if model != served:
        raise ApiError(404, f"The model '{model[:200]}' does not exist; this server serves '{served}' "
                            f"(GET /v1/models)", "model", "model_not_found")


def _unsupported(body: dict, known: set[str]) -> None:
    """The API's fields this server does not implement, each refused by name (first), then unknown fields."""
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"'{name}' is not supported by this server (only 0)", name)
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise ApiError(400, "'logprobs' is not supported by this server", "logprobs")
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none", "auto"):
        raise ApiError(400, "tool calls are not supported by this server", "tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported", "response_format")
    for name, allowed in NO_OP_VALUES.items():
        value = body.get(name)
        if not any(value == a and type(value) is type(a) for a in allowed):  # True == 1, but echo=true is not
            raise ApiError(400, f"'{name}' is not supported by this server (got {json.dumps(value)[:40]})", name)
    for name in body:
        if name not in known and name not in IGNORED:
            raise ApiError(400, f"Unrecognized request argument supplied: {name[:100]}", name)
    if body.get("user") is not None:  # unused, but of its type (OpenAI refuses a number)
        _string(body["user"], "user")


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream", "presence_penalty",
          "frequency_penalty", "logprobs", "top_logprobs", "response_format", "logit_bias", "echo", "best_of",
          "tools", "tool_choice", "functions"}


def _sampling_and_options(body: dict, limits: Limits, default_sampling: Sampling) -> dict:
    n = _integer(body, "n", 1, limits.max_choices)
    max_tokens = _integer(body, "max_tokens", 1, limits.max_tokens)
    completion = _integer(body, "max_completion_tokens", 1, limits.max_tokens)
    if max_tokens is not None and completion is not None and max_tokens != completion:
        raise ApiError(400, f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({completion}) differ; "
                            f"send one", "max_tokens")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0)
    sampling = Sampling(temperature=default_sampling.temperature if temperature is None else temperature,
                        top_k=default_sampling.top_k if top_k is None else top_k,
                        top_p=default_sampling.top_p if top_p is None else top_p)
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    stops = [_string(s, f"stop[{i}]") for i, s in enumerate(stops)]
    if any(not s for s in stops):
        raise ApiError(400, "'stop' strings must not be empty", "stop")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage",
                                                                                   "continuous_usage_stats"}):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    if options is not None and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = _boolean(options or {}, "include_usage")
    return dict(sampling=sampling, max_tokens=completion if max_tokens is None else max_tokens, stops=stops,
                seed=_integer(body, "seed", -(1 << 63), (1 << 63) - 1), stream=stream, include_usage=include_usage,
                n=1 if n is None else n)


def _content(value: object, param: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, f"'{param}[{i}]' must be a text part {{\"type\": \"text\", \"text\": ...}} "
                                    f"(this model reads text only)", param)
            texts.append(_string(part.get("text"), f"{param}[{i}].text"))
        return "".join(texts)
    return _string(value, param)


def parse_chat(body: object, limits: Limits, default_sampling: Sampling) -> Generation:
    body = check_object(body)
    _unsupported(body, COMMON | {"messages", "max_completion_tokens"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    if len(messages) > limits.max_messages:
        raise ApiError(400, f"'messages' has {len(messages)} messages; this server takes at most "
                            f"{limits.max_messages} (--max-messages)", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"'messages[{i}]' must be an object with 'role' and 'content'", f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"'messages[{i}].role' must be one of {', '.join(ROLES)} (got "
                                f"{json.dumps(role)[:40]})", f"messages[{i}].role")
        if "content" not in message:
            raise ApiError(400, f"'messages[{i}].content' is missing", f"messages[{i}].content")
        if message.get("name") is not None:  # unused (the templates have no participant names), but a string
            _string(message["name"], f"messages[{i}].name")
        checked.append({"role": ROLES[role], "content": _content(message["content"], f"messages[{i}].content")})
    if checked[-1]["role"] == "assistant":
        raise ApiError(400, "the last message is the assistant's: this server answers a user or system message "
                            "(continuing an assistant message is not supported)", f"messages[{len(checked) - 1}]")
    return Generation(messages=checked, **_sampling_and_options(body, limits, default_sampling))


def parse_completion(body: object, limits: Limits, default_sampling: Sampling, vocab_size: int) -> Generation:
    body = check_object(body)
    _unsupported(body, COMMON | {"prompt", "suffix"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    options = _sampling_and_options(body, limits, default_sampling)
    if options["max_tokens"] is None:
        options["max_tokens"] = min(16, limits.max_tokens)  # the API's default for completions
    if isinstance(prompt, list):
        if not prompt or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
                             for t in prompt):
            raise ApiError(400, f"'prompt' as token ids must be a non-empty list of integers from 0 to "
                                f"{vocab_size - 1}", "prompt")
        return Generation(prompt_ids=list(prompt), **options)
    if prompt is None:
        raise ApiError(400, "'prompt' is required: a string (or a list of token ids)", "prompt")
    text = _string(prompt, "prompt")
    if not text:
        raise ApiError(400, "'prompt' must not be empty", "prompt")
    return Generation(prompt=text, **options)
