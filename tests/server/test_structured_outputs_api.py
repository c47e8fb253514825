"""Structured outputs and constrained tool choices with the official client against `compilelm
serve` on the default model: pydantic `parse`, JSON schemas sampled at temperature 1, regex and
choice (chat and completions, vLLM's structured_outputs and guided_* fields), json_object, and a
tool round trip with tool_choice required / named, streamed and not."""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "properties": {"city": {"type": "string", "maxLength": 20},
                                                                          "unit": {"enum": ["C", "F"]}},
                                                           "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Annotated[str, Field(max_length=16)]
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(max_length=16)]
    age: Annotated[int, Field(ge=0, le=120)]
    role: Literal["admin", "user", "guest"]
    tags: Annotated[list[Annotated[str, Field(max_length=8)]], Field(max_length=3)]
    address: Address


def test_parse_with_a_pydantic_model(client, model_name):
    r = client.beta.chat.completions.parse(
        model=model_name, messages=[{"role": "user", "content": "Make up a person."}], response_format=Person,
        temperature=0, max_tokens=300)
    assert r.choices[0].finish_reason == "stop"
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)
    assert Person.model_validate_json(r.choices[0].message.content) == person


def test_json_schema_sampled_at_temperature_1_is_always_valid(client, model_name):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                  "strict": True}}

    def one(seed):
        r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "A person:"}],
                                           response_format=fmt, temperature=1.0, seed=seed, max_tokens=400)
        return r.choices[0].finish_reason, r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    for reason, text in results:
        assert reason == "stop", text
        Person.model_validate_json(text)  # raises if not valid against the schema
    assert len({text for _, text in results}) > 10  # sampled, not one answer


def test_regex_and_choice_constrain_exactly(client, model_name):
    r = client.completions.create(model=model_name, prompt="My phone number is", max_tokens=30, temperature=1.0,
                                  seed=1, extra_body={"structured_outputs": {"regex": r"\(\d{3}\) [A-Z]{2}-\d{4}"}})
    assert re.fullmatch(r"\(\d{3}\) [A-Z]{2}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Code?"}], n=4,
                                       temperature=1.0, seed=2, max_tokens=30,
                                       extra_body={"guided_regex": "[a-f]{3}[0-9]"})
    assert all(re.fullmatch("[a-f]{3}[0-9]", c.message.content) for c in r.choices)
    choices = ["yes", "no", "maybe later"]
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Is it?"}], n=6,
                                       temperature=1.0, seed=3, max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=model_name, prompt="Pick a color:", max_tokens=10, n=4, temperature=1.0,
                                  seed=4, extra_body={"guided_choice": ["red", "green"]})
    assert {c.text for c in r.choices} <= {"red", "green"}


def test_guided_json_grammar_and_json_object(client, model_name):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.completions.create(model=model_name, prompt="JSON:", max_tokens=150, temperature=0,
                                  extra_body={"guided_json": schema})
    assert 1 <= json.loads(r.choices[0].text)["n"] <= 9
    r = client.completions.create(model=model_name, prompt="Say:", max_tokens=20, temperature=1.0, seed=5,
                                  extra_body={"guided_grammar": 'start: "hi " NAME\nNAME: /[a-z]{2,5}/'})
    assert re.fullmatch("hi [a-z]{2,5}", r.choices[0].text)
    ask = "Describe a cat as a JSON object with keys name and age."
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": ask}],
                                       max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def _stream_calls(stream):
    calls, finish = {}, []
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                call["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return [calls[i] for i in sorted(calls)], finish


def _check_call(name, arguments):
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F") and len(args["city"]) <= 20
    else:
        assert name == "get_time" and set(args) == {"zone"}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_with_required_choice(client, model_name, stream):
    kw = dict(model=model_name, tools=[WEATHER, TIME], temperature=0, max_tokens=200)
    if stream:
        calls, finish = _stream_calls(client.chat.completions.create(messages=ASK, tool_choice="required",
                                                                     stream=True, **kw))
        assert finish == ["tool_calls"]
    else:
        r = client.chat.completions.create(messages=ASK, tool_choice="required", **kw)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in r.choices[0].message.tool_calls]
    assert calls and all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    for c in calls:
        _check_call(c["name"], c["arguments"])
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]}, *({"role": "tool", "tool_call_id": c["id"], "content": "22 degrees"} for c in calls)]
    r = client.chat.completions.create(messages=history, tool_choice="none", **dict(kw, max_tokens=30))
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > len(calls) * 5  # the calls and the results were rendered


def test_parallel_calls_and_parallel_tool_calls_false(client, model_name):
    def calls(parallel, seed):
        r = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=1.0, seed=seed, max_tokens=300,
                                           parallel_tool_calls=parallel)
        return r.choices[0].message.tool_calls
    assert all(len(calls(False, s)) == 1 for s in range(3))
    assert max(len(calls(True, s)) for s in range(6)) > 1


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_streams_its_arguments(client, model_name, stream):
    kw = dict(model=model_name, messages=ASK, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert len(pieces) > 2 and {p.index for p in pieces} == {0}  # the arguments arrive as written
        assert pieces[0].id and pieces[0].function.name == "get_time"
        assert all(p.id is None and p.function.name is None for p in pieces[1:])
        calls, finish = _stream_calls(iter(chunks))
        assert finish == ["stop"]  # a named choice finishes with "stop", as in OpenAI's API and vLLM
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in r.choices[0].message.tool_calls]
    assert len(calls) == 1
    _check_call(calls[0]["name"], calls[0]["arguments"])
