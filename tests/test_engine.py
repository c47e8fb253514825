"""LLMEngine / LLM behaviour on a tiny random-weight model (2 layers of SmolLM2-135M's shape)."""

import pytest
import torch

from compilelm import LLM, SamplingParams

TINY = dict(model_overrides={"num_hidden_layers": 2}, max_model_len=256, num_kv_blocks=64,
            enforce_eager=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:smollm2-135m", **TINY)


def _greedy(n=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_batch_equals_one_by_one(llm):
    prompts = [[5, 6, 7], list(range(100, 140)), [9] * 17, list(range(1000, 1003))]
    batch = llm.generate(prompts, _greedy(), use_tqdm=False)
    for p, out in zip(prompts, batch):
        alone = llm.generate([p], _greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_prompt_logprobs_match_full_forward(llm):
    prompt = list(range(200, 230))
    out = llm.generate([prompt], _greedy(1, prompt_logprobs=2), use_tqdm=False)[0]
    # reference: one plain forward over the prompt through the same model, eager
    model = llm.engine.model_runner.model
    from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
    n = len(prompt)
    caches = {k: (torch.zeros_like(a), torch.zeros_like(b)) for k, (a, b) in llm.engine.model_runner.kv_caches.items()}
    bs = llm.engine.config.cache.block_size
    blocks = list(range(1, -(-n // bs) + 1))
    meta = AttentionMetadata(torch.arange(bs, bs + n), torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.tensor([blocks], dtype=torch.int32), n, n)
    with torch.inference_mode(), set_forward_context(ForwardContext(meta, caches)):
        logp = torch.log_softmax(model.compute_logits(model(torch.tensor(prompt), torch.arange(n))).float(), -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, n):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(logp[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert set(logp[pos - 1].topk(2).indices.tolist()) <= set(entry)


def test_sample_logprobs_and_cumulative(llm):
    out = llm.generate([[11, 12, 13]], _greedy(5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3 and sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, rel=1e-5)


def test_n_and_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    a = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]
    b = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # children get different seeds


def test_stop_token_ids_and_max_tokens(llm):
    ref = llm.generate([[3, 4, 5]], _greedy(10), use_tqdm=False)[0].outputs[0]
    stop_tok = ref.token_ids[4]
    first = ref.token_ids.index(stop_tok)
    out = llm.generate([[3, 4, 5]], _greedy(10, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10


def test_stop_string_truncates_text(llm):
    ref = llm.generate([[40, 41]], _greedy(12), use_tqdm=False)[0].outputs[0]
    text = ref.text
    if len(text) < 6:
        pytest.skip("random model produced too little text to pick a stop string")
    stop = text[3:5]
    out = llm.generate([[40, 41]], _greedy(12, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate([[40, 41]], _greedy(12, stop=[stop], include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop) + len(stop)]


def test_final_only_outputs(llm):
    """FINAL_ONLY (what LLM.generate uses): step() returns a request only once, finished, with
    the same content as the last of its CUMULATIVE outputs (its text detokenized once, at the end)."""
    from compilelm.sampling_params import RequestOutputKind

    eng = llm.engine
    prompts = {"c": [5, 6, 7], "d": list(range(100, 140))}
    seen = {"cumulative": {}, "final": {}}
    for kind, name in ((RequestOutputKind.CUMULATIVE, "cumulative"), (RequestOutputKind.FINAL_ONLY, "final")):
        for rid, p in prompts.items():
            eng.add_request(f"{name}-{rid}", p, SamplingParams(n=2, temperature=0.8, seed=1, logprobs=1,
                                                               max_tokens=24, ignore_eos=True, output_kind=kind))
        while eng.has_unfinished_requests():
            for out in eng.step():
                seen[name].setdefault(out.request_id.split("-")[1], []).append(out)
    assert all(len(outs) > 1 for outs in seen["cumulative"].values())
    for rid in prompts:
        final, last = seen["final"][rid], seen["cumulative"][rid][-1]
        assert len(final) == 1 and final[0].finished and last.finished
        assert final[0].outputs == last.outputs


def test_abort_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("a", list(range(50)), _greedy(100))
    eng.add_request("b", list(range(60)), _greedy(100))
    eng.step()
    assert eng.kv_cache_manager.usage > 0
    eng.abort_request(["a", "b"])
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.usage == 0
    assert eng.scheduler.num_running == 0 and eng.scheduler.num_waiting == 0


@pytest.mark.parametrize("prompt, params, match", [
    ([], None, "empty"),
    ([1, 2, 10**7], None, "out of vocabulary"),
    (list(range(300)), None, "maximum context length"),
])
def test_bad_requests_raise_value_error(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(None, prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_unknown_engine_argument_named():
    with pytest.raises(ValueError, match="max_num_seq\\b|max_num_seq'|max_num_seq"):
        LLM("dummy:smollm2-135m", max_num_seq=4)


def test_missing_model_path_is_clear():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model")
    with pytest.raises(ValueError, match="unknown dummy model"):
        LLM("dummy:gpt-17")


def test_vllm_prompt_forms_give_the_same_request(llm):
    """Text, token ids (list, numpy), TextPrompt and TokensPrompt dicts: one request each, the same
    ids and greedy tokens; a TokensPrompt's text is echoed; one dict is one prompt, not a batch."""
    import numpy as np

    from compilelm import TextPrompt, TokensPrompt
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text, add_special_tokens=True)
    forms = [text, ids, np.array(ids), TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids),
             TokensPrompt(prompt_token_ids=ids, prompt=text)]
    outs = llm.generate(forms, _greedy(), use_tqdm=False)
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [text, None, None, text, None, text]
    single = llm.generate({"prompt_token_ids": ids}, _greedy(), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, error, match", [
    ({"prompt": "hi", "multi_modal_data": {"image": 1}}, ValueError, "'multi_modal_data': multimodal"),
    ({"prompt_embeds": [[0.0]]}, ValueError, "prompt embeddings"),
    ({"prompt_ids": [1, 2]}, ValueError, "unknown prompt key.*'prompt_ids'"),
    ({}, ValueError, "needs 'prompt'"),
    ({"prompt_token_ids": [1, "2"]}, TypeError, r"integer token ids, got '2'"),
    ([1.0, 2.0], TypeError, "integer token ids, got 1.0"),
    ({"prompt": 5}, TypeError, "must be a string"),
    (7, TypeError, "list of token ids, got int"),
])
def test_bad_prompt_forms_are_named(llm, prompt, error, match):
    with pytest.raises(error, match=match):
        llm.engine.add_request(None, prompt, _greedy())
    assert not llm.engine.has_unfinished_requests()


def test_chat_takes_vllms_template_arguments(llm):
    """chat(chat_template=, tools=, chat_template_kwargs=, add_generation_prompt=) render as the
    template says (checked against the text written out by hand), then generate from those ids."""
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% for t in tools or [] %}tool {{ t.name }}\n{% endfor %}"
                "{% if add_generation_prompt %}{{ 'think' if thinking else 'answer' }}:{% endif %}")
    msgs = [{"role": "user", "content": "Hello there"}]
    tok = llm.get_tokenizer()
    out = llm.chat(msgs, _greedy(), use_tqdm=False, chat_template=template, tools=[{"name": "clock"}],
                   chat_template_kwargs={"thinking": True})[0]
    assert out.prompt_token_ids == tok.encode("user: Hello there\ntool clock\nthink:", add_special_tokens=False)
    plain = llm.chat([msgs, msgs], _greedy(), use_tqdm=False, chat_template=template, add_generation_prompt=False)
    assert [o.prompt_token_ids for o in plain] == [tok.encode("user: Hello there\n", add_special_tokens=False)] * 2
    alone = llm.generate(out.prompt_token_ids, _greedy(), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == out.outputs[0].token_ids
