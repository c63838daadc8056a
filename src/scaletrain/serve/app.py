"""The HTTP layer of ``scaletrain serve``: the OpenAI API's routes over a ``Session`` and its ``Batcher``.

Each route reads and checks its body (``protocol.py``), renders or encodes the prompt (the session's template),
hands the generation to the batcher and relays its events: one JSON answer, or server-sent events of ``delta``
chunks ending with a ``finish_reason`` chunk (a ``usage`` chunk with ``stream_options.include_usage``) and
``data: [DONE]``. A client that goes away cancels its request (the batcher frees its row at the next step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources

import torch
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from scaletrain.data.tokenizer import DataError
from scaletrain.infer.batch import Batcher, Event, Job, QueueFull
from scaletrain.infer.session import Session, default_sampling
from scaletrain.serve.protocol import (
    ApiError,
    Generation,
    Limits,
    check_model,
    check_object,
    parse_chat,
    parse_completion,
    parse_json,
)

RETRY_AFTER_S = 1  # what a 503 (every slot and the queue taken) asks the client to wait
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


@dataclass
class ServeOptions:
    """What ``scaletrain serve``'s flags set: the model's name, the Bearer key (None: no key asked), the
    origins CORS allows (none: the browser's same-origin rule), and the limits of one request."""

    name: str
    limits: Limits
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def fit_context(prompt_tokens: int, max_tokens: int | None, context: int, limit: int, where: str) -> int:
    """The new tokens a request gets: its ``max_tokens`` (default: what the context leaves, at most ``limit``),
    or a 400 naming the context when the prompt and its answer do not fit."""
    if prompt_tokens >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens. However, your {where} "
                            f"resulted in {prompt_tokens} tokens (it must leave room for at least one new token).",
                       where, "context_length_exceeded")
    room = context - prompt_tokens
    if max_tokens is None:
        return min(limit, room)
    if max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in "
                            f"the completion). Please reduce the length of the {where} or max_tokens.",
                       "max_tokens", "context_length_exceeded")
    return max_tokens


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes before it is read whole (a stated Content-Length first)."""
    stated = request.headers.get("content-length")
    if stated is not None and stated.isdigit() and int(stated) > limit:
        raise ApiError(413, f"the request body is {int(stated):,} bytes; this server takes at most {limit:,} "
                            f"(--max-body-bytes)", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit:,} bytes, this server's limit (--max-body-bytes)",
                           code="request_too_large")
    return bytes(body)


def chat_page() -> str:
    return resources.files("scaletrain").joinpath("assets/serve/chat.html").read_text(encoding="utf-8")


def build_app(session: Session, batcher: Batcher, options: ServeOptions) -> FastAPI:
    """The server's routes (module docstring) over a started ``batcher``."""
    app = FastAPI(title=f"scaletrain serve: {options.name}", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    page = chat_page()
    if options.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=options.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path} (see GET /v1/models, POST "
                        f"/v1/chat/completions, /v1/completions)",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404
                                     else None).body(), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        print(f"serve: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}").body(), 500)

    async def checked_body(request: Request) -> object:
        authorize(request, options.api_key)
        return parse_json(await read_body(request, options.limits.max_body_bytes))

    def model_card() -> dict:
        return {"id": options.name, "object": "model", "created": created, "owned_by": "scaletrain",
                "max_model_len": session.context}

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": options.name, "slots": batcher.cache.slots, "busy": batcher.busy,
                "waiting": len(batcher.pending), "steps": batcher.steps}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request, options.api_key)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict:
        authorize(request, options.api_key)
        check_model({"model": model}, options.name)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await checked_body(request)
        gen = parse_chat(body, options.limits, default_sampling("serve"))
        check_model(body, options.name)
        prompt = await encode(session.render, gen.messages)
        max_tokens = fit_context(len(prompt), gen.max_tokens, session.context, options.limits.max_tokens,
                                 "messages")
        return await respond(request, gen, prompt, max_tokens, gen.stops + session.conversation.stop_texts, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await checked_body(request)
        gen = parse_completion(body, options.limits, default_sampling("serve"), session.tokenizer.vocab_size)
        check_model(body, options.name)
        prompt = gen.prompt_ids or await encode(session.tokenizer.encode, gen.prompt)
        if not prompt:
            raise ApiError(400, "'prompt' has no tokens", "prompt")
        max_tokens = fit_context(len(prompt), gen.max_tokens, session.context, options.limits.max_tokens,
                                 "prompt")
        return await respond(request, gen, prompt, max_tokens, gen.stops, False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = check_object(await checked_body(request))
        check_model(body, options.name)
        if "messages" in body:
            ids = await encode(session.render, parse_chat({"messages": body["messages"]}, options.limits,
                                                          default_sampling("serve")).messages)
        elif isinstance(body.get("prompt"), str):
            ids = await encode(session.tokenizer.encode, body["prompt"])
        else:
            raise ApiError(400, "send {\"prompt\": TEXT} or {\"messages\": [...]} to tokenize", "prompt")
        return {"count": len(ids), "max_model_len": session.context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = check_object(await checked_body(request))
        check_model(body, options.name)
        ids = body.get("tokens")
        vocab = session.tokenizer.vocab_size
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                                            for t in ids):
            raise ApiError(400, f"'tokens' must be a list of integers from 0 to {vocab - 1}", "tokens")
        return {"prompt": session.tokenizer.decode(ids)}

    async def encode(function, value) -> list[int]:
        try:  # a chat template's rendering and a long text's encoding take milliseconds: off the event loop
            return list(await run_in_threadpool(function, value))
        except DataError as exc:  # a character a character vocabulary does not hold
            raise ApiError(400, str(exc)) from None

    async def respond(request: Request, gen: Generation, prompt: list[int], max_tokens: int, stops: list[str],
                      chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()  # (choice index, event) of every choice

        def emitter(index: int):
            def emit(event: Event) -> None:  # called from the batcher's thread
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the event loop has closed (the server is shutting down)
                    pass
            return emit

        # Choice i samples with seed + i: a seeded request answers the same n choices again, and they differ.
        seed = gen.seed if gen.seed is not None else secrets.randbits(62)
        jobs = [Job(prompt, max_tokens, gen.sampling, emitter(i), torch.Generator().manual_seed(seed + i), stops)
                for i in range(gen.n)]
        try:
            batcher.submit(*jobs)  # all the choices or none
        except QueueFull as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry in {RETRY_AFTER_S} s", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        reply = Reply(options.name, chat, len(prompt))
        if gen.stream:
            return StreamingResponse(stream_events(events, jobs, reply, gen.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await collect(request, events, jobs, reply))

    def cancel(jobs: list[Job]) -> None:
        for job in jobs:
            job.cancel()  # no-op once finished; frees the row when the client went away
        batcher.wake()

    async def collect(request: Request, events: asyncio.Queue, jobs: list[Job], reply: Reply) -> dict:
        texts: list[list[str]] = [[] for _ in jobs]
        last: dict[int, Event] = {}
        try:
            while len(last) < len(jobs):
                try:
                    index, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise ApiError(499, "the client went away") from None
                    continue
                texts[index].append(event.text)
                if event.finish_reason == "error":
                    raise ApiError(500, event.error)
                if event.finish_reason:
                    last[index] = event
            return reply.whole(["".join(text) for text in texts], [last[i] for i in range(len(jobs))])
        finally:
            cancel(jobs)

    async def stream_events(events: asyncio.Queue, jobs: list[Job], reply: Reply,
                            include_usage: bool) -> AsyncIterator[str]:
        finished: dict[int, int] = {}  # choice -> its completion tokens
        try:
            for index in range(len(jobs)):
                yield sse(reply.chunk({"role": "assistant", "content": ""}, index=index))
            while len(finished) < len(jobs):
                index, event = await events.get()
                if event.finish_reason == "error":
                    yield sse(ApiError(500, event.error).body())
                    break
                if event.text:
                    yield sse(reply.chunk({"content": event.text}, index=index))
                if event.finish_reason:
                    yield sse(reply.chunk({}, event.finish_reason, index=index))
                    finished[index] = event.completion_tokens
            if include_usage and len(finished) == len(jobs):  # every choice ended (not an error's break)
                yield sse(reply.usage_chunk(sum(finished.values())))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the response's task is cancelled) or the answer is done
            cancel(jobs)

    return app


def authorize(request: Request, api_key: str | None) -> None:
    """With an API key, the request must carry ``Authorization: Bearer KEY`` (compared in constant time)."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer KEY' "
                            "(the --api-key the server was started with)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Reply:
    """The response objects of one request, in the OpenAI shapes (chat: ``chat.completion`` and its chunks;
    completions: ``text_completion``)."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int):
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, texts: list[str], events: list[Event]) -> dict:
        """The answer with one choice per text (``n``); usage counts the prompt once and every choice's tokens."""
        choices = [{**({"index": i, "message": {"role": "assistant", "content": text}} if self.chat
                       else {"index": i, "text": text}), "logprobs": None, "finish_reason": event.finish_reason}
                   for i, (text, event) in enumerate(zip(texts, events))]
        return {**self._head(False), "choices": choices,
                "usage": usage(self.prompt_tokens, sum(event.completion_tokens for event in events))}

    def chunk(self, delta: dict, finish_reason: str | None = None, index: int = 0) -> dict:
        choice = {"index": index, "delta": delta} if self.chat else {"index": index, "text": delta.get("content", "")}
        return {**self._head(True), "choices": [{**choice, "logprobs": None, "finish_reason": finish_reason}],
                "usage": None}

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._head(True), "choices": [], "usage": usage(self.prompt_tokens, completion_tokens)}
