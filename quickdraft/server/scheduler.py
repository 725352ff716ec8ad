"""Continuous batching: the engine's step loop, fed by a bounded queue.

Between two steps the loop drops the rows whose clients went away (their cache is freed
there and then), admits waiting jobs into the free rows, and runs one step for every
active row; each row's update goes to its request's asyncio queue on the event loop. The
engine is only ever touched by the loop's thread, and the event loop never waits on a step.

`quickdraft serve` runs the loop in the process's main thread and the HTTP server in
another: oneDNN's products (the native runtime's decode linears) run at about half speed
when called from any other thread (measured on this 2-core CPU: a one-row product of the
target's MLP weight 112 us instead of 59 us; OpenMP teams of non-initial threads), which
had halved the server's tokens/s. `docs/bench/thread_penalty.py` reproduces it.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch

from ..decoding.sampling import SamplingParams
from ..decoding.stats import GenerationStats
from ..decoding.step import ContextOverflowError
from ..decoding.stopping import StopConditions
from .metrics import ServerMetrics


class QueueFullError(RuntimeError):
    """The queue holds ``max_queue`` waiting generations already."""


class ShuttingDownError(RuntimeError):
    """The step loop has stopped (the server is shutting down)."""


SHUTDOWN_MESSAGE = "the server is shutting down; retry the request on another instance or after a restart"


@dataclass
class Event:
    """A row's update as the request sees it: ``stats`` is a copy taken in the step thread.
    ``error`` (a message) instead when the row could not run."""

    index: int
    tokens: list[int] = field(default_factory=list)
    drafted: int = 0
    finish: str | None = None
    stats: GenerationStats | None = None
    error: str | None = None
    error_code: str | None = None


@dataclass(eq=False)  # compared by identity: the queue removes a job by `is`
class Job:
    """One generation (one choice of one request)."""

    index: int
    prompt: torch.Tensor
    params: SamplingParams
    stop: StopConditions
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.monotonic)
    row: int | None = None
    cancelled: bool = False
    done: bool = False
    first_token_at: float | None = None
    seen: GenerationStats = field(default_factory=GenerationStats)
    counted: bool = False  # holds one of the server's places (a row or the queue)

    def send(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """Owns the engine; ``submit`` and ``cancel`` are safe to call from any thread."""

    def __init__(self, engine, metrics: ServerMetrics, max_queue: int, stall_seconds: float = 120.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.stall_seconds = stall_seconds  # a step (or a wait with work to do) longer than this is a stall
        self._busy_since: float | None = None  # when the loop last began work it has not finished
        self._waiting: deque[Job] = deque()
        self._cancelled: list[Job] = []
        self._rows: dict[int, Job] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._state = {"active": 0, "free_slots": engine.free_slots, "kv_cache_bytes": 0}
        # Generations submitted and not yet finished, failed or cancelled: what the bound on
        # rows + queue counts. Released the moment a job ends (before its client hears of
        # it), so a client that sends its next request at once always finds its place.
        self._in_flight = 0
        self._ended = False  # the loop has returned (or died)
        metrics.engine_state = self.state

    def stop(self) -> None:
        """End the loop after the current step (safe from any thread and signal handler)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    @property
    def alive(self) -> bool:
        """The step loop is running (or about to start)."""
        return not self._ended

    def run(self) -> None:
        """The step loop, in the calling thread (the main thread: see the module
        docstring), until :meth:`stop`."""
        try:
            self._loop()
        finally:
            self._ended = True
            self._end_open_jobs()

    def _end_open_jobs(self) -> None:
        """The loop is over: running and waiting generations end now with a 503, so their
        streams close within the HTTP server's grace period instead of being cut."""
        with self._wake:
            jobs = [*self._rows.values(), *self._waiting]
            self._waiting.clear()
        self._rows.clear()
        for job in jobs:
            if not job.done:
                self._finish(job)
                try:
                    job.send(Event(job.index, error=SHUTDOWN_MESSAGE, error_code="server_shutdown"))
                except RuntimeError:  # the event loop is closed already: nobody is listening
                    pass

    def problem(self) -> str | None:
        """Why the engine cannot make progress, or None when it can: the loop has ended,
        rows are held by no generation (a leak: they would never free), or one round of
        admission and a step has run for more than ``stall_seconds``."""
        if self._ended:
            return "engine stopped"
        with self._wake:
            state, busy_since = self._state, self._busy_since
        lost = self.engine.max_batch_size - state["free_slots"] - state["active"]
        if lost > 0:
            return f"engine stuck: {lost} rows are held by no generation"
        if busy_since is not None and time.monotonic() - busy_since > self.stall_seconds:
            return f"engine stuck: one step has run for more than {self.stall_seconds:g} s"
        return None

    def state(self) -> dict:
        """Occupancy as of the last step: active rows, free rows, KV bytes, waiting jobs."""
        with self._wake:
            return {**self._state, "waiting": len(self._waiting)}

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's generations, all or none (:class:`QueueFullError`): jobs that a
        free row will take at the next step do not count against ``max_queue``."""
        with self._wake:
            if self._stopping or self._ended:
                raise ShuttingDownError(SHUTDOWN_MESSAGE)
            if self._in_flight + len(jobs) > self.max_queue + self.engine.max_batch_size:
                raise QueueFullError(
                    f"the server is busy: {len(self._waiting)} generations are waiting already "
                    f"(--max-queue {self.max_queue}); retry later"
                )
            for job in jobs:
                job.counted = True
            self._in_flight += len(jobs)
            self._waiting.extend(jobs)
            self._wake.notify()

    def cancel(self, jobs: list[Job]) -> None:
        """The client went away: drop these jobs (their rows are freed before the next step)."""
        with self._wake:
            for job in jobs:
                if not job.done and not job.cancelled:
                    job.cancelled = True
                    self._cancelled.append(job)
                    self._release(job)
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self._cancelled or self.engine.active):
                    self._wake.wait()
                if self._stopping:
                    return
                self._busy_since = time.monotonic()
                cancelled, self._cancelled = self._cancelled, []
                for job in cancelled:
                    if job in self._waiting:
                        self._waiting.remove(job)
            for job in cancelled:
                self._drop(job)
            self._admit()
            if self.engine.active:
                self._step()
            self._publish()

    def _release(self, job: Job) -> None:
        """Give back the job's place (once)."""
        with self._wake:
            if job.counted:
                job.counted = False
                self._in_flight -= 1

    def _finish(self, job: Job) -> None:
        """The job is over (finished, failed or dropped): mark it and free its place."""
        job.done = True
        self._release(job)

    def _drop(self, job: Job) -> None:
        if job.row is not None and self._rows.pop(job.row, None) is job:
            self.engine.cancel(job.row)
        if not job.done:
            self._finish(job)
            self.metrics.label(self.metrics.cancelled).inc()

    def _admit(self) -> None:
        while self.engine.free_slots:
            with self._wake:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
            try:
                job.row = self.engine.add(job.prompt, job.params, job.stop)
            except Exception as exc:  # the request's fault (400) or a bug (500): that request fails alone
                self._finish(job)
                if isinstance(exc, ContextOverflowError):
                    job.send(Event(job.index, error=str(exc), error_code="context_length_exceeded"))
                elif isinstance(exc, ValueError):
                    job.send(Event(job.index, error=str(exc)))
                else:
                    traceback.print_exc(file=sys.stderr)
                    job.send(Event(job.index, error="the engine failed on this request", error_code="server_error"))
                continue
            self._rows[job.row] = job
            self.metrics.label(self.metrics.prompt_tokens).inc(job.prompt.numel())

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception:  # a bug: fail the rows that were running, keep serving the rest
            traceback.print_exc(file=sys.stderr)
            for row, job in list(self._rows.items()):
                self.engine.cancel(row)
                self._finish(job)
                job.send(Event(job.index, error="the engine failed on this request", error_code="server_error"))
            self._rows.clear()
            return
        now = time.monotonic()
        self.metrics.record_step(sum(len(u.tokens) for u in updates.values()))
        for row, update in updates.items():
            job = self._rows.get(row)
            if job is None:
                continue
            stats = copy.deepcopy(update.stats)
            self.metrics.record_speculation(job.seen, stats)
            job.seen = stats
            if update.tokens and job.first_token_at is None:
                job.first_token_at = now
                self.metrics.label(self.metrics.ttft).observe(now - job.arrived)
            if update.error:  # this row alone failed (the engine has dropped it); the others go on
                del self._rows[row]
                self._finish(job)
                job.send(Event(job.index, error=update.error, error_code=update.error_code))
                continue
            if update.finish:
                del self._rows[row]
                self._finish(job)
                self.metrics.label(self.metrics.request_success, update.finish).inc()
                self.metrics.label(self.metrics.e2e).observe(now - job.arrived)
            job.send(Event(job.index, list(update.tokens), update.drafted, update.finish, stats))

    def _publish(self) -> None:
        state = {"active": self.engine.active, "free_slots": self.engine.free_slots,
                 "kv_cache_bytes": int(getattr(self.engine, "kv_cache_bytes", 0))}
        k = getattr(self.engine, "last_k", None)
        if k is not None:  # what the engine drafted at its last step (the batch policy's choice)
            state["num_speculative_tokens_used"] = k
        with self._wake:
            self._state = state
            self._busy_since = None
