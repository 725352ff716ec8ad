"""`quickdraft serve` end to end: the official `openai` client against a real server process on
loopback, the exact SSE format, every bad request, the queue limit and a bounded load test
with clients hanging up mid-stream."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving import MODEL, metric

from quickdraft.cli import main
from quickdraft.server.loadtest import run_load, stream_completion, summarize

PROMPTS = ["def median(values):", "import os\n", "class Point:\n", "for i in range("]


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def generate_json(*args) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", *args, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def plain():
    """Greedy text of `quickdraft generate --method ar` for the test prompts (12 tokens)."""
    from quickdraft import SpeculativeGenerator

    cli = generate_json("--method", "ar", "--prompt", PROMPTS[0], "--max-new-tokens", "12")["text"]
    gen = SpeculativeGenerator.from_pretrained(method="ar")
    texts = {p: gen.generate(p, max_new_tokens=12).text for p in PROMPTS}
    assert texts[PROMPTS[0]] == cli
    return texts


def test_models_health_and_metric_names(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = server.health()
    assert health["status"] == "ok" and health["engine"] in ("solo", "batch")
    assert health["method"] == "draft" and health["num_speculative_tokens"] == 3
    text = server.metrics()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
                 "quickdraft:generation_tokens_per_second", "quickdraft:kv_cache_bytes"):
        assert name in text, name
    assert 'position="2"' in text  # k = 3 positions from the start, as vLLM


def test_completions_greedy_equal_plain_decoding(client, plain):
    prompt = PROMPTS[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == plain[prompt]
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 12
    timings = out.model_extra["timings"]
    assert timings["predicted_n"] == 12 and timings["draft_n"] >= timings["draft_n_accepted"] > 0
    assert timings["mean_accepted_tokens"] > 1

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain[prompt]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_greedy_equals_plain_decoding(client, server, plain):
    prompt = PROMPTS[1]  # the code template: one user message is the prompt itself
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=12, temperature=0)
    assert out.choices[0].message.content == plain[prompt] and out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain[prompt]
    assert chunks[-1].choices[0].finish_reason == "length"
    # The load test streams a chat category's messages the same way.
    streamed = stream_completion(server.url, MODEL, [{"role": "user", "content": prompt}], 12)
    assert streamed.text == plain[prompt] and streamed.tokens == 12 and streamed.ttft is not None


def test_sse_wire_format(server):
    conn = server.connection()
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    raw = resp.read().decode()
    conn.close()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert all(b["object"] == "text_completion" and b["id"] == bodies[0]["id"] for b in bodies)
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 6
    steps = [b["choices"][0]["quickdraft"] for b in bodies if b["choices"] and "quickdraft" in b["choices"][0]]
    assert sum(s["tokens"] for s in steps) == 6 and any(s["drafted"] for s in steps)
    assert all(0 <= s["drafted"] <= s["tokens"] for s in steps)


def test_stop_seed_and_n(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=["\n"])
    assert "\n" not in out.choices[0].text and out.choices[0].finish_reason == "stop"
    ref = generate_json("--prompt", PROMPTS[2], "--max-new-tokens", "40", "--stop", "\\n", "-k", "3")
    assert out.choices[0].text == ref["text"]

    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.9, seed=7, n=2)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    solo = generate_json("--prompt", PROMPTS[0], "--max-new-tokens", "10", "--temperature", "0.9", "--seed", "7",
                         "-k", "3")
    assert first.choices[0].text == solo["text"]  # a row's sample is its solo sample


def test_several_prompts_times_n_stream_interleaved(client, plain):
    """Choice i * n + j is prompt i's j-th choice; streamed choices interleave and each adds
    up to its own text."""
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    texts, finished = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage
    assert texts == {i: plain[PROMPTS[i // 2]] for i in range(4)} and set(finished) == {0, 1, 2, 3}
    lengths = [client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens for p in PROMPTS[:2]]
    assert usage.completion_tokens == 48 and usage.prompt_tokens == sum(lengths)  # each prompt counted once


BAD = [
    ({"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ({"model": MODEL, "prompt": "x", "temperature": 1e308}, 400, "temperature", None),  # was a 500: NaN
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ({"model": MODEL, "prompt": "word " * 2100}, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ({"model": MODEL, "prompt": [10 ** 6]}, 400, "prompt", None),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"model": MODEL, "prompt": "x", "logprobs": 3}, 400, "logprobs", "unsupported_parameter"),
    ({"prompt": "x"}, 400, "model", None),
    ('{"model": "qd-stdlib-target", "prompt": ', 400, None, "invalid_json"),
    ("[1, 2]", 400, None, None),
    ('{"model": "qd-stdlib-target", "prompt": "' + "x" * 120_000 + '"}', 413, None, "body_too_large"),
]


@pytest.mark.parametrize("body,status,param,code", BAD, ids=[
    "unknown-model", "max-tokens-0", "max-tokens-negative", "temperature-negative", "temperature-huge", "top-p-0", "top-p-1.5",
    "prompt-over-context", "prompt-plus-max-tokens-over-context", "empty-prompt", "token-id-out-of-vocab",
    "five-stops", "logprobs", "no-model", "malformed-json", "not-an-object", "oversized-body"])
def test_bad_completion_requests_get_openai_errors(server, body, status, param, code):
    got, error = server.post("/v1/completions", body)
    assert got == status, error
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["message"] and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param and (code is None or error["error"]["code"] == code)


def test_bad_chat_requests_and_the_server_keeps_serving(server, client):
    import openai

    for body, param in [({"model": MODEL, "messages": []}, "messages"),
                        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 0}, "max_completion_tokens"),
                        # constrained decoding is not implemented: refused, not ignored
                        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "json_object"}}, "response_format")]:
        status, error = server.post("/v1/chat/completions", body)
        assert status == 400 and error["error"]["param"] == param, error
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
          "response_format": {"type": "text"}}
    assert server.post("/v1/chat/completions", ok)[0] == 200
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 2100}])
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    assert server.get("/no/such/route")[0] == 404
    # greedy: sampled at the API's default temperature 1, "x" is followed by the end of text one
    # time in ~11,000 (p = 9e-5), and a fresh clone's `make test` drew it once (session 49)
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert done.usage.completion_tokens == 2
    assert "Traceback" not in server.log.read_text()


def test_full_queue_is_a_429_and_hung_up_streams_free_their_rows(server):
    """4 rows + 6 waiting fill the server: more requests at once get 429 with an OpenAI error;
    when every client hangs up, rows and queue empty and KV memory returns to its baseline."""
    baseline = server.wait_idle()
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True})
    conns = [server.connection() for _ in range(14)]
    for conn in conns:  # all sent before any answer is read
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    statuses = []
    for conn in conns:
        resp = conn.getresponse()
        statuses.append(resp.status)
        if resp.status == 429:
            error = json.loads(resp.read())["error"]
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_exceeded", error
            assert resp.getheader("retry-after") == "1"
    assert statuses.count(200) == 10 and statuses.count(429) == 4, statuses
    cancelled = metric(server.metrics(), "quickdraft:requests_cancelled_total")
    for conn in conns:
        if conn.sock is not None:
            conn.sock.shutdown(socket.SHUT_RDWR)  # hang up mid-stream
        conn.close()
    idle = server.wait_idle()
    assert idle["active"] == 0 and idle["waiting"] == 0 and idle["free_slots"] == baseline["free_slots"]
    assert idle["kv_cache_bytes"] == baseline["kv_cache_bytes"]
    assert metric(server.metrics(), "quickdraft:requests_cancelled_total") == cancelled + 10


def test_load_32_requests_8_concurrent_with_hang_ups(server, plain):
    """Every request completes with the right text or was hung up by its client; the server
    stays healthy and returns to its idle occupancy."""
    before = server.metrics()
    baseline = server.wait_idle()
    alive = []
    probe = threading.Thread(target=lambda: alive.extend(server.get("/health")[0] for _ in range(3)))
    results, wall = run_load(server.url, MODEL, PROMPTS, requests=32, concurrency=8, max_tokens=12,
                             disconnect_every=4)
    probe.start()
    probe.join()
    summary = summarize(results, wall)
    assert summary["completed"] == 24 and summary["disconnected"] == 8, summary
    assert all(r.gaps for r in results if not r.disconnected)  # 12 tokens: more than one chunk each
    assert 0 < summary["gap_p50"] <= summary["gap_p99"] <= summary["gap_max"]
    assert summary["refused"] == 0 and summary["failed"] == 0, [r.error for r in results if r.error]
    for r in results:
        if not r.disconnected:
            assert r.text == plain[r.prompt] and r.tokens == 12 and r.finish == "length"
    assert alive == [200, 200, 200]
    idle = server.wait_idle()
    assert idle["active"] == 0 and idle["kv_cache_bytes"] == baseline["kv_cache_bytes"]
    after = server.metrics()
    gained = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    assert gained("vllm:request_success_total", finished_reason="length") == 24
    assert gained("quickdraft:requests_cancelled_total") + gained("vllm:request_success_total") == 32
    drafted = gained("vllm:spec_decode_num_draft_tokens_total")
    accepted = gained("vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    assert gained("vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert stream_completion(server.url, MODEL, PROMPTS[3], 12).text == plain[PROMPTS[3]]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_mid_stream_stops_the_server_cleanly(tmp_path, sig):
    """The step loop runs in the main thread and HTTP in another: SIGTERM (a process manager)
    or Ctrl-C during a stream ends both, with exit status 0, within the grace period; the
    open stream gets a 503-style error chunk and [DONE] instead of a cut connection."""
    import signal
    import time

    from serving import ServerProcess

    srv = ServerProcess(["-k", "3", "--max-batch-size", "2"], tmp_path / "serve.log")
    try:
        conn = srv.connection()
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "stream": True, "temperature": 0}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")  # streaming now
        started = time.monotonic()
        srv.proc.send_signal(getattr(signal, sig))
        rest = resp.read().decode()  # the stream ends with OpenAI's error object, not a cut
        assert '"code":"server_shutdown"' in rest and rest.endswith("data: [DONE]\n\n"), rest[-300:]
        assert srv.proc.wait(15) == 0, (srv.proc.returncode, srv.log.read_text())
        assert time.monotonic() - started < 10
        conn.close()
    finally:
        srv.stop()
    assert "Traceback" not in srv.log.read_text()


def test_a_long_prompt_prefilled_in_chunks_beside_a_running_stream(server):
    """A prompt of 600+ tokens is prefilled 256 tokens a step (the default --prefill-chunk)
    while another stream runs: both texts are what each request gives alone."""
    from quickdraft import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(method="ar")
    long_prompt = "def add(a, b):\n    return a + b\n\n\n" * 60
    assert len(gen.tokenizer(long_prompt)["input_ids"]) > 600
    expected = {p: gen.generate(p, max_new_tokens=n).text for p, n in ((PROMPTS[1], 40), (long_prompt, 12))}
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(stream_completion, server.url, MODEL, PROMPTS[1], 40)
        time.sleep(0.05)  # the short stream starts first
        joining = pool.submit(stream_completion, server.url, MODEL, long_prompt, 12)
        results = [running.result(), joining.result()]
    assert [r.text for r in results] == [expected[PROMPTS[1]], expected[long_prompt]], [r.error for r in results]
