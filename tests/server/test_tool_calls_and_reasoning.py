"""Tool calling (`tool_choice: auto` read by --tool-call-parser hermes) and reasoning
(--reasoning-parser qwen3) end to end with the official client, on a scripted model: a tiny
Llama whose greedy output is fixed text (tests/hf_fixtures.scripted_llama), behind a small chat
template that renders tools, earlier tool calls and tool results, and whose generation prompt
depends on the conversation so far (a question -> think, then call get_weather; a tool result ->
answer; enable_thinking false -> answer without thinking)."""

from __future__ import annotations

import json

import pytest

from tests.hf_fixtures import scripted_llama
from tests.server.utils import RemoteServer

CALL = ['{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}']
WORDS = ["user", "assistant", "tool", "ask", "result", "nothink", "get_weather", "<think>", "hmm", "</think>",
         "<tool_call>", *CALL, "</tool_call>", "It", "is", "sunny", "weather?"]
SCRIPT = {"ask": "<think>", "<think>": "hmm", "hmm": "</think>", "</think>": "<tool_call>", "<tool_call>": CALL[0],
          **{a: b for a, b in zip(CALL, CALL[1:])}, CALL[-1]: "</tool_call>",
          "result": "It", "nothink": "It", "It": "is", "is": "sunny"}
TEMPLATE = ("{% for m in messages %}{{ m.role }} {{ m.content }} "
            "{% for c in m.tool_calls or [] %}{{ c.function.name }} {{ c.function.arguments.city }} {% endfor %}"
            "{% endfor %}{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
            "{% if add_generation_prompt %}{% if messages[-1].role == 'tool' %}result"
            "{% elif enable_thinking is defined and not enable_thinking %}nothink{% else %}ask{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    model = scripted_llama(root / "m", WORDS, SCRIPT)
    (root / "t.jinja").write_text(TEMPLATE)
    server = RemoteServer([str(model), "--chat-template", str(root / "t.jinja"), "--enforce-eager",
                           "--max-model-len", "128", "--num-kv-blocks", "32", "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(srv):
    import openai
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)


def _collect(stream):
    """A stream's deltas gathered as a client gathers them: (reasoning, content, calls, finish reasons)."""
    reasoning, content, calls, finish = "", "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] = (tc.function.name if tc.function else None) or call["name"]
                call["arguments"] += (tc.function.arguments if tc.function else None) or ""
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_tools_reach_the_template(srv):
    import httpx
    r = httpx.post(f"{srv.url}/tokenize", json={"messages": QUESTION, "tools": TOOLS, "return_token_strs": True})
    assert r.json()["token_strs"][-2:] == ["get_weather", "ask"]


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_with_auto_tool_choice_and_reasoning(client, stream):
    kw = dict(model=client.models.list().data[0].id, tools=TOOLS, temperature=0, max_tokens=40)
    if stream:
        reasoning, content, calls, finish = _collect(client.chat.completions.create(
            messages=QUESTION, stream=True, **kw))
        assert finish == ["tool_calls"]
        call_id, name, arguments = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
    else:
        r = client.chat.completions.create(messages=QUESTION, **kw)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        reasoning, content = m.model_extra["reasoning_content"], m.content
        calls = m.tool_calls
        call_id, name, arguments = calls[0].id, calls[0].function.name, calls[0].function.arguments
    assert reasoning.strip() == "hmm" and not content  # the think block is reasoning, the call no content
    assert len(calls) == 1 and name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert call_id.startswith("chatcmpl-tool-")
    # the tool's answer goes back; the template renders the call and the result, the model answers
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    if stream:
        reasoning, content, calls, finish = _collect(client.chat.completions.create(
            messages=history, stream=True, **kw))
        assert finish == ["stop"] and not calls and not reasoning
    else:
        r = client.chat.completions.create(messages=history, **kw)
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
        content = r.choices[0].message.content
        assert r.choices[0].message.model_extra["reasoning_content"] is None
    assert content.strip() == "It is sunny"


def test_rendered_history_holds_the_call_and_its_result(srv):
    import httpx
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    strs = httpx.post(f"{srv.url}/tokenize", json={"messages": history, "return_token_strs": True}).json()["token_strs"]
    # the arguments reached the template as an object (c.function.arguments.city)
    assert strs == ["user", "weather?", "assistant", "get_weather", "<unk>", "tool", "sunny", "result"]


def test_enable_thinking_false_and_tool_choice_none(client):
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=20,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert m.content.strip() == "It is sunny" and m.model_extra["reasoning_content"] is None and not m.tool_calls


def test_parallel_tool_calls_false_keeps_one_call_and_both_stream(client):
    """How many pieces a call arrives in depends on timing: the server sends only the newest
    output of a stream the client lags behind on (tests/test_chat_output.py drives the parser
    token by token). What holds whatever the timing: one call, its id and name in its first piece,
    its pieces add up to its arguments, and the reasoning comes apart from it."""
    chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION,
                                                 tools=TOOLS, temperature=0, max_tokens=40, stream=True,
                                                 parallel_tool_calls=False))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    pieces = [tc for d in deltas for tc in d.tool_calls or []]
    assert {tc.index for tc in pieces} == {0} and sum(1 for tc in pieces if tc.id) == 1  # one call
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in pieces[1:])
    assert json.loads("".join(tc.function.arguments or "" for tc in pieces)) == {"city": "Paris"}


def test_a_tokenizer_llguidance_cannot_read_is_a_400_not_a_crash(srv, client):
    """The scripted model's word-level tokenizer (a WordPiece decoder) is not one llguidance reads:
    the server still starts, and a constrained request is refused, naming the field."""
    import httpx
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": QUESTION, "tools": TOOLS,
                                                           "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "cannot use this tokenizer" in r.json()["error"]["message"]
    assert client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION,
                                          max_tokens=3).choices  # still serving
