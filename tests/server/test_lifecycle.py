"""Overload, shutdown and engine death: 429 with Retry-After on a full queue, SIGTERM drains
in-flight work (or aborts it with --shutdown-timeout 0; exits at once while the model still
loads), and an exception inside the engine
fails every request with a 500 / error event and turns /health to 503."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.utils import DUMMY, RemoteServer, dummy_server, stream_to_end, wait_healthy, wait_in_flight

pytestmark = pytest.mark.slow

LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}


class _Events:
    """Reads a streaming response event by event. Keep it referenced while the request should
    stay open: dropping a half-read iterator closes the connection (a client disconnect)."""

    def __init__(self, response: httpx.Response):
        self.lines = response.iter_lines()

    def next(self) -> dict:
        for line in self.lines:
            if line.startswith("data: "):
                return json.loads(line[6:])
        raise AssertionError("no event")

    def rest(self) -> list[str]:
        return [line for line in self.lines if line]


def test_full_queue_gets_429_with_retry_after():
    srv = dummy_server(max_num_seqs=2, max_queue_len=1, step_delay=0.02)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=LONG) as a, \
                    c.stream("POST", "/v1/completions", json=LONG) as b, \
                    c.stream("POST", "/v1/completions", json=LONG) as w:  # 2 running + 1 waiting
                readers = [_Events(a), _Events(b)]
                assert all(r.next()["choices"] for r in readers)
                assert w.status_code == 200 and srv.state.async_engine.num_seqs_in_flight == 3
                r = c.post("/v1/completions", json={**LONG, "stream": False})
                assert r.status_code == 429
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
                r = c.post("/v1/completions", json={**LONG, "stream": True})
                assert r.status_code == 429  # a real status, not an error inside a 200 stream
                client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    client.completions.create(model="dummy", prompt=[5], max_tokens=1)
            # the three streams were closed: their slots are free again
            deadline = time.monotonic() + 30
            while srv.state.async_engine.num_seqs_in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert r.status_code == 200
            assert 'reason="queue_full"' in c.get("/metrics").text
    finally:
        srv.close()


def test_engine_death_fails_requests_and_health(caplog):
    srv = dummy_server(max_num_seqs=8, max_queue_len=None, step_delay=0.01)
    engine = srv.state.async_engine.engine
    boom = threading.Event()
    step = engine.step

    def failing_step():
        if boom.is_set():
            raise RuntimeError("injected forward failure")
        return step()

    engine.step = failing_step
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            blocking: dict = {}
            t = threading.Thread(target=lambda: blocking.setdefault(
                "r", c.post("/v1/completions", json={**LONG, "stream": False})))
            with caplog.at_level(logging.ERROR, logger="compilelm"):
                with c.stream("POST", "/v1/completions", json=LONG) as s:
                    events = _Events(s)
                    assert events.next()["choices"][0]["text"] is not None
                    t.start()
                    time.sleep(0.3)
                    boom.set()
                    rest = events.rest()
                t.join(30)
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2][6:])["error"]
            assert "injected forward failure" in error["message"]
            r = blocking["r"]
            assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
            assert c.get("/health").status_code == 503
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
            assert r.status_code == 500 and time.monotonic() - t0 < 5  # fails fast, no hang
            assert any("engine step failed" in rec.getMessage() for rec in caplog.records)
    finally:
        srv.close()


def test_health_503_while_loading_then_sigterm_drains_in_flight_requests():
    srv = RemoteServer([DUMMY, "--enforce-eager", "--max-model-len", "256", "--num-kv-blocks",
                        "64", "--shutdown-timeout", "60"], wait=False)
    try:
        statuses = []  # /health from the moment the port answers: 503 (loading) until ready
        deadline = time.monotonic() + 180
        while not statuses or statuses[-1][0] != 200:
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log()
            try:
                r = httpx.get(f"{srv.url}/health", timeout=2)
                statuses.append((r.status_code, r.headers.get("retry-after")))
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        assert statuses[0][0] == 503 and statuses[0][1] is not None, statuses[:3]
        assert {s for s, _ in statuses} == {503, 200}
        body = {**LONG, "max_tokens": 24}
        results: dict = {}
        threads = [threading.Thread(target=stream_to_end, args=(srv.url, body, results, k))
                   for k in ("a", "b")]
        for t in threads:
            t.start()
        wait_in_flight(srv, 2)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert r.status_code == 503 and "retry-after" in r.headers
        for t in threads:
            t.join(120)
        assert srv.proc.wait(60) == 0, srv.log()
        for k in ("a", "b"):  # both ran to the end: 24 tokens, finish_reason length, [DONE]
            lines = results[k]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        srv.close()


def test_sigterm_while_loading_exits_at_once():
    """SIGTERM before the model is ready: nothing is in flight, the process exits 0 at once (it
    used to abort, exit 134, as the interpreter ended under the engine thread inside torch)."""
    srv = RemoteServer([DUMMY, "--max-model-len", "256", "--num-kv-blocks", "64"], wait=False)
    try:
        # the port answers /health with 503 while the model loads and compiles
        wait_healthy(srv.url, 120, lambda: srv.proc.poll() is None, srv.log, status=503, interval=0.02)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log()
        assert time.monotonic() - t0 < 10
        log = srv.log()
        assert "exiting while the model was still loading" in log and "terminate called" not in log, log[-3000:]
    finally:
        srv.close()


def test_sigterm_with_zero_timeout_aborts_and_exits_fast():
    """--shutdown-timeout 0: in-flight streams end as vLLM ends aborted ones, each unfinished
    choice with finish_reason "abort", then the usage chunk and [DONE] (no error event); the
    process exits 0."""
    srv = RemoteServer([DUMMY, "--enforce-eager", "--max-model-len", "256", "--num-kv-blocks",
                        "64", "--shutdown-timeout", "0"])
    try:
        usage = {"stream_options": {"include_usage": True}}
        bodies = {"/v1/completions": ({**LONG, **usage}, 1),
                  "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                            "max_tokens": 200, "ignore_eos": True, "stream": True,
                                            **usage}, 2)}
        results: dict = {}
        threads = [threading.Thread(target=stream_to_end, args=(srv.url, body, results, path, path))
                   for path, (body, _) in bodies.items()]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(len(results.get(path, ())) >= 3 for path in bodies):  # text is streaming
            assert time.monotonic() < deadline, results
            time.sleep(0.05)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(15) == 0, srv.log()
        assert time.monotonic() - t0 < 10
        for t in threads:
            t.join(30)
        for path, (_, n) in bodies.items():
            lines = results[path]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert not any("error" in e for e in events), events[-3:]
            finished = sorted((c["index"], c["finish_reason"]) for e in events
                              for c in e["choices"] if c["finish_reason"])
            assert finished == [(i, "abort") for i in range(n)], finished
            assert events[-1]["choices"] == []
            u = events[-1]["usage"]
            assert u["completion_tokens"] >= n and u["prompt_tokens"] > 0
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    finally:
        srv.close()
