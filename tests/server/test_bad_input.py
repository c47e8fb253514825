"""Bad input always gets a 4xx with OpenAI's error body (never a 5xx, never a crash); auth is
deny-by-default (the schema-driven fuzz run is test_fuzz.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.utils import API_KEY, DUMMY, RemoteServer

pytestmark = pytest.mark.slow

M = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * 1100  # > max_model_len (1024) tokens

# (name, method, path, body (dict -> JSON, bytes -> raw), headers, status, code, param)
CASES = [
    ("malformed json", "POST", CMPL, b'{"model": "x", "prompt": ', {}, 400, "invalid_json", None),
    ("string body", "POST", CMPL, b'"a string"', {}, 400, None, None),
    ("list body", "POST", CHAT, b"[1, 2]", {}, 400, None, None),
    ("null body", "POST", CHAT, b"null", {}, 400, None, None),
    ("number body", "POST", CMPL, b"3", {}, 400, None, None),
    ("wrong content type", "POST", CMPL, json.dumps({"prompt": "hi"}).encode(),
     {"content-type": "text/plain"}, 400, None, None),
    ("max_tokens wrong type", "POST", CMPL, {"prompt": "hi", "max_tokens": "many"}, {}, 400, None,
     "max_tokens"),
    ("messages wrong type", "POST", CHAT, {"messages": "hi"}, {}, 400, None, "messages"),
    ("temperature NaN", "POST", CMPL, b'{"prompt": "hi", "temperature": NaN}', {}, 400, None,
     "temperature"),
    ("unknown model", "POST", CMPL, {"model": "gpt-9", "prompt": "hi"}, {}, 404,
     "model_not_found", "model"),
    ("unknown chat model", "POST", CHAT, {"model": "gpt-9", "messages": MSG}, {}, 404,
     "model_not_found", "model"),
    ("empty prompt", "POST", CMPL, {"prompt": ""}, {}, 400, None, "prompt"),
    ("empty prompt list", "POST", CMPL, {"prompt": []}, {}, 400, None, "prompt"),
    ("empty messages", "POST", CHAT, {"messages": []}, {}, 400, None, "messages"),
    ("missing prompt", "POST", CMPL, {"model": M}, {}, 400, None, "prompt"),
    ("max_tokens 0", "POST", CMPL, {"prompt": "hi", "max_tokens": 0}, {}, 400, None, "max_tokens"),
    ("max_tokens negative", "POST", CHAT, {"messages": MSG, "max_tokens": -5}, {}, 400, None,
     "max_tokens"),
    ("max_completion_tokens 0", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 0}, {},
     400, None, "max_completion_tokens"),
    ("token id out of vocab", "POST", CMPL, {"prompt": [1, 2, 49152]}, {}, 400, None, "prompt"),
    ("huge token id", "POST", CMPL, {"prompt": [10**12]}, {}, 400, None, None),
    ("negative token id", "POST", CMPL, {"prompt": [5, -1]}, {}, 400, None, None),
    ("prompt too long", "POST", CMPL, {"prompt": LONG_PROMPT}, {}, 400,
     "context_length_exceeded", "prompt"),
    ("chat too long", "POST", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, {},
     400, "context_length_exceeded", "messages"),
    ("max_tokens over context", "POST", CMPL, {"prompt": "hi", "max_tokens": 5000}, {}, 400,
     "context_length_exceeded", "max_tokens"),
    ("n too large", "POST", CMPL, {"prompt": "hi", "n": 100000}, {}, 400, None, "n"),
    ("n zero", "POST", CHAT, {"messages": MSG, "n": 0}, {}, 400, None, "n"),
    ("prompts x n too many", "POST", CMPL, {"prompt": ["a"] * 10, "n": 100}, {}, 400, None, "n"),
    ("logprobs too many", "POST", CMPL, {"prompt": "hi", "logprobs": 21}, {}, 400, None,
     "logprobs"),
    ("top_logprobs too many", "POST", CHAT, {"messages": MSG, "logprobs": True,
                                              "top_logprobs": 21}, {}, 400, None, "top_logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, {}, 400,
     None, None),
    ("stream_options without stream", "POST", CHAT,
     {"messages": MSG, "stream_options": {"include_usage": True}}, {}, 400, None, None),
    ("seed out of int64", "POST", CMPL, {"prompt": "hi", "seed": 2**64}, {}, 400, None, "seed"),
    ("temperature negative", "POST", CMPL, {"prompt": "hi", "temperature": -1}, {}, 400, None,
     "temperature"),
    ("top_p zero", "POST", CMPL, {"prompt": "hi", "top_p": 0}, {}, 400, None, "top_p"),
    ("empty stop string", "POST", CMPL, {"prompt": "hi", "stop": [""]}, {}, 400, None, "stop"),
    ("bad role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, None,
     None),
    ("image content", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, {}, 400, None,
     "messages.0.content.0"),
    ("json_schema that does not compile", "POST", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}}, {}, 400, None,
     "response_format"),
    ("json_schema without a schema", "POST", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, {}, 400, None, "response_format"),
    ("regex that does not compile", "POST", CMPL, {"prompt": "hi", "structured_outputs": {"regex": "(a"}}, {}, 400,
     None, "structured_outputs"),
    ("guided_json not JSON", "POST", CMPL, {"prompt": "hi", "guided_json": "{oops"}, {}, 400, None, "guided_json"),
    ("guided_grammar bad", "POST", CHAT, {"messages": MSG, "guided_grammar": "start: nowhere"}, {}, 400, None,
     "guided_grammar"),
    ("two structured outputs", "POST", CHAT, {"messages": MSG, "guided_regex": "a", "response_format": {
        "type": "json_object"}}, {}, 400, None, "guided_regex"),
    ("structured_outputs with two kinds", "POST", CMPL, {"prompt": "hi", "structured_outputs": {
        "regex": "a", "choice": ["a"]}}, {}, 400, None, "structured_outputs"),
    ("tools without --enable-auto-tool-choice", "POST", CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, {}, 400, None, "tool_choice"),
    ("named tool not in tools", "POST", CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
            "name": "g"}}}, {}, 400, None, "tool_choice"),
    ("tool_choice without tools", "POST", CHAT, {"messages": MSG, "tool_choice": "required"}, {}, 400, None,
     "tool_choice"),
    ("tool parameters not a schema", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": 3}}}], "tool_choice": "required"}, {}, 400, None, "tools"),
    ("tool without a name", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {
        "parameters": {}}}]}, {}, 400, None, "tools"),
    ("named tool and response_format", "POST", CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
            "name": "f"}}, "response_format": {"type": "json_object"}}, {}, 400, None, "response_format"),
    ("logit_bias bad key", "POST", CMPL, {"prompt": "hi", "logit_bias": {"abc": 1}}, {}, 400,
     None, "logit_bias"),
    ("logit_bias out of vocab", "POST", CMPL, {"prompt": "hi", "logit_bias": {"49152": 1}}, {},
     400, None, "logit_bias"),
    ("logit_bias too big", "POST", CHAT, {"messages": MSG, "logit_bias": {"5": 101}}, {}, 400,
     None, "logit_bias"),
    ("suffix", "POST", CMPL, {"prompt": "hi", "suffix": "end"}, {}, 400, None, "suffix"),
    ("detokenize out of vocab", "POST", "/detokenize", {"tokens": [49152]}, {}, 400, None,
     "tokens"),
    # JSON may escape a lone surrogate, which is no Unicode text: every string field refuses it
    ("lone surrogate tokenize", "POST", "/tokenize", b'{"prompt": "\\ud800"}', {}, 400, None,
     "prompt"),
    ("lone surrogate prompt", "POST", CMPL, b'{"prompt": "a\\udfffb"}', {}, 400, None, "prompt"),
    ("lone surrogate chat", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', {}, 400, None, "messages"),
    ("lone surrogate tokenize chat", "POST", "/tokenize",
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', {}, 400, None, "messages"),
    ("lone surrogate model", "POST", CMPL, b'{"model": "\\ud800", "prompt": "hi"}', {}, 400,
     None, "model"),
    ("lone surrogate stop", "POST", CMPL, b'{"prompt": "hi", "stop": ["x", "\\udbff"]}', {}, 400,
     None, "stop"),
    ("lone surrogate logit_bias key", "POST", CMPL,
     b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', {}, 400, None, "logit_bias"),
    ("body too large", "POST", CMPL, {"prompt": "x" * (2**20 + 10)}, {}, 413, "request_too_large",
     None),
    ("unknown route", "GET", "/v1/nope", None, {}, 404, None, None),
    ("wrong method", "GET", CMPL, None, {}, 405, None, None),
]


@pytest.mark.parametrize("name,method,path,body,headers,status,code,param", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_4xx(http, name, method, path, body, headers, status, code, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    if isinstance(body, bytes) and "content-type" not in headers:
        headers = {"content-type": "application/json", **headers}
    r = http.request(method, path, headers=headers, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("body,message,param", [
    ({"prompt": []}, "prompt: List should have at least 1 item", "prompt"),
    ({"prompt": [[]]}, "prompt.0: List should have at least 1 item", "prompt"),
    ({"prompt": [1, "a"]}, "prompt.1: Input should be a valid integer", "prompt"),
    ({"prompt": "hi", "stop": [1, 2]}, "stop.0: Input should be a valid string", "stop"),
    ({"prompt": [], "max_tokens": "x"}, "(and 1 more error)", "prompt"),
])
def test_a_value_matching_no_form_of_a_union_gets_the_closest_forms_error(http, body, message, param):
    """`prompt` is a string, strings, token ids or lists of token ids: pydantic reports one error
    per form, under tags like `constrained-str`; the message names the form the value got
    furthest in, without the tag."""
    r = http.post(CMPL, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert message in err["message"] and "constrained" not in err["message"], err
    assert err["param"] == param


def test_server_still_serves_after_bad_input(client, model_name):
    # openai-python raises BadRequestError (400) rather than retrying (it would retry a 5xx)
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="hi", logprobs=50)
    assert e.value.status_code == 400
    assert client.completions.create(model=model_name, prompt="hi", max_tokens=2).choices


@pytest.mark.parametrize("path,method", [
    ("/v1/models", "GET"), ("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
    ("/tokenize", "POST"), ("/detokenize", "POST"), ("/tokenizer_info", "GET"), ("/version", "GET"),
    ("/openapi.json", "GET"), ("/docs", "GET"), ("/v1/unknown", "GET")])
def test_auth_required_everywhere_but_health_and_metrics(server, path, method):
    body = {"prompt": "hi", "max_tokens": 1} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"}):
        r = httpx.request(method, server.url + path, json=body, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    # the Host header never changes which route is protected (CVE-2026-48746)
    r = httpx.request(method, server.url + path, json=body, headers={"Host": "evil/health"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_are_open_by_default_and_guarded_on_request(server):
    """vLLM's API key guards /v1/*, so a Prometheus scrape set up for vLLM sends no key:
    /metrics is open unless --require-api-key-for-metrics."""
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and "compilelm:num_requests_running" in r.text
    guarded = RemoteServer([DUMMY, "--enforce-eager", "--max-model-len", "128", "--num-kv-blocks",
                            "16", "--api-key", API_KEY, "--require-api-key-for-metrics"])
    try:
        r = httpx.get(f"{guarded.url}/metrics")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(f"{guarded.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200 and "compilelm:num_requests_running" in r.text
        assert httpx.get(f"{guarded.url}/health").status_code == 200
    finally:
        guarded.close()


def test_openai_client_auth(server, model_name):
    import openai
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == model_name
