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
