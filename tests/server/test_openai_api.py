"""The OpenAI API surface against a real `compilelm serve` on the default model, driven by the
official `openai` client (and httpx where the wire format itself is under test)."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from compilelm.models.tokenizer import apply_chat_template
from tests.server.sse import read_events
from tests.server.utils import API_KEY

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


def test_models_version_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].max_model_len == 1024
    assert httpx.get(f"{server.url}/health").status_code == 200  # public without the key
    v = httpx.get(f"{server.url}/version", headers={"Authorization": f"Bearer {API_KEY}"})
    assert v.status_code == 200 and v.json()["version"]


def test_completion_usage_is_exact(client, model_name, tokenizer):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True}, logprobs=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 7 == len(choice.logprobs.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert "".join(choice.logprobs.tokens) == choice.text


def test_chat_usage_is_exact(client, model_name, tokenizer):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0,
                                       max_completion_tokens=6, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(apply_chat_template(tokenizer, MESSAGES))
    assert r.usage.completion_tokens == 6
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    # max_tokens (deprecated spelling) works the same
    r2 = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0,
                                        max_tokens=6, extra_body={"ignore_eos": True})
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_chat_stream_matches_non_stream(http, client, model_name):
    body = {"model": model_name, "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    full = client.chat.completions.create(**body)
    events = read_events(http, "/v1/chat/completions",
                         {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_event, chunks = events[-2], events[:-2]
    assert usage_event["choices"] == [] and usage_event["usage"] == full.usage.model_dump(
        exclude_none=True)
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full.choices[0].message.content
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert reasons == [full.choices[0].finish_reason]


def test_completion_stream_matches_non_stream(client, model_name):
    kw = dict(model=model_name, prompt=PROMPT, temperature=0, max_tokens=20)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        full.choices[0].finish_reason]


def test_completion_prompt_forms_and_indices(client, model_name, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=model_name, prompt=[ids, tokenizer.encode("Hello")],
                                      max_tokens=5, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    first = [c.text for c in batch.choices if c.index < 2]
    assert first == [by_text.choices[0].text] * 2
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Hello"))


def test_n_choices_stream_and_not(http, client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, n=3, max_tokens=8,
                                       temperature=1.0, seed=11)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    events = read_events(http, "/v1/chat/completions",
                         {"model": model_name, "messages": MESSAGES, "n": 3, "max_tokens": 8,
                          "temperature": 1.0, "seed": 11, "stream": True})
    texts, reasons = ["", "", ""], [[], [], []]
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["delta"].get("content", "")
            if c["finish_reason"]:
                reasons[c["index"]].append(c["finish_reason"])
    assert all(len(r_) == 1 for r_ in reasons)  # exactly one finish_reason per choice
    assert texts == [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]


def test_same_seed_same_text(client, model_name):
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=12, temperature=1.0)
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    c = client.completions.create(**kw, seed=4321).choices[0].text
    assert a == b
    assert a != c


def test_sampling_knobs_are_applied(client, model_name):
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=8)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    # top_k=1 and min_p=1 keep only the most likely token: sampling at T=1 must equal greedy
    assert client.completions.create(**kw, temperature=1.0, seed=3,
                                     extra_body={"top_k": 1}).choices[0].text == greedy
    assert client.completions.create(**kw, temperature=1.0, seed=3,
                                     extra_body={"min_p": 1.0}).choices[0].text == greedy
    r = client.completions.create(**kw, temperature=0.7, top_p=0.9, presence_penalty=0.5,
                                  frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2,
                                                                     "min_tokens": 8})
    assert r.usage.completion_tokens == 8


def test_logit_bias_forces_a_token(client, model_name, tokenizer):
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(token): 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([token])] * 3


def test_stop_strings(http, client, model_name):
    kw = dict(model=model_name, prompt=PROMPT, temperature=0, max_tokens=24)
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]
    cut = full[:full.index(stop)]
    r = client.completions.create(**kw, stop=[stop, "@@never@@"])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop,
                                                                          stream=True))
    assert streamed == cut  # a half-matched stop string is never streamed
    inc = client.completions.create(**kw, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert inc.choices[0].text == cut + stop


def test_completion_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=6,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for _tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4
        assert math.isclose(val, max(top.values()), abs_tol=1e-6)  # greedy picks the top token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_echo_prompt_logprobs_match_generation(client, model_name, tokenizer):
    """lm-eval's loglikelihood request: the echoed prompt's logprob of token t equals the
    logprob the model gave t when it generated it."""
    ids = tokenizer.encode(PROMPT)
    gen = client.completions.create(model=model_name, prompt=ids, temperature=0, max_tokens=1,
                                    logprobs=1)
    next_id = tokenizer.encode(gen.choices[0].text, add_special_tokens=False)
    assert len(next_id) == 1
    echo = client.completions.create(model=model_name, prompt=ids + next_id, temperature=0,
                                     max_tokens=1, logprobs=1, echo=True)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(tokenizer.decode(ids + next_id))
    assert len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert math.isclose(lp.token_logprobs[len(ids)], gen.choices[0].logprobs.token_logprobs[0],
                        abs_tol=1e-3)


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0,
                                       max_tokens=5, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert math.isclose(c.logprob, c.top_logprobs[0].logprob, abs_tol=1e-6)
        assert bytes(c.bytes).decode() == c.token


def test_json_object_response_format(client, model_name):
    r = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with keys name "
                                              "and age."}])
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text  # the object completes within max_tokens
    assert isinstance(json.loads(text), dict), text


def test_tokenize_detokenize(http, tokenizer):
    r = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == apply_chat_template(tokenizer, MESSAGES)
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(r["tokens"])


def test_tokenizer_info_serves_lm_eval_remote_tokenizer(http, tokenizer):
    """lm-eval's `tokenizer_backend=remote`: GET /tokenizer_info must hold `eos_token`, then
    POST /tokenize {"prompt": ..., "add_special_tokens": false} gives the ids; vLLM's shape
    (tokenizer_config fields, `tokenizer_class`, the chat template, no file paths)."""
    r = http.get("/tokenizer_info")
    assert r.status_code == 200
    info = r.json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert not {"vocab_file", "merges_file"} & set(info)
    test = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert test["tokens"] == tokenizer.encode("test", add_special_tokens=False)
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"][0] == tokenizer.eos_token_id  # lm-eval's eos_token_id


def test_extra_fields_are_accepted(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2,
                                  extra_body={"some_future_field": {"x": 1}})
    assert r.choices[0].text


def scrape_metrics(http) -> dict[tuple, float]:
    """(sample name, sorted label items) -> value."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_exactly(http, client, model_name):
    before = scrape_metrics(http)
    total_prompt = total_gen = 0
    for i in range(3):
        r = client.completions.create(model=model_name, prompt=f"{PROMPT} {i}", max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
        total_prompt += r.usage.prompt_tokens
        total_gen += r.usage.completion_tokens
    after = scrape_metrics(http)
    model = (("model_name", model_name),)

    def delta(name, labels=model):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    length = (("finished_reason", "length"), ("model_name", model_name))
    assert delta("compilelm:request_success_total", length) == 3
    assert delta("compilelm:prompt_tokens_total") == total_prompt
    assert delta("compilelm:generation_tokens_total") == total_gen
    assert delta("compilelm:time_to_first_token_seconds_count") == 3
    assert delta("compilelm:inter_token_latency_seconds_count") == 3 * 3
    assert delta("compilelm:e2e_request_latency_seconds_count") == 3
    assert delta("compilelm:request_queue_time_seconds_count") == 3
    assert delta("compilelm:request_generation_tokens_sum") == total_gen
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert (f"compilelm:{name}", model) in after
