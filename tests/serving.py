"""Helpers of the server tests: a real `quickdraft serve` subprocess on loopback and raw HTTP."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

MODEL = "qd-stdlib-target"


class HTTPMixin:
    """Raw HTTP to ``self.port`` on loopback."""

    port: int

    def connection(self, timeout: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | str | None = None,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
        conn = self.connection()
        try:
            conn.request(method, path, body, headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, bytes]:
        status, _, body = self.request("GET", path)
        return status, body

    def post(self, path: str, body) -> tuple[int, dict]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        status, _, raw = self.request("POST", path, data, {"Content-Type": "application/json"})
        return status, json.loads(raw)

    def health(self) -> dict:
        return json.loads(self.get("/health")[1])

    def metrics(self) -> str:
        return self.get("/metrics")[1].decode()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """/health once no row runs and nothing waits (or the last one seen at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if (health["active"] == 0 and health["waiting"] == 0) or time.monotonic() > deadline:
                return health
            time.sleep(0.1)


class ServerProcess(HTTPMixin):
    """`python -m quickdraft serve --port 0 ARGS`, its URL read from its banner line."""

    def __init__(self, args: list[str], log: Path, timeout: float = 180.0, env: dict | None = None,
                 stop_timeout: float = 15.0) -> None:
        self.log = log
        self.stop_timeout = stop_timeout  # how long SIGTERM may take before SIGKILL
        env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "quickdraft", "serve", "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env)
        deadline = time.monotonic() + timeout
        self.url = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = re.search(r" at (http://127\.0\.0\.1:\d+)", log.read_text())
            if found:
                self.url = found.group(1)
                break
            time.sleep(0.2)
        if self.url is None:
            self.stop()
            raise RuntimeError(f"quickdraft serve did not start:\n{log.read_text()}")
        while time.monotonic() < deadline:  # the banner comes just before uvicorn accepts
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("quickdraft serve never became healthy")

    @property
    def port(self) -> int:
        return urlsplit(self.url).port

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()


def metric(text: str, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == str(v) for k, v in labels.items()):
            total += float(m.group(3))
    return total


class InProcessServer(HTTPMixin):
    """The app over ``engine`` in this process (uvicorn in a thread, the scheduler's loop in
    another), so a test can patch the engine's methods to raise (fault injection) and read
    the scheduler. ``state`` sets ServerState fields (limits, api_key, allowed_hosts...)."""

    def __init__(self, pair, engine, max_queue: int = 6, settings: dict | None = None, **state) -> None:
        import threading

        import uvicorn

        from quickdraft.server.app import ServerState, create_app
        from quickdraft.server.cli import listen
        from quickdraft.server.metrics import ServerMetrics
        from quickdraft.server.scheduler import Scheduler

        self.engine = engine
        metrics = ServerMetrics(MODEL)
        self.scheduler = Scheduler(engine, metrics, max_queue)
        self.state = ServerState(MODEL, pair.tokenizer, pair.target.eos_token_ids, pair.target.context_length,
                                 pair.target.vocab_size, self.scheduler, metrics,
                                 settings or {"method": "draft", "engine": "batch"}, **state)
        sock = listen("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state), log_level="critical", lifespan="on"))
        self._threads = [threading.Thread(target=self.scheduler.run, daemon=True),
                         threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)]
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.scheduler.stop()
        for thread in self._threads:
            thread.join(10)
