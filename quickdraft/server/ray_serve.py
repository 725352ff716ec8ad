"""`quickdraft serve --ray`: the server as Ray Serve replicas behind Ray's HTTP proxy.

Each replica is one `quickdraft serve` minus its HTTP listener: it loads the models with
the same options (:func:`.loading.load_server`), runs one engine with continuous batching, and
answers through the very same FastAPI app (:func:`.app.create_app`), which Ray Serve's
proxy calls as an ASGI app (``@serve.ingress`` with the app built in the replica, once the
models are loaded). Every endpoint, streaming included, is the single server's.

Each replica also serves its own Prometheus text on a port of its own (the proxy's
``/metrics`` answers for whichever replica it routes to); ``/health`` names the replica and
that URL. Ray's replica health check asks the scheduler whether the engine can progress.

The step loop runs in a thread of the replica (Ray owns the process's main thread), where
oneDNN's products run slower than in `quickdraft serve`'s main thread (scheduler.py).

``serve run quickdraft.server.ray_serve:build model=... max_batch_size=8`` (or a Serve
config file naming this builder) deploys the same application without the CLI.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping

from ray import serve

from ..cli import CliError
from .auth import is_loopback

#: The Serve application's name (``serve status`` shows it).
APP_NAME = "quickdraft"
#: How often Ray asks a replica whether its engine can make progress (seconds).
HEALTH_CHECK_PERIOD_S = 10.0


def _serve_options(args: argparse.Namespace) -> dict:
    """`quickdraft serve`'s options as plain values a replica can receive."""
    return {key: value for key, value in vars(args).items() if key != "func"}


@serve.deployment(name="QuickdraftServer", health_check_period_s=HEALTH_CHECK_PERIOD_S)
@serve.ingress()
class QuickdraftReplica:
    """One replica: the models, an engine with continuous batching and its step loop,
    the server's app (built by :meth:`__serve_build_asgi_app__`) and a metrics port."""

    def __init__(self, options: Mapping) -> None:
        from prometheus_client import start_http_server

        from .loading import load_server

        args = argparse.Namespace(**options)
        if not args.threads:  # torch would take every core of the node: take the CPUs Ray reserved
            args.threads = max(1, int(args.replica_cpus))
        self.loaded = load_server(args, log=_log)
        state = self.loaded.state
        context = serve.get_replica_context()
        bind = "127.0.0.1" if is_loopback(args.host) else "0.0.0.0"
        self._metrics_server, _ = start_http_server(
            args.replica_metrics_port, bind, registry=state.metrics.registry
        )
        port = self._metrics_server.server_address[1]
        host = "127.0.0.1" if bind == "127.0.0.1" else _node_ip()
        state.settings = {
            **state.settings,
            "replica": context.replica_id.unique_id,
            "metrics_url": f"http://{host}:{port}/metrics",
        }
        self._steps = threading.Thread(
            target=self.loaded.scheduler.run, name="quickdraft-steps", daemon=True
        )
        self._steps.start()

    def __serve_build_asgi_app__(self):
        """The single server's app over this replica's scheduler."""
        from .app import create_app

        return create_app(self.loaded.state)

    def check_health(self) -> None:
        """Ray's health check: raising marks the replica unhealthy and Ray replaces it."""
        problem = self.loaded.scheduler.problem()
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self) -> None:
        self.loaded.scheduler.stop()
        self._metrics_server.shutdown()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _log(message: str) -> None:
    print(f"quickdraft: {message}", file=sys.stderr, flush=True)


def application(args: argparse.Namespace) -> serve.Application:
    """The Serve application for `quickdraft serve`'s options: ``--replicas`` replicas, or
    autoscaling between ``--min-replicas`` and ``--max-replicas``; each replica takes at
    most ``--max-batch-size + --max-queue`` requests (what one server holds) from the proxy."""
    if args.max_replicas is not None:
        low = args.replicas if args.min_replicas is None else args.min_replicas
        if not low <= args.replicas <= args.max_replicas:
            raise CliError(
                f"--replicas {args.replicas} must lie between --min-replicas {low} and "
                f"--max-replicas {args.max_replicas}"
            )
        scaling = {
            "autoscaling_config": {
                "min_replicas": low,
                "initial_replicas": args.replicas,
                "max_replicas": args.max_replicas,
                "target_ongoing_requests": args.target_ongoing_requests
                or float(args.max_batch_size),
            }
        }
    elif args.min_replicas is not None or args.target_ongoing_requests is not None:
        raise CliError(
            "--min-replicas and --target-ongoing-requests set autoscaling: give --max-replicas too"
        )
    else:
        scaling = {"num_replicas": args.replicas}
    return QuickdraftReplica.options(
        ray_actor_options={"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus},
        max_ongoing_requests=args.max_batch_size + args.max_queue,
        **scaling,
    ).bind(_serve_options(args))


def build(cli_args: Mapping[str, object]) -> serve.Application:
    """The application builder for ``serve run quickdraft.server.ray_serve:build KEY=VALUE``
    and Serve config files: the keys are `quickdraft serve`'s options (``max_batch_size``
    or ``max-batch-size``; ``true`` for a flag), checked by its own parser."""
    from ..cli import build_parser

    argv = ["serve", "--ray"]
    for key, value in cli_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is not False and str(value).lower() != "false":
            argv += [flag, str(value)]
    return application(build_parser().parse_args(argv))


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run_ray(args: argparse.Namespace) -> int:
    """Start (or join, ``--ray-address``) a Ray cluster, deploy the replicas behind Serve's
    proxy at ``--host:--port``, print the URL, and serve until Ctrl-C or SIGTERM."""
    import ray

    app = application(args)  # bad replica settings fail before Ray starts
    # Serve's proxy needs a port number: --port 0 picks a free one here
    port = args.port or _free_port(args.host)
    started = args.ray_address is None
    # Ray reports usage statistics to its makers unless told not to: a server of ours sends
    # nothing anywhere unasked (RAY_USAGE_STATS_ENABLED=1 turns it back on).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        if started:  # a one-node cluster for this command; no dashboard, a small object store
            ray.init(
                include_dashboard=False, object_store_memory=256 << 20, logging_level="warning"
            )
        else:
            ray.init(address=args.ray_address, logging_level="warning")
    except ConnectionError as exc:
        raise CliError(
            f"--ray-address {args.ray_address}: {exc}; start the cluster with `ray start`"
        ) from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{port}"
        scaling = (
            f"{args.replicas} replicas"
            if args.max_replicas is None
            else f"{args.replicas} replicas, autoscaling up to {args.max_replicas}"
        )
        print(
            f"quickdraft: serving through Ray Serve ({scaling}, {args.max_batch_size} rows each) at {url}  "
            f"(OpenAI API {url}/v1, {url}/health; each replica's /metrics URL is in /health; "
            "Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(0.5):  # a timed wait: the signal handlers run between waits
            pass
    finally:
        try:  # the cluster we started goes with us; a cluster we joined keeps running
            if started:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0


__all__ = ["APP_NAME", "QuickdraftReplica", "application", "build", "run_ray"]
