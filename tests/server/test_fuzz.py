"""Schema-driven fuzzing over /openapi.json (schemathesis): never a 5xx, never a 429 from an idle
server, and the status codes, content types, headers and bodies are the documented ones.

Schema-valid values alone miss what broke servers before, so the cases also carry:
- strings with lone surrogate escapes (`"\\ud800"`: valid JSON, not Unicode) and control
  characters, anywhere in the body (the keys of nested objects included);
- on a server holding 4 sequences (max_num_seqs 2 + max_queue_len 2), completion batches of up
  to 8 prompts x n = 3, beyond what it can hold (an idle server must serve them);
- every case of a run on one kept-alive connection: the server must never drop it.
"""

from __future__ import annotations

import json
import time

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks

from tests.server.utils import API_KEY, ConnectionCounter, dummy_server

KEEP_ALIVE_S = 5  # the server's keep-alive timeout (api_server.py: timeout_keep_alive)

pytestmark = pytest.mark.slow

SURROGATES = ["\ud800", "\udfff", "a\udbffz", "\udc00\ud800"]  # lone, or in the wrong order
CONTROLS = ["\x00", "\x1b[2J", "\x7f", "\x01\x1f", "\r\n\t", "\u2028", "\ufeff"]
VOCAB = 49152  # the default model's (and its dummy's) vocabulary
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          checks.response_headers_conformance]


def _tainted(data, value, top: bool = True):
    """`value` (a JSON body) with a hostile piece put into some of its strings (the keys of
    nested objects included; the body's own keys stay the API's field names)."""
    if isinstance(value, str):
        where = data.draw(st.sampled_from(["keep", "prefix", "suffix", "replace"]))
        if where == "keep":
            return value
        piece = data.draw(st.sampled_from(SURROGATES) | st.sampled_from(CONTROLS))
        return {"prefix": piece + value, "suffix": value + piece, "replace": piece}[where]
    if isinstance(value, dict):
        return {(k if top else _tainted(data, k, False)): _tainted(data, v, False)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_tainted(data, v, False) for v in value]
    return value


def _batch(max_prompts: int):
    """A completions `prompt` of several prompts: texts, or token-id lists."""
    texts = st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=max_prompts)
    ids = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), min_size=2,
                   max_size=max_prompts)
    return st.one_of(texts, ids)


def _num_seqs(body) -> int:
    """Sequences a completions body asks for (prompts x n)."""
    if not isinstance(body, dict):
        return 0
    prompt, n = body.get("prompt"), body.get("n") or 1
    batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
    return (len(prompt) if batch else 1) * (n if isinstance(n, int) else 1)


def _fuzz(url: str, headers: dict, paths: set[str] | None, examples: int,
          batch_prompts: int = 0) -> list:
    """Runs every operation (or those in `paths`) on one kept-alive connection; returns
    (path, status, sequences asked for) per case; fails if any check did not hold."""
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json", headers=headers,
                                                      timeout=30).json())
    operations = [op.ok() for op in schema.get_all_operations()
                  if paths is None or op.ok().path in paths]
    conns = ConnectionCounter()
    client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=1))
    failures, generated = [], []
    previous = None  # the previous case, unless its response announced `Connection: close`
    previous_at = 0.0  # when its response came

    for op in operations:
        generation = "completions" in op.path

        @given(case=op.as_strategy(), data=st.data())
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck),
                  phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
        def run(case, data):
            nonlocal previous, previous_at
            if isinstance(case.body, dict) and generation:  # keep generation short on CPU
                case.body["max_tokens"] = min(case.body.get("max_tokens") or 2, 2)
                case.body.pop("max_completion_tokens", None)
                case.body.pop("min_tokens", None)
                case.body["n"] = min(case.body.get("n") or 1, 3 if batch_prompts else 2)
                if batch_prompts and data.draw(st.booleans()):
                    case.body["prompt"] = data.draw(_batch(batch_prompts))
                    for name in ("model", "best_of", "suffix"):  # let most batches through
                        case.body.pop(name, None)
            request = case.as_transport_kwargs(base_url=url, headers=headers)
            body = request.get("json")
            if body is not None and data.draw(st.booleans()):
                body = _tainted(data, body)
            opened, sent = conns.opened, time.monotonic()
            try:
                response = client.request(  # json.dumps escapes lone surrogates: `"\\ud800"`
                    request["method"], request["url"], headers=request["headers"],
                    params=request["params"] or None, extensions={"trace": conns},
                    content=None if body is None else json.dumps(body).encode())
            except httpx.TransportError as e:  # a lost request
                failures.append((case.method, case.path, body, None, f"{e!r} after {previous}"))
                previous = None
                return
            generated.append((op.path, response.status_code, _num_seqs(body)))
            where = (case.method, case.path, body, response.status_code)
            # (a connection idle for the server's keep-alive timeout, 5 s, is closed by design: on a
            # slow machine the next case may take that long to draw)
            if previous is not None and conns.opened != opened and sent - previous_at < KEEP_ALIVE_S - 1:
                failures.append((*previous, "the server dropped the kept-alive connection after "
                                 "this case"))
            previous = None if response.headers.get("connection", "").lower() == "close" else where
            previous_at = time.monotonic()
            if response.status_code == 429:
                failures.append((*where, "429 from an idle server: " + response.text[:300]))
            try:
                case.validate_response(response, checks=CHECKS)
            except BaseException as e:  # noqa: BLE001 - collected, reported below
                failures.append((*where, str(e)[:500]))

        run()
    client.close()
    assert not failures, failures[:3]
    return generated


def test_schemathesis_no_server_errors(server):
    """Every operation of the main server (the default model)."""
    generated = _fuzz(server.url, {"Authorization": f"Bearer {API_KEY}"}, None, examples=40)
    assert {path for path, _, _ in generated} >= {"/v1/completions", "/v1/chat/completions",
                                                "/tokenize", "/tokenizer_info", "/health",
                                                "/metrics"}
    ok = [path for path, status, _ in generated if status == 200]
    # random token ids are mostly out of vocabulary (400), but some requests must get through
    assert ok.count("/v1/completions") >= 3 and ok.count("/v1/chat/completions") >= 3


def test_schemathesis_batches_beyond_the_queue():
    """Completions on a server holding 4 sequences, with batches of up to 8 prompts x n = 3."""
    srv = dummy_server(max_num_seqs=2, max_queue_len=2)
    try:
        # 80: the draws are derandomized, so a new request field reshuffles them (40, then 60 after the
        # structured-output fields came, left too few big batches)
        generated = _fuzz(srv.url, {}, {"/v1/completions"}, examples=80, batch_prompts=8)
    finally:
        srv.close()
    served = [seqs for _, status, seqs in generated if status == 200]
    assert sum(seqs > 4 for seqs in served) >= 5, generated  # more than the server holds
