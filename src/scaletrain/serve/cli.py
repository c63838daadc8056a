"""``scaletrain serve --run DIR [--host 127.0.0.1] [--port 8000]``: the run's model behind the OpenAI API.

Safe by default: it binds 127.0.0.1 (this machine only); another address needs ``--api-key`` (every API
request then carries ``Authorization: Bearer KEY``); CORS is off unless ``--cors-origin`` names the origins a
browser page elsewhere may call it from; one request's body, messages and ``max_tokens`` are bounded. Nothing
in a request is executed or reaches the file system: messages are rendered by the run's chat template
(transformers' sandboxed Jinja) and encoded.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys

from scaletrain.core.options import ConfigError
from scaletrain.infer.batch import Batcher
from scaletrain.infer.session import Session

API_KEY_ENV = "SCALETRAIN_API_KEY"  # the key read from the environment: a flag's value shows in `ps`


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Serve a run's model over the OpenAI API (POST /v1/chat/completions, /v1/completions, GET "
                     "/v1/models, /health, POST /tokenize, /detokenize) with a chat page at /; concurrent "
                     "requests share the decode (continuous batching). Needs scaletrain[serve] (docs/serving.md).")
    p.add_argument("--run", required=True, help="the run folder (train.run_dir)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind; other than a loopback address it needs --api-key")
    p.add_argument("--port", type=int, default=8000, help="the port (0: any free one, printed)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on the API (default: ${API_KEY_ENV})")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda or cuda:N")
    p.add_argument("--model-name", default=None, help="the model's id in the API (default: the run folder's name)")
    p.add_argument("--compile", action="store_true",
                   help="decode the batch with a torch.compile'd step over every slot (as generate --compile; one "
                        "shape whoever joins or leaves, compiled once before the server answers: seconds to a "
                        "minute)")
    p.add_argument("--slots", type=int, default=8, help="requests decoded together (the batch)")
    p.add_argument("--queue", type=int, default=64, help="requests that may wait for a slot; past it: 503")
    p.add_argument("--max-tokens-limit", type=int, default=0,
                   help="the most new tokens one request may ask (default: the model's context)")
    p.add_argument("--max-messages", type=int, default=256, help="the most messages in one chat request")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the largest request body")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser pages from this origin (e.g. http://localhost:3000); repeat; default none")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_serve_arguments(args: argparse.Namespace) -> None:
    """Every flag in its range, and the rule that an address other machines reach has a key."""
    if not is_loopback(args.host) and not args.api_key:
        raise ConfigError(f"--host {args.host} lets other machines reach the server: pass --api-key KEY (or set "
                          f"${API_KEY_ENV}) so that only clients holding it are answered")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535 (got {args.port})")
    for flag, value in (("--slots", args.slots), ("--max-messages", args.max_messages),
                        ("--max-body-bytes", args.max_body_bytes)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")
    if args.queue < 0 or args.max_tokens_limit < 0:
        raise ConfigError("--queue and --max-tokens-limit must be >= 0")
    if args.api_key is not None and (not args.api_key.strip() or not args.api_key.isprintable()):
        raise ConfigError("--api-key must be printable text, not empty")
    if args.device != "cpu":
        import torch

        if not args.device.startswith("cuda") or not torch.cuda.is_available():
            what = "no CUDA GPU" if args.device.startswith("cuda") else "no such device (cpu, cuda, cuda:N)"
            raise ConfigError(f"--device {args.device}: {what} here; pass --device cpu")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound before the model loads: a port in use is one line, at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "is in use (pass another --port)" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc})"
        raise ConfigError(f"--host {host} --port {port} {why}") from None
    sock.listen(2048)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    check_serve_arguments(args)
    try:
        import uvicorn

        from scaletrain.serve.app import ServeOptions, build_app
        from scaletrain.serve.protocol import Limits
    except ImportError as exc:
        raise ConfigError(f"scaletrain serve needs the serve extra ({exc.name} is missing): "
                          f"pip install 'scaletrain[serve]'") from None
    sock = bind(args.host, args.port)
    session = Session.from_run(args.run, device=args.device, compile=args.compile)
    batcher = Batcher(session, slots=args.slots, queue_size=args.queue)
    if session.decoder is not None:
        print(f"--compile: compiling the decode step over {args.slots} slots", file=sys.stderr, flush=True)
        batcher.warm_up()
    batcher.start()
    limits = Limits(max_tokens=min(args.max_tokens_limit or session.context, session.context),
                    max_messages=args.max_messages, max_body_bytes=args.max_body_bytes, max_choices=args.slots)
    options = ServeOptions(args.model_name or session.name, limits, args.api_key, args.cors_origin)
    app = build_app(session, batcher, options)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    decode = "compiled" if session.decoder else "eager"
    print(f"serving {args.run} as '{options.name}' at http://{where}:{port} ({args.slots} slots, a queue of "
          f"{args.queue}, context {session.context}, {decode} decode); the chat page is at /, the API at /v1",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        batcher.close()
        sock.close()
    print("server stopped", file=sys.stderr)
    return 0
