"""Greedy generation on the default model must match Hugging Face transformers token for token:
in one batch, with chunked prefill forced, with prefix-cache hits, and under preemption."""

import pytest

from compilelm import LLM, SamplingParams
from tests.e2e.conftest import MAX_NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _run(llm, hf_reference, as_text=True):
    prompts = PROMPTS if as_text else hf_reference["prompt_ids"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.prompt_token_ids == hf_reference["prompt_ids"][i], f"prompt {i} tokenized differently"
        assert out.outputs[0].token_ids == hf_reference["outputs"][i], f"prompt {i} diverged"
    return outs


def test_one_batch_matches_hf(hf_reference):
    llm = LLM(enforce_eager=True)
    outs = _run(llm, hf_reference)
    # the detokenized text is what the tokenizer makes of those tokens
    tok = llm.tokenizer
    for out in outs:
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_chunked_prefill_and_prefix_cache_match_hf(hf_reference):
    # a 16-token budget forces every prompt longer than that through several chunks
    llm = LLM(enforce_eager=True, max_num_batched_tokens=16, max_num_seqs=8)
    outs = _run(llm, hf_reference, as_text=False)
    assert sum(o.num_cached_tokens for o in outs) > 0, "shared prefix should hit the prefix cache"


def test_preemption_matches_hf(hf_reference):
    # 8 prompts of up to ~50 tokens + 24 new ones need ~27 blocks of 16 tokens; 11 are usable
    llm = LLM(enforce_eager=True, num_kv_blocks=12, max_model_len=160, max_num_seqs=8)
    _run(llm, hf_reference)
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny KV cache should force preemption"


def test_logprobs_match_hf_logits(hf_reference):
    import torch

    llm = LLM(enforce_eager=True, max_model_len=512)
    ids = hf_reference["prompt_ids"][4]
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    with torch.inference_mode():
        full = torch.tensor([ids + out.outputs[0].token_ids[:-1]])
        ref = torch.log_softmax(hf_reference["model"](full).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):  # prompt token pos is predicted by row pos - 1
        assert out.prompt_logprobs[pos][ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=2e-3)
    for i, tok in enumerate(out.outputs[0].token_ids):
        assert out.outputs[0].logprobs[i][tok].logprob == pytest.approx(ref[len(ids) - 1 + i, tok].item(), abs=2e-3)


def test_tensor_parallel_3_matches_hf(hf_reference):
    """The default model's 9 heads / 3 KV heads split over three ranks (three processes, gloo),
    compiled with the all-reduce + add + RMSNorm fusion: still HF's greedy tokens."""
    llm = LLM(tensor_parallel_size=3, max_model_len=512)
    try:
        _run(llm, hf_reference)
    finally:
        llm.engine.shutdown()
