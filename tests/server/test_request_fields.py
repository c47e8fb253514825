"""Request fields as vLLM treats them: unknown ones (vllm_xargs, ...) are accepted, logged once per
name and listed in the response's Warning header; `chat_template_kwargs` reaches the template
(Qwen3's enable_thinking); `priority` 0 is accepted and anything else refused as vLLM refuses it
without priority scheduling."""

from __future__ import annotations

import httpx
import pytest

from tests.hf_fixtures import tiny_llama, word_tokenizer
from tests.server.utils import RemoteServer

TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}mat {% endif %}"
            "{% for m in messages %}{{ m.content }} {% endfor %}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    model = tiny_llama(root / "m", vocab_size=32)
    word_tokenizer(model)
    (root / "t.jinja").write_text(TEMPLATE)
    server = RemoteServer([str(model), "--chat-template", str(root / "t.jinja"), "--enforce-eager",
                           "--max-model-len", "64", "--num-kv-blocks", "16"])
    yield server
    server.close()


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def test_unknown_fields_are_listed_and_logged_once(srv, http):
    body = {"prompt": "the cat", "max_tokens": 2, "vllm_xargs": {"a": 1}, "mm_processor_kwargs": {}}
    for _ in range(2):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["warning"] == ('299 compilelm "The following fields were present in the request but '
                                        'ignored: vllm_xargs, mm_processor_kwargs"')
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True,
            "vllm_xargs": {}}) as r:
        assert r.status_code == 200 and "vllm_xargs" in r.headers["warning"]
        r.read()
    lines = [line for line in srv.log().splitlines() if "present in the request but ignored" in line]
    assert len(lines) == 1 and "vllm_xargs" in lines[0] and "mm_processor_kwargs" in lines[0]
    known = http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 1, "priority": 0})
    assert known.status_code == 200 and "warning" not in known.headers


def test_odd_field_names_stay_out_of_the_header(http):
    r = http.post("/v1/completions", json={"prompt": "the", "max_tokens": 1, "bad\r\nname": 1, "x" * 100: 2})
    assert r.status_code == 200
    assert r.headers["warning"].endswith('ignored: and 2 more"')


def test_chat_template_kwargs_reach_the_template(http):
    msgs = [{"role": "user", "content": "the cat"}]
    plain = http.post("/tokenize", json={"messages": msgs, "return_token_strs": True}).json()
    off = http.post("/tokenize", json={"messages": msgs, "return_token_strs": True,
                                       "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert plain["token_strs"] == ["the", "cat"] and off["token_strs"] == ["mat", "the", "cat"]
    chat = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1,
                                                   "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert chat["usage"]["prompt_tokens"] == 3
    bad = http.post("/v1/chat/completions", json={"messages": msgs, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_priority_other_than_zero_is_refused(http):
    r = http.post("/v1/completions", json={"prompt": "the", "max_tokens": 1, "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "priority scheduling is not enabled" in r.json()["error"]["message"]
