"""Tool-call and reasoning parsers, and the chat message / streaming deltas built from them: each
format parses to the calls it holds, malformed calls stay content, and for every way of cutting
the text into stream pieces the deltas add up to the non-streamed message."""

from __future__ import annotations

import json
import random

import pytest

from compilelm.entrypoints.openai.chat_output import ChoiceOutput
from compilelm.entrypoints.openai.protocol import ChatCompletionTool
from compilelm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from compilelm.entrypoints.openai.tool_choice import NamedToolOutput, RequiredToolOutput
from compilelm.entrypoints.openai.tool_parsers import TOOL_PARSERS

TOOLS = [ChatCompletionTool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hot": {"type": "boolean"}, "opts": {"type": "object"}}}}})]

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>')
QWEN3_CODER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=hot>\ntrue\n</parameter>\n<parameter=opts>\n"
               '{"unit": "C"}\n</parameter>\n</function>\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", ' \
        '"parameters": {"city": "Rome"}}'


def _message(parser, text, reasoning=None):
    return ChoiceOutput(REASONING_PARSERS[reasoning]() if reasoning else None, parser).message(text)


def _calls(m):
    return [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls]


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", HERMES, "Let me check.\n", [("get_weather", {"city": "Paris"}),
                                           ("get_weather", {"city": "Oslo", "days": 2})]),
    ("hermes", "no tools here", "no tools here", []),
    ("hermes", "<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok", []),
    ("qwen3_coder", QWEN3_CODER, None, [("get_weather", {"city": "San Francisco", "days": 3, "hot": True,
                                                         "opts": {"unit": "C"}})]),
    ("llama3_json", LLAMA, None, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {}}', None, [("get_weather", {})]),
    ("llama3_json", "Paris is nice {", "Paris is nice {", []),
    ("llama3_json", '{"a": 1} is JSON', '{"a": 1} is JSON', []),
])
def test_tool_parsers(name, text, content, calls):
    m = _message(TOOL_PARSERS[name](TOOLS), text)
    assert _calls(m) == calls
    assert m.content == content


@pytest.mark.parametrize("parser, text, args", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"days": 2, "ci', '{"days": 2, "ci'),
    ("qwen3_coder", QWEN3_CODER.split("<parameter=hot>")[0], '{"city": "San Francisco", "days": 3}'),
])
def test_a_call_cut_short_keeps_what_was_written(parser, text, args):
    """max_tokens in the middle of a call: the call stays, with the arguments written (OpenAI's
    answer too), as its stream showed it."""
    m = _message(TOOL_PARSERS[parser](TOOLS), text)
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [("get_weather", args)]
    assert m.content is None


@pytest.mark.parametrize("parser, text, upto, args", [
    ("hermes", HERMES, '"arguments": {"ci', '{"ci'),
    ("llama3_json", LLAMA, '"parameters": {"city": "Par', '{"city": "Par'),
    ("qwen3_coder", QWEN3_CODER, "<parameter=hot>\ntr", '{"city": "San Francisco", "days": 3'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "A"}}, {"name": "get_weather", "parameters": {',
     '{"name": "get_weather", "parameters": {"city": "A', '{"city": "A'),
])
def test_arguments_stream_as_they_are_written(parser, text, upto, args):
    """A call's first delta comes once its name is written; its arguments follow while the model
    writes them, not when the call is complete."""
    out = ChoiceOutput(None, RequiredToolOutput() if parser == "required" else TOOL_PARSERS[parser](TOOLS))
    d = out.delta(text[:text.index(upto) + len(upto)], final=False)
    assert [(c["index"], c["function"]["name"]) for c in d["tool_calls"]] == [(0, "get_weather")]
    assert d["tool_calls"][0]["function"]["arguments"] == args and d["tool_calls"][0]["id"]


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nsome thought\n</think>\n\nParis.", "\nsome thought\n", "\n\nParis."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "<think>cut sho", "cut sho", None),
    ("deepseek_r1", "some thought</think>Paris.", "some thought", "Paris."),
    ("deepseek_r1", "<think>a</think>b", "a", "b"),
    ("deepseek_r1", "still thinking", "still thinking", None),
])
def test_reasoning_parsers(name, text, reasoning, content):
    m = _message(None, text, name)
    assert (m.reasoning, m.content) == (reasoning, content)


def test_required_and_named_outputs():
    m = _message(RequiredToolOutput(), '[{"name": "get_weather", "parameters": {"city": "A"}}, '
                                       '{"name": "get_weather", "parameters": {}}]')
    assert _calls(m) == [("get_weather", {"city": "A"}), ("get_weather", {})] and m.content is None
    m = _message(NamedToolOutput("get_weather"), '{"city": "B"}')
    assert _calls(m) == [("get_weather", {"city": "B"})]


@pytest.mark.parametrize("parser, reasoning, text", [
    (lambda: TOOL_PARSERS["hermes"](TOOLS), "qwen3", "<think>hmm, weather</think>\n\n" + HERMES),
    (lambda: TOOL_PARSERS["hermes"](TOOLS), None, "plain <tool_ text that only looks like a tag <tool_call"),
    (lambda: TOOL_PARSERS["qwen3_coder"](TOOLS), None, "Sure.\n" + QWEN3_CODER),
    (lambda: TOOL_PARSERS["llama3_json"](TOOLS), None, LLAMA),
    (lambda: TOOL_PARSERS["llama3_json"](TOOLS), None, "  Just words."),
    (lambda: NamedToolOutput("get_weather"), None, '{"city": "Paris", "days": 3}'),
    (lambda: RequiredToolOutput(), None, '[{"name": "get_weather", "parameters": {"city": "A"}}, '
                                         '{"name": "get_weather", "parameters": {}}]'),
    (lambda: RequiredToolOutput(), None, '[ {"name": "get_weather", "parameters": {"city": "a \\" } ]"}}, '
                                         '{"name": "get_weather", "parameters": 3}]'),
    (lambda: TOOL_PARSERS["hermes"](TOOLS), None, '<tool_call>{"name": "get_weather", "arguments": {"opts": '
                                                  '{"x": [1, "]}"]}}}</tool_call>'),
    (lambda: TOOL_PARSERS["hermes"](TOOLS), None, '<tool_call>{"arguments": {"city": "A"}, "name": "get_weather"}'
                                                  '</tool_call>'),  # name last: read once complete
    (lambda: TOOL_PARSERS["hermes"](TOOLS), None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    (lambda: TOOL_PARSERS["qwen3_coder"](TOOLS), None, QWEN3_CODER.replace("<parameter=days>", "<parameter=city>")),
    (lambda: None, "deepseek_r1", "a</thi</think> b </think"),
])
def test_stream_deltas_add_up_to_the_message(parser, reasoning, text):
    whole = _message(parser(), text, reasoning)
    rng = random.Random(0)
    for trial in range(30):
        out = ChoiceOutput(REASONING_PARSERS[reasoning]() if reasoning else None, parser())
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if trial else \
            list(range(1, len(text)))  # trial 0: one character at a time
        got_reasoning, got_content, calls = "", "", {}
        for end in [*cuts, len(text)]:
            d = out.delta(text[:end], final=end == len(text))
            got_reasoning += d.get("reasoning_content", "")
            got_content += d.get("content", "")
            for c in d.get("tool_calls", []):
                entry = calls.setdefault(c["index"], {"id": c.get("id"), "name": c["function"].get("name"), "args": ""})
                assert "id" not in c or entry["id"] == c["id"]
                entry["args"] += c["function"]["arguments"]
        assert got_reasoning == (whole.reasoning or "")
        assert got_content == (whole.content or "")
        assert [(c["name"], c["args"]) for _, c in sorted(calls.items())] == \
            [(c.function.name, c.function.arguments) for c in whole.tool_calls]
