"""Prometheus metrics of the server (``GET /metrics``).

Speculative-decoding counters use vLLM's names so existing dashboards read them:
``vllm:spec_decode_num_drafts`` (target passes that verified a draft),
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
``vllm:spec_decode_num_accepted_tokens_per_pos{position}``, and so do the request figures
vLLM has (running / waiting requests, prompt and generation tokens, finished requests,
time to first token, end-to-end latency). What vLLM has no name for is ``quickdraft:``.
Every series carries ``model_name`` as vLLM's do.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..decoding.stats import GenerationStats

RATE_WINDOW_SECONDS = 10.0
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """The server's metrics in a registry of their own (one per app). ``engine_state`` (set
    by the scheduler) is called at scrape time for the occupancy gauges: a dict with
    ``active``, ``free_slots``, ``waiting`` and ``kv_cache_bytes``. ``draft_positions`` (k)
    per-position series are exported from the start."""

    def __init__(self, model_name: str, draft_positions: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.engine_state: Callable[[], dict] = lambda: dict.fromkeys(("active", "free_slots", "waiting",
                                                                        "kv_cache_bytes"), 0)
        m, r = ["model_name"], self.registry
        self.model_name = model_name

        def counter(name, doc, labels=()):
            return Counter(name, doc, m + list(labels), registry=r)

        def gauge(name, doc, key):
            g = Gauge(name, doc, m, registry=r)
            g.labels(model_name).set_function(lambda: float(self.engine_state()[key]))

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Target passes that verified a draft.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0 = first).", ["position"])
        for pos in range(draft_positions):  # shown at 0 from the start, as vLLM does
            self.label(self.accepted_per_pos, str(pos))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests admitted.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.request_success = counter("vllm:request_success", "Generations that finished.", ["finished_reason"])
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time from the request's arrival to its first token.", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Time from the request's arrival to its last token.", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        gauge("vllm:num_requests_running", "Generations in the engine now.", "active")
        gauge("vllm:num_requests_waiting", "Generations waiting in the queue.", "waiting")
        gauge("quickdraft:engine_free_slots", "Rows the engine can take now.", "free_slots")
        gauge("quickdraft:kv_cache_bytes", "KV cache memory held by the engine's rows.", "kv_cache_bytes")
        self.requests = counter("quickdraft:requests", "HTTP generation requests received.", ["endpoint"])
        self.rejected = counter("quickdraft:requests_rejected",
                                "Requests refused before generating (bad request, queue full).", ["reason"])
        self.cancelled = counter("quickdraft:requests_cancelled",
                                 "Generations stopped because their client went away.")
        self.steps = counter("quickdraft:engine_steps", "Engine steps (one target pass per active row).")
        rate = Gauge("quickdraft:generation_tokens_per_second",
                     f"Tokens generated per second over the last {RATE_WINDOW_SECONDS:.0f} s.", m, registry=r)
        rate.labels(model_name).set_function(self.tokens_per_second)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def label(self, metric, *values):
        return metric.labels(self.model_name, *values)

    def record_step(self, tokens: int) -> None:
        """One engine step that emitted ``tokens`` tokens over all rows."""
        self.label(self.steps).inc()
        self.label(self.generation_tokens).inc(tokens)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_SECONDS:
                self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            return sum(n for t, n in self._recent if t >= now - RATE_WINDOW_SECONDS) / RATE_WINDOW_SECONDS

    def record_speculation(self, before: GenerationStats, after: GenerationStats) -> None:
        """Add what a row's stats gained between two updates to the spec-decode counters."""
        drafts = _at(after.drafted_per_position, 0) - _at(before.drafted_per_position, 0)
        if drafts:
            self.label(self.num_drafts).inc(drafts)
        drafted = after.drafted_tokens - before.drafted_tokens
        if drafted:
            self.label(self.num_draft_tokens).inc(drafted)
        accepted = after.accepted_tokens - before.accepted_tokens
        if accepted:
            self.label(self.num_accepted_tokens).inc(accepted)
        for pos in range(len(after.accepted_per_position)):
            gained = _at(after.accepted_per_position, pos) - _at(before.accepted_per_position, pos)
            if gained:
                self.label(self.accepted_per_pos, str(pos)).inc(gained)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _at(values: list[int], i: int) -> int:
    return values[i] if i < len(values) else 0
