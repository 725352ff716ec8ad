"""``quickdraft serve``: the OpenAI-compatible server on one command."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

from ..argtypes import (
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from ..cli import CliError, add_method_options, add_placement_options
from .loading import load_server, make_engine

#: Prompt tokens the batched engine prefills per step (``--prefill-chunk``): on 2 CPU cores
#: ~50 ms of the embedded target's time and ~0.2 s of SmolLM2-135M's.
DEFAULT_PREFILL_CHUNK = 256

__all__ = ["add_serve_parser", "listen", "load_server", "make_engine", "run_serve"]


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to an argparse subparsers object."""
    from ..drafters.factory import METHODS

    p = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible API and a web playground",
        description="Serve /v1/completions, /v1/chat/completions and /v1/models (OpenAI-compatible, "
        "streaming with SSE), /metrics (Prometheus), /health and a playground at /. Requests join "
        "and leave the running batch between steps (continuous batching).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port (default 8000; 0 = any free port, printed)")
    p.add_argument("--model", help="target: embedded name, HF directory or hub id (default: embedded default)")
    p.add_argument("--draft", help="draft model with the target's tokenizer (default: the target's paired draft)")
    p.add_argument("--method", choices=list(METHODS), default=None,
                   help="decoding method, as for generate (default: draft; hybrid-eagle for smollm2-135m: "
                   "auto's usual choice there, without measuring it at start)")
    add_method_options(p)
    p.add_argument("--num-speculative-tokens", "-k", type=positive_int, default=None,
                   help="draft tokens per step (default: the cost model's choice, as for generate; the "
                   "batched engine applies its own batch-size policy unless -k is given)")
    p.add_argument("--remeasure", action="store_true", help="measure the cost model's k again")
    p.add_argument("--auto-for", choices=["completion", "chat"], default=None,
                   help="--method auto: the requests its choice is measured on, completions (default) or "
                   "chats through the model's template (an instruct model's traffic: SmolLM2's replies "
                   "favour another method than its completions); one engine serves both endpoints with it")
    p.add_argument("--backend", choices=["auto", "native", "hf"], default="auto",
                   help="model runtime: native (default when supported) or transformers")
    add_placement_options(p)
    p.add_argument("--engine", choices=["auto", "batch", "solo"], default="auto",
                   help="batch = rows verified together in one pass (draft, ngram, hybrid, early-exit, ar on "
                   "the native runtime); solo = each row its own decode loop, stepped in turn (every method and "
                   "backend); auto (default) = batch when it supports the method, else solo")
    p.add_argument("--max-batch-size", type=positive_int, default=8,
                   help="generations running at once (default 8)")
    p.add_argument("--prefill-chunk", type=non_negative_int, default=DEFAULT_PREFILL_CHUNK, metavar="TOKENS",
                   help="batched engine: prompt tokens prefilled per step, all joining requests together, "
                   "so a long prompt's prefill is spread over several steps and running streams keep "
                   f"decoding in between (same output, bit for bit); 0 = each prompt whole in one pass "
                   f"(default {DEFAULT_PREFILL_CHUNK})")
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
    ray = p.add_argument_group(
        "Ray Serve", "--ray serves through Ray Serve's HTTP proxy at --host:--port: each replica is one engine "
        "with continuous batching (pip install 'quickdraft[ray]'; README: multi-node clusters)")
    ray.add_argument("--ray", action="store_true",
                     help="run the server as Ray Serve replicas instead of one process")
    ray.add_argument("--ray-address", default=None,
                     help="the Ray cluster to join: 'auto' (the one `ray start` made on this node) or "
                     "HOST:6379 (default: start a local one-node cluster)")
    ray.add_argument("--replicas", type=positive_int, default=1,
                     help="replicas to run (default 1); with --max-replicas, the number to start with")
    ray.add_argument("--min-replicas", type=non_negative_int, default=None,
                     help="autoscale: fewest replicas (default: --replicas)")
    ray.add_argument("--max-replicas", type=positive_int, default=None,
                     help="autoscale between --min-replicas and this many replicas (default: no autoscaling)")
    ray.add_argument("--target-ongoing-requests", type=positive_float, default=None,
                     help="autoscale: requests in flight per replica to aim for (default: --max-batch-size)")
    ray.add_argument("--replica-cpus", type=positive_float, default=1.0,
                     help="CPUs Ray reserves for each replica (default 1; torch threads follow unless --threads)")
    ray.add_argument("--replica-gpus", type=non_negative_float, default=0.0,
                     help="GPUs Ray reserves for each replica (default 0)")
    ray.add_argument("--replica-metrics-port", type=non_negative_int, default=0,
                     help="port of each replica's own Prometheus endpoint (default 0: a free one, "
                     "shown in /health as metrics_url)")
    p.set_defaults(func=run_serve, auto_k=False)
    return p


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


#: The Ray options and their defaults: any other value needs --ray.
RAY_DEFAULTS = {"ray_address": None, "replicas": 1, "min_replicas": None, "max_replicas": None,
                "target_ongoing_requests": None, "replica_cpus": 1.0, "replica_gpus": 0.0,
                "replica_metrics_port": 0}


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    if args.ray:
        try:
            from .ray_serve import run_ray
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] != "ray":
                raise
            raise CliError("--ray needs Ray Serve: pip install 'quickdraft[ray]'") from None
        return run_ray(args)
    given = [f"--{name.replace('_', '-')}" for name, default in RAY_DEFAULTS.items()
             if getattr(args, name) != default]
    if given:
        raise CliError(f"{', '.join(given)} set Ray Serve replicas: add --ray (or leave them out)")
    sock = listen(args.host, args.port)  # a taken port fails before the models load
    loaded = load_server(args)
    state, scheduler, k, k_source = loaded.state, loaded.scheduler, loaded.k, loaded.k_source
    name, settings, engine = state.model_name, state.settings, scheduler.engine
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    k_text = f", k={k} ({k_source})" if k is not None else ""
    print(f"quickdraft: serving {name} ({settings['method']}{k_text}, {engine.name} engine, {args.max_batch_size} rows, "
          f"queue {args.max_queue}) at {url}  (playground {url}/, OpenAI API {url}/v1, {url}/metrics, "
          f"{url}/health; Ctrl-C stops)", file=sys.stderr, flush=True)
    # h11 and asyncio named, not uvicorn's "auto": the ray extra installs httptools and
    # uvloop, and the server must parse and answer requests the same with or without it.
    config = uvicorn.Config(create_app(state), log_level=args.log_level, http="h11", loop="asyncio",
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
