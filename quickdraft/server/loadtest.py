"""Load a running ``quickdraft serve`` with concurrent streamed completions and report the
aggregate tokens/s, the time to first token (p50 / p95) and the gaps between a stream's
chunks (p50 / p99 / max: how long running streams stall), per prompt category.

    python -m quickdraft.server.loadtest --start -- -k 3          # starts its own server
    python -m quickdraft.server.loadtest --url http://127.0.0.1:8000 --concurrency 1,8

Every request streams ``/v1/completions``, or ``/v1/chat/completions`` for a category of
chats (``chat``: the messages through the model's template; greedy unless ``--temperature``). The
aggregate rate is completion tokens of every finished request over the wall time of the
whole run at that concurrency; the ratio column compares it with concurrency 1 run in the
same process. Only loopback or the address you give is contacted; the number of requests
is bounded.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..argtypes import non_negative_float, positive_int


@dataclass
class Result:
    """One request: ``status`` (HTTP), the streamed ``text``, ``tokens`` generated,
    ``ttft`` (seconds to the first chunk with tokens), ``gaps`` (seconds between its
    chunks with tokens after that), ``seconds`` in all, ``finish`` reason, ``error``
    message (refused or failed), ``disconnected`` (we hung up)."""

    index: int
    prompt: str | list[dict]
    status: int = 0
    text: str = ""
    tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    seconds: float = 0.0
    finish: str | None = None
    error: str | None = None
    disconnected: bool = False


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)


def sse_events(response: http.client.HTTPResponse):
    """The ``data:`` payloads of a server-sent event stream, as strings."""
    buffer = b""
    while True:
        chunk = response.read1(65536)
        if not chunk:
            return
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data: "):
                    yield line[6:]


def stream_completion(url: str, model: str, prompt: str | list[dict], max_tokens: int, *, index: int = 0,
                      temperature: float = 0.0, seed: int | None = None, disconnect_after: int | None = None,
                      timeout: float = 300.0) -> Result:
    """Stream one completion (``prompt`` a string) or chat completion (a list of messages);
    hang up after ``disconnect_after`` chunks with tokens."""
    result = Result(index, prompt)
    chat = not isinstance(prompt, str)
    body = {"model": model, "messages" if chat else "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    started = time.perf_counter()
    conn = _connection(url, timeout)
    try:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        result.status = response.status
        if response.status != 200:
            result.error = json.loads(response.read() or b"{}").get("error", {}).get("message", response.reason)
            return result
        seen, last = 0, started
        for data in sse_events(response):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                break
            if chunk.get("usage"):
                result.tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                result.text += (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
                step = choice.get("quickdraft") or {}
                if step.get("tokens"):
                    seen += 1
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - started
                    else:
                        result.gaps.append(now - last)
                    last = now
                result.finish = choice.get("finish_reason") or result.finish
            if disconnect_after is not None and seen >= disconnect_after:
                result.disconnected = True
                break
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if result.disconnected and conn.sock is not None:
            conn.sock.shutdown(socket.SHUT_RDWR)  # an abrupt hang-up, as a closed browser tab
        conn.close()
        result.seconds = time.perf_counter() - started
    return result


def run_load(url: str, model: str, prompts: list[str | list[dict]], requests: int, concurrency: int, max_tokens: int,
             disconnect_every: int = 0, temperature: float = 0.0) -> tuple[list[Result], float]:
    """``requests`` streamed completions (prompts in turn), ``concurrency`` at a time; every
    ``disconnect_every``-th request hangs up after its first chunk. Returns the results and
    the wall time."""

    def one(i: int) -> Result:
        hang_up = 1 if disconnect_every and i % disconnect_every == disconnect_every - 1 else None
        return stream_completion(url, model, prompts[i % len(prompts)], max_tokens, index=i,
                                 temperature=temperature, seed=i if temperature else None,
                                 disconnect_after=hang_up)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    return results, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation; None without values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def summarize(results: list[Result], wall: float) -> dict:
    done = [r for r in results if r.status == 200 and r.error is None and not r.disconnected]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    tokens = sum(r.tokens for r in done)
    return {
        "requests": len(results), "completed": len(done),
        "refused": sum(r.status not in (0, 200) for r in results),
        "disconnected": sum(r.disconnected for r in results),
        "failed": sum(r.status in (0, 200) and r.error is not None for r in results),
        "tokens": tokens, "wall_seconds": wall, "tokens_per_second": tokens / wall if wall > 0 else None,
        "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95),
        # between a stream's chunks with tokens: how long a running stream stalls (e.g. while
        # other requests' prompts are prefilled)
        "gap_p50": percentile(gaps, 0.5), "gap_p99": percentile(gaps, 0.99), "gap_max": max(gaps, default=None),
    }


def start_server(serve_args: list[str], timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """``quickdraft serve --port 0 SERVE_ARGS`` on loopback; returns the process and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "quickdraft", "serve", "--host", "127.0.0.1", "--port", "0",
                             *serve_args], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        sys.stderr.write(line)
        if " at http://" in line:
            url = line.split(" at ", 1)[1].split()[0]
            # Keep draining stderr so the server never blocks on a full pipe.
            threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
            return proc, url
    proc.kill()
    raise SystemExit("quickdraft serve did not start; see its output above")


def _model(url: str) -> str:
    conn = _connection(url, 30)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def category_prompts(category: str, limit: int) -> list[str | list[dict]]:
    """The category's first ``limit`` bench prompts: texts, or a chat's messages."""
    from ..bench.prompts import category_file, load_prompts

    return [p.messages if p.is_chat else p.prompt for p in load_prompts(category_file(category))][:limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quickdraft.server.loadtest", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one with --start)")
    parser.add_argument("--start", action="store_true", help="start `quickdraft serve` on loopback for the run; "
                        "arguments after -- go to it")
    parser.add_argument("--categories", default="short,long,out-of-domain", help="bench prompt categories")
    parser.add_argument("--prompts-per-category", type=positive_int, default=8)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated; the first is the ratio's base")
    parser.add_argument("--requests", type=positive_int, default=16, help="requests per category and concurrency")
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0)
    parser.add_argument("--json", help="write the rows to this file")
    args, serve_args = parser.parse_known_args(argv)
    serve_args = [a for a in serve_args if a != "--"]
    if not args.url and not args.start:
        parser.error("give --url of a running server or --start")
    proc = None
    url = args.url
    if args.start:
        proc, url = start_server(serve_args)
    try:
        model = _model(url)
        levels = [int(c) for c in args.concurrency.split(",")]
        rows = []
        print(f"{'category':<14} {'conc':>4} {'done':>5} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'ratio':>6} "
              f"{'TTFT p50':>9} {'TTFT p95':>9} {'gap p50':>8} {'gap p99':>8} {'gap max':>8}")
        for category in args.categories.split(","):
            prompts = category_prompts(category, args.prompts_per_category)
            stream_completion(url, model, prompts[0], 8)  # warm-up
            base = None
            for level in levels:
                results, wall = run_load(url, model, prompts, args.requests, level, args.max_tokens,
                                         temperature=args.temperature)
                row = {"category": category, "concurrency": level, **summarize(results, wall)}
                base = base or row["tokens_per_second"]
                row["ratio"] = row["tokens_per_second"] / base if base else None
                rows.append(row)
                fmt = lambda x, unit="": "-" if x is None else f"{x * (1000 if unit else 1):.0f}{unit}"  # noqa: E731
                print(f"{category:<14} {level:>4} {row['completed']:>5} {row['tokens']:>7} {wall:>7.1f} "
                      f"{row['tokens_per_second']:>7.1f} {row['ratio']:>6.2f} {fmt(row['ttft_p50'], 'ms'):>9} "
                      f"{fmt(row['ttft_p95'], 'ms'):>9} {fmt(row['gap_p50'], 'ms'):>8} {fmt(row['gap_p99'], 'ms'):>8} "
                      f"{fmt(row['gap_max'], 'ms'):>8}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"url": url, "model": model, "args": vars(args), "serve_args": serve_args, "rows": rows},
                          f, indent=2)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
