"""Admission takes or refuses a whole HTTP request (prompts x n sequences) at once: a request
larger than max_num_seqs + max_queue_len is served by an idle server (it used to get an endless
429) and gets 429 + Retry-After, saying why, while other requests are in flight."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.utils import dummy_server

pytestmark = pytest.mark.slow

LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def srv():
    server = dummy_server(max_num_seqs=2, max_queue_len=2, step_delay=0.02)  # capacity 4
    yield server
    server.close()


def _wait_idle(srv, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while srv.state.async_engine.num_seqs_in_flight:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


@pytest.mark.parametrize("body,choices", [
    ({"prompt": ["a", "b", "c", "d", "e"]}, 5),
    ({"prompt": ["a", "b", "c"], "n": 2}, 6),
    ({"prompt": "a", "n": 5}, 5),
])
def test_request_larger_than_the_server_is_served_when_idle(srv, body, choices):
    _wait_idle(srv)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert sorted(ch["index"] for ch in r.json()["choices"]) == list(range(choices))


def test_request_larger_than_the_server_waits_while_busy(srv):
    _wait_idle(srv)
    big = {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as s:
            assert s.status_code == 200
            lines = s.iter_lines()  # kept: dropping a half-read iterator hangs up
            assert next(lines).startswith("data: ")  # the first token: it is running
            r = c.post("/v1/completions", json=big)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["code"] == "queue_full" and "no other request is in flight" in err["message"]
            r = c.post("/v1/completions", json={**big, "prompt": ["a", "b", "c"]})  # 1 + 3 fit
            assert r.status_code == 200 and len(r.json()["choices"]) == 3
        _wait_idle(srv)  # the stream was closed: its request was aborted
        assert c.post("/v1/completions", json=big).status_code == 200
