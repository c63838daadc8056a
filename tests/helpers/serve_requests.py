"""The bad requests ``tests/serve/test_serve.py`` sends a real ``scaletrain serve`` (and
``benchmarks/serve_requests.py`` records with their answers): (path, body, status, a piece of the one-line message).
The expectations are those of the tests' server: the tiny run of ``tests/serve/test_serve.py``'s fixture (context
64, model id ``run``) served with ``SERVER_FLAGS``. A body is a dict (sent as JSON), a str (sent as is, UTF-8) or
bytes."""

from __future__ import annotations

SERVER_FLAGS = ("--slots", "4", "--queue", "8")
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello there"}]

# (path, body, status, a piece of the one message): at least 30 bad requests, each answered alone.
BAD_REQUESTS = [
    (CHAT, "{bad", 400, "not valid JSON"),
    (CHAT, "", 400, "body is empty"),
    (CHAT, "[1, 2]", 400, "must be a JSON object"),
    (CHAT, '"text"', 400, "must be a JSON object"),
    (CHAT, b"\xff\xfe{\x00}", 400, "not UTF-8"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "not valid JSON"),
    (CHAT, "[" * 100000 + "]" * 100000, 400, "nests too deeply"),
    (CHAT, {}, 400, "'messages' must be a non-empty list"),
    (CHAT, {"messages": []}, 400, "'messages' must be a non-empty list"),
    (CHAT, {"messages": "hi"}, 400, "'messages' must be a non-empty list"),
    (CHAT, {"messages": ["hi"]}, 400, "'messages[0]' must be an object"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "'messages[0].role' must be one of"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "'messages[0].content' is missing"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "must be a string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text part"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "lone surrogate"),
    (CHAT, {"messages": [{"role": "assistant", "content": "hi"}]}, 400, "the last message is the assistant's"),
    (CHAT, {"messages": MESSAGES * 300}, 400, "at most 256"),
    (CHAT, {"messages": MESSAGES, "max_tokens": -1}, 400, "'max_tokens' must be from 1 to 64"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, 400, "'max_tokens' must be from 1"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 10 ** 12}, 400, "'max_tokens' must be from 1 to 64"),
    (CHAT, {"messages": MESSAGES, "max_tokens": "10"}, 400, "'max_tokens' must be an integer"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 2.5}, 400, "'max_tokens' must be an integer"),
    (CHAT, {"messages": MESSAGES, "max_tokens": True}, 400, "'max_tokens' must be an integer"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 60}, 400, "maximum context length is 64 tokens"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": -5}, 400, "'max_completion_tokens' must be"),
    (CHAT, {"messages": MESSAGES, "temperature": 9}, 400, "'temperature' must be in [0.0, 2.0]"),
    (CHAT, {"messages": MESSAGES, "temperature": "hot"}, 400, "'temperature' must be a number"),
    (CHAT, {"messages": MESSAGES, "top_p": 0}, 400, "'top_p' must be in (0.0, 1.0]"),
    (CHAT, {"messages": MESSAGES, "n": 5}, 400, "'n' must be from 1 to 4"),  # each choice a batch row: --slots 4
    (CHAT, {"messages": MESSAGES, "n": 0}, 400, "'n' must be from 1 to 4"),
    (CHAT, {"messages": MESSAGES, "stop": 5}, 400, "'stop' must be a string or a list"),
    (CHAT, {"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    (CHAT, {"messages": MESSAGES, "stop": [""]}, 400, "must not be empty"),
    (CHAT, {"messages": MESSAGES, "seed": "x"}, 400, "'seed' must be an integer"),
    (CHAT, {"messages": MESSAGES, "stream": "yes"}, 400, "'stream' must be true or false"),
    (CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "only allowed with"),
    (CHAT, {"messages": MESSAGES, "logprobs": True}, 400, "'logprobs' is not supported"),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tool calls are not supported"),
    (CHAT, {"messages": MESSAGES, "frequency_penalty": 1}, 400, "'frequency_penalty' is not supported"),
    (CHAT, {"messages": MESSAGES, "bogus": 1}, 400, "Unrecognized request argument supplied: bogus"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 200}]}, 400, "maximum context length is 64 tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "日本"}]}, 400, "not in the"),
    (CHAT, {"messages": MESSAGES, "model": "gpt-4"}, 404, "The model 'gpt-4' does not exist"),
    (CHAT, {"messages": MESSAGES, "model": 7}, 400, "'model' must be a string"),
    (CHAT, b"{" + b" " * (2 << 20) + b"}", 413, "at most 1,048,576"),
    ("/v1/completions", {}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": ""}, 400, "'prompt' must not be empty"),
    ("/v1/completions", {"prompt": [1, -4]}, 400, "token ids must be"),
    ("/v1/completions", {"prompt": "ROMEO:", "echo": True}, 400, "'echo' is not supported"),
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 64}, 400, "maximum context length is 64 tokens"),
    ("/tokenize", {"text": "x"}, 400, "send {\"prompt\": TEXT}"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "'tokens' must be a list of integers"),
    ("/v1/nothing", {}, 404, "no route POST /v1/nothing"),
    # wrong types and values the lines above leave out
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "'messages[0].content' must be a string"),
    (CHAT, {"messages": [{"role": 5, "content": "hi"}]}, 400, "'messages[0].role' must be one of"),
    (CHAT, {"messages": [{"role": "tool", "content": "hi"}]}, 400, "'messages[0].role' must be one of"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": 3}]}, 400, "'messages[0].name' must be a string"),
    (CHAT, {"messages": MESSAGES, "user": 5}, 400, "'user' must be a string"),
    (CHAT, {"messages": MESSAGES, "top_p": 1.5}, 400, "'top_p' must be in (0.0, 1.0]"),
    (CHAT, {"messages": MESSAGES, "temperature": -1}, 400, "'temperature' must be in [0.0, 2.0]"),
    (CHAT, {"messages": MESSAGES, "top_k": -3}, 400, "'top_k' must be >= 0"),
    (CHAT, {"messages": MESSAGES, "seed": 2 ** 70}, 400, "'seed' must be from"),
    (CHAT, {"messages": MESSAGES, "n": "2"}, 400, "'n' must be an integer"),
    (CHAT, {"messages": MESSAGES, "stop": [5]}, 400, "'stop[0]' must be a string"),
    (CHAT, {"messages": MESSAGES, "stream": True, "stream_options": "x"}, 400, "'stream_options' must be an object"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}]} x', 400, "not valid JSON: Extra data"),
    (CHAT, b'{"messages": [{"role": "user", "content": "caf\xc3("}]}', 400, "not UTF-8"),  # a broken sequence
    ("/v1/completions", {"prompt": 5}, 400, "'prompt' must be a string"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 400, "'prompt' as token ids must be"),
    ("/v1/completions", {"prompt": "ROMEO:", "model": "nope"}, 404, "The model 'nope' does not exist"),
    ("/tokenize", {"prompt": 5}, 400, "send {\"prompt\": TEXT}"),
    ("/detokenize", {"tokens": "abc"}, 400, "'tokens' must be a list of integers"),
]
