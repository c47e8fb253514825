"""A failed request never costs the client its kept-alive connection: after a 500 (a fault
injected into the running server), a 400 or a stream that fails half-way, the next request on
the same httpx connection is served, over the one TCP connection the client opened."""

from __future__ import annotations

import json

import httpx
import pytest

from compilelm.entrypoints.openai import serving_engine
from tests.server.utils import ConnectionCounter, dummy_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv():
    server = dummy_server(max_num_seqs=4, max_queue_len=None)
    yield server
    server.close()


@pytest.fixture
def client(srv):
    conns = ConnectionCounter()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.conns = conns
        yield c


def _request(c, method: str, path: str, **kw) -> httpx.Response:
    return c.request(method, path, extensions={"trace": c.conns}, **kw)


def _raw_json(body: bytes) -> dict:
    return {"content": body, "headers": {"content-type": "application/json"}}


def test_connection_survives_an_internal_error(srv, client, monkeypatch):
    tok = srv.state.async_engine.engine.tokenizer
    encode = tok.encode

    def faulty_encode(text, **kw):
        if text == "boom":
            raise RuntimeError("injected tokenizer fault")
        return encode(text, **kw)

    monkeypatch.setattr(tok, "encode", faulty_encode)
    r = _request(client, "POST", "/tokenize", json={"prompt": "boom"})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal server error: RuntimeError",
                                 "type": "internal_server_error", "param": None,
                                 "code": "internal_error"}
    assert _request(client, "POST", "/tokenize", json={"prompt": "fine"}).json()["tokens"]
    assert _request(client, "GET", "/v1/models").status_code == 200
    assert client.conns.opened == 1


def test_connection_survives_a_bad_request(client):
    r = _request(client, "POST", "/tokenize", **_raw_json(b'{"prompt": "\\ud800"}'))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert _request(client, "POST", "/tokenize", json={"prompt": "fine"}).status_code == 200
    assert client.conns.opened == 1


def test_stream_failing_half_way_ends_with_an_error_event(srv, client, monkeypatch):
    def faulty_next(self, out):
        raise RuntimeError("injected streaming fault")

    monkeypatch.setattr(serving_engine.ChoiceStream, "next", faulty_next)
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body,
                       extensions={"trace": client.conns}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "internal_error"
    monkeypatch.undo()
    r = _request(client, "POST", "/v1/completions", json={**body, "stream": False})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert client.conns.opened == 1
