"""``quickdraft serve``: the OpenAI-compatible server on one command."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from ..cli import CliError, add_method_options, choose_k, draft_options, notice, positive_int


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to an argparse subparsers object."""
    from ..drafters.factory import METHODS

    p = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible API and a web playground",
        description="Serve /v1/completions, /v1/chat/completions and /v1/models (OpenAI-compatible, "
        "streaming with SSE), /metrics (Prometheus), /health and a playground at /. Requests join "
        "and leave the running batch between steps (continuous batching).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    p.add_argument("--model", help="target: embedded name, HF directory or hub id (default: embedded default)")
    p.add_argument("--draft", help="draft model with the target's tokenizer (default: the target's paired draft)")
    p.add_argument("--method", choices=list(METHODS), default="draft",
                   help="decoding method, as for generate (default draft)")
    add_method_options(p)
    p.add_argument("--num-speculative-tokens", "-k", type=positive_int, default=None,
                   help="draft tokens per step (default: the cost model's choice, as for generate; the "
                   "batched engine applies its own batch-size policy unless -k is given)")
    p.add_argument("--remeasure", action="store_true", help="measure the cost model's k again")
    p.add_argument("--backend", choices=["auto", "native", "hf"], default="auto",
                   help="model runtime: native (default when supported) or transformers")
    p.add_argument("--engine", choices=["auto", "batch", "solo"], default="auto",
                   help="batch = rows verified together in one pass (draft, ngram, hybrid, early-exit, ar on "
                   "the native runtime); solo = each row its own decode loop, stepped in turn (every method and "
                   "backend); auto (default) = batch when it supports the method, else solo")
    p.add_argument("--max-batch-size", type=positive_int, default=8,
                   help="generations running at once (default 8)")
    p.add_argument("--max-queue", type=positive_int, default=64,
                   help="generations waiting for a row at most; past it requests get 429 (default 64)")
    p.add_argument("--served-model-name", help="the model id clients send (default: --model as given, "
                   "or the embedded model's name)")
    p.add_argument("--chat-max-tokens", type=positive_int, default=256,
                   help="max_tokens of a chat request that gives none (default 256)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                   help="largest request body accepted; larger ones get 413 (default 1 MiB)")
    p.add_argument("--max-n", type=positive_int, default=16, help="most choices (n) per prompt (default 16)")
    p.add_argument("--max-prompts", type=positive_int, default=32,
                   help="most prompts in one /v1/completions request (default 32)")
    p.add_argument("--max-request-tokens", type=positive_int, default=65536,
                   help="most tokens one request may take: prompts + max_tokens, times n (default 65536)")
    p.add_argument("--api-key", default=os.environ.get("QUICKDRAFT_API_KEY") or None,
                   help="ask /v1/ clients for `Authorization: Bearer KEY` (default: $QUICKDRAFT_API_KEY; none)")
    p.add_argument("--allowed-hosts", type=lambda v: [h for h in v.split(",") if h], default=[],
                   help="Host header names to answer besides localhost, 127.0.0.1 and ::1 (comma-separated; "
                   "a non-loopback --host answers any Host unless this names some)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="warning",
                   help="uvicorn's log level (default warning)")
    p.set_defaults(func=run_serve, auto_k=False)
    return p


def make_engine(choice: str, target, method: str, draft, max_batch_size: int, k: int | None,
                explicit_k: bool, options, acceptance: str):
    """The engine for these settings: the batched one where it supports them (``choice``
    auto or batch), else :class:`~quickdraft.server.solo_engine.SoloEngine`."""
    from ..batch_generate import make_batch_engine
    from ..drafters.factory import BATCH_METHODS
    from .solo_engine import SoloEngine

    why_not = None
    if method not in BATCH_METHODS:
        why_not = f"the batched engine runs {', '.join(BATCH_METHODS)}, not {method}"
    elif target.backend != "native" or (draft is not None and draft.backend != "native"):
        why_not = "the batched engine needs the native runtime"
    if choice == "batch" and why_not:
        raise CliError(f"--engine batch: {why_not}; use --engine solo or auto")
    if choice != "solo" and why_not is None:
        engine = make_batch_engine(target, method, draft, max_batch_size=max_batch_size,
                                   num_speculative_tokens=k if explicit_k else None, options=options)
        engine.name = "batch"
        return engine
    return SoloEngine(target, method=method, draft=draft, max_batch_size=max_batch_size,
                      num_speculative_tokens=k, options=options, acceptance=acceptance)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (bound here so that ``--port 0`` can print the port it got)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from .. import __version__
    from ..generator import SpeculativeGenerator
    from ..quiet import quiet_transformers
    from .app import ServerState, create_app
    from .auth import guard_settings
    from .metrics import ServerMetrics
    from .scheduler import Scheduler

    if args.threads:
        torch.set_num_threads(args.threads)
    options = draft_options(args)
    sock = listen(args.host, args.port)  # a taken port fails before the models load
    with quiet_transformers():
        gen = SpeculativeGenerator.from_pretrained(args.model, args.draft, args.method, args.backend, options,
                                                   args.multi_draft_rule, remeasure=args.remeasure, log=notice,
                                                   draft_vocab=args.draft_vocab)
    k, k_source = choose_k(args, gen)
    plan = gen.plan
    # -k and auto's k hold at every batch size; otherwise the batched engine's own policy
    # picks k per batch size
    fixed_k = args.num_speculative_tokens is not None or plan.choice is not None
    engine = make_engine(args.engine, gen.target, plan.method, gen.draft, args.max_batch_size, k, fixed_k,
                         plan.options, args.multi_draft_rule)
    name = args.served_model_name or args.model or gen.target.model_dir.name
    settings = {"method": plan.label,
                "num_speculative_tokens": k, "num_speculative_tokens_source": k_source,
                "engine": engine.name, "max_batch_size": args.max_batch_size, "max_queue": args.max_queue,
                "backend": gen.target.backend, "fingerprint": f"quickdraft-{__version__}-{plan.method}"}
    metrics = ServerMetrics(name, draft_positions=k or 0)
    scheduler = Scheduler(engine, metrics, args.max_queue)
    state = ServerState(name, gen.tokenizer, gen.eos_token_ids, gen.target.context_length,
                        gen.target.vocab_size, scheduler, metrics, settings, args.chat_max_tokens,
                        args.max_body_bytes, int(time.time()), **guard_settings(args))
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    k_text = f", k={k} ({k_source})" if k is not None else ""
    print(f"quickdraft: serving {name} ({settings['method']}{k_text}, {engine.name} engine, {args.max_batch_size} rows, "
          f"queue {args.max_queue}) at {url}  (playground {url}/, OpenAI API {url}/v1, {url}/metrics, "
          f"{url}/health; Ctrl-C stops)", file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(state), log_level=args.log_level,
                            timeout_graceful_shutdown=3, lifespan="on")
    server = uvicorn.Server(config)

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            scheduler.stop()  # the HTTP side is gone (or never came up): nothing left to serve

    # The step loop runs here, in the main thread (oneDNN is twice as slow from others:
    # scheduler.py), and the HTTP server in a thread; Ctrl-C or SIGTERM ends both.
    http = threading.Thread(target=serve_http, name="quickdraft-http", daemon=True)
    http.start()
    signal.signal(signal.SIGTERM, lambda *_: scheduler.stop())

    def on_ctrl_c(*_) -> None:
        # A flag, not KeyboardInterrupt: an exception raised while the main thread runs a
        # __del__ or a weakref callback is swallowed, and the server then kept streaming
        # (seen once in the suite). A second Ctrl-C interrupts at once.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        scheduler.stop()

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        scheduler.run()
    except KeyboardInterrupt:
        pass
    server.should_exit = True
    http.join(timeout=10)
    return 0
