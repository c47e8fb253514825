"""The engine loop dies (an exception in a step of a real `compilelm serve` process): every
in-flight request gets an OpenAI-shaped error (a 500, or an error event then [DONE] in a
stream) and the process exits with status 1, so that a supervisor restarts it."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.faulty_serve import POISON
from tests.server.utils import DUMMY, RemoteServer, stream_to_end, wait_in_flight

pytestmark = pytest.mark.slow

LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True}
ERROR_KEYS = {"message", "type", "param", "code"}


def _post(url: str, body: dict, out: dict, key: str) -> None:
    out[key] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_engine_failure_fails_in_flight_requests_and_exits_1():
    srv = RemoteServer([DUMMY, "--enforce-eager", "--max-model-len", "256", "--num-kv-blocks",
                        "64"], module="tests.server.faulty_serve")
    try:
        results: dict = {}
        threads = [threading.Thread(target=stream_to_end,
                                    args=(srv.url, {**LONG, "stream": True}, results, "stream")),
                   threading.Thread(target=_post, args=(srv.url, LONG, results, "blocking"))]
        for t in threads:
            t.start()
        wait_in_flight(srv, 2)
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": POISON, "max_tokens": 4},
                       timeout=120)
        assert r.status_code == 500 and set(r.json()["error"]) == ERROR_KEYS
        for t in threads:
            t.join(60)
        blocking = results["blocking"]
        assert blocking.status_code == 500
        err = blocking.json()["error"]
        assert set(err) == ERROR_KEYS and err["type"] == "internal_server_error"
        assert "injected step failure" in err["message"]
        lines = results["stream"]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][len("data: "):])["error"]
        assert set(err) == ERROR_KEYS and "injected step failure" in err["message"]
        assert srv.proc.wait(60) == 1, srv.log()[-3000:]
        log = srv.log()
        assert "engine step failed" in log and "exiting with status 1" in log
    finally:
        srv.close()
